"""Regenerate the recorded GPU results of book/10_transformer_engine_blackwell and book/11_fp8_or_nvfp4 (TE on Hopper).

One run on the GPU machine writes ``<out>/te_gpu.json`` and ``<out>/te_gpu.png``::

    bash .device/install.sh --te && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_te_report.py --out $OUT

(then copy ``te_gpu.json`` and ``te_gpu.png`` into ``results/``). The script itself took 90 s on
an H100 and 72 s on an H200 (2026-11-22), after TE's ~1-minute install. ``--smoke`` runs every section at toy sizes on any machine, TE or not (what needs
TE or a GPU is recorded as skipped, with the reason); the CPU test suite runs it.

Sections (each guarded: a failure is recorded with its error and traceback and the rest
still runs; the JSON is rewritten after every section):

``environment``
    device name, driver (``nvidia-smi``), compute capability, memory, torch / CUDA / cuDNN /
    Triton / TE / nvfp4lab versions, ``NVTE_*`` variables, UTC date.
``probe``
    ``nvfp4lab.probe().to_dict()`` and its printed table.
``nvfp4_refusal``
    ``NVFP4BlockScaling`` on this GPU: TE's own ``is_nvfp4_available``; what
    ``nvfp4lab.te.autocast`` raises (before TE is entered); what raw ``te.autocast`` raises,
    whether that left TE's global autocast state switched on (TE mutates its state in
    ``autocast_enter`` *before* asserting, and ``__exit__`` never runs), and whether FP8 still
    works after the state is restored.
``training``
    the small GPT (preset ``laptop``: 4 blocks, width 128, context 128; batch 32 = 4096
    tokens/step; 300 steps) trained on the built-in byte corpus from the same initial
    weights and the same batches with: TE BF16 and TE FP8 current / delayed / block scaling
    (``nvfp4lab.te_model``, ``--backend te``), TE NVFP4 (refused on Hopper, recorded),
    nvfp4lab BF16 and nvfp4lab's emulated NVFP4 (``--backend nvfp4lab``, on CUDA: RHT + SR +
    2D weights, first and last block in BF16). Per run: train loss per step, validation
    curve, final losses, tokens/s (steps after the first 10, synchronized), peak CUDA memory.
    The TE model differs from nvfp4lab's in LayerNorm bias, tanh-GELU and BF16 attention
    (see :mod:`nvfp4lab.te_model`), so compare NVFP4 with ``nvfp4lab-bf16`` and FP8 with
    ``te-bf16``. ``--runs ...,te-nvfp4-reference`` adds TE's NVFP4 reference emulation
    through the TE model (not by default: slow).
``reference_vs_nvfp4lab``
    TE's NVFP4 reference (``make_recipe("nvfp4-reference")`` = ``CustomRecipe`` with
    ``nvfp4_ref_rht_2d_factory``) on a bias-free ``te.Linear`` against nvfp4lab's
    ``NVFP4Linear`` with SR disabled (TE's reference has none), RHT and 2D on, same weight,
    input and output gradient: first the quantizers bit for bit (weight 16x16; input rowwise
    and RHT'd columnwise), then the relative differences of y, dX, dW (see TOLERANCE_WHY).
``linear_timings``
    fwd+bwd of one linear layer, M=8192 tokens, K=N=4096, BF16 operands, bias-free: torch
    ``nn.Linear`` BF16 (the baseline), TE BF16, TE FP8 current / delayed / block, TE NVFP4
    reference (2 iterations: ~0.4 s each), nvfp4lab ``NVFP4Linear`` (RHT + SR + 2D). CUDA
    events around each iteration after warm-up; median; ratio to the baseline. Also the
    device's copy bandwidth and BF16 matmul TFLOP/s as cross-device baselines.

JSON schema (``schema`` = ``"nvfp4lab.te_gpu_report/1"``)::

    {schema, mode ("full"|"smoke"), argv, started_utc, total_seconds, files: {json, png},
     sections: {<name>: {status: "ok"|"error"|"skipped", seconds, error?, traceback?, reason?, ...}}}

    environment:  date_utc, python, platform, torch, cuda, cudnn, triton, transformer_engine,
                  nvfp4lab, git_commit, gpu_available, device_name, compute_capability [maj, min],
                  total_memory_bytes, device_count, driver_version, nvidia_smi, nvte_env {..}
    probe:        caps (probe().to_dict()), table (str)
    nvfp4_refusal: is_nvfp4_available [bool, reason], nvfp4lab_autocast {raised, type, message,
                  reason, te_state_enabled_after}, raw_te_autocast {raised, type, message,
                  te_state_enabled_after, autocast_depth_after, restored}, fp8_after_refusal_ok
    training:     setup {preset, model (GPTConfig dict), batch_size, seq_len, tokens_per_step,
                  steps, lr, warmup_steps, eval_every, eval_batches, corpus {..}, device, timing_skip},
                  runs {<name>: {status ("ok"|"error"|"refused"|"skipped"), backend, precision,
                  kernel_options (nvfp4lab.kernels.use_options changes, e.g. {layer_graphs: False}),
                  te_recipe, layers {nvfp4, fp8, high}, train_loss [per step], val_curve [[step, loss]],
                  final_train_loss (mean of last 10 steps), final_val_loss, tokens_per_s,
                  step_ms_median, peak_memory_bytes, peak_memory_kind, allocated_at_start_bytes (left by
                  earlier runs of the process when the peak counter was reset), wall_s, error?}}
    reference_vs_nvfp4lab: shape {M, K, N}, tolerance {rel_fro, why}, quantizer_bit_exact {..},
                  cases {bf16: {y|dx|dw: {rel_fro_vs_te, max_abs_diff, frac_elements_differ,
                  max_ulp_diff, rel_fro_te_vs_bf16, rel_fro_nvfp4lab_vs_bf16}}, fp32: {..}},
                  passed (bool, the bf16 case)
    linear_timings: shape {M, K, N}, method, device_baselines {copy_gb_s, bf16_matmul_tflops},
                  results {<name>: {status, median_ms, min_ms, iters, tflops, vs_torch_bf16, error?}}
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


SCHEMA = "nvfp4lab.te_gpu_report/1"
JSON_NAME = "te_gpu.json"
PNG_NAME = "te_gpu.png"
SECTIONS = ("environment", "probe", "nvfp4_refusal", "training", "reference_vs_nvfp4lab", "linear_timings")

#: Reference-vs-nvfp4lab tolerance (relative Frobenius norm of the difference, BF16 outputs).
REL_TOL = 1e-3
TOLERANCE_WHY = (
    "Both sides quantize bit-identically (checked first: codes, E4M3 block scales and amaxes of the "
    "weight and of both input copies), and both apply the same FP32 factor amax_a*amax_b/(6*6*448*448). "
    "Every product (code*scale) x (code*scale) is exact in FP32 (at most 2x(3+4) significant bits), so the "
    "two can differ only in FP32 summation order: TE's reference qgemm sums one exact 16-wide block dot "
    "product (times sx*sw) per K block in a Python loop, nvfp4lab runs one FP32 matmul over code*scale "
    "values (cuBLAS order). When the partial sums also fit in 24 bits (typical: few mantissa bits, block "
    "scales within a narrow range) the order does not matter and the results are bit-identical (see "
    "frac_elements_differ; 0 on an H100 in the first recorded run). In general an order difference is "
    "~1e-7 relative per element before the output cast, i.e. at most a 1-ulp flip of a few elements after "
    "the cast to BF16. 1e-3 leaves margin for that, is 8x below TE's own tolerance for its NVFP4 GEMMs "
    "(atol=rtol=8e-3) and ~100x below NVFP4's quantization error (~14 % here), so any real mismatch (a "
    "wrong tile, scale, RHT sign or transpose) fails it. The fp32 case is informational: TE's reference "
    "computes the RHT as an FP32 matmul, which is not exact for FP32 inputs (nvfp4lab computes the exact "
    "sum rounded once), so dW differs in a few elements; TE's native RHT accepts only BF16."
)


# ----------------------------------------------------------------------------- helpers
class Skip(Exception):
    """Raised inside a section to record it as skipped (with the message as reason)."""


def log(msg: str) -> None:
    print(f"[gpu_te_report {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _tb() -> str:
    return traceback.format_exc()[-3000:]


def _te_or_skip():
    """``transformer_engine.pytorch`` or :class:`Skip` with the reason (no TE / no GPU)."""
    from nvfp4lab import te as T

    if not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        return T.require_te()
    except T.TransformerEngineUnavailable as exc:
        raise Skip(f"Transformer Engine unavailable: {exc}") from None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write(report: dict[str, Any], out: Path) -> None:
    tmp = out / (JSON_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str, allow_nan=True)
        f.write("\n")
    os.replace(tmp, out / JSON_NAME)


def run_section(report: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]], out: Path) -> None:
    """Run one section; record its result or its error/skip; rewrite the JSON."""
    log(f"section {name} ...")
    t0 = time.perf_counter()
    try:
        data = fn()
        entry = {"status": "ok", **data}
    except Skip as exc:
        entry = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - recorded, the report goes on
        entry = {"status": "error", "error": _exc(exc), "traceback": _tb()}
    entry["seconds"] = round(time.perf_counter() - t0, 3)
    report["sections"][name] = entry
    _write(report, out)
    log(f"section {name}: {entry['status']} ({entry['seconds']:.1f} s)"
        + (f" - {entry.get('error') or entry.get('reason')}" if entry["status"] != "ok" else ""))


# ----------------------------------------------------------------------------- environment
def _nvidia_smi() -> tuple[str | None, str | None]:
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, _exc(exc)
    line = r.stdout.strip().splitlines()[0] if r.stdout.strip() else None
    if line is None:
        return None, (r.stderr.strip() or f"nvidia-smi exit {r.returncode}")
    return line, None


def section_environment(args) -> dict[str, Any]:
    """What this report adds to the environment block (``report["environment"]``, from
    :func:`nvfp4lab.provenance.environment`): TE's ``NVTE_*`` settings and import error, TF32,
    why cuDNN's version could not be read, the SM count and nvidia-smi's line."""
    env: dict[str, Any] = {
        "gpu_available": torch.cuda.is_available(),
        "nvte_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NVTE_")},
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    try:
        if torch.backends.cudnn.is_available():
            torch.backends.cudnn.version()
    except Exception as exc:  # noqa: BLE001 - e.g. TE loaded another cuDNN 9 first (see main)
        env["cudnn_error"] = _exc(exc)
    from nvfp4lab.capabilities import import_transformer_engine

    env["transformer_engine_error"] = import_transformer_engine()[2]
    if torch.cuda.is_available():
        env["multiprocessors"] = torch.cuda.get_device_properties(0).multi_processor_count
        line, err = _nvidia_smi()
        env["nvidia_smi"] = line or err
    return env


def section_probe(args) -> dict[str, Any]:
    from nvfp4lab.capabilities import format_table, probe

    caps = probe()
    return {"caps": caps.to_dict(), "table": format_table(caps)}


# ----------------------------------------------------------------------------- NVFP4 refusal
def section_nvfp4_refusal(args) -> dict[str, Any]:
    te = _te_or_skip()
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as G

    from nvfp4lab import te as T

    out: dict[str, Any] = {"is_nvfp4_available": list(te.is_nvfp4_available(return_reason=True))}

    def state() -> tuple[bool, int]:
        return bool(G.is_fp8_enabled()), int(G.quantization_state.autocast_depth)

    before = state()
    ours: dict[str, Any] = {"raised": False}
    try:
        with T.autocast(T.make_recipe("nvfp4")):
            pass
    except Exception as exc:  # noqa: BLE001
        ours.update(raised=True, type=type(exc).__name__, message=str(exc), reason=getattr(exc, "reason", None))
    ours["te_state_enabled_after"], ours["autocast_depth_after"] = state()
    out["nvfp4lab_autocast"] = ours

    raw: dict[str, Any] = {"raised": False}
    snapshot = G.get_autocast_state()
    depth = G.quantization_state.autocast_depth
    try:
        with te.autocast(enabled=True, recipe=R.NVFP4BlockScaling()):
            raw["body_ran"] = True
    except Exception as exc:  # noqa: BLE001
        raw.update(raised=True, type=type(exc).__name__, message=str(exc))
    raw["te_state_enabled_after"], raw["autocast_depth_after"] = state()
    # TE 2.20 mutates its global state in autocast_enter before the assertion; __exit__ never
    # runs, so restore it by hand (what nvfp4lab.te.autocast avoids by checking first).
    G.set_autocast_state(snapshot)
    G.quantization_state.autocast_depth = depth
    raw["restored"] = state() == before
    out["raw_te_autocast"] = raw
    out["state_before"] = {"enabled": before[0], "autocast_depth": before[1]}

    # FP8 still works afterwards.
    lin = te.Linear(128, 128, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    with T.autocast("fp8-current"):
        y = lin(x)
    out["fp8_after_refusal_ok"] = bool(torch.isfinite(y).all())
    return out


# ----------------------------------------------------------------------------- training
def _train_one(spec: dict[str, Any], setup: dict[str, Any], args, device: torch.device, out: Path) -> dict[str, Any]:
    """One run of ``spec`` through the library's training loop (``nvfp4lab.train``), reported in
    this file's layout: the loop does the training, CUDA-graph capture and steady-state timing."""
    from nvfp4lab import kernels
    from nvfp4lab import te as T
    from nvfp4lab.precisions import get_precision
    from nvfp4lab.training import GRAPH_WARMUP_STEPS, NonFiniteError, TrainConfig, train

    backend, precision, graphed = spec["backend"], spec["precision"], bool(spec.get("graph"))
    if backend == "te" and device.type != "cuda":
        raise Skip("--backend te needs a CUDA GPU")
    if graphed and device.type != "cuda":
        raise Skip("CUDA-graph runs need a CUDA GPU")
    allocated_at_start = None
    if device.type == "cuda":
        gc.collect()   # a previous run's CUDA graphs, kept by reference cycles, would count in this peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        allocated_at_start = torch.cuda.memory_allocated(device)
    cfg = TrainConfig(
        preset=setup["preset"], precision=precision, backend=backend, steps=setup["steps"],
        batch_size=setup["batch_size"], seq_len=setup["seq_len"], lr=setup["lr"],
        warmup_steps=setup["warmup_steps"], eval_interval=setup["eval_every"], eval_batches=setup["eval_batches"],
        seed=setup["seed"], text=args.text, device=str(device), cuda_graph=graphed, graph_optimizer=graphed,
        timing_warmup_steps=setup["timing_skip"], log_interval=1, checkpoint_interval=0, progress=False,
        plot=False, name=spec["name"], out=str(out / spec["name"]))
    try:
        with kernels.use_options(**spec.get("kernel_options", {})):
            r = train(cfg)
        status, error = "ok", None
    except T.TransformerEngineUnavailable as exc:
        raise Skip(f"Transformer Engine unavailable: {str(exc).splitlines()[0]}") from None
    except NonFiniteError as exc:
        r, status, error = exc.result, "error", str(exc)
    records = [json.loads(line) for line in Path(r.metrics_path).read_text().splitlines()]
    losses = [rec["loss"] for rec in records if rec["type"] == "train"]
    start = next(rec for rec in records if rec.get("event") == "start")
    run: dict[str, Any] = {
        "backend": backend, "precision": precision, "status": status,
        "kernel_options": spec.get("kernel_options", {}),
        "te_recipe": get_precision(precision).te_recipe if backend == "te" else None,
        "layers": r.layers, "train_loss": [round(v, 5) for v in losses],
        "val_curve": [[s_, round(v, 5)] for s_, v in r.val_curve],
        "final_train_loss": statistics.fmean(losses[-10:]) if losses else None,
        "final_val_loss": r.final_val_loss, "tokens_per_s": r.tokens_per_s, "step_ms_median": r.step_ms_median,
        "wall_s": round(r.wall_time_s, 3), "num_parameters": int(start["params"]),
        "peak_memory_bytes": r.peak_memory_bytes if device.type == "cuda" else None,
        "allocated_at_start_bytes": allocated_at_start,
        "peak_memory_kind": ("torch.cuda.max_memory_allocated (weights, AdamW state, activations)"
                             if device.type == "cuda" else "not measured on CPU"),
    }
    if error:
        run["error"] = error
    if graphed:
        run["cuda_graph"] = ("forward + backward + clip + fused AdamW step captured once after "
                             f"{GRAPH_WARMUP_STEPS} eager warm-up steps on a side stream, then replayed "
                             "(nvfp4lab.train with cuda_graph=True, graph_optimizer=True)")
    return run


