"""NVFP4 the way people call it: ``python benchmarks/bench_api.py [--out FILE] [--smoke] [--skip-training]``.

(``--training-only``, ``--training-rounds N``, ``--training-modes MODE ...``: section 3 alone, N runs
per precision and mode, some modes.)

Measured side by side in one run on one device and written with provenance to
``results/api_speed_<cpu|cuda>.json`` (``--out`` to name it) (issue 17's table "how you call it -> what you get"):

1. ``quantize``: the public call on an 8192² BF16 tensor made from Python each time (``eager``:
   CUDA events around each call, its host read of the amax included), without the NaN/Inf check
   (``check=False``), and the same call captured in a CUDA graph (``kernels``: the kernels' GPU time
   alone); each also with the amax given. Against the one-pass limit: the input read once and the
   codes and scales written once, at the copy bandwidth measured in the same run. For scale, a
   PyTorch call of two kernels on the same tensor, ``x.abs().amax()``, timed the same two ways
   (``torch_reference``): what an eager call costs over its kernels when it is not ours. On a GPU
   the copy and the kernels are timed a second way too (``clean_l2``): after an L2 flush that reads
   instead of do_bench's, which zeroes a buffer and leaves dirty lines for the first kernel after
   it to write back (:func:`nvfp4lab.timing.bench_ms`, ``l2_flush="read"``).
2. ``linear``: ``NVFP4Linear`` forward+backward (the paper's recipe: RHT, SR gradients, 2D weights)
   against BF16 ``nn.Linear`` in the same mode: eager, ``torch.compile`` and captured in the
   user's own CUDA graph, at M=8192, K=N=4096 and at GPT-2-small's ``qkv`` shape (768 -> 2304).
   NVFP4 eager three times: replayed from the layer's own graphs (``eager``, the default,
   ``KernelOptions.layer_graphs``, outputs owned by each layer's graph), with its kernels launched
   one by one (``eager_no_graphs``) and with every output copied out of a graph shared by the
   layers of one shape (``eager_copy_out``, ``layer_graphs_owned_outputs=False``).
3. ``training`` (unless ``--skip-training``): steady-state tokens/s of ``nvfp4lab.train`` on the
   ``gpt2-small`` preset, NVFP4 against BF16 in the same mode: eager (NVFP4 also without the
   layer graphs), ``compile`` (NVFP4 also with its layer graphs' outputs copied out,
   ``compile_copy_out``), ``cuda_graph`` (with the optimizer in the graph), and both
   (``compile_cuda_graph``: the compiled step captured). ``--training-rounds`` repeats each run
   (BF16, then NVFP4, per round) and reports the median ratio and its spread: the compiled modes'
   tokens/s differed by up to 16% between two sessions on lent H200s (BF16 ``compile``: 568k and 477k).
   A compiled mode first trains each precision for two unrecorded steps (its first run in a process
   was often the slowest).

Timings come from :mod:`nvfp4lab.timing` (medians). Sections 1 and 2 repeat their measurements in
``--rounds`` rounds (default 5), the two sides of each ratio back to back within a round, and report
medians over the rounds with the ratios' spread: single runs of the same comparison on one machine
differed by up to ~10% (the BF16 baseline of a captured step, an eager call's host time).
``--smoke`` runs tiny shapes on any device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvfp4lab import kernels  # noqa: E402
from nvfp4lab.capabilities import require_device  # noqa: E402
from nvfp4lab.linear import LAYER_GRAPHS, NVFP4Linear  # noqa: E402
from nvfp4lab.provenance import environment  # noqa: E402
from nvfp4lab.quantize import quantize  # noqa: E402
from nvfp4lab.timing import bench_ms, capture, median_ms  # noqa: E402
from nvfp4lab.training import TrainConfig, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _log(*args: Any) -> None:
    print("[bench_api]", *args, file=sys.stderr, flush=True)


def _spread(values: list[float]) -> dict[str, Any]:
    """Median, min and max of one figure over the rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_quantize(device: str, n: int, rounds: int) -> dict[str, Any]:
    """Section 1: the public ``quantize`` call against its kernels and the one-pass limit.

    Each call is timed ``rounds`` times, eager and captured alternately (one capture per call):
    the medians are reported, and each eager/kernels ratio is the median of the rounds' ratios.
    On a GPU, ``clean_l2`` gives the copy, the one-pass limit and each call's kernels timed after a
    reading L2 flush (``bench_ms(..., l2_flush="read")``, once per round)."""
    x = torch.randn(n, n, device=device).to(torch.bfloat16)
    dst = torch.empty_like(x)
    one_pass_bytes = x.numel() * (x.element_size() + 0.5 + 1 / 16)   # read x; write codes + E4M3 scales

    def copy_limit(**flush: str) -> tuple[float, float, float]:
        """(copy ms, copy GB/s counting its read and its write, one-pass limit ms)."""
        ms = bench_ms(lambda: dst.copy_(x), device, **flush)
        gbps = 2 * x.numel() * x.element_size() / ms / 1e6
        return ms, gbps, one_pass_bytes / gbps / 1e6

    _, copy_gbps, limit_ms = copy_limit()
    clean = copy_limit(l2_flush="read") if device == "cuda" else None
    amax = x.abs().amax().float()
    calls: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {
        "quantize(x)": (lambda: quantize(x), {}),
        "quantize(x, check=False)": (lambda: quantize(x, check=False), {}),
        "quantize(x, check=False), Triton's own launches": (lambda: quantize(x, check=False),
                                                            {"launch_cache": False}),
        "quantize(x, amax=a)": (lambda: quantize(x, amax=amax), {}),
        "quantize(x, amax=a, check=False)": (lambda: quantize(x, amax=amax, check=False), {}),
    }
    reference = "x.abs().amax()"   # PyTorch, for scale: a call of two kernels that is not ours
    calls[reference] = (lambda: x.abs().amax(), {})
    rows, ref = [], None
    for name, (fn, opts) in calls.items():
        ours = name != reference
        captured = device == "cuda" and ("check=False" in name or not ours)
        eager, kern, kern_clean = [], [], []
        with kernels.use_options(**opts):
            graph = capture(fn)[0] if captured else None
            for _ in range(rounds):
                eager.append(median_ms(fn, device, iters=50, warmup=3))
                if graph is not None:
                    kern.append(bench_ms(graph.replay, device))
                    kern_clean.append(bench_ms(graph.replay, device, l2_flush="read"))
        del graph
        row = {"call": name, "eager_ms": statistics.median(eager), "eager_ms_rounds": eager}
        if ours:
            row["eager_frac_one_pass"] = limit_ms / row["eager_ms"]
        if kern:
            ratios = [e / k for e, k in zip(eager, kern)]
            row.update(kernels_ms=statistics.median(kern), kernels_ms_rounds=kern,
                       eager_over_kernels=statistics.median(ratios), eager_over_kernels_spread=_spread(ratios))
            if ours:
                row["kernels_frac_one_pass"] = limit_ms / row["kernels_ms"]
            if clean is not None:
                row["kernels_ms_clean_l2"] = statistics.median(kern_clean)
                if ours:
                    row["kernels_frac_one_pass_clean_l2"] = clean[2] / row["kernels_ms_clean_l2"]
        if ours:
            rows.append(row)
        else:
            ref = row
        _log(row)
    out = {"n": n, "dtype": "bfloat16", "rounds": rounds, "copy_GBps": copy_gbps, "one_pass_bytes": one_pass_bytes,
           "one_pass_limit_ms": limit_ms, "calls": rows, "torch_reference": ref}
    if clean is not None:
        out["clean_l2"] = {"copy_ms": clean[0], "copy_GBps": clean[1], "one_pass_limit_ms": clean[2]}
    return out


