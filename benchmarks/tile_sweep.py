"""Which tile each of the layer's quantize kernels runs fastest with, at the shapes a user trains:
``python benchmarks/tile_sweep.py [--shapes MxKxN,...] [--keys KEY,...] [--out FILE]``.

The tiles of ``nvfp4lab.kernels``' default configuration (``KernelOptions.config``, one entry per
kernel mode) were mostly tuned on 8192² tensors. GPT-2-small's layers are narrower (K or N = 768),
where a kernel's grid and its tail differ. For each shape ``M x K -> N`` this captures
:class:`~nvfp4lab.linear.NVFP4Linear`'s forward and backward (BF16, no bias, the paper's recipe:
``benchmarks/bench_api.py``'s step) in a CUDA graph, with the layer's own graphs off, and for each
mode of ``--keys`` and each candidate tile in :data:`CANDIDATES` re-captures it with that one mode
changed (``kernels.use_options(config={mode: tile})``). Reported per candidate:

* ``kernels_us``: the GPU time of nvfp4lab's own kernels per forward+backward (``torch.profiler``'s
  kernel durations over ``--replays`` graph replays, summed over the names of
  :func:`benchmarks.launch_profile.nvfp4lab_kernel_names`). The GEMMs do not depend on the tiles and
  are left out, so small differences are not buried in theirs;
* ``graph_us``: the whole graph's time (:func:`nvfp4lab.timing.bench_ms`);
* ``bits_equal``: whether one eager forward+backward from the same SR state gives the same output,
  dX and dW, bit for bit, as the default tiles (a tile changes which program computes an element,
  never its arithmetic).

The default is measured twice per shape; ``noise_us`` is the difference of the two, a scale for what a
candidate's ``delta_us`` means. CUDA only; written with provenance to
``results/tile_sweep_<device>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_api import _fwd_bwd  # noqa: E402  (the same step as the API benchmark)
from benchmarks.bench_kernels import _slug  # noqa: E402  (the result files' device names)
from benchmarks.launch_profile import kernels_per_call, nvfp4lab_kernel_names  # noqa: E402  (the one kernel-time profile)
from nvfp4lab import kernels  # noqa: E402
from nvfp4lab.linear import NVFP4Linear  # noqa: E402
from nvfp4lab.provenance import environment  # noqa: E402
from nvfp4lab.timing import bench_ms, capture  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: the API benchmark's qkv shape, and GPT-2-small's four layers at its training batch (16 x 1024 tokens)
SHAPES = ((8192, 768, 2304), (16384, 768, 2304), (16384, 768, 768), (16384, 768, 3072), (16384, 3072, 768))


def _slices(*tiles: tuple[int, int, int]) -> list[dict[str, int]]:
    return [dict(G=g, BK=bk, num_warps=w) for g, bk, w in tiles]


def _rows(*tiles: tuple[int, int, int]) -> list[dict[str, int]]:
    return [dict(BM=bm, NB=nb, num_warps=w) for bm, nb, w in tiles]


_SLICES = _slices((4, 64, 4), (2, 64, 4), (8, 64, 4), (4, 32, 4), (4, 128, 4), (2, 128, 4), (4, 64, 8), (2, 32, 2),
                  (8, 32, 4), (4, 128, 8), (1, 64, 2), (2, 64, 2))
_ROWS = _rows((4, 32, 4), (2, 32, 2), (8, 32, 4), (4, 32, 2), (8, 32, 8), (16, 32, 8), (2, 64, 4), (4, 64, 4),
              (1, 64, 2))
#: mode -> candidate tiles (the modes the layer's recipe runs)
CANDIDATES: dict[str, list[dict[str, int]]] = {
    # (programs_per_sm None: one program per tile)
    "amax_slices": [dict(G=g, BK=bk, FB=min(128, bk), num_warps=w, programs_per_sm=p) for g, bk, w, p in
                    ((2, 256, 4, 3), (2, 256, 4, None), (2, 256, 8, None), (2, 256, 4, 2), (2, 256, 4, 4),
                     (2, 256, 4, 6), (2, 256, 8, 2), (4, 256, 4, 2), (4, 256, 4, 3), (1, 256, 4, 3), (1, 256, 4, 6),
                     (2, 128, 4, 3), (2, 512, 4, 2))],
    "slices_col_sr": _SLICES, "slices_col": _SLICES, "slices2d": _SLICES,
    "rows_values_narrow": _rows((4, 16, 2), (8, 16, 4), (4, 16, 4), (16, 16, 4), (2, 16, 2), (8, 16, 2),
                                (16, 16, 8), (4, 16, 1), (2, 16, 1)),
    "rows_values": _ROWS, "values": _ROWS,
    "amax": [dict(BM=bm, BK=bk, num_warps=w) for bm, bk, w in
             ((64, 256, 8), (32, 256, 8), (64, 128, 8), (128, 256, 8), (32, 128, 4), (16, 256, 4), (64, 512, 8))],
}


def kernel_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """The GPU microseconds of nvfp4lab's kernels (:func:`benchmarks.launch_profile.nvfp4lab_kernel_names`)
    per replay of ``graph`` (:func:`benchmarks.launch_profile.kernels_per_call`'s profile of its replays)."""
    ours = nvfp4lab_kernel_names()
    return sum(us for name, us in kernels_per_call(graph.replay, replays)[1].items() if name in ours)


def sweep_shape(M: int, K: int, N: int, keys: list[str], replays: int) -> dict[str, Any]:
    """Every candidate of every mode in ``keys`` at one layer shape (see the module docstring)."""
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    layer = NVFP4Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    step = _fwd_bwd(layer, x, gy)
    (stream,) = layer.sr_streams()
    state = stream.get_state()

    def outputs() -> tuple[torch.Tensor, ...]:
        stream.set_state(state)
        layer.weight.grad = x.grad = None
        y = layer(x)
        y.backward(gy)
        return y.detach().clone(), x.grad.clone(), layer.weight.grad.clone()

    def measure() -> dict[str, Any]:
        graph = capture(step)[0]
        row = {"kernels_us": kernel_us(graph, replays), "graph_us": bench_ms(graph.replay, "cuda") * 1e3}
        del graph
        return row

    ref = outputs()
    base = [measure(), measure()]
    base_us = min(b["kernels_us"] for b in base)
    result: dict[str, Any] = {"M": M, "K": K, "N": N, "default": base,
                              "noise_us": abs(base[0]["kernels_us"] - base[1]["kernels_us"]), "modes": {}}
    print(f"{M}x{K}->{N}: kernels {base[0]['kernels_us']:.1f} / {base[1]['kernels_us']:.1f} us, "
          f"graph {base[0]['graph_us']:.1f} us", flush=True)
    for key in keys:
        rows = []
        for tile in CANDIDATES[key]:
            with kernels.use_options(config={key: tile}):
                row = {"tile": tile, **measure()}
                row["bits_equal"] = all(torch.equal(a, b) for a, b in zip(outputs(), ref))
            row["delta_us"] = row["kernels_us"] - base_us
            rows.append(row)
            print(f"  {key} {tuple(tile.values())}: {row['kernels_us']:.1f} us ({row['delta_us']:+.1f}), "
                  f"graph {row['graph_us']:.1f}{'' if row['bits_equal'] else ', BITS DIFFER'}", flush=True)
        result["modes"][key] = rows
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                    help="comma-separated MxKxN (default: %(default)s)")
    ap.add_argument("--keys", default=",".join(CANDIDATES), help="kernel modes to sweep (default: all)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays profiled per candidate")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tile_sweep.py measures CUDA kernels: no CUDA device here")
    keys = [k for k in args.keys.split(",") if k]
    unknown = sorted(set(keys) - set(CANDIDATES))
    if unknown:
        raise SystemExit(f"tile_sweep.py: unknown mode(s) {unknown}; choose from {', '.join(CANDIDATES)}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    if any(len(s) != 3 for s in shapes):
        raise SystemExit(f"tile_sweep.py: --shapes takes MxKxN, got {args.shapes!r}")
    with kernels.use_options(layer_graphs=False):   # the kernels launched one by one, as a user's capture does
        rows = [sweep_shape(M, K, N, keys, args.replays) for M, K, N in shapes]
    env = environment()
    out = args.out or ROOT / "results" / f"tile_sweep_{_slug(env['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/tile_sweep.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps({"command": command, "replays": args.replays, "environment": env,
                               "default_config": {k: dict(v) for k, v in kernels.options().config.items()},
                               "shapes": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