TRAIN_RUNS = (
    {"name": "te-bf16", "backend": "te", "precision": "bf16"},
    {"name": "te-fp8-current", "backend": "te", "precision": "fp8-current"},
    {"name": "te-fp8-delayed", "backend": "te", "precision": "fp8-delayed"},
    {"name": "te-fp8-block", "backend": "te", "precision": "fp8-block"},
    {"name": "te-nvfp4", "backend": "te", "precision": "nvfp4"},
    {"name": "nvfp4lab-bf16", "backend": "nvfp4lab", "precision": "bf16"},
    {"name": "nvfp4lab-nvfp4", "backend": "nvfp4lab", "precision": "nvfp4"},
    {"name": "nvfp4lab-bf16-graph", "backend": "nvfp4lab", "precision": "bf16", "graph": True},
    {"name": "nvfp4lab-nvfp4-graph", "backend": "nvfp4lab", "precision": "nvfp4", "graph": True},
)
#: Only when named in --runs: TE's pure-PyTorch NVFP4 reference through the TE model (slow), and
#: eager NVFP4 without the layers' own CUDA graphs.
OPTIONAL_RUNS = (
    {"name": "te-nvfp4-reference", "backend": "te", "precision": "nvfp4-reference"},
    # eager NVFP4 with its layers' kernels launched one by one: no layer graphs, whose buffers and
    # outputs add to the peak (what nvfp4lab.plan does not count)
    {"name": "nvfp4lab-nvfp4-no-layer-graphs", "backend": "nvfp4lab", "precision": "nvfp4",
     "kernel_options": {"layer_graphs": False}},
)


