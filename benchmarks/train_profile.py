"""Where a training step's GPU time goes: ``python benchmarks/train_profile.py [--modes cuda_graph ...] [--out FILE]``.

``nvfp4lab.train`` on the ``gpt2-small`` preset, BF16 and NVFP4, under ``torch.profiler`` (CUDA
activity: every kernel and copy, inside CUDA graphs too). Each precision and mode trains twice, for
``--steps`` and for ``--steps + --extra`` steps, with the same warm-up, compilation, graph captures,
final evaluation and checkpoint; the difference of the two runs' kernel times is what ``--extra``
steady training steps cost, divided per step. Kernels are grouped by what they are: cuBLAS GEMMs,
nvfp4lab's own Triton kernels (quantize, amax, decode, GEMM scaling), copies on the device
(device-to-device copies and PyTorch copy kernels, among them the layer graphs' copies in and out),
attention, host transfers (batches in, logged values and checkpoints out: their time depends on the
host and does not cancel exactly between the two runs) and the rest (element-wise work, layer
norms, the optimizer). Where the two runs did different work outside their extra
steps (a kind of kernel with negative time per step, a compute kernel launched a fractional number
of times per step; under ``torch.compile``, Inductor's compile-time kernels or fusions can differ between
the runs: a short unprofiled run first fills its caches, so that neither profiled run tunes kernels), that precision and mode get a list of ``problems`` and the script exits with status 1
after writing the file. The profiler slows the host, so its runs' tokens/s are not the benchmark's
(``bench_api.py``); kernel times are what it measures. ``layer_graphs_per_step``: what the NVFP4
layers' own CUDA graphs did per steady step of the longer run (its ``RunResult.layer_graphs`` over
its timed steps: calls run directly, captures, replays, bytes copied in and out; zero where the
layers replay no graphs of their own, as in BF16 or inside a captured step). Written with
provenance to ``results/train_profile_<device>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.launch_profile import nvfp4lab_kernel_names  # noqa: E402  (the one list of nvfp4lab's kernels)
from nvfp4lab.capabilities import require_device  # noqa: E402
from nvfp4lab.provenance import environment  # noqa: E402
from nvfp4lab.training import TrainConfig, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = {"eager": {}, "compile": {"compile": True}, "cuda_graph": {"cuda_graph": True, "graph_optimizer": True}}


def category(name: str, ours: frozenset[str]) -> str:
    """The group a kernel of this name belongs to (see the module docstring)."""
    if name in ours:
        return "nvfp4lab kernels"
    low = name.lower()
    if any(k in low for k in ("nvjet", "gemm", "xmma", "cutlass")):
        return "GEMM (cuBLAS)"
    if "dtoh" in low or "htod" in low:
        return "host transfers"
    if "memcpy" in low or "copy" in low:
        return "copies"
    if "sdpa" in low or "flash" in low or "attention" in low:
        return "attention"
    return "other"


def kernel_ms(cfg: TrainConfig) -> tuple[dict[str, float], dict[str, tuple[int, float]], Any]:
    """Train with ``cfg`` under the profiler: (ms by category, (calls, ms) by kernel name, the run's result)."""
    ours = nvfp4lab_kernel_names()
    torch._dynamo.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = train(cfg)
    by_cat: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_cat[category(e.name, ours)] += e.device_time / 1e3
            entry = by_name[e.name]
            entry[0] += 1
            entry[1] += e.device_time / 1e3
    return dict(by_cat), {k: (v[0], v[1]) for k, v in by_name.items()}, result


def difference_problems(per_step: dict[str, float], kernels: list[dict[str, Any]], tol_ms: float = 0.05) -> list[str]:
    """What makes a two-run difference not one of steady steps: a kind of kernel (host transfers
    aside, whose time depends on the host) with negative time per step, or a compute kernel
    launched a fractional number of times per step. Both mean the two runs did different work
    outside their extra steps (under ``torch.compile``: compile-time kernels in one run only, or
    differently fused kernels). Copies and host transfers may vary from step to step and are not
    checked for whole counts: the layer graphs copy an input in only when it has moved
    (:mod:`nvfp4lab.cuda_graphs`), which depends on where the allocator put it. ``per_step``: ms
    per step by category; ``kernels``: rows with ``name``, ``calls_per_step``, ``ms_per_step``.
    Returns one sentence per problem (empty: none found)."""
    ours = nvfp4lab_kernel_names()
    problems = [f"{cat}: {ms:.2f} ms per step (negative)" for cat, ms in per_step.items()
                if cat != "host transfers" and ms < -tol_ms]
    problems += [f"{k['name'][:60]}: {k['calls_per_step']:g} calls per step" for k in kernels
                 if category(k["name"], ours) not in ("host transfers", "copies")
                 and abs(k["calls_per_step"] - round(k["calls_per_step"])) > 0.01]
    return problems


def profile_mode(mode: str, steps: int, extra: int, device: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        def config(precision: str, n: int, tag: str) -> TrainConfig:
            """gpt2-small in ``precision`` and this mode for ``n`` steps, validated once, at its end."""
            return TrainConfig(preset="gpt2-small", precision=precision, steps=n, device=device,
                               out=f"{tmp}/{mode}-{precision}-{tag}", progress=False, plot=False, eval_interval=n,
                               checkpoint_interval=0, **MODES[mode])

        for precision in ("bf16", "nvfp4"):
            if MODES[mode].get("compile"):
                # an unprofiled run first: on a cold cache Inductor benchmarks its kernels' configs the
                # first time they launch (CachingAutotuner.autotune_to_one_config in PyTorch's
                # torch/_inductor/runtime/triton_heuristics.py): extra launches in whichever profiled run
                # compiled first, which the difference then refuses; after this run both find them cached
                torch._dynamo.reset()
                train(config(precision, 2, "warm"))
            runs = [kernel_ms(config(precision, n, str(n))) for n in (steps, steps + extra)]
            (cat0, name0, _), (cat1, name1, res) = runs
            per_step = {c: (cat1.get(c, 0.0) - cat0.get(c, 0.0)) / extra for c in sorted(set(cat0) | set(cat1))}
            kernels = sorted(((k, (c - name0.get(k, (0, 0.0))[0]) / extra, (ms - name0.get(k, (0, 0.0))[1]) / extra)
                              for k, (c, ms) in name1.items()), key=lambda r: -r[2])[:20]
            top = [{"name": k, "calls_per_step": c, "ms_per_step": ms} for k, c, ms in kernels]
            out[precision] = {"kernel_ms_per_step": per_step, "kernel_ms_per_step_total": sum(per_step.values()),
                              "top_kernels": top, "tokens_per_s": res.tokens_per_s,
                              "layer_graphs_per_step": {k: v / res.timed_steps for k, v in res.layer_graphs.items()},
                              "problems": difference_problems(per_step, top)}
            print(f"[train_profile] {mode} {precision}", {k: round(v, 2) for k, v in per_step.items()},
                  "layer graphs per steady step:", out[precision]["layer_graphs_per_step"], file=sys.stderr, flush=True)
            for problem in out[precision]["problems"]:
                print(f"[train_profile] {mode} {precision}: not a steady-step difference: {problem}",
                      file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", nargs="+", default=["cuda_graph", "compile", "eager"], choices=list(MODES))
    ap.add_argument("--steps", type=int, default=20, help="steps of the shorter run (warm-up included)")
    ap.add_argument("--extra", type=int, default=10, help="steady steps the longer run adds")
    args = ap.parse_args(argv)
    require_device(args.device)
    device = torch.device(args.device).type
    out = args.out or ROOT / "results" / f"train_profile_{device}.json"
    result: dict[str, Any] = {"environment": environment(args.device), "steps": args.steps, "extra": args.extra,
                              "command": " ".join(["python", "benchmarks/train_profile.py",
                                                   *(sys.argv[1:] if argv is None else argv)]),
                              "modes": {}}
    for mode in args.modes:   # written after each mode: a cut-off run keeps what it measured
        result["modes"][mode] = profile_mode(mode, args.steps, args.extra, device)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    bad = [f"{mode} {prec}" for mode, r in result["modes"].items() for prec, v in r.items() if v["problems"]]
    if bad:
        print(f"[train_profile] written to {out}, but these differences are not steady steps: {', '.join(bad)} "
              "(see their 'problems')", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