def _fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor) -> Callable[[], Any]:
    def step():
        layer.weight.grad = None
        x.grad = None
        layer(x).backward(gy)
    return step


def bench_linear(device: str, shapes: list[tuple[int, int, int]], rounds: int) -> list[dict[str, Any]]:
    """Section 2: NVFP4Linear vs BF16 nn.Linear, forward+backward, eager / compiled / captured.

    One mode after the other (eager first: compiling leaves state behind that slows later eager
    calls of the same process), each in ``rounds`` rounds that time BF16 and right after it NVFP4,
    so that the two sides of a ratio are measured back to back (the GPU's clocks and the host's
    state drift between rounds). NVFP4 without its layer graphs (``eager_no_graphs``) and with their
    outputs copied out (``eager_copy_out``) is paired with BF16 eager timed again in that mode's
    rounds (BF16 has neither: its figures under those names are eager ones). ``ms`` are the
    medians over the rounds, ``vs_bf16`` the medians of the rounds' ratios, with their spread."""
    rows = []
    for M, K, N in shapes:
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        make = {
            "bf16_nn.Linear": lambda: torch.nn.Linear(K, N, bias=False, device=device, dtype=torch.bfloat16),
            "nvfp4_NVFP4Linear": lambda: NVFP4Linear(K, N, bias=False, device=device, dtype=torch.bfloat16),
        }

        def timer(name: str, mode: str) -> Callable[[], float]:
            layer = make[name]()
            if mode == "captured":
                graph = capture(_fwd_bwd(layer, x, gy))[0]
                return lambda: bench_ms(graph.replay, device)
            step = _fwd_bwd(torch.compile(layer) if mode == "compile" else layer, x, gy)
            opts = {"eager_no_graphs": dict(layer_graphs=False),
                    "eager_copy_out": dict(layer_graphs_owned_outputs=False)}.get(mode, {})
            opts = opts if name.startswith("nvfp4") else {}

            def eager() -> float:
                with kernels.use_options(**opts):
                    return median_ms(step, device, iters=20, warmup=3)
            return eager

        modes = ["eager", "eager_no_graphs", "eager_copy_out", "compile"]
        modes += ["captured"] if device == "cuda" else []
        times: dict[str, dict[str, list[float]]] = {name: {} for name in make}
        torch._dynamo.reset()
        for mode in modes:
            timers = {name: timer(name, mode) for name in make}
            for _ in range(rounds):
                for name, t in timers.items():
                    times[name].setdefault(mode, []).append(t())
            del timers
        bf, nv = times["bf16_nn.Linear"], times["nvfp4_NVFP4Linear"]
        ratios = {m: [a / b for a, b in zip(nv[m], bf[m])] for m in modes}
        ms = {name: {m: statistics.median(v) for m, v in t.items()} for name, t in times.items()}
        for name in ms:
            _log(M, K, N, name, ms[name])
        rows.append({"M": M, "K": K, "N": N, "rounds": rounds, "ms": ms, "ms_rounds": times,
                     "vs_bf16": {m: statistics.median(r) for m, r in ratios.items()},
                     "vs_bf16_spread": {m: _spread(r) for m, r in ratios.items()}})
    LAYER_GRAPHS.clear()   # their buffers would count in the training section's peak memory
    return rows


