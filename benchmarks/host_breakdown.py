"""Host time of each piece of an eager NVFP4Linear step: ``python benchmarks/host_breakdown.py [--out FILE]``.

Every piece is called back to back (``--tokens`` rows; the GPU work of each piece is shorter than
its host time, so the GPU never holds the host back) and timed with ``time.perf_counter``:
microseconds of host time per call, what each adds to an eager step (launch-bound at GPT-2-small
sizes, see ``benchmarks/launch_profile.py``). The whole layer step is also captured in a CUDA graph
for its GPU time. ``--one-core`` pins the process to one CPU core first (``os.sched_setaffinity``;
threads started later, such as autograd's device thread that runs the backward, inherit it).
The layer runs with ``KernelOptions(layer_graphs=False)``: its kernels launched one by one, what
its own CUDA graphs (the eager default, :mod:`nvfp4lab.cuda_graphs`) replay.
CUDA only. Written with provenance to ``results/host_breakdown_cuda.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_api import _fwd_bwd  # noqa: E402
from nvfp4lab import kernels  # noqa: E402
from nvfp4lab.linear import NVFP4Linear  # noqa: E402
from nvfp4lab.provenance import environment  # noqa: E402
from nvfp4lab.quantize import nvfp4_matmul, quantize, quantize_rowwise_columnwise  # noqa: E402
from nvfp4lab.rounding import SRStream  # noqa: E402
from nvfp4lab.timing import graph_ms  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_BENCH_OPS = torch.library.Library("nvfp4lab_bench", "FRAGMENT")


def host_us(fn: Callable[[], Any], calls: int = 400, repeats: int = 5) -> float:
    """Median over ``repeats`` of the host microseconds per call of ``calls`` back-to-back calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append(1e6 * (time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--one-core", action="store_true", help="pin the process to one CPU core first")
    args = ap.parse_args(argv)
    if args.one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if not torch.cuda.is_available():
        raise SystemExit("host_breakdown.py needs CUDA")
    dev, M, K, N = "cuda", args.tokens, 768, 2304
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    amax = x.abs().amax().float()
    k = kernels._kernels()
    d = torch.empty(M, K // 2, dtype=torch.uint8, device=dev)
    s = torch.empty(M, K // 16, dtype=torch.uint8, device=dev)
    seeds = torch.zeros(2, dtype=torch.int64, device=dev)
    cfg = kernels.options().config["rows"]
    stream = SRStream(0, dev)
    qx, qw = quantize(x, check=False), quantize(w, block="2d", check=False)
    ones = torch.ones(1, device=dev)
    layer = NVFP4Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g

    fwd_bwd = _fwd_bwd(layer, xg, dy)   # the step of the API benchmark
    def _no_grad(fn, *a):
        with torch.no_grad():
            return fn(*a)

    def no_grad_fwd():
        with torch.no_grad():
            layer(xg)

    def noop_fwd_bwd():
        xg.grad = None
        Noop.apply(xg).backward(x)

    from nvfp4lab import linear as lin

    state = layer._state
    _, qxt, qwt = lin._fprop(state, x, layer.weight, None, True, True)

    def autocast_off():
        with torch.autocast(device_type="cuda", enabled=False):
            pass

    # one no-op operator registered both ways: what the registration itself costs per call
    @torch.library.custom_op("nvfp4lab_bench::noop_decorated", mutates_args=())
    def _noop_decorated(a: torch.Tensor, n: int) -> torch.Tensor:
        return a.new_empty(0)

    torch.library.define("nvfp4lab_bench::noop_defined", "(Tensor a, SymInt n) -> Tensor", lib=_BENCH_OPS)
    torch.library.impl("nvfp4lab_bench::noop_defined", "default", lambda a, n: a.new_empty(0), lib=_BENCH_OPS)

    rows_grid = (M // cfg["BM"], (K // 16) // 16)
    rows_args = (x, M, K, x.stride(0), amax, seeds, d.view(torch.int32), s, s, s, K // 8, K // 16, K // 2, 1 / 6)
    rows_constexprs = dict(SR=False, VALUES=False, WORDS=True, BM=cfg["BM"], NB=16, REVERSE=False, EVEN=True,
                           I64=False)
    pieces: dict[str, Callable[[], Any]] = {
        "torch.empty (1 allocation)": lambda: torch.empty(M, K, dtype=torch.uint8, device=dev),
        "torch.zeros(2) (allocation + fill kernel)": lambda: torch.zeros(2, dtype=torch.float32, device=dev),
        "kernels._amax_buffer (a slot of a zeroed pool)": lambda: kernels._amax_buffer(x.device),
        "torch op launch (ones.add_(1))": lambda: ones.add_(1),
        "no-op operator, @torch.library.custom_op": lambda: torch.ops.nvfp4lab_bench.noop_decorated(ones, 3),
        "no-op operator, torch.library.define + impl (as nvfp4lab's ops)": lambda: torch.ops.nvfp4lab_bench.noop_defined(
            ones, 3),
        "Triton launch (quantize_rows_kernel[grid](...))": lambda: k.quantize_rows_kernel[rows_grid](
            *rows_args, **rows_constexprs, num_warps=cfg["num_warps"], enable_fp_fusion=False),
        "the same launch through kernels._launch (launch cache)": lambda: kernels._launch(
            k.quantize_rows_kernel, rows_grid, *rows_args, **rows_constexprs, num_warps=cfg["num_warps"]),
        "SRStream.seeds()": stream.seeds,
        "kernels.quantize_rowwise(x, amax=a)": lambda: kernels.quantize_rowwise(x, amax=amax),
        "quantize(x, amax=a, check=False)": lambda: quantize(x, amax=amax, check=False),
        "quantize(x, check=False)": lambda: quantize(x, check=False),
        "quantize_rowwise_columnwise(x) RNE, RHT columnwise": lambda: quantize_rowwise_columnwise(
            x, dict(block="1d"), dict(block="1d", rht=True), values=(True, False), fallback=False),
        "quantize_rowwise_columnwise(dy) SR, RHT columnwise": lambda: quantize_rowwise_columnwise(
            dy, dict(block="1d", rounding="stochastic"), dict(block="1d", rht=True, rounding="stochastic"),
            generator=stream, values=(True, True), fallback=False),
        "nvfp4_matmul(qx, qw)": lambda: nvfp4_matmul(qx, qw, out_dtype=torch.bfloat16),
        "autograd.Function no-op forward+backward": noop_fwd_bwd,
        "torch.autocast(enabled=False) enter+exit": autocast_off,
        "NVFP4Recipe.quantize_options(role)": lambda: state.recipe.quantize_options("grad_output_columnwise"),
        "torch.ops.nvfp4lab.linear_fprop under no_grad (the op a compiled model calls)": lambda: _no_grad(
            torch.ops.nvfp4lab.linear_fprop, x, layer.weight, None, state.key, state.saved_code, True, True),
        "linear._fprop (the forward's work: X, W pairs, Fprop GEMM)": lambda: lin._fprop(
            state, x, layer.weight, None, True, True),
        "linear._bprop (the backward's work: dY pair, Dgrad, Wgrad GEMMs)": lambda: lin._bprop(
            state, dy, qxt, qwt, K, x.dtype, layer.weight.dtype, None, True, True, False),
        "NVFP4Linear forward, grad enabled (graph built, no backward)": lambda: layer(xg),
        "NVFP4Linear forward under no_grad": no_grad_fwd,
        "NVFP4Linear forward+backward": fwd_bwd,
    }
    rows = []
    for name, fn in pieces.items():
        us = host_us(fn)
        rows.append({"piece": name, "host_us": us})
        print(f"{us:9.1f} us  {name}", flush=True)
    step_gpu_us = 1e3 * graph_ms(fwd_bwd)
    print(f"{step_gpu_us:9.1f} us  GPU time of NVFP4Linear forward+backward (captured)")
    out = args.out or ROOT / "results" / "host_breakdown_cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(), "command": " ".join(["python", *sys.argv]),
                               "one_core": args.one_core, "cpus": sorted(os.sched_getaffinity(0)),
                               "tokens": M, "K": K, "N": N, "pieces": rows,
                               "layer_step_gpu_us": step_gpu_us}, indent=1) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    with kernels.use_options(layer_graphs=False):
        raise SystemExit(main())
