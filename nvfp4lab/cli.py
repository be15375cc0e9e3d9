"""The ``nvfp4lab`` command line.

Subcommands are registered in :data:`SUBCOMMANDS`, a dict ``name -> registrar``. A registrar
receives the ``argparse`` sub-parsers object, adds its parser and sets ``func`` (called with the
parsed namespace, returning the exit code). It is either a callable or a lazy
``"module:function"`` string, imported only when the parser is built (so ``--help`` stays fast
and a broken optional module only costs its own subcommand). To add one (``bench``, say),
either add a line to :data:`SUBCOMMANDS` or, from the module itself::

    from nvfp4lab.cli import register_subcommand

    @register_subcommand("bench")
    def _register(subparsers):
        p = subparsers.add_parser("bench", help="...")
        p.set_defaults(func=run_bench)

Built in here:

* ``nvfp4lab train --precision {bf16,fp32,fp8,nvfp4} [recipe options] --preset ... --steps ... --out DIR``
* ``nvfp4lab compare --variants bf16,fp8,nvfp4,nvfp4-no-rht,... [same options] --out DIR``
* ``torchrun --nproc-per-node N -m nvfp4lab train [--parallel fsdp|ddp] ...``: the same training
  spread over N ranks (FSDP2 by default; NCCL on CUDA, gloo on the CPU)
* ``nvfp4lab export RUN_OR_CKPT OUT.pt``: a checkpoint's FP32 weights as one state-dict file

Exit codes: 0 success, 2 bad arguments (argparse) or invalid configuration, with one line
``nvfp4lab <cmd>: error: ...`` on stderr (a missing or corrupt checkpoint, an unavailable device,
Transformer Engine missing ...), 3 a run stopped on a non-finite loss or gradient, 141 the reader
of the output went away (``nvfp4lab probe --json | head``: the output ends quietly, as a shell
reports a process ended by SIGPIPE). Unexpected exceptions keep their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from typing import Any, Callable, Sequence

__all__ = ["SUBCOMMANDS", "register_subcommand", "build_parser", "main"]

Registrar = Callable[[Any], Any]

#: name -> registrar(subparsers), a callable or a lazy "module:function" string. Insertion order
#: is the order in ``--help``. ``train`` and ``compare`` are added below.
SUBCOMMANDS: dict[str, Registrar | str] = {
    "probe": "nvfp4lab.capabilities:add_probe_subcommand",
    "bench": "nvfp4lab.bench:register",
    "plan": "nvfp4lab.plan:register",
    "report": "nvfp4lab.training.report:register",
}


def register_subcommand(name: str) -> Callable[[Registrar], Registrar]:
    """Decorator: add ``registrar`` to :data:`SUBCOMMANDS` under ``name`` (replacing any)."""

    def deco(fn: Registrar) -> Registrar:
        SUBCOMMANDS[name] = fn
        return fn

    return deco


def _resolve(name: str, registrar: Registrar | str) -> Registrar | None:
    if callable(registrar):
        return registrar
    module, _, attr = registrar.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        print(f"nvfp4lab: warning: subcommand {name!r} unavailable ({registrar}: {exc})", file=sys.stderr)
        return None


def _checked(cast: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse ``type=`` that casts and range-checks, naming what it expected."""

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v

    return parse