def section_training(args, device: torch.device) -> dict[str, Any]:
    import dataclasses

    from nvfp4lab import te as T
    from nvfp4lab.data import load_corpus
    from nvfp4lab.model import get_preset

    cfg = get_preset(args.preset)
    if args.seq_len:
        cfg = dataclasses.replace(cfg, block_size=args.seq_len)
    setup: dict[str, Any] = {
        "preset": args.preset, "config": cfg, "batch_size": args.batch_size, "seq_len": cfg.block_size,
        "tokens_per_step": args.batch_size * cfg.block_size, "steps": args.train_steps, "lr": args.lr,
        "warmup_steps": max(1, args.train_steps // 10), "eval_every": max(1, args.train_steps // 6),
        "eval_batches": args.eval_batches, "seed": args.seed, "device": str(device),
        "timing_skip": min(10, max(0, args.train_steps - 1)),
        "loop": "nvfp4lab.train (the library's one training loop); tokens_per_s excludes the first "
                "timing_skip steps (TrainConfig.timing_warmup_steps)",
        "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1 on matrices), grad clip 1.0, "
                     "linear warm-up (10% of steps) then cosine to 0.1*lr",
        "autocast": "torch.autocast(bfloat16) around the forward pass (FP32 master weights)",
        "nvfp4lab_nvfp4_recipe": "NVFP4Recipe(): RHT + SR + 2D weights, first and last block BF16, head BF16",
    }
    setup["corpus"] = load_corpus(args.text).describe()
    out = Path(tempfile.mkdtemp(prefix="gpu_te_report_runs_"))   # the loop's run folders (not kept)
    runs: dict[str, Any] = {}
    if args.runs:
        wanted = [r for r in TRAIN_RUNS + OPTIONAL_RUNS if r["name"] in args.runs]
    else:
        wanted = list(TRAIN_RUNS)
    for spec in wanted:
        log(f"  training {spec['name']} ...")
        try:
            runs[spec["name"]] = _train_one(spec, setup, args, device, out)
        except Skip as exc:
            runs[spec["name"]] = {"status": "skipped", "reason": str(exc), **_spec_fields(spec)}
        except T.RecipeNotSupported as exc:  # NVFP4NotSupported included
            runs[spec["name"]] = {"status": "refused", "error": _exc(exc), "reason": exc.reason,
                                  **_spec_fields(spec)}
        except Exception as exc:  # noqa: BLE001
            runs[spec["name"]] = {"status": "error", "error": _exc(exc), "traceback": _tb(), **_spec_fields(spec)}
        r = runs[spec["name"]]
        if r["status"] == "ok":
            log(f"  {spec['name']}: final train {r['final_train_loss']:.4f}, val {r['final_val_loss']:.4f}, "
                f"{r['tokens_per_s']:,.0f} tok/s, {r['wall_s']:.1f} s")
        else:
            log(f"  {spec['name']}: {r['status']}: {r.get('error') or r.get('reason')}")
    setup["config"] = cfg.to_dict()
    return {"setup": setup, "runs": runs}


def _spec_fields(spec: dict[str, Any]) -> dict[str, Any]:
    return {"backend": spec["backend"], "precision": spec["precision"]}


# ----------------------------------------------------------------------------- reference vs nvfp4lab
def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Map BF16/FP32 bit patterns to integers that are monotone in the value (for ulp distances)."""
    if t.dtype == torch.bfloat16:
        i = t.contiguous().view(torch.int16).to(torch.int64)
        mag = i & 0x7FFF
    else:
        i = t.float().contiguous().view(torch.int32).to(torch.int64)
        mag = i & 0x7FFFFFFF
    return torch.where(i < 0, -mag, mag)


def _diff_stats(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor) -> dict[str, Any]:
    a, b, e = ours.detach(), theirs.detach(), exact.detach().float()
    d = (a.float() - b.float())
    same = torch.signbit(a.float()) == torch.signbit(b.float())
    return {
        "rel_fro_vs_te": float(d.norm() / b.float().norm()),
        "max_abs_diff": float(d.abs().max()),
        "max_abs_te": float(b.float().abs().max()),
        "frac_elements_differ": float((a != b).float().mean()),
        # ulp distance among elements of equal sign; a sign flip (both values tiny) is counted apart
        "max_ulp_diff": int(((_ordered_bits(a) - _ordered_bits(b)).abs() * same).max()) if same.any() else 0,
        "sign_flips": int((~same).sum()),
        "rel_fro_te_vs_unquantized": float((b.float() - e).norm() / e.norm()),
        "rel_fro_nvfp4lab_vs_unquantized": float((a.float() - e).norm() / e.norm()),
    }


def _quantizer_bit_exact(w: torch.Tensor, x: torch.Tensor) -> dict[str, Any]:
    """TE's reference quantizers (the roles of nvfp4_ref_rht_2d_factory) vs nvfp4lab.quantize, bit for bit."""
    from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import nvfp4_ref_rht_2d_factory

    from nvfp4lab.quantize import quantize

    def role(tensor_type: str):
        return types.SimpleNamespace(module_type="linear", tensor_type=tensor_type, name="")

    res: dict[str, Any] = {}
    qw = nvfp4_ref_rht_2d_factory(role("weight")).quantize(w)
    ow, owt = quantize(w, block="2d"), quantize(w.t().contiguous(), block="2d")
    res["weight_rowwise_2d"] = bool(
        torch.equal(ow.data, qw.data) and torch.equal(ow.rowwise_scale.view(torch.uint8),
                                                      qw.scale.view(torch.uint8)[: w.shape[0]])
        and torch.equal(ow.amax.reshape(1), qw.global_amax_row.reshape(1)))
    res["weight_columnwise_2d"] = bool(
        torch.equal(owt.data, qw.data_t) and torch.equal(owt.rowwise_scale.view(torch.uint8),
                                                         qw.scale_t.view(torch.uint8)[: w.shape[1]]))
    qx = nvfp4_ref_rht_2d_factory(role("input")).quantize(x)
    ox, oxt = quantize(x), quantize(x.t().contiguous(), rht=True)
    res["input_rowwise_1x16"] = bool(
        torch.equal(ox.data, qx.data) and torch.equal(ox.scale.view(torch.uint8), qx.scale.view(torch.uint8))
        and torch.equal(ox.amax.reshape(1), qx.global_amax_row.reshape(1)))
    res["input_columnwise_1x16_rht"] = bool(
        torch.equal(oxt.data, qx.data_t) and torch.equal(oxt.scale.view(torch.uint8), qx.scale_t.view(torch.uint8))
        and torch.equal(oxt.amax.reshape(1), qx.global_amax_col.reshape(1)))
    res["all"] = all(res.values())
    return res


def compare_reference(M: int, K: int, N: int, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """TE NVFP4 reference (CustomRecipe) on a bias-free te.Linear vs nvfp4lab NVFP4Linear (SR off)."""
    te = _te_or_skip()
    from nvfp4lab import te as T
    from nvfp4lab.linear import NVFP4Linear
    from nvfp4lab.recipe import NVFP4Recipe

    dev = torch.device("cuda")
    torch.manual_seed(seed)
    lin = te.Linear(K, N, bias=False, params_dtype=dtype)
    w = lin.weight.detach().clone()
    x = torch.randn(M, K, device=dev, dtype=dtype)
    g = torch.randn(M, N, device=dev, dtype=dtype)

    x_te = x.clone().requires_grad_()
    with T.autocast(T.make_recipe("nvfp4-reference")):
        y_te = lin(x_te)
    y_te.backward(g)

    ours = NVFP4Linear(K, N, bias=False, device=dev, dtype=dtype,
                       recipe=NVFP4Recipe(disable_stochastic_rounding=True))
    with torch.no_grad():
        ours.weight.copy_(w)
    x_l = x.clone().requires_grad_()
    y_l = ours(x_l)
    y_l.backward(g)

    xf, wf, gf = x.double(), w.double(), g.double()  # unquantized products, for scale
    out = {
        "y": _diff_stats(y_l, y_te, xf @ wf.t()),
        "dx": _diff_stats(x_l.grad, x_te.grad, gf @ wf),
        "dw": _diff_stats(ours.weight.grad, lin.weight.grad, gf.t() @ xf),
        "dtype": str(dtype).replace("torch.", ""),
    }
    if dtype == torch.bfloat16:
        out["quantizer_bit_exact"] = _quantizer_bit_exact(w, x)
    return out


def section_reference(args) -> dict[str, Any]:
    _te_or_skip()
    M, K, N = (64, 128, 64) if args.smoke else (512, 1024, 512)
    cases: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        try:
            cases[name] = compare_reference(M, K, N, dtype, args.seed)
        except Exception as exc:  # noqa: BLE001
            errors[name] = _exc(exc)
            cases[name] = {"status": "error", "error": _exc(exc), "traceback": _tb()}
    bf16 = cases.get("bf16", {})
    passed = ("y" in bf16 and all(bf16[k]["rel_fro_vs_te"] <= REL_TOL for k in ("y", "dx", "dw"))
              and bf16.get("quantizer_bit_exact", {}).get("all", False))
    res = {
        "shape": {"M": M, "K": K, "N": N},
        "setup": "te.Linear(K, N, bias=False) under nvfp4lab.te.autocast(make_recipe('nvfp4-reference')) vs "
                 "NVFP4Linear(K, N, bias=False, recipe=NVFP4Recipe(disable_stochastic_rounding=True)) "
                 "(RHT on Wgrad operands, 16x16 weight tiles); same weight, x ~ N(0,1), dY ~ N(0,1)",
        "tolerance": {"rel_fro": REL_TOL, "applies_to": "bf16 case: y, dx, dw", "why": TOLERANCE_WHY},
        "cases": cases,
        "passed": bool(passed),
    }
    if "quantizer_bit_exact" in bf16:
        res["quantizer_bit_exact"] = bf16["quantizer_bit_exact"]
    if errors:
        res["case_errors"] = errors
    return res


# ----------------------------------------------------------------------------- linear timings
def _device_baselines(device: torch.device, smoke: bool) -> dict[str, Any]:
    from nvfp4lab.timing import per_call_ms  # nvfp4lab only after main() imported TE (see main)

    n = 1 << (18 if smoke else 28)  # fp32 elements per buffer: 1 MiB (smoke) or 1 GiB
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = per_call_ms(lambda: dst.copy_(src), device, iters=5 if smoke else 20, warmup=2)
    copy = 2 * src.numel() * 4 / (statistics.median(t) * 1e-3) / 1e9
    s = 256 if smoke else 8192
    a = torch.randn(s, s, device=device, dtype=torch.bfloat16)
    b = torch.randn(s, s, device=device, dtype=torch.bfloat16)
    t = per_call_ms(lambda: a @ b, device, iters=3 if smoke else 20, warmup=2)
    return {"copy_gb_s": copy, "copy_bytes_moved": 2 * src.numel() * 4,
            "bf16_matmul_tflops": 2 * s**3 / (statistics.median(t) * 1e-3) / 1e12, "bf16_matmul_size": s}


def section_linear_timings(args, device: torch.device) -> dict[str, Any]:
    from nvfp4lab.timing import per_call_ms  # nvfp4lab only after main() imported TE (see main)

    from nvfp4lab import te as T
    from nvfp4lab.linear import NVFP4Linear

    M, K, N = (64, 64, 64) if args.smoke else (8192, 4096, 4096)
    dtype = torch.bfloat16
    iters, warmup = (2, 1) if args.smoke else (20, 5)
    res: dict[str, Any] = {
        "shape": {"M": M, "K": K, "N": N},
        "method": (f"fwd+bwd (y = layer(x); y.backward(dy)) with BF16 x [M, K], dy [M, N], bias-free layers; "
                   f"{warmup} warm-up iterations, then CUDA events around each of {iters} iterations "
                   "(fewer for the slow emulations, see iters); median. TFLOP/s counts 6*M*N*K."),
        "device": str(device),
    }
    try:
        res["device_baselines"] = _device_baselines(device, args.smoke)
    except Exception as exc:  # noqa: BLE001
        res["device_baselines"] = {"error": _exc(exc)}
    torch.manual_seed(args.seed)
    x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(M, N, device=device, dtype=dtype)

    def fwd_bwd(layer: nn.Module, ctx: Callable[[], Any] = contextlib.nullcontext) -> Callable[[], None]:
        def step() -> None:
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            with ctx():
                y = layer(x)
            y.backward(g)
        return step

    def te_layer():
        te = _te_or_skip()
        return te.Linear(K, N, bias=False, params_dtype=dtype, device=device)

    configs: list[tuple[str, Callable[[], tuple[Callable[[], None], int, int]]]] = [
        ("torch-bf16", lambda: (fwd_bwd(nn.Linear(K, N, bias=False, device=device, dtype=dtype)), iters, warmup)),
        ("te-bf16", lambda: (fwd_bwd(te_layer()), iters, warmup)),
    ]
    def te_recipe_step(name: str, n_iter: int, n_warm: int):
        layer = te_layer()
        recipe = T.make_recipe(name)  # one recipe object per layer (TE keys its amax state on it)
        return fwd_bwd(layer, lambda: T.autocast(recipe)), n_iter, n_warm

    for name in ("fp8-current", "fp8-delayed", "fp8-block"):
        configs.append((f"te-{name}", lambda name=name: te_recipe_step(name, iters, warmup)))
    # TE's NVFP4 emulation loops over K/16 slices in Python: ~0.4 s per fwd+bwd at this shape.
    configs.append(("te-nvfp4-reference", lambda: te_recipe_step("nvfp4-reference", 2, 1)))
    configs.append(("nvfp4lab-nvfp4", lambda: (
        fwd_bwd(NVFP4Linear(K, N, bias=False, device=device, dtype=dtype)), min(iters, 5), min(warmup, 2))))

    results: dict[str, Any] = {}
    flops = 6.0 * M * N * K
    for name, make in configs:
        try:
            step, n_iter, n_warm = make()
            times = per_call_ms(step, device, iters=n_iter, warmup=n_warm)
            med = statistics.median(times)
            results[name] = {"status": "ok", "median_ms": med, "min_ms": min(times), "iters": n_iter,
                             "warmup": n_warm, "tflops": flops / (med * 1e-3) / 1e12}
        except Skip as exc:
            results[name] = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001
            results[name] = {"status": "error", "error": _exc(exc), "traceback": _tb()}
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r = results[name]
        log(f"  {name}: " + (f"{r['median_ms']:.3f} ms" if r["status"] == "ok" else f"{r['status']}: "
                                                                                   f"{r.get('error') or r.get('reason')}"))
    base = results.get("torch-bf16", {}).get("median_ms")
    for r in results.values():
        if r.get("status") == "ok" and base:
            r["vs_torch_bf16"] = r["median_ms"] / base
    res["results"] = results
    return res


# ----------------------------------------------------------------------------- plot
def _moving_average(values: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for j, v in enumerate(values):
        acc += v
        if j >= k:
            acc -= values[j - k]
        out.append(acc / min(j + 1, k))
    return out


def make_plot(report: dict[str, Any], path: Path) -> str:
    """Three panels: training loss, loss gap to the same backend's BF16 run, linear-layer times."""
    # The Figure API leaves pyplot and its backend alone (this also runs inside notebooks).
    from matplotlib.figure import Figure

    env = report["sections"].get("environment", {})
    fig = Figure(figsize=(17, 4.8))
    ax1, ax3, ax2 = fig.subplots(1, 3)
    runs = report["sections"].get("training", {}).get("runs", {})
    ok = {n: r for n, r in runs.items() if r.get("status") == "ok" and r.get("train_loss")}
    colors = {n: f"C{i}" for i, n in enumerate(runs)}
    for name, r in ok.items():
        loss = r["train_loss"]
        k = max(1, len(loss) // 30)
        ax1.plot(range(1, len(loss) + 1), _moving_average(loss, k), color=colors[name], lw=1.2,
                 label=f"{name} (val {r['final_val_loss']:.4f})" if r.get("final_val_loss") is not None else name)
        if r.get("val_curve"):
            s, v = zip(*r["val_curve"])
            ax1.plot(s, v, "o", color=colors[name], ms=3)
        base = ok.get(f"{r['backend']}-bf16")
        if base is not None and base is not r and len(base["train_loss"]) == len(loss):
            gap = [a - b for a, b in zip(loss, base["train_loss"])]  # same batches: a paired difference
            k2 = max(1, len(gap) // 10)
            ax3.plot(range(1, len(gap) + 1), _moving_average(gap, k2), color=colors[name], lw=1.2,
                     label=f"{name} - {r['backend']}-bf16")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats / byte)")
    ax1.set_title("small GPT: train loss (moving avg), validation (dots)")
    ax1.grid(alpha=0.3)
    if ax1.lines:
        ax1.legend(fontsize=7)
    ax3.axhline(0.0, color="0.5", lw=0.8)
    ax3.set_xlabel("step")
    ax3.set_ylabel("train-loss difference (nats / byte)")
    ax3.set_title("gap to BF16 of the same backend (moving avg)")
    ax3.grid(alpha=0.3)
    if ax3.lines[1:]:
        ax3.legend(fontsize=7)
    lt = report["sections"].get("linear_timings", {})
    rows = [(n, r["median_ms"]) for n, r in lt.get("results", {}).items() if r.get("status") == "ok"]
    if rows:
        names, ms = zip(*rows)
        ax2.barh(range(len(ms)), ms, color=[f"C{i}" for i in range(len(ms))])
        ax2.set_yticks(range(len(ms)), names, fontsize=8)
        ax2.set_xscale("log")
        ax2.invert_yaxis()
        for i, v in enumerate(ms):
            ax2.text(v, i, f" {v:.3g} ms", va="center", fontsize=7)
    shape = lt.get("shape", {})
    ax2.set_xlabel("fwd+bwd time (ms, log scale)")
    ax2.set_title(f"one linear layer, M={shape.get('M')}, K={shape.get('K')}, N={shape.get('N')}")
    ax2.grid(alpha=0.3, axis="x")
    fig.suptitle(f"{env.get('device_name', '?')} | torch {env.get('torch')} | TE {env.get('transformer_engine')} "
                 f"| {env.get('date_utc', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "results"), help="output folder (default results/)")
    p.add_argument("--smoke", action="store_true",
                   help="toy sizes, any machine (CPU without TE included); TE/GPU sections recorded as skipped")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--runs", default="", help="comma-separated training runs (default: "
                   f"{', '.join(r['name'] for r in TRAIN_RUNS)}; also available: "
                   f"{', '.join(r['name'] for r in OPTIONAL_RUNS)})")
    p.add_argument("--preset", default=None, help="model preset (default laptop; smoke: ci)")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's context length (smoke: 32)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 32; smoke 2)")
    p.add_argument("--train-steps", type=int, default=None, help="steps per run (default 300; smoke 2)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--eval-batches", type=int, default=None, help="validation batches (default 8; smoke 1)")
    p.add_argument("--text", default=None, help="corpus file/folder (default: built-in pydoc_data.topics)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 if any section ends in 'error'")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    smoke = args.smoke
    args.preset = args.preset or ("ci" if smoke else "laptop")
    args.batch_size = args.batch_size or (2 if smoke else 32)
    args.train_steps = args.train_steps or (2 if smoke else 300)
    if smoke and args.seq_len is None:
        args.seq_len = 32
    args.eval_batches = args.eval_batches or (1 if smoke else 8)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    unknown += [r for r in args.runs if r not in {x["name"] for x in TRAIN_RUNS + OPTIONAL_RUNS}]
    if unknown:
        print(f"unknown section(s) or run(s) {unknown}; sections: {SECTIONS}; runs: "
              f"{[x['name'] for x in TRAIN_RUNS + OPTIONAL_RUNS]}", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # Import TE before anything initializes cuDNN: on the lent H100 a system cuDNN 9 in
    # /lib/x86_64-linux-gnu clashes with the one torch has loaded once torch.backends.cudnn
    # was queried, and TE's import then fails with an undefined cudnn symbol.
    from nvfp4lab.capabilities import import_transformer_engine

    import_transformer_engine()
    threads = torch.get_num_threads()
    if smoke and device.type == "cpu":
        torch.set_num_threads(1)  # toy sizes: threads only add overhead on a shared CPU
    try:
        return _run(args, sections, device)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, sections: list[str], device: torch.device) -> int:
    smoke = args.smoke
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    from nvfp4lab.provenance import environment  # after main() imported TE (cuDNN order, see main)

    report: dict[str, Any] = {
        "schema": SCHEMA, "mode": "smoke" if smoke else "full", "argv": args.argv,
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(device),
        "files": {"json": JSON_NAME, "png": None}, "sections": {},
    }
    fns = {
        "environment": lambda: section_environment(args),
        "probe": lambda: section_probe(args),
        "nvfp4_refusal": lambda: section_nvfp4_refusal(args),
        "training": lambda: section_training(args, device),
        "reference_vs_nvfp4lab": lambda: section_reference(args),
        "linear_timings": lambda: section_linear_timings(args, device),
    }
    for name in SECTIONS:
        if name in sections:
            run_section(report, name, fns[name], out)
    if not args.no_plot:
        try:
            make_plot(report, out / PNG_NAME)
            report["files"]["png"] = PNG_NAME
        except Exception as exc:  # noqa: BLE001
            report["plot_error"] = _exc(exc)
    report["total_seconds"] = round(time.perf_counter() - t0, 2)
    _write(report, out)
    statuses = {k: v["status"] for k, v in report["sections"].items()}
    log(f"done in {report['total_seconds']:.1f} s: {statuses}; wrote {out / JSON_NAME}")
    if args.strict and any(s == "error" for s in statuses.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
