"""The training loop: :func:`train` runs one configuration, :func:`compare` several."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn

from ..data import ByteTokenizer, get_batch, load_corpus, shard_rows, split_tokens, validation_batches
from .. import kernels
from ..fp8_recipes import DELAYED_SCALING_BUFFERS
from ..linear import LAYER_GRAPHS, block_recipe_for, convert_model, layer_precisions, set_high_precision_scope
from ..model import GPT
from ..health import HEALTH_NAME, health_pass
from ..precisions import canonical_name
from ..provenance import environment
from ..rounding import SRStream
from ..timing import side_stream
from . import distributed
from .checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_NAME, check_resume_compatible, load_checkpoint,
                         load_distributed_state, load_full_state, save_checkpoint, save_distributed_checkpoint)
from .config import TrainConfig, lr_at
from .report import CompareResult, RunResult, format_table, plot_compare, plot_metrics, read_jsonl, write_json
from .monitor import SpikeDetector
from .step import GRAPH_WARMUP_STEPS, GraphedStep, autocast_for, clip_and_norm, param_groups

__all__ = ["NonFiniteError", "train", "compare"]

class NonFiniteError(RuntimeError):
    """Raised when the loss or the gradient norm is not finite (``on_nonfinite="stop"``).

    Attributes: ``step`` (0-based optimizer step), ``what`` ("loss" or "gradient norm"; the
    reason, such as "loss spike (z = 7.1)", when a fallback chain ran out), ``checkpoint`` (path of
    the last good checkpoint, or None), ``result`` (the :class:`RunResult` so far, with
    ``status="stopped_nonfinite"``, or ``"stopped_spike"`` when a spike in the chain's last
    precision stopped it; also written to ``run.json``).
    """

    def __init__(self, message: str, *, step: int, what: str, checkpoint: str | None,
                 result: "RunResult | None" = None) -> None:
        super().__init__(message)
        self.step, self.what, self.checkpoint, self.result = step, what, checkpoint, result


def rss_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``; elsewhere the
    process-lifetime peak from ``resource.getrusage``): the CPU runs' memory figure."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # non-Linux: process-lifetime peak
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@torch.no_grad()
def _load_model_state(model: nn.Module, state: dict) -> None:
    """``model.load_state_dict(state)``, strict except for FP8 delayed-scaling state.

    A :class:`~nvfp4lab.fp8_recipes.DelayedScalingLinear` keeps its amax history and scales as
    buffers: resuming a delayed-scaling run restores them, resuming it in another precision drops
    them, and resuming another precision's checkpoint as delayed scaling starts them fresh (zero
    history, unit scales), so checkpoints stay interchangeable across precisions.

    Raises:
        RuntimeError: any other missing or unexpected key (as a strict load would).
    """
    missing, unexpected = model.load_state_dict(state, strict=False)
    def _other(keys):
        return [k for k in keys if k.rpartition(".")[2] not in DELAYED_SCALING_BUFFERS]
    if _other(missing) or _other(unexpected):
        raise RuntimeError(f"checkpoint does not match the model: missing keys {_other(missing)}, "
                           f"unexpected keys {_other(unexpected)}")


@torch.no_grad()
def _evaluate(model: nn.Module, batches, precision: str, device: torch.device) -> float:
    """Mean validation loss over ``batches`` (this rank's rows), in eval mode and without autograd."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with autocast_for(precision, device):
            _, loss = model(x.to(device), y.to(device))
        total += float(loss)
    model.train(was_training)
    return total / len(batches)


def _reporter(cfg: TrainConfig):
    """``say(msg)``: one status line on stderr (``[name] msg``), unless ``cfg.progress`` is False."""
    if cfg.progress is False:
        return lambda msg: None
    return lambda msg: print(f"[{cfg.name}] {msg}", file=sys.stderr, flush=True)


class _ProgressLines:
    """Progress as plain lines for logs (``progress="lines"``): every tenth of the run, every
    ``PERIOD_S`` seconds and at the end, with loss, validation loss, tokens/s and ETA."""

    PERIOD_S = 30.0

    def __init__(self, steps: int, tokens_per_step: int) -> None:
        self.steps, self.every, self.tokens_per_step = steps, max(1, steps // 10), tokens_per_step
        self.last_t = time.perf_counter()

    def __call__(self, done: int, step_times: Sequence[float], loss: float, val: float | None) -> str | None:
        """The line after step ``done`` (or None), from this session's ``step_times`` (seconds)."""
        now = time.perf_counter()
        if not (done % self.every == 0 or done == self.steps or now - self.last_t >= self.PERIOD_S):
            return None
        self.last_t = now
        spent = sum(step_times)
        eta = (self.steps - done) * spent / len(step_times)
        val_text = f"val {val:.4f}" if val is not None else "val -"
        return (f"step {done}/{self.steps}  loss {loss:.4f}  {val_text}  "
                f"{self.tokens_per_step * len(step_times) / spent:,.0f} tok/s  ETA {_fmt_seconds(eta)}")


def _fmt_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ----------------------------------------------------------------------------- train
class FallbackRequested(Exception):
    """Inside a training session: a non-finite step or a spike asks for the next precision."""

    def __init__(self, step: int, reason: str, checkpoint: str | None) -> None:
        super().__init__(reason)
        self.step, self.reason, self.checkpoint = step, reason, checkpoint
        self.result: RunResult | None = None   # the session's result, set as it ends
        self.is_main = True


def train(config: TrainConfig) -> RunResult:
    """Train one model as described by ``config``; see the module docstring.

    With ``on_nonfinite="fallback"`` or ``spike_action="fallback"``, a failing step ends the
    session in its precision; training resumes from the last checkpoint in the next precision of
    ``fallback_chain`` (an event in ``metrics.jsonl``; ``run.json``'s ``precision_segments`` list
    each precision's steps). A run resumed after a crash continues in the precision its checkpoint
    was in. When the chain is exhausted the last session's error is raised.

    Writes into ``config.out`` (default ``runs/<name>``): ``metrics.jsonl`` (one JSON object per
    line: ``type`` "train" / "eval" / "event"), ``run.json`` (the :class:`RunResult`),
    ``loss.png`` and ``checkpoint.pt``.

    Under ``torchrun`` with ``WORLD_SIZE > 1`` every rank runs this same function: the model is
    spread by ``config.parallel`` (:mod:`nvfp4lab.training.distributed`), each rank trains on its
    rows of the global batch, checkpoints are DCP folders (``checkpoint-step<N>.dcp/``), and rank 0
    alone writes the metrics, ``run.json`` and the plot. Every rank returns the result. ``train``
    creates the process group and destroys it at the end; a script that trains several times in one
    ``torchrun`` launch initialises it first (``torch.distributed.init_process_group``, as
    :func:`compare` does through :func:`~nvfp4lab.training.distributed.setup`), and each call
    then uses it and leaves it up.

    Raises:
        ValueError: an invalid config or an incompatible ``resume`` checkpoint.
        NonFiniteError: the loss or gradient went non-finite with ``on_nonfinite="stop"``, or the
            fallback chain is exhausted (on every rank: the decision is agreed).
    """
    cfg = config.resolved()
    segments: list[dict[str, Any]] = []
    if cfg.resume and cfg.falls_back:  # a run that had fallen back continues where it was
        saved = load_checkpoint(cfg.resume)
        if saved.get("precision_segments"):
            segments = [dict(s) for s in saved["precision_segments"]]
            cfg = _fallback_config(cfg, saved["config"]["precision"], cfg.resume)
    while True:
        try:
            return _train_session(cfg, segments)
        except FallbackRequested as fb:
            chain = list(cfg.fallback_chain)
            # Compare canonical names: the chain may hold aliases ("fp8" is "fp8-current").
            here = [canonical_name(p) for p in chain].index(canonical_name(cfg.precision))
            if here + 1 >= len(chain) or fb.checkpoint is None:
                message = (f"{fb.reason} at step {fb.step} in {cfg.precision}, the last precision of the "
                           f"fallback chain {chain}; training stopped")
                result = dataclasses.replace(fb.result, message=message)
                if fb.is_main:
                    write_json(Path(result.out_dir) / "run.json", result.to_dict())
                raise NonFiniteError(message, step=fb.step, what=fb.reason, checkpoint=fb.checkpoint,
                                     result=result) from None
            nxt = chain[here + 1]
            back_to = int(load_checkpoint(fb.checkpoint)["step"])
            segments.append({"precision": cfg.precision, "from_step": segments[-1]["to_step"] if segments else 0,
                             "to_step": back_to, "ended_by": f"{fb.reason} at step {fb.step}"})
            out = Path(cfg.out if cfg.out else Path("runs") / cfg.name)
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"type": "event", "event": f"fallback to {nxt}", "step": back_to,
                                    "reason": f"{fb.reason} at step {fb.step} in {cfg.precision}"}) + "\n")
            cfg = _fallback_config(cfg, nxt, fb.checkpoint)