def bench_training(device: str, preset: str, steps: int, rounds: int = 1,
                   only: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Section 3: steady-state tokens/s of ``nvfp4lab.train``, NVFP4 vs BF16 in each mode (``only``:
    these modes), ``rounds`` times (BF16 then NVFP4 in each round): each precision's figures are
    those of its median round by tokens/s, with ``tokens_per_s_rounds``; ``nvfp4_vs_bf16`` is the
    median of the rounds' ratios, with their ``nvfp4_vs_bf16_spread``."""
    modes = {"eager": {}, "eager_no_graphs": {}, "compile": {"compile": True}, "compile_copy_out": {"compile": True},
             "cuda_graph": {"cuda_graph": True, "graph_optimizer": device == "cuda"},
             "compile_cuda_graph": {"compile": True, "cuda_graph": True, "graph_optimizer": device == "cuda"}}
    # NVFP4-only variants: (the mode whose BF16 runs they are compared with, the kernel options they change)
    options = {"eager_no_graphs": ("eager", dict(layer_graphs=False)),
               "compile_copy_out": ("compile", dict(layer_graphs_owned_outputs=False))}
    if only is not None:
        unknown = sorted(set(only) - set(modes))
        if unknown:
            raise ValueError(f"unknown training modes {unknown}; choose from {sorted(modes)}")
        modes = {m: extra for m, extra in modes.items()
                 if m in only or any(options.get(o, ("",))[0] == m for o in only)}   # with the modes they compare with
    rows = []
    bf16_runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, extra in modes.items():
            if "cuda_graph" in extra and device != "cuda":
                continue
            shown = only is None or mode in only   # else run only for its BF16 runs, which a variant shown uses
            runs: dict[str, list[dict[str, Any]]] = {"bf16": [], "nvfp4": []}
            order = ("bf16", "nvfp4") if shown else ("bf16",)
            # the precisions this mode trains itself: BF16 has no layer graphs, a variant takes its base mode's runs
            precisions = [p for p in order if not (mode in options and p == "bf16")]

            def train_run(precision: str, n: int, tag: str):
                torch._dynamo.reset()
                with kernels.use_options(**(options[mode][1] if mode in options else {})):
                    return train(TrainConfig(preset=preset, precision=precision, steps=n, device=device,
                                             out=f"{tmp}/{mode}-{precision}-{tag}", progress=False, plot=False,
                                             eval_interval=n, checkpoint_interval=0, **extra))

            if extra.get("compile"):
                # an unrecorded short run of each precision first, as benchmarks/train_profile.py does: on
                # lent H200s the first compiled BF16 run of a process often ran its steady steps ~10% slower
                # than the next (504k-512k tokens/s against 534k-578k, 2026-11-29), which moved that round's ratio
                for precision in precisions:
                    train_run(precision, 2, "warm")
            for r in range(rounds):
                for precision in order:
                    if precision not in precisions:
                        runs["bf16"] = bf16_runs[options[mode][0]]
                        continue
                    res = train_run(precision, steps, str(r))
                    run = {"tokens_per_s": res.tokens_per_s, "warmup_time_s": res.to_dict().get("warmup_time_s"),
                           "final_val_loss": res.final_val_loss, "peak_memory_bytes": res.peak_memory_bytes,
                           "peak_memory_kind": res.peak_memory_kind}
                    runs[precision].append(run)
                    _log(mode, precision, r, run)
            bf16_runs[mode] = runs["bf16"]
            if not shown:
                continue
            ratios = [n["tokens_per_s"] / b["tokens_per_s"] for n, b in zip(runs["nvfp4"], runs["bf16"])]
            row = {"mode": mode, "preset": preset, "steps": steps, "rounds": len(ratios)}
            for precision, got in runs.items():
                median = sorted(got, key=lambda g: g["tokens_per_s"])[(len(got) - 1) // 2]
                row[precision] = {**median, "tokens_per_s_rounds": [g["tokens_per_s"] for g in got]}
            row["nvfp4_vs_bf16"] = statistics.median(ratios)
            row["nvfp4_vs_bf16_spread"] = _spread(ratios)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps (any device)")
    ap.add_argument("--skip-training", action="store_true")
    ap.add_argument("--steps", type=int, default=40, help="training steps per run (section 3)")
    ap.add_argument("--training-rounds", type=int, default=1, help="runs per precision and mode (section 3)")
    ap.add_argument("--training-modes", nargs="+", help="section 3's modes (default: all)")
    ap.add_argument("--training-only", action="store_true", help="section 3 alone")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of sections 1 and 2 (medians reported)")
    args = ap.parse_args(argv)
    if args.training_only and args.skip_training:
        ap.error("--training-only and --skip-training leave nothing to measure")
    require_device(args.device)
    device = torch.device(args.device).type
    n = 256 if args.smoke else 8192
    shapes = [(256, 128, 128)] if args.smoke else [(8192, 4096, 4096), (8192, 768, 2304)]
    out = args.out or ROOT / "results" / ("api_speed_smoke.json" if args.smoke else f"api_speed_{device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"environment": environment(args.device)}
    rounds = 2 if args.smoke else args.rounds
    sections = {} if args.training_only else {"quantize": lambda: bench_quantize(device, n, rounds),
                                               "linear": lambda: bench_linear(device, shapes, rounds)}
    if not args.skip_training:
        sections["training"] = lambda: bench_training(
            device, "ci" if args.smoke else "gpt2-small", 8 if args.smoke else args.steps, args.training_rounds,
            None if args.training_modes is None else tuple(args.training_modes))
    for name, run in sections.items():  # written after each section: a cut-off run keeps what it measured
        result[name] = run()
        out.write_text(json.dumps(result, indent=2) + "\n")
        _log(f"wrote {out} ({name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