_positive_int = _checked(int, lambda v: v > 0, "a positive integer")
_nonneg_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
_fraction = _checked(float, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")


def _add_common_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``train`` and ``compare`` (everything but precision/out/resume)."""
    from .model import PRESETS

    g = p.add_argument_group("model and data")
    g.add_argument("--preset", default="ci", choices=sorted(PRESETS),
                   help="model and optimisation preset (default: ci)")
    g.add_argument("--steps", type=_positive_int, help="optimizer steps (default: preset)")
    g.add_argument("--batch-size", type=_positive_int, help="sequences per step (default: preset)")
    g.add_argument("--seq-len", type=_positive_int, help="sequence length (default: preset)")
    g.add_argument("--n-layer", type=_positive_int, help="transformer blocks (default: preset)")
    g.add_argument("--n-embd", type=_positive_int, help="model width (default: preset)")
    g.add_argument("--n-head", type=_positive_int, help="attention heads (default: preset)")
    g.add_argument("--untie-weights", dest="tie_weights", action="store_false", default=None,
                   help="separate LM-head and embedding weights (default: tied)")
    g.add_argument("--lr", type=float, help="peak learning rate (default: preset)")
    g.add_argument("--warmup-steps", type=_nonneg_int, help="linear warmup steps (default: preset)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip, 0 = off (default 1.0)")
    g.add_argument("--text", metavar="PATH",
                   help="UTF-8 file or folder of files (default: built-in pydoc_data.topics)")
    g.add_argument("--seed", type=_nonneg_int, default=0, help="seed for init, data and SR (default 0)")

    r = p.add_argument_group("NVFP4 recipe (TE NVFP4BlockScaling fields and layer selection)")
    r.add_argument("--disable-rht", action="store_true", help="no random Hadamard transform on Wgrad operands")
    r.add_argument("--disable-stochastic-rounding", "--disable-sr", dest="disable_stochastic_rounding",
                   action="store_true", help="round gradients to nearest instead of stochastically")
    r.add_argument("--disable-2d-quantization", "--disable-2d", dest="disable_2d_quantization",
                   action="store_true", help="1x16 weight blocks instead of 16x16 tiles")
    r.add_argument("--bf16-first-layers", type=_nonneg_int, default=1,
                   help="leading blocks kept in BF16 (default 1)")
    r.add_argument("--bf16-last-layers", type=_nonneg_int, default=1,
                   help="trailing blocks kept in BF16 (default 1)")
    r.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too")
    r.add_argument("--nvfp4-4over6", choices=("none", "weights", "activations", "all"), default="none",
                   help="4over6: per block keep the better of the map-to-4 and map-to-6 scales for these "
                        "operands (never gradients; activations/all need --disable-rht; default none)")
    r.add_argument("--nvfp4-4over6-e4m3-use-256", choices=("none", "weights", "activations", "all"), default="all",
                   help="where 4over6's global scale uses E4M3 bound 256 instead of 448 (default all)")
    r.add_argument("--nvfp4-4over6-err-mode", choices=("MAE", "MSE"), default="MAE",
                   help="the error 4over6 compares (default MAE)")
    r.add_argument("--row-scaled-activation", action="store_true",
                   help="one FP32 amax per token for the forward activation (needs --disable-rht)")
    r.add_argument("--cooldown-frac", type=_fraction, default=0.0,
                   help="switch NVFP4/FP8 layers to BF16 for this final fraction of steps (default 0)")
    r.add_argument("--health-interval", type=_nonneg_int, default=0,
                   help="every N steps record each NVFP4 operand's quantization health in health.jsonl "
                        "(one extra side-effect-free pass; 0: off; `nvfp4lab report RUN` draws it)")
    r.add_argument("--cooldown-step", type=_nonneg_int, default=None,
                   help="switch to BF16 from this step on (instead of --cooldown-frac)")
    r.add_argument("--cooldown-scope", choices=("all", "fprop", "bwd"), default="all",
                   help="which GEMMs the switch moves to BF16: all (default), fprop (the forward GEMMs: most of "
                        "the gain, paper appendix D) or bwd (Dgrad and Wgrad; NVFP4 layers)")

    s = p.add_argument_group("batch and memory")
    s.add_argument("--grad-accum-steps", type=_positive_int, default=1,
                   help="micro-batches per optimizer step; --batch-size stays the global batch, so each "
                        "micro-batch holds batch_size / (ranks x grad_accum_steps) sequences (default 1)")
    s.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each transformer block's activations in backward instead of keeping them "
                        "(torch.utils.checkpoint; less memory, one more forward)")

    b = p.add_argument_group("bookkeeping")
    b.add_argument("--eval-interval", type=_positive_int, help="steps between validations (default: preset)")
    b.add_argument("--eval-batches", type=_positive_int, help="validation batches (default: preset)")
    b.add_argument("--log-interval", type=_positive_int, default=10, help="steps between train-loss records")
    b.add_argument("--checkpoint-interval", type=_nonneg_int,
                   help="steps between checkpoints (default: eval interval; 0: only at the end)")
    b.add_argument("--on-nonfinite", choices=("stop", "skip", "fallback"), default="stop",
                   help="on a NaN/Inf loss or gradient: stop (default), skip the step, or fall back: roll back "
                        "to the last checkpoint and continue in the next precision of --fallback-chain")
    b.add_argument("--spike-z", type=float, default=None,
                   help="flag a loss or gradient-norm spike more than this many EMA standard deviations above "
                        "its running mean (default off)")
    b.add_argument("--spike-action", choices=("warn", "skip", "fallback"), default="warn",
                   help="what a spike does: log an event (default), skip the step, or fall back")
    b.add_argument("--fallback-chain", default="nvfp4,fp8,bf16",
                   help="precisions to fall back through, in order (default nvfp4,fp8,bf16)")
    b.add_argument("--device", default="auto",
                   help="torch device: cpu, cuda, cuda:1, ... (default auto: cuda when a GPU is visible, else cpu)")
    b.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    b.add_argument("--cuda-graph", action="store_true",
                   help="capture forward+backward of a step in a CUDA graph after a few eager steps "
                        "(CUDA, nvfp4lab backend; much faster for small models)")
    b.add_argument("--compile", action="store_true",
                   help="run the training forward and backward through torch.compile (nvfp4lab backend; NVFP4 "
                        "layers are custom ops to it, with the eager numerics)")
    b.add_argument("--graph-optimizer", action="store_true",
                   help="with --cuda-graph: capture the fused AdamW step in the graph too (a non-finite step "
                        "is still skipped or stops the run)")
    prog = b.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="always show the progress bar")
    prog.add_argument("--no-progress", dest="progress", action="store_false",
                      help="never show the progress bar (default: only on a terminal)")
    b.add_argument("--no-plot", dest="plot", action="store_false", help="skip the loss-curve PNG")


def _resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def config_from_args(args: argparse.Namespace, precision: str | None = None):
    """Build a :class:`~nvfp4lab.training.TrainConfig` from parsed ``train``/``compare`` options."""
    from .recipe import NVFP4Recipe
    from .training import TrainConfig

    recipe = NVFP4Recipe(
        disable_rht=args.disable_rht,
        disable_stochastic_rounding=args.disable_stochastic_rounding,
        disable_2d_quantization=args.disable_2d_quantization,
        bf16_first_layers=args.bf16_first_layers,
        bf16_last_layers=args.bf16_last_layers,
        quantize_lm_head=args.quantize_lm_head,
        nvfp4_4over6=getattr(args, "nvfp4_4over6", "none"),
        nvfp4_4over6_e4m3_use_256=getattr(args, "nvfp4_4over6_e4m3_use_256", "all"),
        nvfp4_4over6_err_mode=getattr(args, "nvfp4_4over6_err_mode", "MAE"),
        row_scaled_activation=getattr(args, "row_scaled_activation", False),
    )
    return TrainConfig(
        precision=precision or getattr(args, "precision", "nvfp4"),
        backend=getattr(args, "backend", "nvfp4lab"),
        preset=args.preset, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, tie_weights=args.tie_weights, lr=args.lr,
        warmup_steps=args.warmup_steps, grad_clip=args.grad_clip, text=args.text, seed=args.seed,
        recipe=recipe, cooldown_frac=args.cooldown_frac,
        cooldown_step=args.cooldown_step, cooldown_scope=args.cooldown_scope, health_interval=args.health_interval, eval_interval=args.eval_interval,
        eval_batches=args.eval_batches, log_interval=args.log_interval,
        checkpoint_interval=args.checkpoint_interval, on_nonfinite=args.on_nonfinite,
        spike_z=args.spike_z, spike_action=args.spike_action,
        fallback_chain=tuple(p.strip() for p in args.fallback_chain.split(",") if p.strip()),
        device=_resolve_device(args.device), threads=args.threads, cuda_graph=args.cuda_graph,
        graph_optimizer=args.graph_optimizer, compile=args.compile,
        progress=args.progress if args.progress is not None else (None if sys.stderr.isatty() else "lines"),
        plot=args.plot, extend_schedule=getattr(args, "extend_schedule", False),
        grad_accum_steps=args.grad_accum_steps, activation_checkpointing=args.activation_checkpointing,
        parallel=getattr(args, "parallel", "fsdp"),
        out=getattr(args, "out", None), resume=getattr(args, "resume", None),
        name=getattr(args, "name", None),
    )


def _print_run(r) -> None:
    loss = f"{r.final_val_loss:.4f}" if r.final_val_loss is not None else "n/a"
    took = f"{r.wall_time_s:.1f} s"
    if r.resumed_from_step is not None:
        took += f" (this session, resumed at step {r.resumed_from_step}; {r.total_wall_time_s:.1f} s in total)"
    session_steps = r.steps_completed - (r.resumed_from_step or 0)
    n_warm = session_steps - r.timed_steps if r.timed_steps is not None else 0
    warm = (f" (the first {n_warm} step{'s' if n_warm > 1 else ''} of {r.warmup_time_s:.1f} s excluded: warm-up, "
            "compilation, capture)" if n_warm > 0 and r.warmup_time_s is not None else "")
    print(f"{r.name}: {r.status}, {r.steps_completed} steps, final val loss {loss} nats/byte, "
          f"{r.tokens_per_s:,.0f} tokens/s steady state{warm}, {took}")
    if r.precision_segments:
        print("  precision:  " + ", ".join(f"{s['precision']} for steps {s['from_step']}-{s['to_step']}"
                                          for s in r.precision_segments))
    print(f"  layers: {r.layers}")
    g = r.layer_graphs
    if g and g["calls"] and r.timed_steps:   # the NVFP4 layers' own CUDA graphs (eager or compiled steps)
        n = r.timed_steps
        print(f"  layer graphs, per steady step: {(g['owned_replays'] + g['copying_replays']) / n:g} replays, "
              f"{g['direct'] / n:g} direct calls, {g['captures'] / n:g} captures, "
              f"{g['bytes_in'] / n / 1e6:.1f} MB copied in, {g['bytes_out'] / n / 1e6:.1f} MB out")
    print(f"  results:    {r.out_dir}/run.json")
    print(f"  metrics:    {r.metrics_path}")
    if r.plot_path:
        print(f"  plot:       {r.plot_path}")
    if r.checkpoint_path:
        print(f"  checkpoint: {r.checkpoint_path}")


def _cmd_train(args: argparse.Namespace) -> int:
    from .training import NonFiniteError, train

    try:
        cfg = config_from_args(args)
        cfg.resolved()
    except ValueError as exc:
        print(f"nvfp4lab train: error: {exc}", file=sys.stderr)
        return 2
    from .te import RecipeNotSupported, TransformerEngineUnavailable

    try:
        result = train(cfg)
    except NonFiniteError as exc:
        print(f"nvfp4lab train: {exc}", file=sys.stderr)
        return 3
    except (TransformerEngineUnavailable, RecipeNotSupported) as exc:
        print(f"nvfp4lab train: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"nvfp4lab train: error: {exc}", file=sys.stderr)
        return 2
    if result.world_size == 1 or os.environ.get("RANK", "0") == "0":   # under torchrun: rank 0 reports
        _print_run(result)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .training import VARIANTS, compare

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        print(f"nvfp4lab compare: error: unknown variant(s) {unknown}; choose from "
              f"{', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    try:
        cfg = config_from_args(args, precision="nvfp4")  # each variant sets its own precision
        cfg.resolved()
        result = compare(cfg, variants, out=args.out, baseline=args.baseline, jobs=args.jobs)
    except (ValueError, FileNotFoundError) as exc:
        print(f"nvfp4lab compare: error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":   # under torchrun: rank 0 reports
        print(result.table())
        print(f"table: {result.table_path}\njson:  {result.json_path}")
        if result.plot_path:   # (none with --no-plot)
            print(f"plot:  {result.plot_path}")
    return 0


@register_subcommand("train")
def _register_train(subparsers) -> None:
    from .precisions import EMULATED, TE_BACKEND

    p = subparsers.add_parser("train", help="train the small GPT in one precision",
                              description="Train the small GPT on byte-level text in one precision.")
    te_only = [n for n in TE_BACKEND if n not in EMULATED]
    emulated_only = [n for n in EMULATED if n not in TE_BACKEND]
    p.add_argument("--precision", choices=tuple(EMULATED) + tuple(te_only), default="nvfp4", metavar="PRECISION",
                   help="bf16: autocast mixed precision; fp8 (= fp8-current): TE Float8CurrentScaling; fp8-delayed, "
                        "fp8-block, mxfp8: TE DelayedScaling, Float8BlockScaling, MXFP8BlockScaling; mxfp4: MXFP4 "
                        "(E2M1, E8M0 scales per 32; no TE recipe); nvfp4: TE NVFP4BlockScaling (default). The "
                        f"nvfp4lab backend emulates {', '.join(EMULATED)}; --backend te runs "
                        f"{', '.join(TE_BACKEND)} ({', '.join(te_only) or 'none'} only there, "
                        f"{', '.join(emulated_only) or 'none'} not there)")
    p.add_argument("--backend", choices=("nvfp4lab", "te"), default="nvfp4lab",
                   help="nvfp4lab: exact emulation on any device (default); te: the same GPT from "
                        "Transformer Engine modules (CUDA; NVFP4 needs compute capability 10.0)")
    p.add_argument("--out", metavar="DIR", help="run folder (default runs/<name>)")
    p.add_argument("--name", help="run name (default: the precision)")
    p.add_argument("--resume", metavar="CKPT", help="checkpoint file or run folder to continue from")
    p.add_argument("--extend-schedule", action="store_true",
                   help="with --resume and a larger --steps: stretch the learning-rate schedule over the new "
                        "--steps (default: keep the checkpoint's schedule; the LR stays at its final value past it)")
    p.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp",
                   help="under torchrun with several ranks: fsdp shards weights, gradients and AdamW states with "
                        "FSDP2 (default); ddp replicates them. Ignored in one process")
    _add_common_options(p)
    p.set_defaults(func=_cmd_train)


def _cmd_export(args: argparse.Namespace) -> int:
    from .training import CheckpointError, export_weights

    try:
        out = export_weights(args.checkpoint, args.out)
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"nvfp4lab export: error: {exc}", file=sys.stderr)
        return 2
    print(f"weights: {out} (torch.load(..., weights_only=True) gives the model's state dict)")
    return 0


@register_subcommand("export")
def _register_export(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint's weights as one state-dict file",
                              description="Write the FP32 model weights of a checkpoint (a run folder, a "
                                          "checkpoint.pt or a distributed checkpoint-step<N>.dcp folder) as one "
                                          "torch.save file of a plain state dict, loadable with weights_only=True.")
    p.add_argument("checkpoint", metavar="RUN_OR_CKPT", help="run folder, checkpoint.pt or DCP checkpoint folder")
    p.add_argument("out", metavar="OUT.pt", help="the file to write")
    p.set_defaults(func=_cmd_export)


@register_subcommand("compare")
def _register_compare(subparsers) -> None:
    from .training import VARIANTS
    from .training.loop import COMPARE_BASELINE

    p = subparsers.add_parser("compare", help="train several precisions / ablations and tabulate",
                              description="Train one configuration per variant; write a table and a plot. "
                                          f"Variants: {', '.join(VARIANTS)}.")
    p.add_argument("--variants", default="bf16,fp8,nvfp4",
                   help="comma-separated variant names (default bf16,fp8,nvfp4)")
    p.add_argument("--baseline", default=COMPARE_BASELINE,
                   help=f"variant the relative gaps refer to (default {COMPARE_BASELINE}; none where no variant has it)")
    p.add_argument("--out", metavar="DIR", default="runs/compare", help="output folder (default runs/compare)")
    p.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                   help="variants trained at once, each in its own process with CPUs/N torch threads unless "
                        "--threads says otherwise (default 1: one after another; not under torchrun)")
    _add_common_options(p)
    p.set_defaults(func=_cmd_compare)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="nvfp4lab", description="NVFP4 training from first principles (emulated, bit-exact with TE 2.20).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, registrar in list(SUBCOMMANDS.items()):
        fn = _resolve(name, registrar)
        if fn is not None:
            fn(sub)
    return parser


class _WarningLines:
    """``warnings.showwarning`` for the CLI: one ``nvfp4lab: warning:`` line per warning, each text
    once (``train`` resolves its config twice, and the "once" filter is per module in CPython)."""

    def __init__(self):
        self.seen: set[str] = set()

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        if str(message) not in self.seen:
            self.seen.add(str(message))
            print(f"nvfp4lab: warning: {message}", file=file or sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``nvfp4lab`` / ``python -m nvfp4lab``); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _WarningLines()
            code = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`nvfp4lab probe --json | head`). Point stdout at devnull so that
        # Python's flush at exit does not raise again (Python docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
