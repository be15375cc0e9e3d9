"""Where the columnwise quantize kernel's time goes: ``python benchmarks/slices_parts.py [--out FILE]``.

The columnwise RHT copies are the slowest quantize kernels: they run furthest below copy bandwidth
(the appendix's goal table). This benchmark separates what the 16-slice kernel
(``quantize_slices_kernel``) reads and writes from the arithmetic it does, in one run on one GPU,
for the two columnwise copies of a training step:

* ``copy``: a device-to-device copy of the BF16 input, ``M·K·2`` bytes read and written;
* ``pattern``: :func:`slices_pattern_kernel`, a probe that loads the input as the kernel does (the
  same tiles, :func:`~nvfp4lab.kernels.triton_kernels._load_slice_tile`) and stores it transposed
  as the values-only kernel stores its values
  (:func:`~nvfp4lab.kernels.triton_kernels._store_slices_transposed`): the same bytes at the same
  addresses, without arithmetic (it writes ``xᵀ``, checked by ``tests/test_kernels.py``);
* the columnwise kernel alone, its amax given (``nvfp4lab.kernels._run`` with ``row=False``, the
  layer's own dispatch; with SR also the one-element advance of the layer's kind of key stream,
  :class:`~nvfp4lab.rounding.SRStream`), for dY's copy (RHT, SR, BF16 values only: what Wgrad's GEMM reads) and
  X's copy (RHT, RNE, codes and scales: what the layer saves for Wgrad and what
  ``bench_kernels.py``'s goal reads), each also with parts of the work switched off: without the
  SR (RNE instead), without the RHT, without both, and with the FP32 butterfly
  (``KernelOptions.rht_f64=False``, not bit-exact with TE: see ``triton_kernels``' docstring).

Each figure is the median over ``--rounds`` rounds of the kernel captured in a CUDA graph and
replayed (:func:`nvfp4lab.timing.bench_ms`), every variant timed once per round; ``frac_copy`` is
its bytes moved per second over the copy's, both from the same round (values: 2 bytes read and 2
written per element, as the copy; codes: 2 read and 0.5 + 1/16 written). What a variant costs over
``pattern`` is arithmetic the memory traffic does not hide. CUDA only; written with provenance to
``results/slices_parts_<device>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import _slug  # noqa: E402  (the result files' device names)
from nvfp4lab import kernels  # noqa: E402
from nvfp4lab.hadamard import WGRAD_SIGNS  # noqa: E402
from nvfp4lab.kernels.triton_kernels import _load_slice_tile, _store_slices_transposed  # noqa: E402
from nvfp4lab.provenance import environment  # noqa: E402
from nvfp4lab.rounding import SRStream  # noqa: E402
from nvfp4lab.timing import bench_ms, capture  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((8192, 8192), (8192, 2304))   # the goal's tensor; GPT-2-small's qkv dY (tokens x 3·768)

#: name -> (rht, sr, values only, rht_f64): the kernel's work with parts switched off
VARIANTS = {
    "dY: RHT + SR, values only": (True, True, True, True),
    "dY without SR (RNE)": (True, False, True, True),
    "dY without the RHT": (False, True, True, True),
    "dY without the RHT and SR": (False, False, True, True),
    "dY with the FP32 butterfly": (True, True, True, False),
    "X: RHT + RNE, codes and scales": (True, False, False, True),
    "X without the RHT": (False, False, False, True),
    "X with the FP32 butterfly": (True, False, False, False),
}


@triton.jit
def slices_pattern_kernel(x_ptr, vt_ptr, M, K, sxm, sxk, vt_rs, G: tl.constexpr, BK: tl.constexpr,
                          EVEN: tl.constexpr):
    """Write ``vt = xᵀ`` (x [M, K] BF16, M % 16 == 0; vt [K, M] viewed as int16) with the 16-slice
    kernel's loads and its values' stores, and no arithmetic: the memory pattern alone."""
    xs, g, cols, pm, pk = _load_slice_tile(x_ptr, M, K, sxm, sxk, G, BK, False, EVEN, False)
    vs = [xs[i].to(tl.bfloat16).to(tl.int16, bitcast=True)
          for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    _store_slices_transposed(vt_ptr, vt_rs, vs, cols, pm, M, K, G, BK, EVEN)


def transpose_by_pattern(x: torch.Tensor, vt: torch.Tensor, config: dict[str, int]) -> torch.Tensor:
    """``vt[:] = x.t()`` by :func:`slices_pattern_kernel` with a slices config (G, BK, num_warps).

    Args:
        x: BF16 [M, K], unit column stride, ``M % 16 == 0``. vt: contiguous BF16 [K, M].
    Raises:
        ValueError: shapes, dtypes or strides other than these.
    """
    M, K = x.shape
    if x.dtype != torch.bfloat16 or vt.dtype != torch.bfloat16 or vt.shape != (K, M) or M % 16 or x.stride(1) != 1 \
            or not vt.is_contiguous():
        raise ValueError(f"need BF16 x [M, K] (M % 16 == 0, unit column stride) and contiguous BF16 vt [K, M]; "
                         f"got x {x.dtype} {tuple(x.shape)} stride {x.stride()}, vt {vt.dtype} {tuple(vt.shape)}")
    G, BK = config["G"], config["BK"]
    grid = (triton.cdiv(M, 16 * G) * triton.cdiv(K, BK),)
    slices_pattern_kernel[grid](x, vt.view(torch.int16), M, K, x.stride(0), x.stride(1), M, G=G, BK=BK,
                                EVEN=(M % (16 * G) == 0 and K % BK == 0), num_warps=config["num_warps"])
    return vt


def columnwise(x: torch.Tensor, amax: torch.Tensor, rht: bool, sr: bool, values_only: bool,
               stream: SRStream) -> tuple:
    """The columnwise copy of x alone, its amax given: the 16-slice kernel, and with SR the
    advance of the layer's kind of key stream (``stream``: its keys read in place, one small add
    kernel after; a generator would add a draw kernel that the layer does not run)."""
    return kernels._run(x, row=False, col=True, row_rht=False, col_rht=rht, block2d=False, sr=sr,
                        mask=kernels.sign_mask(WGRAD_SIGNS), generator=stream, amax_row=amax, amax_col=amax,
                        values=(False, values_only), col_codes=not values_only)


def measure(M: int, K: int, rounds: int) -> dict[str, Any]:
    """One shape: µs and share of copy bandwidth of the copy, the pattern probe and each variant."""
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    amax = x.abs().amax().float()
    y, vt = torch.empty_like(x), torch.empty(K, M, device="cuda", dtype=torch.bfloat16)
    config = dict(kernels.options().config["slices_col_sr"])
    stream = SRStream(0, device="cuda")
    calls: dict[str, tuple[Callable[[], Any], float]] = {
        "copy": (lambda: y.copy_(x), 4.0), "pattern": (lambda: transpose_by_pattern(x, vt, config), 4.0)}
    for name, (rht, sr, only, f64) in VARIANTS.items():
        def call(rht=rht, sr=sr, only=only, f64=f64):
            with kernels.use_options(rht_f64=f64):
                return columnwise(x, amax, rht, sr, only, stream)
        calls[name] = (call, 4.0 if only else 2.0 + 0.5 + 1 / 16)
    graphs = {name: capture(fn)[0] for name, (fn, _) in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, g in graphs.items():
            times[name].append(bench_ms(g.replay, "cuda") * 1e3)
    copy = times["copy"]
    out = {}
    for name, (_, bytes_per_el) in calls.items():
        fracs = [(bytes_per_el / t) / (4.0 / c) for t, c in zip(times[name], copy)]
        out[name] = {"us": statistics.median(times[name]), "frac_copy": statistics.median(fracs),
                     "bytes_per_element": bytes_per_el}
    return {"M": M, "K": K, "config": config, "calls": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("slices_parts.py measures CUDA kernels: no CUDA device here")
    rows = [measure(M, K, args.rounds) for M, K in SHAPES]
    for r in rows:
        print(f"{r['M']}x{r['K']}: " + "; ".join(f"{n} {c['us']:.1f} us ({100 * c['frac_copy']:.0f}%)"
                                                 for n, c in r["calls"].items()), flush=True)
    env = environment()
    out = args.out or ROOT / "results" / f"slices_parts_{_slug(env['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python benchmarks/slices_parts.py", "rounds": args.rounds,
                               "environment": env, "shapes": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