def _fallback_config(cfg: TrainConfig, precision: str, checkpoint: str) -> TrainConfig:
    """``cfg`` continuing from ``checkpoint`` in ``precision`` (options of other precisions dropped)."""
    quantized = canonical_name(precision) not in ("fp32", "bf16")
    nvfp4 = canonical_name(precision) == "nvfp4"
    return dataclasses.replace(
        cfg, precision=precision, resume=str(checkpoint),
        cooldown_frac=cfg.cooldown_frac if quantized else 0.0,
        cooldown_step=cfg.cooldown_step if quantized else None,
        cooldown_scope=cfg.cooldown_scope if nvfp4 else "all",
        health_interval=cfg.health_interval if nvfp4 else 0).resolved()


def _train_session(cfg: TrainConfig, segments: list[dict[str, Any]]) -> RunResult:
    """One training session in one precision (:func:`train` chains them on a fallback), in the
    process group of this launch (:func:`~nvfp4lab.training.distributed.setup`)."""
    ctx = distributed.setup(cfg.device)
    try:
        return _train(cfg, ctx, segments)
    finally:
        LAYER_GRAPHS.clear()   # the layers' CUDA graphs hold buffers of this session's shapes
        distributed.teardown(ctx)


def _train(cfg: TrainConfig, ctx: distributed.DistContext, segments: list[dict[str, Any]]) -> RunResult:
    """:func:`train`'s body for a resolved config on this rank of ``ctx``."""
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = ctx.device
    if ctx.distributed:
        if cfg.backend != "nvfp4lab" or cfg.cuda_graph:
            raise ValueError(f"distributed training ({ctx.world_size} ranks) runs the nvfp4lab backend without "
                             "cuda_graph")
        if cfg.batch_size % (ctx.world_size * cfg.grad_accum_steps):
            raise ValueError(f"batch_size={cfg.batch_size} is not divisible by {ctx.world_size} ranks x "
                             f"grad_accum_steps={cfg.grad_accum_steps} (the global batch is split evenly)")

    # data (pure function of the bytes)
    corpus = load_corpus(cfg.text)
    tokenizer = ByteTokenizer()
    split = split_tokens(tokenizer.encode(corpus.text), chunk_bytes=cfg.chunk_bytes, val_every=cfg.val_every)
    data_info = {"corpus": corpus.describe(), "tokenizer": tokenizer.describe(), "split": split.describe()}
    val_batches = [(shard_rows(x, ctx.rank, ctx.world_size), shard_rows(y, ctx.rank, ctx.world_size))
                   for x, y in validation_batches(split.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches)]

    # model and precision; all randomness derives from the seed
    torch.manual_seed(cfg.seed)
    # device-resident SR keys (CUDA graphs replay fresh draws); distinct per rank, rank 0's the single-process one
    sr_gen = SRStream(distributed.sr_seed(cfg.seed, ctx.rank), device)
    data_gen = torch.Generator().manual_seed(cfg.seed + 2_000_003)
    if cfg.backend == "te":
        # Raises TransformerEngineUnavailable / NVFP4NotSupported (with the fallbacks) up front.
        from ..te_model import build_te_model

        model = build_te_model(cfg.model_config(), cfg.precision, cfg.recipe, device=device)
        layers = model.layer_counts()
    else:
        model = GPT(cfg.model_config()).to(device)
        block_recipe = (block_recipe_for(cfg.precision, cfg.block_recipe) if cfg.block_recipe is not None
                        else None)
        convert_model(model, cfg.precision, cfg.recipe, fp8_recipe=cfg.fp8_recipe, generator=sr_gen,
                      block_recipe=block_recipe)
        precisions = layer_precisions(model)
        layers = {k: sum(1 for v in precisions.values() if v == k) for k in ("nvfp4", "fp8", "high")}
        if "mxfp4" in precisions.values():
            layers["mxfp4"] = sum(1 for v in precisions.values() if v == "mxfp4")
        model.activation_checkpointing = cfg.activation_checkpointing
    net = distributed.wrap_model(model, cfg.parallel, ctx)   # what runs the steps (model itself in one process)
    if cfg.graph_optimizer:  # the step's CUDA graph holds the update: fused AdamW, a device lr, found_inf
        optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=torch.tensor(cfg.lr, device=device),
                                      betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=True, capturable=True)
        optimizer.found_inf = torch.zeros((), device=device)
    else:
        optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                      betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    own_flags = [{k: g[k] for k in ("lr", "fused", "capturable", "foreach") if k in g} for g in optimizer.param_groups]

    out = Path(cfg.out if cfg.out else Path("runs") / cfg.name)
    say = _reporter(cfg) if ctx.is_main else (lambda msg: None)
    start_step, best_val, skipped, elapsed_before = 0, None, 0, 0.0
    schedule_steps = cfg.schedule_steps or cfg.steps
    val_curve: list[list[float]] = []
    ckpt_path = out / CHECKPOINT_NAME
    if cfg.resume:
        saved = load_checkpoint(cfg.resume)
        check_resume_compatible(saved, cfg, data_info)
        if "dcp" in saved:   # sharded on disk: DCP reshards onto however many ranks run now
            load_distributed_state(saved["dcp"], net, optimizer)
        elif ctx.distributed:
            load_full_state(net, optimizer, saved, _param_names(model, optimizer))
        else:
            _load_model_state(model, saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
        for g, flags in zip(optimizer.param_groups, own_flags):  # this run's implementation, not the saved one's
            g.update(flags)
        if cfg.graph_optimizer:  # a fused, capturable AdamW keeps its step counts on the device
            for st in optimizer.state.values():
                if "step" in st:
                    st["step"] = st["step"].to(device=device, dtype=torch.float32)
        start_step = int(saved["step"])
        rng = saved["rng"]
        # a single-process checkpoint holds rank 0's states; a DCP one every rank's (lists)
        torch_states = rng["torch_ranks"] if "torch_ranks" in rng else [rng["torch"]]
        sr_states = rng["sr_ranks"] if "sr_ranks" in rng else [rng.get("sr")]
        if ctx.rank < len(torch_states):
            torch.set_rng_state(torch_states[ctx.rank])
        data_gen.set_state(rng["data"])
        # The SR stream's state ([key, counter], int64) is the same on every device; it is restored
        # when the checkpoint has this rank's, otherwise the stream stays freshly seeded from (seed,
        # rank). (Checkpoints of an older format held a device-specific torch.Generator state.)
        sr_state = sr_states[ctx.rank] if ctx.rank < len(sr_states) else None
        if sr_state is not None and sr_state.dtype == torch.int64 and tuple(sr_state.shape) == (2,):
            sr_gen.set_state(sr_state)
        best_val = saved.get("best_val_loss")
        skipped = int(saved.get("skipped_steps", 0))
        val_curve = [list(v) for v in saved.get("val_curve", [])]
        elapsed_before = float(saved.get("elapsed_s", 0.0))
        if start_step > cfg.steps:
            raise ValueError(f"checkpoint is at step {start_step}, beyond steps={cfg.steps}")
        saved_schedule = saved["config"].get("schedule_steps") or saved["config"]["steps"]
        if cfg.schedule_steps is None and not cfg.extend_schedule:
            schedule_steps = saved_schedule
        say(f"resumed from step {start_step} of {cfg.steps} (precision {cfg.precision}, checkpoint "
            f"{cfg.resume})")
        if schedule_steps != saved_schedule:
            lr_old = lr_at(start_step, lr=cfg.lr, steps=saved_schedule, warmup_steps=cfg.warmup_steps,
                           min_lr_frac=cfg.min_lr_frac)
            lr_new = lr_at(start_step, lr=cfg.lr, steps=schedule_steps, warmup_steps=cfg.warmup_steps,
                           min_lr_frac=cfg.min_lr_frac)
            say(f"the learning-rate schedule now spans {schedule_steps} steps instead of {saved_schedule} "
                f"(extend_schedule): the LR at step {start_step} goes from {lr_old:.3g} to {lr_new:.3g}")
        elif cfg.steps > saved_schedule:
            say(f"steps={cfg.steps} goes past the checkpoint's {saved_schedule}-step learning-rate schedule, "
                f"which is kept: the LR stays at its final value after step {saved_schedule} "
                "(--extend-schedule stretches the schedule instead)")
    cfg.schedule_steps = schedule_steps
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    metrics = None
    if ctx.is_main:   # one metrics file per run, written by rank 0
        # On resume, keep the history up to the checkpoint and drop what came after it.
        kept = [r for r in read_jsonl(metrics_path) if r.get("step", 0) <= start_step and
                not (r.get("type") == "train" and r.get("step", 0) >= start_step)] if cfg.resume else []
        with open(metrics_path, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        metrics = open(metrics_path, "a")

    def log(rec: dict[str, Any]) -> None:
        if metrics is not None:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()

    cooldown_start = (cfg.cooldown_step if cfg.cooldown_step is not None else
                      schedule_steps - int(round(cfg.cooldown_frac * schedule_steps)) if cfg.cooldown_frac > 0 else None)
    last_ckpt: str | None = None
    if cfg.resume:
        last_ckpt = saved.get("dcp") or str(Path(cfg.resume) / CHECKPOINT_NAME if Path(cfg.resume).is_dir()
                                            else cfg.resume)

    def make_state(step: int) -> dict[str, Any]:
        """The checkpoint: in one process everything; distributed, all but the model and optimizer
        (DCP writes their shards) with every rank's RNG and SR generator states."""
        if ctx.distributed:
            states = distributed.gather_objects((torch.get_rng_state(), sr_gen.get_state().cpu()), ctx)
            rng = {"torch_ranks": [t for t, _ in states], "sr_ranks": [g for _, g in states],
                   "data": data_gen.get_state()}
            payload: dict[str, Any] = {"world_size": ctx.world_size, "parallel": cfg.parallel}
        else:
            rng = {"torch": torch.get_rng_state(), "data": data_gen.get_state(), "sr": sr_gen.get_state()}
            payload = {"model": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
                       "optimizer": _portable(optimizer.state_dict())}
        return {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            **payload,
            "rng": rng,
            "config": cfg.to_dict(),
            "data": data_info,
            "best_val_loss": best_val,
            "skipped_steps": skipped,
            "precision_segments": segments,
            "val_curve": val_curve,
            "elapsed_s": elapsed_before + time.perf_counter() - t_start,
            "torch_version": str(torch.__version__),
        }

    def make_result(status: str, message: str, steps_completed: int, plot_path: str | None) -> RunResult:
        if device.type == "cuda":
            peak, kind = int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
        else:
            peak, kind = int(peak_rss), "cpu peak resident set size of the process"
        steady = step_times[timing_warmup:] if len(step_times) > timing_warmup else step_times
        graphs = LAYER_GRAPHS.stats.since(graphs_at[len(step_times) - len(steady)])
        now = time.perf_counter()
        return RunResult(
            name=cfg.name, precision=cfg.precision, status=status, message=message,
            steps_completed=int(steps_completed),
            final_val_loss=val_curve[-1][1] if val_curve else None, best_val_loss=best_val,
            final_train_loss=last_loss, val_curve=val_curve,
            tokens_per_s=tokens_per_step * len(steady) / sum(steady) if steady else 0.0,
            peak_memory_bytes=peak, peak_memory_kind=kind,
            wall_time_s=now - t_start, skipped_steps=skipped, out_dir=str(out),
            metrics_path=str(metrics_path), plot_path=plot_path, checkpoint_path=last_ckpt,
            config=cfg.to_dict(), data=data_info, environment=environment(device), layers=layers,
            resumed_from_step=start_step if cfg.resume else None, total_wall_time_s=elapsed_before + now - t_start,
            tokens_per_s_all_steps=tokens_per_step * len(step_times) / sum(step_times) if step_times else 0.0,
            warmup_time_s=sum(step_times[:len(step_times) - len(steady)]), timed_steps=len(steady),
            step_ms_median=1e3 * statistics.median(steady) if steady else None,
            layer_graphs=dataclasses.asdict(graphs) if device.type == "cuda" else None,
            health_time_s=health_time if cfg.health_interval else None,
            precision_segments=(segments + [{"precision": cfg.precision,
                                             "from_step": segments[-1]["to_step"],
                                             "to_step": int(steps_completed), "ended_by": status}]
                                if segments else None), world_size=ctx.world_size,
            parallel=cfg.parallel if ctx.distributed else None)

    def checkpoint(step: int) -> None:
        nonlocal last_ckpt
        if ctx.distributed:
            last_ckpt = str(save_distributed_checkpoint(out, net, optimizer, make_state(step), rank=ctx.rank,
                                                        barrier=lambda: distributed.barrier(ctx)))
        else:
            save_checkpoint(ckpt_path, make_state(step))
            last_ckpt = str(ckpt_path)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak_rss = rss_bytes()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    last_loss: float | None = None
    status, message = "completed", ""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if start_step == 0:
        log({"type": "event", "event": "start", "step": 0, "precision": cfg.precision,
             "layers": layers, "params": model.num_parameters()})
        say(f"start: precision {cfg.precision} ({cfg.backend}), preset {cfg.preset}, "
            f"{model.num_parameters() / 1e6:.2f}M parameters, {cfg.steps} steps x {tokens_per_step:,} tokens "
            f"on {device} -> {out}")
    else:
        log({"type": "event", "event": "resume", "step": start_step, "precision": cfg.precision,
             "schedule_steps": schedule_steps})
    bar = tqdm(total=cfg.steps, initial=start_step, desc=cfg.name, unit="step", dynamic_ncols=True,
               disable=None if cfg.progress is None else cfg.progress is not True, file=sys.stderr)
    progress_line = _ProgressLines(cfg.steps, tokens_per_step) if cfg.progress == "lines" else None
    net.train()
    cooled = False
    step_model = torch.compile(net) if cfg.compile else net  # evaluation stays eager
    graphed = GraphedStep(step_model, params, cfg.precision, device, cfg.grad_clip,
                          (),  # the SR stream needs no registration (its state is a device tensor)
                          optimizer=optimizer if cfg.graph_optimizer else None) if cfg.cuda_graph else None
    timing_warmup = cfg.timing_warmup_steps if cfg.timing_warmup_steps is not None else min(10, cfg.steps // 5)
    step_times: list[float] = []
    # the layers' CUDA graphs' counts when the timed steps begin (cuda_graphs.GraphStats)
    graphs_at = {0: dataclasses.replace(LAYER_GRAPHS.stats)}
    health_time = 0.0
    spike = {what: SpikeDetector(z=cfg.spike_z) for what in ("loss", "gradient norm")} if cfg.spike_z else {}
    if cfg.falls_back and start_step == 0:
        checkpoint(0)   # a fallback always has a checkpoint to roll back to
    warmup_left = GRAPH_WARMUP_STEPS
    try:
        for step in range(start_step, cfg.steps):
            if cooldown_start is not None and not cooled and distributed.agree_any(step >= cooldown_start, ctx):
                if cfg.backend == "te":
                    model.quantize_enabled = False
                else:
                    set_high_precision_scope(model, cfg.cooldown_scope)
                cooled = True
                if graphed is not None:  # another computation: capture again after a warm-up
                    graphed.graph, warmup_left = None, GRAPH_WARMUP_STEPS
                if step == cooldown_start:
                    log({"type": "event", "event": "bf16 cooldown", "scope": cfg.cooldown_scope, "step": step})
            active = (("bf16" if cfg.cooldown_scope == "all" else f"{cfg.precision}, {cfg.cooldown_scope} in bf16")
                      if cooled else cfg.precision)
            lr = lr_at(step, lr=cfg.lr, steps=schedule_steps, warmup_steps=cfg.warmup_steps,
                       min_lr_frac=cfg.min_lr_frac)
            for g in optimizer.param_groups:
                if isinstance(g["lr"], torch.Tensor):
                    g["lr"].fill_(lr)
                else:
                    g["lr"] = lr
            t0 = time.perf_counter()
            x, y = get_batch(split.train, cfg.batch_size, cfg.seq_len, data_gen, rank=ctx.rank,
                             world_size=ctx.world_size)
            x, y = x.to(device), y.to(device)
            if cfg.health_interval and step % cfg.health_interval == 0:
                t_health = time.perf_counter()   # a side-effect-free extra pass (nvfp4lab.health)
                with open(out / HEALTH_NAME, "a") as f:
                    for rec in health_pass(model, x, y, autocast=lambda: autocast_for(active, device)):
                        f.write(json.dumps({"step": step, **rec}) + "\n")
                spent = time.perf_counter() - t_health
                health_time += spent
                t0 += spent
            bad = None
            if graphed is not None and warmup_left == 0:
                # replay: the optimizer step below is outside the graph, so a non-finite loss or
                # gradient is caught before it touches the weights, as in the eager branch
                loss_t, gn = graphed(x, y)
                loss_val, grad_norm = float(loss_t), float(gn)
                if not math.isfinite(loss_val):
                    bad, grad_norm = "loss", float("nan")
                elif not math.isfinite(grad_norm):
                    bad = "gradient norm"
            else:
                side = None
                if graphed is not None:  # warm-up on a side stream (kernels compile, lazy inits)
                    side = side_stream(device)
                    side.wait_stream(torch.cuda.current_stream(device))
                    warmup_left -= 1
                # a warm-up of the step's graph runs its layers' kernels one by one: graphs of their
                # own, on a stream used once, would be captured for nothing and keep memory
                with torch.cuda.stream(side) if side is not None else nullcontext(), \
                        kernels.use_options(layer_graphs=False) if side is not None else nullcontext():
                    optimizer.zero_grad(set_to_none=True)
                    micro, losses = cfg.grad_accum_steps, []
                    for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                        # the gradients are reduced across ranks with the last micro-batch only
                        with distributed.grad_sync(net, i == micro - 1):
                            with autocast_for(cfg.precision, device):
                                _, loss = step_model(xm, ym)
                            losses.append(loss.detach())
                            # the backward runs whatever the loss (a non-finite one is caught below,
                            # before the update): reading it here would make the host wait for the
                            # forward, and the GPU for the backward's first launches
                            (loss / micro if micro > 1 else loss).backward()
                    # One host read after the backward, of the losses and the gradient norm together:
                    # the clip runs on the device first, whatever the loss (as inside a captured step;
                    # a refused step's gradients are dropped), so the GPU does not wait for a second
                    # read before the clip's launches. float64 holds each value exactly.
                    norm = clip_and_norm(params, cfg.grad_clip)
                    if hasattr(norm, "full_tensor"):   # FSDP2: a DTensor, reduced across the ranks
                        norm = norm.full_tensor()
                    *parts, grad_norm = torch.stack([t.double() for t in (*losses, norm)]).tolist()
                    # freed now, as the float it replaced was: a tensor held into the next step moves
                    # that step's allocations, and the layers' graphs then copy their inputs in
                    del norm
                    local = sum(parts)
                    loss_val = distributed.mean_across(local / micro, ctx)
                    if distributed.agree_any(not math.isfinite(local), ctx):
                        bad = "loss"
                        grad_norm = float("nan")
                    elif distributed.agree_any(not math.isfinite(grad_norm), ctx):
                        bad = "gradient norm"
                if side is not None:
                    torch.cuda.current_stream(device).wait_stream(side)
            if bad is None and spike:
                for what, value in (("loss", loss_val), ("gradient norm", grad_norm)):
                    z = spike[what].update(value)
                    if z is not None:
                        log({"type": "event", "event": f"{what} spike", "step": step, "z": round(z, 2),
                             "action": cfg.spike_action})
                        if cfg.spike_action == "fallback":
                            raise FallbackRequested(step, f"{what} spike (z = {z:.1f})", last_ckpt)
                        if cfg.spike_action == "skip":
                            bad = f"{what} spike"
            if bad is not None and bad.endswith("spike"):
                skipped += 1   # spike_action="skip": the update is not applied
                if graphed is None or graphed.graph is None:
                    optimizer.zero_grad(set_to_none=True)
                bar.update(1)
                continue
            if bad is not None:
                value = loss_val if bad == "loss" else grad_norm
                log({"type": "nonfinite", "step": step, "what": bad, "value": str(value)})
                if cfg.on_nonfinite == "fallback":
                    raise FallbackRequested(step, f"non-finite {bad}", last_ckpt)
                if cfg.on_nonfinite == "skip":
                    skipped += 1
                    if graphed is None or graphed.graph is None:
                        optimizer.zero_grad(set_to_none=True)
                    bar.update(1)
                    continue
                status = "stopped_nonfinite"
                message = (f"non-finite {bad} ({value}) at step {step} ({cfg.name}, precision "
                           f"{active}); training stopped. Last good checkpoint: "
                           f"{last_ckpt or 'none written yet'}. Use on_nonfinite='skip' "
                           f"(--on-nonfinite skip) to skip such steps instead.")
                raise NonFiniteError(message, step=step, what=bad, checkpoint=last_ckpt)
            if graphed is None or graphed.graph is None or graphed.optimizer is None:
                if getattr(optimizer, "found_inf", None) is not None:
                    optimizer.found_inf.zero_()   # an eager step here is a finite one
                optimizer.step()   # (a graph with the optimizer inside has already updated)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            if len(step_times) == timing_warmup:
                graphs_at[timing_warmup] = dataclasses.replace(LAYER_GRAPHS.stats)
            last_loss = loss_val
            peak_rss = max(peak_rss, rss_bytes())
            done = step + 1
            if step % cfg.log_interval == 0 or done == cfg.steps:
                log({"type": "train", "step": step, "loss": loss_val, "lr": lr, "grad_norm": grad_norm,
                     "tokens_per_s": tokens_per_step / dt if dt > 0 else None, "precision": active})
            if done % cfg.eval_interval == 0 or done == cfg.steps:
                v = distributed.mean_across(_evaluate(net, val_batches, cfg.precision, device), ctx)
                val_curve.append([done, v])
                best_val = v if best_val is None else min(best_val, v)
                log({"type": "eval", "step": done, "val_loss": v, "precision": active})
                bar.set_postfix(loss=f"{loss_val:.3f}", val=f"{v:.3f}")
            if (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0) or done == cfg.steps:
                checkpoint(done)
            bar.update(1)
            if progress_line is not None:
                line = progress_line(done, step_times, loss_val, val_curve[-1][1] if val_curve else None)
                if line:
                    say(line)
    except FallbackRequested as fb:
        # The session's result, for train() to report should this be the chain's last precision.
        fb.result = make_result("stopped_nonfinite" if fb.reason.startswith("non-finite") else "stopped_spike",
                                fb.reason, step, None)
        fb.is_main = ctx.is_main
        raise
    except NonFiniteError as exc:
        result = make_result(status, message, step, None)
        exc.result = result
        if ctx.is_main:
            write_json(out / "run.json", result.to_dict())
        raise
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    plot_path = None
    if cfg.plot and ctx.is_main:
        what = cfg.precision if cfg.name == cfg.precision else f"{cfg.name}: {cfg.precision}"
        plot_path = plot_metrics(metrics_path, out / "loss.png", title=f"{what}, preset {cfg.preset}")
    result = make_result(status, message, cfg.steps, plot_path)
    if ctx.distributed:   # every rank completes here (the stops above are agreed decisions)
        result.peak_memory_bytes_per_rank = [int(b) for b in distributed.gather_objects(result.peak_memory_bytes, ctx)]
    if ctx.is_main:
        write_json(out / "run.json", result.to_dict())
    return result


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter names in the optimizer's order (how a single-process checkpoint numbers them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _portable(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict that any AdamW can load: a device learning rate becomes a float."""
    for g in state["param_groups"]:
        if isinstance(g.get("lr"), torch.Tensor):
            g["lr"] = float(g["lr"])
    return state


def _train_variant(config: TrainConfig) -> tuple[RunResult, str | None]:
    """:func:`compare`'s run of one variant: its result, and the message of the
    :class:`NonFiniteError` that stopped it (None when it completed). Module-level, so that a
    spawned worker process can run it."""
    try:
        return train(config), None
    except NonFiniteError as exc:
        assert exc.result is not None
        return exc.result, str(exc)


#: :func:`compare`'s default baseline: the relative gaps refer to it where a variant has its name.
COMPARE_BASELINE = "bf16"


def compare(config: TrainConfig, variants: Sequence[str | tuple[str, Mapping[str, Any]]] = (
        "bf16", "fp8", "nvfp4"), *, out: str | os.PathLike | None = None,
        baseline: str | None = COMPARE_BASELINE, jobs: int = 1) -> CompareResult:
    """Train ``config`` once per variant and write ``compare.md``, ``compare.json`` and, unless
    ``config.plot`` is False, ``compare.png`` (the validation curves of every run).

    ``variants``: names from :data:`VARIANTS` or ``(name, overrides)`` pairs. Each run goes to
    ``<out>/<name>/``. A run that stops on a non-finite loss is recorded (status
    ``stopped_nonfinite``) and the comparison goes on. ``baseline`` names the variant the
    relative gaps are computed against (None: no gaps; the default, ``"bf16"``, gives none when no
    variant has that name, any other name must be one of the variants). Under ``torchrun`` every variant trains on
    all ranks in one process group, and rank 0 writes the table, the JSON and the plot.

    ``jobs``: how many variants train at once, each in a process of its own (started with
    ``spawn``; a script that calls this needs Python's ``if __name__ == "__main__":`` guard). The
    default, 1, trains them one after another in this process, as does a single variant. A small
    model leaves most of a CPU's cores idle, so on a CPU ``jobs`` runs finish in about the time of
    one. A variant whose ``threads`` is None gets (usable CPUs) // ``jobs`` torch threads; with the
    same ``threads`` every result is bit-identical to ``jobs=1`` (each run seeds its own generators
    from its config). With ``jobs > 1`` the runs show no progress bars; a line per finished run
    goes to stderr unless ``config.progress`` is False. If a run raises, the runs not yet handed to
    a worker are dropped, those running finish (their folders are complete), and the error is raised.

    Raises:
        ValueError: an unknown or duplicate variant name, a variant whose config does not
            resolve (:meth:`TrainConfig.resolved`; raised before any variant trains), a ``baseline``
            other than ``"bf16"`` that names no variant, ``jobs`` < 1, or ``jobs`` > 1 under
            ``torchrun`` with several ranks (each variant already runs on every rank there).
    """
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"compare: jobs must be a positive int, got {jobs!r}")
    base = config
    out_dir = Path(out if out is not None else (config.out or "runs/compare"))
    named: list[tuple[str, TrainConfig]] = []
    for v in variants:
        if isinstance(v, str):
            name, c = v, base.with_variant(v)
        else:
            name, over = v
            c = base.with_variant(over, name=name)
        c = dataclasses.replace(c, out=str(out_dir / name), name=name, resume=None)
        c.resolved()   # every variant's ValueError before the first one trains
        named.append((name, c))
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate variant names in {names}")
    if baseline is not None and baseline != COMPARE_BASELINE and baseline not in names:
        raise ValueError(f"compare: baseline {baseline!r} is not one of the variants {names}")
    runs: dict[str, RunResult] = {}
    ctx = distributed.setup(config.device)   # one process group for all the runs (each train uses it)
    try:
        if jobs > 1 and ctx.distributed:
            raise ValueError(f"compare: jobs={jobs} under torchrun with {ctx.world_size} ranks; every variant "
                             "already trains on all of them (use jobs=1)")
        workers = min(jobs, len(named))   # a single variant trains in this process
        if workers > 1:
            runs = _compare_in_processes(named, workers, report=config.progress is not False)
        else:
            for name, c in named:
                runs[name], stopped = _train_variant(c)
                if stopped and ctx.is_main:
                    print(f"[compare] {stopped}", file=sys.stderr)
    finally:
        distributed.teardown(ctx)
    table = format_table(runs, baseline if baseline in runs else None)
    table_path, json_path = out_dir / "compare.md", out_dir / "compare.json"
    plot_path = None
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        table_path.write_text(table + "\n")
        write_json(json_path, {"baseline": baseline, "runs": {k: r.to_dict() for k, r in runs.items()}})
        if config.plot:
            plot_path = plot_compare(runs, out_dir / "compare.png",
                                     title=f"validation loss, preset {base.preset}")
    return CompareResult(runs, str(table_path), str(json_path), plot_path,
                         baseline if baseline in runs else None)


def _compare_in_processes(named: list[tuple[str, TrainConfig]], jobs: int, report: bool) -> dict[str, RunResult]:
    """:func:`compare`'s runs, ``jobs`` (at most ``len(named)``) at a time in spawned processes; the
    results in ``named``'s order."""
    import concurrent.futures
    import multiprocessing

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_job = max(1, cpus // jobs)
    done: dict[str, RunResult] = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs,
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_train_variant, dataclasses.replace(
            c, progress=False, threads=c.threads if c.threads is not None else per_job)): name for name, c in named}
        try:
            for fut in concurrent.futures.as_completed(futures):
                name = futures[fut]
                done[name], stopped = fut.result()   # an exception in a worker is raised here
                if stopped:
                    print(f"[compare] {stopped}", file=sys.stderr)
                elif report:
                    r = done[name]
                    print(f"[compare] {name}: {r.status}, {r.steps_completed} steps, final val loss "
                          f"{r.final_val_loss:.4f} ({len(done)} of {len(named)})", file=sys.stderr)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)   # drop the runs not started; let running ones finish
            raise
    return {name: done[name] for name, _ in named}
