"""Benchmarks of nvfp4lab's NVFP4 kernels: ``python benchmarks/bench_kernels.py [--smoke]`` (or ``nvfp4lab bench``).

Measured side by side in one run, written to JSON (``--out``, default
``results/bench_<device>.json``) with a PNG plot beside it:

1. **copy**: the device's device-to-device copy bandwidth (bytes read + written), the ceiling.
2. **quantize**: throughput of the Triton kernels at 4096², 8192², 16384² (bf16; fp32 at 8192²)
   for the roles of the recipe, against the copy bandwidth; and the pure-PyTorch reference.
   Two byte counts: ``min_bytes`` (input read once + outputs written: 2.5625 B/element for a
   1×16 bf16 quantize, 3.125 with both copies) and ``moved_bytes`` (what the two-pass kernels
   move: the amax pass reads the input once more). ``frac_copy`` uses ``min_bytes`` (and
   ``targets`` also records ``moved_bytes`` over time against the copy bandwidth) and the
   kernels' GPU time (``ms``: the call captured in a CUDA graph and replayed, so that Python and
   launch overhead do not count); ``eager_ms`` is the same call made from Python each time.
3. **linear**: ``NVFP4Linear`` forward+backward (full recipe: RHT, SR gradients, 2D weights) on
   the fused Triton path vs BF16 ``nn.Linear``, at M=8192, K=N=4096 and GPT-2-small's layer
   shapes; the pure-PyTorch reference; TE's FP8 recipes and NVFP4 reference recipe when
   Transformer Engine is installed. ``ms`` / ``vs_bf16``: eager (what a Python training loop
   sees); ``graph_ms`` / ``graph_vs_bf16``: the same fwd+bwd captured in a CUDA graph (GPU
   time alone; not measured for TE's modules, which need ``te.make_graphed_callables``).
4. **cpu**: quantize time of a 4096² fp32 tensor on CPU, nvfp4lab vs torchao 0.18
   ``nvfp4_quantize`` (two-level scaling, amax included), when torchao is installed.

GPU timings are medians of ``triton.testing.do_bench`` (CUDA events, warm-up, L2 flushed
between repeats, inputs rotated when they would fit in L2); CPU timings are medians of
``time.perf_counter`` over repeats after a warm-up. ``--smoke`` runs tiny shapes anywhere
(CPU in seconds; under ``TRITON_INTERPRET=1`` the kernels run in Triton's interpreter).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

#: The repository; results go to its ``results/`` by default.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from nvfp4lab import kernels  # noqa: E402
from nvfp4lab.capabilities import import_transformer_engine, require_device  # noqa: E402
from nvfp4lab.provenance import environment  # noqa: E402
from nvfp4lab.linear import NVFP4Linear  # noqa: E402
from nvfp4lab.timing import bench_ms, graph_ms, median_ms  # noqa: E402
from nvfp4lab.quantize import quantize, quantize_rowwise_columnwise  # noqa: E402

GPT2_SMALL = [("gpt2.attn.qkv", 768, 2304), ("gpt2.attn.proj", 768, 768), ("gpt2.mlp.fc", 768, 3072),
              ("gpt2.mlp.proj", 3072, 768)]


# ----------------------------------------------------------------------------- timing
def _rotating(make: Callable[[int], Any], nbytes: int, device: str) -> Callable[[], Any]:
    """Cycle through enough input copies that repeats do not hit in L2 (GPU)."""
    n = 1
    if device == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
        n = max(1, min(8, -(-4 * l2 // max(nbytes, 1))))
    items = [make(i) for i in range(n)]
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % n
        return items[state["i"]]

    return nxt


# ----------------------------------------------------------------------------- metadata
def _meta(device: str) -> dict:
    """What the benchmark adds to the environment block (:func:`nvfp4lab.provenance.environment`):
    the kernels' options and, on CUDA, the SM count, L2 size and nvidia-smi's driver and clock."""
    meta = {"triton_interpret": kernels.interpreter_mode(), "kernel_options": kernels.options().to_dict()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        meta.update(sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            meta["nvidia_smi"] = out.stdout.strip()
        except Exception:
            pass
    return meta


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "device"


# ----------------------------------------------------------------------------- 1. copy bandwidth
def bench_copy(device: str, n: int, repeat: int) -> dict:
    src = torch.randn(n, n, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, repeat=repeat)
    nbytes = 2 * src.numel() * src.element_size()
    return {"shape": [n, n], "dtype": "bfloat16", "ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6}


# ----------------------------------------------------------------------------- 2. quantize
def _quant_cases(device: str = "cpu"):
    """name -> (callable(x), bytes written per element, passes over the input)."""
    amax = torch.tensor(5.0, device=device)  # a device tensor: no host-to-device copy per call
    out1 = 0.5 + 1 / 16  # packed codes + one E4M3 scale per 16
    q = functools.partial(quantize, check=False)  # the kernels alone (the public call's check: see bench_api)

    def both(x, col_rht=False, rounding="nearest", block="1d"):
        return quantize_rowwise_columnwise(x, dict(block=block, rounding=rounding),
                                           dict(block=block, rht=col_rht, rounding=rounding), fallback=False)

    cases = {
        "row_1d_rne": (lambda x: q(x), out1, 2),
        "row_1d_rne_amax_given": (lambda x: q(x, amax=amax), out1, 1),
        "row_1d_sr": (lambda x: q(x, rounding="stochastic"), out1, 2),
        "col_1d_rht_rne(x.t())": (lambda x: q(x.t(), rht=True), out1, 2),
        "weight_2d_row+col": (lambda x: both(x, block="2d"), 2 * out1, 2),
        "act_row+col_rht_rne": (lambda x: both(x, col_rht=True), 2 * out1, 2),
        "grad_row+col_rht_sr": (lambda x: both(x, col_rht=True, rounding="stochastic"), 2 * out1, 2),
        "dequant_block_values_bf16": None,  # filled below (needs a quantized input)
    }
    return cases


def bench_quantize(device: str, sizes: list[int], repeat: int, copy_gbps: float, reference_max: int,
                   fp32_sizes: list[int]) -> list[dict]:
    rows = []
    fast_ok = kernels.available(device)
    for n, dtype in [(s, torch.bfloat16) for s in sizes] + [(s, torch.float32) for s in fp32_sizes]:
        esize = torch.tensor([], dtype=dtype).element_size()
        nbytes_in = n * n * esize
        gen = _rotating(lambda i: torch.randn(n, n, device=device, dtype=torch.float32).to(dtype), nbytes_in, device)
        cases = _quant_cases(device)
        for name, spec in cases.items():
            if not fast_ok:
                break
            if spec is None:
                q = quantize(gen())
                fn = lambda q=q: q.block_values(torch.bfloat16)  # noqa: E731
                min_b = n * n * (0.5 + 1 / 16) + n * n * 2
                moved = min_b
            else:
                f, out_per_el, passes = spec
                fn = lambda f=f: f(gen())  # noqa: E731
                q = None
                min_b = nbytes_in + n * n * out_per_el
                moved = min_b + (passes - 1) * nbytes_in
            try:
                eager = bench_ms(fn, device, repeat=repeat)
                if device == "cuda":  # kernel throughput: one input, captured, replayed
                    x_fixed = gen()
                    f_fixed = (lambda q=q: q.block_values(torch.bfloat16)) if spec is None \
                        else (lambda f=f, x_fixed=x_fixed: f(x_fixed))
                    ms = graph_ms(f_fixed)
                else:
                    ms = eager
            except Exception as exc:  # report and continue
                rows.append({"case": name, "n": n, "dtype": str(dtype), "error": repr(exc)[:300]})
                continue
            gbps = min_b / ms / 1e6
            rows.append({"case": name, "impl": "triton", "n": n, "dtype": str(dtype).replace("torch.", ""),
                         "ms": ms, "timing": "cuda_graph" if device == "cuda" else "eager", "eager_ms": eager,
                         "min_bytes": min_b, "moved_bytes": moved, "GBps": gbps,
                         "moved_GBps": moved / ms / 1e6, "frac_copy": gbps / copy_gbps if copy_gbps else None})
        if n <= reference_max:
            min_b = nbytes_in + n * n * (0.5 + 1 / 16)
            with kernels.disabled():
                x = gen()
                ms = bench_ms(lambda: quantize(x), device, repeat=max(1, repeat // 2), rep_ms=100)
            rows.append({"case": "row_1d_rne", "impl": "pytorch_reference", "n": n,
                         "dtype": str(dtype).replace("torch.", ""), "ms": ms, "min_bytes": min_b,
                         "GBps": min_b / ms / 1e6, "frac_copy": min_b / ms / 1e6 / copy_gbps if copy_gbps else None})
        _log(rows[-8:] if fast_ok else rows[-1:])
    return rows


# ----------------------------------------------------------------------------- 3. linear fwd+bwd
def _linear_variants(device: str, K: int, N: int, with_reference: bool):
    """name -> module factory (each module maps bf16 [M, K] -> [M, N])."""
    variants: dict[str, Callable[[], Any]] = {}
    dtype = torch.bfloat16
    variants["bf16_nn.Linear"] = lambda: torch.nn.Linear(K, N, bias=False, device=device, dtype=dtype)
    if kernels.available(device):
        def fast():
            # the layer's own SR stream (seeded): state on the GPU, so eager calls replay the layer's
            # own CUDA graphs (the default a user gets; a torch.Generator would turn them off) and a
            # captured step draws fresh keys per replay without registering a generator
            return NVFP4Linear(K, N, bias=False, device=device, dtype=dtype, seed=0)

        variants["nvfp4_linear_triton"] = fast
    if with_reference:
        variants["nvfp4_linear_pytorch_reference"] = lambda: _Disabled(
            NVFP4Linear(K, N, bias=False, device=device, dtype=dtype))
    if device == "cuda":
        variants.update(_te_variants(K, N))
    return variants


class _Disabled(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with kernels.disabled():
            return self.inner(x)


def _te_variants(K: int, N: int) -> dict:
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe
    except Exception as exc:
        print(f"[bench] Transformer Engine unavailable, no TE rows: {exc!r}"[:300], file=sys.stderr)
        return {}
    out = {}

    def wrap(rec):
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = te.Linear(K, N, bias=False, params_dtype=torch.bfloat16)

            def forward(self, x):
                with te.autocast(enabled=True, recipe=rec):
                    return self.lin(x)

        return M

    for name, make in [("te_fp8_delayed", lambda: recipe.DelayedScaling()),
                       ("te_fp8_current", lambda: recipe.Float8CurrentScaling()),
                       ("te_fp8_block", lambda: recipe.Float8BlockScaling())]:
        try:
            out[name] = wrap(make())
        except Exception:
            pass
    try:
        from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import nvfp4_ref_rht_2d_factory

        out["te_nvfp4_reference_custom"] = wrap(recipe.CustomRecipe(qfactory=nvfp4_ref_rht_2d_factory))
    except Exception:
        pass
    return out


def bench_linear(device: str, shapes: list[tuple[str, int, int, int]], repeat: int, with_reference: bool) -> list[dict]:
    rows = []
    for label, M, K, N in shapes:
        g = torch.Generator(device).manual_seed(0)
        x = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(M, N, device=device, generator=g).to(torch.bfloat16)
        base = base_graph = None
        for name, factory in _linear_variants(device, K, N, with_reference and label == shapes[0][0]).items():
            try:
                mod = factory()

                def step(mod=mod):
                    x.grad = None
                    for p in mod.parameters():
                        p.grad = None
                    mod(x).backward(dy)

                slow = "reference" in name
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                ms = bench_ms(step, device, repeat=2 if slow else repeat, rep_ms=(400 if slow else 300))
                peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
            except Exception as exc:
                rows.append({"shape": label, "M": M, "K": K, "N": N, "impl": name, "error": repr(exc)[:300]})
                continue
            g_ms = graph_err = None
            if device == "cuda" and not slow and not name.startswith("te_"):
                try:
                    x.grad = None
                    g_ms = graph_ms(lambda mod=mod: mod(x).backward(dy), rep_ms=300)
                except Exception as exc:  # report and continue
                    graph_err = repr(exc)[:300]
            if name.startswith("nvfp4"):   # the layer's own CUDA graphs hold memory: not in the next rows' peaks
                from nvfp4lab.linear import LAYER_GRAPHS
                LAYER_GRAPHS.clear()
            if name == "bf16_nn.Linear":
                base, base_graph = ms, g_ms
            row = {"shape": label, "M": M, "K": K, "N": N, "impl": name, "ms": ms,
                   "vs_bf16": ms / base if base else None, "peak_mem_mib": peak,
                   "tflops_3gemm": 6 * M * K * N / ms / 1e9}
            if device == "cuda":
                row.update(graph_ms=g_ms, graph_vs_bf16=(g_ms / base_graph if g_ms and base_graph
                                                             else None))
                if graph_err:
                    row["graph_error"] = graph_err
            rows.append(row)
            del mod
        _log([r for r in rows if r.get("shape") == label])
    return rows


# ----------------------------------------------------------------------------- 4. CPU vs torchao
def bench_cpu(n: int, repeat: int) -> list[dict]:
    rows = []
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    with kernels.disabled():
        ms = median_ms(lambda: quantize(x), "cpu", iters=repeat)
        ms_2d = median_ms(lambda: quantize(x, block="2d"), "cpu", iters=repeat)
        ms_rht = median_ms(lambda: quantize(x, rht=True), "cpu", iters=repeat)
    rows.append({"impl": "nvfp4lab.quantize", "n": n, "dtype": "float32", "ms": ms,
                 "threads": torch.get_num_threads()})
    rows.append({"impl": "nvfp4lab.quantize(block='2d')", "n": n, "dtype": "float32", "ms": ms_2d,
                 "threads": torch.get_num_threads()})
    rows.append({"impl": "nvfp4lab.quantize(rht=True)", "n": n, "dtype": "float32", "ms": ms_rht,
                 "threads": torch.get_num_threads()})
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
        import torchao

        def ao():
            return nvfp4_quantize(x, 16, per_tensor_amax_to_scale(x.abs().amax()))

        ms_ao = median_ms(ao, "cpu", iters=repeat)
        rows.append({"impl": "torchao.nvfp4_quantize (two-level, amax included)",
                     "torchao": torchao.__version__, "n": n, "dtype": "float32", "ms": ms_ao,
                     "threads": torch.get_num_threads()})
        for row in rows[:3]:
            row["vs_torchao"] = row["ms"] / ms_ao
    except Exception as exc:
        rows.append({"impl": "torchao", "error": repr(exc)[:300]})
    _log(rows)
    return rows


# ----------------------------------------------------------------------------- output
def _log(rows):
    for r in rows:
        print("[bench] " + ", ".join(f"{k}={_fmt(v)}" for k, v in r.items()), flush=True)


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def plot(result: dict, path: Path) -> None:
    # The Figure API leaves pyplot and its backend alone (this also runs inside notebooks).
    from matplotlib.figure import Figure

    q = [r for r in result.get("quantize", []) if "ms" in r]
    lin = [r for r in result.get("linear", []) if "ms" in r]
    fig = Figure(figsize=(16, max(5.0, 0.16 * max(len(q), len(lin)) + 1.5)))
    axes = fig.subplots(1, 2)
    ax = axes[0]
    labels = [f'{r["case"]} {r["n"]}² {r["dtype"]} ({r["impl"]}, {r["ms"] * 1e3:.0f} us)' for r in q]
    ax.barh(range(len(q)), [r["GBps"] for r in q], color=["C0" if r["impl"] == "triton" else "C3" for r in q])
    ax.set_yticks(range(len(q)), labels, fontsize=6)
    copy = result.get("copy", {}).get("GBps")
    if copy:
        ax.axvline(copy, color="k", ls="--", label=f"copy {copy:.0f} GB/s")
        ax.axvline(0.7 * copy, color="g", ls=":", label="70% of copy")
        ax.legend(fontsize=7)
    ax.set_xlabel("GB/s (input read once + outputs written)")
    ax.set_title("NVFP4 quantize throughput", fontsize=9)
    ax = axes[1]
    pos = list(range(len(lin)))
    ax.barh([p - 0.2 for p in pos], [r["vs_bf16"] or 0 for r in lin], height=0.4, color="C1", label="eager")
    ax.barh([p + 0.2 for p in pos], [r.get("graph_vs_bf16") or 0 for r in lin], height=0.4, color="C2",
            label="CUDA graph (GPU time)")
    ax.set_yticks(pos, [f'{r["shape"]} {r["impl"]} ({r["ms"]:.2f} ms)' for r in lin], fontsize=6)
    ax.axvline(1.0, color="k", ls="--")
    ax.axvline(1.3, color="g", ls=":", label="target 1.3x")
    ax.set_xscale("log")
    ax.set_xlabel("fwd+bwd time / BF16 nn.Linear")
    ax.set_title("Linear forward+backward", fontsize=9)
    ax.legend(fontsize=7)
    env = result["environment"]
    title = f'{env["device"]}  torch {env["torch"]}  triton {env["triton"]}  {env["date_utc"]}'
    qenv = result.get("quantize_environment")   # a quantize section measured in a later run
    if qenv:
        title += f'  (quantize: {qenv["date_utc"]}, {qenv["git_commit"].split()[0]})'
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# ----------------------------------------------------------------------------- entry point
def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="nvfp4lab bench", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU/CI, seconds)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/bench_<device>.json)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--sizes", default=None, help="comma-separated square sizes for the quantize benchmark")
    p.add_argument("--repeat", type=int, default=None, help="CPU repeats (GPU: do_bench's own)")
    p.add_argument("--skip", default="", help="comma list of sections to skip: copy,quantize,linear,cpu")
    p.add_argument("--no-reference", action="store_true", help="skip the slow pure-PyTorch references")
    p.add_argument("--linear-shapes", choices=["main", "all"], default="all",
                   help="main: only M=8192, K=N=4096; all: also GPT-2-small's layers")
    p.add_argument("--no-plot", action="store_true")
    return p


def main_bench(argv: list[str] | None = None) -> int:
    """``nvfp4lab bench``: run the benchmarks and write JSON + PNG. Returns an exit code."""
    args = build_parser().parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if require_device(device).type not in ("cpu", "cuda") or ":" in device:
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    except ValueError as exc:
        print(f"nvfp4lab bench: error: {exc}", file=sys.stderr)
        return 2
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    smoke = args.smoke
    repeat = args.repeat or (3 if smoke or device == "cpu" else 10)
    if smoke:
        sizes, fp32_sizes, copy_n, ref_max, cpu_n = [128], [], 256, 128, 256
        lin_shapes = [("tiny", 64, 64, 48)]
    else:
        sizes, fp32_sizes, copy_n, ref_max, cpu_n = [4096, 8192, 16384], [8192], 16384, 8192, 4096
        lin_shapes = [("M8192_K4096_N4096", 8192, 4096, 4096)] + [(n, 8192, k, nn) for n, k, nn in GPT2_SMALL]
        if device == "cpu":  # a full CPU run only makes sense for the torchao comparison
            skip |= {"quantize", "linear"}
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
        fp32_sizes = [s for s in fp32_sizes if s in sizes]
    if args.linear_shapes == "main":
        lin_shapes = lin_shapes[:1]
    if "linear" not in skip and device == "cuda":
        # TE first: environment() initializes cuDNN, after which TE's import can fail on a host whose
        # system cuDNN clashes with torch's (the reason gpu_te_report.py imports it first, too)
        import_transformer_engine()
    env = environment(device)
    result: dict[str, Any] = {"environment": env, "meta": _meta(device),
                              "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"[bench] {env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['git_commit']}", flush=True)
    copy_gbps = None
    if "copy" not in skip:
        result["copy"] = bench_copy(device, copy_n, repeat)
        copy_gbps = result["copy"]["GBps"]
        _log([result["copy"]])
    if "quantize" not in skip:
        result["quantize"] = bench_quantize(device, sizes, repeat, copy_gbps, 0 if args.no_reference else ref_max,
                                            fp32_sizes)
        best = [r for r in result["quantize"] if r.get("impl") == "triton" and r["n"] == 8192
                and r["dtype"] == "bfloat16" and "ms" in r]
        result["targets"] = {"quantize_8192_bf16_frac_copy": {r["case"]: r["frac_copy"] for r in best},
                             "quantize_8192_bf16_moved_frac_copy": {
                                 r["case"]: r["moved_GBps"] / copy_gbps if copy_gbps else None for r in best},
                             "target": 0.7}
    if "linear" not in skip:
        result["linear"] = bench_linear(device, lin_shapes, repeat, not args.no_reference)
        big = lin_shapes[0][0]
        result.setdefault("targets", {})["linear_vs_bf16"] = {
            "shape": big, "target": 1.3,
            **{f"{r['impl']}_{k}": r.get(k) for r in result["linear"] if r.get("shape") == big
               and r.get("impl") == "nvfp4_linear_triton" for k in ("vs_bf16", "graph_vs_bf16")}}
    if "cpu" not in skip:
        result["cpu"] = bench_cpu(cpu_n, 3 if smoke else 5)
    name = env["device"] if env["device_type"] == "cuda" else "cpu"
    out = args.out or ROOT / "results" / f"bench_{_slug(name)}{'_smoke' if smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"[bench] wrote {out}")
    if not args.no_plot:
        try:
            plot(result, out.with_suffix(".png"))
            print(f"[bench] wrote {out.with_suffix('.png')}")
        except Exception as exc:
            print(f"[bench] plot failed: {exc!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main_bench())
