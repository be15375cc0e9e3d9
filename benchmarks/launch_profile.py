"""Where a public call's time goes: ``python benchmarks/launch_profile.py [--out FILE] [--cprofile N]``.

For each public call of :mod:`benchmarks.bench_api` (``quantize`` on 8192² BF16, ``NVFP4Linear``
forward+backward at M=8192, K=N=4096 and at GPT-2-small's ``qkv`` shape) it reports, in one run:

* ``kernels``: the GPU kernels one call launches (``torch.profiler``), by name, with their count,
  and ``kernel_us``: their GPU microseconds per call, by name (launched one by one, as below);
* ``host_us``: the host time of one call, calls issued back to back without synchronizing
  (when it exceeds the GPU time, the call is launch-bound: the GPU waits for Python);
* ``gpu_us``: the call's GPU time captured in a CUDA graph (:func:`nvfp4lab.timing.graph_ms`);
* with ``--cprofile N``: the N Python functions with the most own time over 50 calls.

The layer runs with ``KernelOptions(layer_graphs=False)``: its kernels launched one by one, what
its own CUDA graphs (the eager default, :mod:`nvfp4lab.cuda_graphs`) replay.
CUDA only. Written with provenance to ``results/launch_profile_cuda.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_api import _fwd_bwd  # noqa: E402  (the same step as the API benchmark)
from benchmarks.host_breakdown import host_us  # noqa: E402  (the one host timer of these benchmarks)
from nvfp4lab import kernels  # noqa: E402
from nvfp4lab.linear import NVFP4Linear  # noqa: E402
from nvfp4lab.provenance import environment  # noqa: E402
from nvfp4lab.quantize import quantize  # noqa: E402
from nvfp4lab.timing import graph_ms  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def kernels_per_call(fn: Callable[[], Any], calls: int = 10) -> tuple[dict[str, int], dict[str, float]]:
    """The GPU kernels of one call of ``fn`` (after warm-up): name -> count, and name -> their GPU
    microseconds per call (the profiler's kernel durations, averaged over ``calls`` calls)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    counts: collections.Counter[str] = collections.Counter()
    us: collections.Counter[str] = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            counts[ev.name[:90]] += 1
            us[ev.name[:90]] += ev.device_time / calls
    return {k: c // calls for k, c in counts.most_common()}, {k: round(v, 2) for k, v in us.most_common()}


def nvfp4lab_kernel_names() -> frozenset[str]:
    """The names of nvfp4lab's Triton kernels as the profiler reports them: every ``@triton.jit``
    function of :mod:`nvfp4lab.kernels.triton_kernels` whose name ends in ``_kernel`` (the GEMMs are
    cuBLAS's). The one list of "our kernels" for the benchmarks that profile them."""
    from nvfp4lab.kernels import triton_kernels

    return frozenset(name for name in dir(triton_kernels) if name.endswith("_kernel"))


def top_functions(fn: Callable[[], Any], n: int, calls: int = 50, sort: str = "tottime") -> str:
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s).sort_stats(sort)
    stats.print_stats(n)
    own: collections.Counter[str] = collections.Counter()
    for (file, _, _), (_, _, tt, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        own["nvfp4lab" if "/nvfp4lab/" in file else "triton" if "/triton/" in file
            else "torch" if "/torch/" in file else "builtins/other"] += tt / calls * 1e6
    s.write("own time per call (us, profiled): " + ", ".join(f"{k} {v:.0f}" for k, v in own.most_common()) + "\n")
    return s.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cprofile", type=int, default=0, help="print the N Python functions with most own time")
    ap.add_argument("--sort", default="tottime", help="cProfile order (tottime, cumulative)")
    ap.add_argument("--only", default="", help="profile only the calls whose name contains this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("launch_profile.py needs CUDA")
    dev = "cuda"
    x = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    amax = x.abs().amax().float()
    calls: dict[str, Callable[[], Any]] = {
        "quantize(x, check=False)": lambda: quantize(x, check=False),
        "quantize(x, amax=a, check=False)": lambda: quantize(x, amax=amax, check=False),
        "quantize(x)": lambda: quantize(x),
    }
    for M, K, N in ((8192, 4096, 4096), (8192, 768, 2304)):
        xl = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        calls[f"NVFP4Linear fwd+bwd {M}x{K}->{N}"] = _fwd_bwd(
            NVFP4Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16), xl, gy)
        calls[f"nn.Linear bf16 fwd+bwd {M}x{K}->{N}"] = _fwd_bwd(
            torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16), xl, gy)
    rows = []
    for name, fn in calls.items():
        if args.only not in name:
            continue
        counts, kernel_us = kernels_per_call(fn)
        row = {"call": name, "kernels": counts, "kernel_us": kernel_us, "host_us": host_us(fn),
               "gpu_us": 1e3 * graph_ms(fn)}
        row["launches"] = sum(counts.values())
        rows.append(row)
        print(f"{name}: {row['launches']} launches, host {row['host_us']:.1f} us, GPU {row['gpu_us']:.1f} us",
              flush=True)
        for k, c in row["kernels"].items():
            print(f"    {c} x {k}: {kernel_us[k]:.1f} us")
        if args.cprofile:
            print(top_functions(fn, args.cprofile, sort=args.sort), flush=True)
    out = args.out or ROOT / "results" / "launch_profile_cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(), "calls": rows}, indent=1) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    with kernels.use_options(layer_graphs=False):
        raise SystemExit(main())
