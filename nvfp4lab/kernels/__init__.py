"""Fast NVFP4 kernels (Triton) behind the pure-PyTorch contract of :mod:`nvfp4lab.quantize`.

Hopper has no FP4 tensor cores, so emulated NVFP4 training there is bounded by the cost of
quantization. This package holds Triton kernels that produce *bit-identical* results to the
reference code of :mod:`nvfp4lab.quantize` (round-to-nearest) and statistically equivalent ones
(stochastic rounding). As torchao's ``mx_formats`` kernels, they take and return plain tensors
(packed codes, scales, amaxes, BF16 values); :mod:`nvfp4lab.quantize` alone decides whether they
run (``covers_*`` below say what they cover) and wraps their outputs in ``NVFP4Tensor``:

* :func:`quantize_rowwise` — ``quantize(x)``: a global amax reduction kernel (the global scale
  needs the whole-tensor amax; skipped when ``amax`` is given), then one quantize kernel (1×16 or
  16×16 blocks, optional RHT butterfly, RNE or SR).
* :func:`quantize_rowwise_columnwise` — the rowwise ``quantize(x)`` and the columnwise
  ``quantize(x.t(), rht=...)`` a training step needs, from one amax pass and one read of ``x``
  per copy, optionally with their BF16 block values.
* :func:`block_values`, :func:`dequantize` — decode to BF16.
* :func:`gemm` — a cuBLAS BF16 GEMM of the block values with FP32 accumulation and one epilogue
  for the per-tensor factor, the bias and the output cast.

Kernel families (``triton_kernels.py``): a tile kernel for any layout; a one-block-per-thread
kernel for rowwise 1×16 blocks (each thread holds its 16 elements, so block amax, scale and
packing need no shuffle); a 16-slice kernel for columnwise blocks and 16×16 tiles (a columnwise
block is the same column of 16 row slices, so the RHT butterfly is element-wise between slices).
Performance is recorded in ``results/bench_nvidia_h200.json`` (``nvfp4lab bench``). The work per
element is what bounds the kernels on Hopper, whose integer pipe issues at half the FP32 rate: the
E2M1 code is computed with FP32 operations (the minimum of three exact candidates, see
``triton_kernels._e2m1_rne_fast``), SR takes one Philox draw per block (8 random bits per element),
BF16 rounding uses the hardware conversion; the rowwise RNE kernel executes about twenty SASS
instructions per element, SR and the RHT's exact FP64 butterfly add to that. One Python call
launches two or three kernels, each through :func:`_launch` (Triton's compiled kernel kept per launch
signature and called through Triton's own launcher: a fraction of the host time of Triton's
``kernel[grid](...)``); ``quantize(x)``'s usual case (1x16, no RHT) also keeps its tiles, grids and
kernels per call signature (:func:`_quantize_rows`) and takes its amax buffer from a zeroed pool
(:func:`_amax_buffer`). Capture small steps in CUDA graphs all the same.

Where the kernels run: CUDA tensors when Triton is installed; CPU tensors only in Triton's
interpreter (``TRITON_INTERPRET=1`` set before this package is first used), which the CPU
tests use. Set ``NVFP4LAB_DISABLE_KERNELS=1`` (or use :func:`disabled`) to turn them off. The
kernels do not scan for NaN (that would cost a host synchronisation): a NaN input makes the amax
NaN, which :func:`nvfp4lab.quantize.quantize` checks (one scalar) and every GEMM output using
that operand shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ..formats import GEMM_ALPHA_DENOMINATOR, RCP_E2M1_MAX, RCP_GLOBAL_SCALE_NUMERATOR
from ..hadamard import RHT_SIZE, WGRAD_SIGN_MASK, WGRAD_SIGNS
from ..rounding import SRStream

__all__ = [
    "available", "interpreter_mode", "disabled", "KernelOptions", "options", "use_options",
    "covers_quantize", "covers_rowwise_columnwise", "covers_decode", "covers_gemm", "sign_mask",
    "quantize_rowwise", "quantize_rowwise_columnwise", "check_col_out", "block_values", "dequantize", "gemm",
]

_INV6 = RCP_E2M1_MAX  # RN_fp32(1/6), passed to the kernels as an fp32 argument
_INV2688 = RCP_GLOBAL_SCALE_NUMERATOR  # RN_fp32(1/2688)
_GEMM_FACTOR = GEMM_ALPHA_DENOMINATOR  # 6*6*448*448

#: Tile shapes and warps per kernel mode (tuned on an H200; ``use_options(config=...)`` for sweeps).
_DEFAULT_CONFIG: dict[str, dict[str, int]] = {
    # the plain amax pass (no RHT); H200, quantize(x) at 8192^2 (amax pass, then the rows kernel),
    # 8 calls back to back: 86.2 vs 87.5 us at BM=64 BK=128 (the pass alone 34.9 vs 37.5; 27.1 vs
    # 28.8 at 16384 x 3072). With L2 flushed before each call (bench_api) no change: 94.5 vs 94.9.
    # The pass reads near DRAM speed: with the zeroing of its buffer, after a flush that leaves the L2
    # clean, 37.1 us at 8192^2 (134 MB at 3.6 TB/s; a copy of x, 268 MB moved, at 3.9 TB/s in the same
    # run). No other form made quantize(x) faster there (H200, one run, 94.2 us at this tile): tiles
    # 32x256 w4, 128x256 w8, 64x512 w8 (94.4-96.8 us), or a grid-stride loop of 4, 8 or 16 programs per
    # SM, with the next tile's loads in flight or without (94.6-102.7 us; the pass alone, clean L2,
    # 36.0-46.9 us). At 8192 x 2304, 128x256 w8 and the loop's best were 1.0-1.2 us faster (36.8-36.9 vs
    # 38.0 us; the other forms 37.0-43.5): one run, not adopted
    "amax": dict(BM=64, BK=256, num_warps=8),
    "amax_rht": dict(BM=64, BK=128, num_warps=8),   # the same pass with an RHT (ROW_RHT or COL_RHT)
    "row": dict(BM=32, BK=256, num_warps=4),
    "col": dict(BM=128, BK=64, num_warps=8),
    "both": dict(BM=64, BK=128, num_warps=8),
    "2d": dict(BM=64, BK=128, num_warps=8),
    "dequant": dict(BM=32, BK=256, num_warps=8),
    # one-block-per-thread kernels (rowwise 1x16, K % 16 == 0): BM rows x NB blocks per program
    "rows": dict(BM=8, NB=32, num_warps=4),
    # the same with the amax given (no amax pass just before: H200, 8192^2, RNE 53.2 vs 58.2 us at
    # BM=8 NB=32 w4, SR 80.3 vs 84.0; after an amax pass BM=8 NB=32 w4 is faster, 94.7 vs 98.2 us
    # in all: narrow column tiles reuse more of what the amax pass left in L2)
    "rows_amax_given": dict(BM=1, NB=64, num_warps=2),
    "rows_narrow": dict(BM=4, NB=16, num_warps=2),  # when K/16 is not a multiple of 32 (K = 768: -7%)
    "rows_values": dict(BM=4, NB=32, num_warps=4),  # with the BF16 values (H200, 8192^2: 172 vs 190 us)
    # the same, K/16 not a multiple of 32 (K = 768, 2304). H200, NVFP4Linear fwd+bwd captured: its
    # kernels' GPU time 5.2 us less than at BM=8 NB=16 w4 at 8192 x 768 -> 2304, and 6.9, 5.7, 5.2,
    # 2.6 us less at GPT-2-small's four layers, 16384 tokens (results/tile_sweep_nvidia_h200.json)
    "rows_values_narrow": dict(BM=4, NB=16, num_warps=2),
    "values": dict(BM=4, NB=32, num_warps=4),
    # 16-slice kernel (columnwise blocks as element-wise ops between 16 row slices): G groups of
    # 16 rows x BK columns per program
    "slices_col": dict(G=4, BK=64, num_warps=4),
    "slices_col_sr": dict(G=4, BK=64, num_warps=4),  # stochastic rounding (H200, 8192^2: 126 vs 131 us at G2 w2)
    "slices_both": dict(G=4, BK=64, num_warps=4),
    "slices2d": dict(G=4, BK=64, num_warps=4),
    # FB: columns per step of its rare FP64 fallback. H200, ROW + COL_RHT, against the FP64-only pass at
    # G=2 BK=128 w4: 57.2 vs 69.2 us at 8192^2; 16.3 vs 17.5, 45.6 vs 53.2, 36.1 vs 42.3 at 16384 x 768/3072/2304.
    # Four warps, not eight, since the last butterfly stage merged with its max (38499dc): alone, 5-12%
    # faster at seven shapes from 8192 x 768 to 8192^2 (13.2 vs 14.9 us at 8192 x 2304, 45.7 vs 49.5 at
    # 8192^2); in the captured layer 1.2-6.0 us less at the five shapes of results/tile_sweep_nvidia_h200.json.
    # programs_per_sm: at most that many programs per SM, each looping over tiles with the next one's
    # loads in flight (_amax_slices_programs; the loop takes 128-136 registers a thread, so three programs
    # of four warps fit an SM). H200, alone, against one program of four warps per tile: 12.2 vs 12.9 us
    # at 8192 x 2304, 23.1 vs 26.8 at 16384 x 2304, 29.0 vs 34.1 at 16384 x 3072, 36.0 vs 44.2 at 8192^2;
    # in the captured layer at GPT-2-small's shapes 1.2-6.4 us less, and 2, 4 or 6 per SM no better
    # (results/tile_sweep_amax_nvidia_h200.json)
    "amax_slices": dict(G=2, BK=256, FB=128, num_warps=4, programs_per_sm=3),
}


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the kernels run: one immutable object instead of module flags (identical outputs for
    every choice, except ``rht_f64=False``, see below). The options in force are :func:`options`;
    :func:`use_options` changes them for a block of code (this thread).

    Attributes:
        slices: use the 16-slice kernel for columnwise outputs whenever M % 16 == 0 (else the tile
            kernel with an in-register transpose).
        fuse_row_col: :func:`quantize_rowwise_columnwise` (1x16) writes both copies from one
            kernel (True) or runs a rowwise and a columnwise kernel that read the input once each
            (False, the default: the kernels are instruction-bound, and on an H200 the fused kernel's
            register pressure made it slower than the two together: 222 vs 86 + 110 us at 8192² bf16).
            A 16-slice kernel that also made the rowwise copy one block per thread, as the rowwise
            kernel does, from a second load of its tile, was no better (tried at 010d81a, H200,
            captured pairs from 16384 x 768 to 8192²: the dY pair 1.6-8.3 us faster, the X pair
            4.3-10.7 us slower, every GPT-2-small layer slower; it issued nearly the two kernels'
            instructions per element together, 60.97 against 36.97 + 26.81 for dY's pair).
        rows_kernel: rowwise 1x16 quantization (no RHT, K % 16 == 0, unit column stride) and BF16
            block values by the one-block-per-thread kernels; False: the tile kernels.
        rht_f64: run the RHT butterfly in float64 (bit-exact with nvfp4lab for bf16 and fp32 inputs);
            False: a float32 butterfly (faster; see ``triton_kernels``' docstring for what differs).
        cublas_alpha: without a bias, apply the per-tensor factor alpha in cuBLAS's epilogue
            (device-pointer alpha, :mod:`nvfp4lab.kernels.cublas`); False: FP32 GEMM output, then
            the epilogue kernel (also the path with a bias, or without cuBLAS).
        e2m1_bits: E2M1 encode by float32 bit arithmetic (True) or by the 7 thresholds of TE's
            reference (False); identical codes.
        config: tile shapes and warps per kernel mode (read-only mappings).
        layer_graphs: replay an eager :class:`~nvfp4lab.linear.NVFP4Linear` forward and backward
            from CUDA graphs captured per shape (:mod:`nvfp4lab.cuda_graphs`: bit-identical, a
            copy of the inputs in and, where the layer's own graph cannot hand out its outputs, of
            the outputs out; the launch overhead of ~20 kernels gone); False: the kernels launched
            one by one.
        layer_graphs_owned_outputs: with ``layer_graphs``, each layer and direction also has a
            graph of its own that writes outputs it owns (its inputs — X or dY, the weight, the
            bias, the saved copies — read where they are while they stay at one address, and
            copied in once one has moved a few times): a
            call returns those without copying them out, whenever nothing holds the
            outputs of that layer's previous call any more (in training, by its next call: the
            backward has consumed them), and otherwise copies them out (the
            ``owner`` tier of :class:`nvfp4lab.cuda_graphs.GraphedCalls`). The outputs stay
            allocated between calls: GPT-2-small training under ``torch.compile`` measured faster
            and with a higher peak memory than with the copies (``benchmarks/bench_api.py``:
            ``compile`` against ``compile_copy_out``).
        launch_cache: launch a kernel whose launch signature was seen before through the compiled
            kernel Triton returned for it (:func:`_launch`: the same binary and arguments, a
            fraction of the host time), and plan ``quantize(x)``'s launches per call signature
            (:func:`_quantize_rows`); False: Triton's own launch every time.
        alternate_reads: where two kernels read the input one after the other (the rowwise, then
            the columnwise copy of :func:`quantize_rowwise_columnwise`), the second reads its tiles
            in the order opposite to the first's, starting with those the first read last, which
            the L2 may still hold; False: both in the first's order. The order of the tiles changes
            no output. H200, captured, one run: the forward's X pair (RNE, RHT columnwise) 0.4-1.7 us
            and the backward's dY pair (SR, values) 0.6-4.3 us faster from 16384 x 768 to 8192^2 bf16;
            GPT-2-small's four layers, forward+backward at 16384 tokens, 1.0-6.0 us (of 218-566).
        interpret_on_cpu: in Triton's interpreter (``TRITON_INTERPRET=1``), run the kernels on CPU
            tensors. Off by default: the interpreter is numpy, far slower than the PyTorch
            reference; the CPU tests of the kernels turn it on.
    """

    slices: bool = True
    fuse_row_col: bool = False
    rows_kernel: bool = True
    rht_f64: bool = True
    cublas_alpha: bool = True
    e2m1_bits: bool = True
    interpret_on_cpu: bool = False
    layer_graphs: bool = True
    layer_graphs_owned_outputs: bool = True
    launch_cache: bool = True
    alternate_reads: bool = True
    config: Mapping[str, Mapping[str, int]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({k: MappingProxyType(dict(v)) for k, v in _DEFAULT_CONFIG.items()}))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for result files): the flags and the tile configs."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        out["config"] = {k: dict(v) for k, v in self.config.items()}
        return out


_DEFAULT_OPTIONS = KernelOptions()


def options() -> KernelOptions:
    """The :class:`KernelOptions` in force (in every thread of the process)."""
    return _state.options


@contextlib.contextmanager
def use_options(**changes: Any) -> Iterator[KernelOptions]:
    """Within the block, run the kernels with ``options()`` changed by ``changes``.

    The change holds for the whole process while the block runs, in every thread: autograd runs
    a CUDA backward pass on its own thread, which must see the same options as the forward.

    ``config=`` may give only the modes to change (``config={"slices_both": dict(G=2, BK=512,
    num_warps=4)}``); the others keep their values.

    Raises:
        TypeError: an unknown option name.
    """
    current = options()
    if "config" in changes:
        merged = {k: dict(v) for k, v in current.config.items()}
        merged.update({k: dict(v) for k, v in changes["config"].items()})
        changes["config"] = MappingProxyType({k: MappingProxyType(v) for k, v in merged.items()})
    new = dataclasses.replace(current, **changes)
    prev, _state.options = _state.options, new
    try:
        yield new
    finally:
        _state.options = prev


class _State:
    """Process-wide switches (not thread-local: autograd's backward thread must see them)."""

    options: KernelOptions = _DEFAULT_OPTIONS
    off: bool = False


_state = _State()
_KERNELS: Any = None
_IMPORT_ERROR: Exception | None = None
_INTERPRETED: bool | None = None


def _kernels():
    """The Triton kernel module, imported on first use (None without Triton)."""
    global _KERNELS, _IMPORT_ERROR
    if _KERNELS is None and _IMPORT_ERROR is None:
        try:
            from . import triton_kernels

            _KERNELS = triton_kernels
        except Exception as exc:  # ImportError, or a Triton that cannot initialise
            _IMPORT_ERROR = exc
    return _KERNELS


def interpreter_mode() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    global _INTERPRETED
    if _INTERPRETED is None:
        k = _kernels()
        if k is None:
            return False
        _INTERPRETED = type(k.quantize_kernel).__name__ == "InterpretedFunction"   # fixed once built
    return _INTERPRETED


def available(device: torch.device | str) -> bool:
    """Whether the kernels run on ``device``: CUDA with Triton; CPU only in Triton's interpreter with
    ``options().interpret_on_cpu``; never inside :func:`disabled` or with ``NVFP4LAB_DISABLE_KERNELS=1``."""
    if os.environ.get("NVFP4LAB_DISABLE_KERNELS", "0") not in ("", "0") or _state.off:
        return False
    if _kernels() is None:
        return False
    dev = device if isinstance(device, torch.device) else torch.device(device)
    if interpreter_mode():
        return dev.type == "cpu" and options().interpret_on_cpu
    return dev.type == "cuda"


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, the kernels are off (in every thread, as :func:`use_options`): every
    caller takes the reference path."""
    prev, _state.off = _state.off, True
    try:
        yield
    finally:
        _state.off = prev


# ----------------------------------------------------------------------------- helpers
def sign_mask(rht_signs: torch.Tensor | None) -> int | None:
    """The RHT's 16 signs as the kernels' bit mask (bit i set where s_i = -1).

    ``None`` (the plain Hadamard matrix) gives 0; a vector that is not 16 values of ±1 gives
    ``None`` (the kernels do not take it; the reference does).
    """
    if rht_signs is None:
        return 0
    if rht_signs is WGRAD_SIGNS:
        return WGRAD_SIGN_MASK
    s = torch.as_tensor(rht_signs, dtype=torch.float32).flatten().tolist()
    if len(s) != RHT_SIZE or any(v not in (1.0, -1.0) for v in s):
        return None
    return sum(1 << i for i, v in enumerate(s) if v == -1.0)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [M, K] as a strided view when possible (else a copy)."""
    K = x.shape[-1]
    if x.dim() == 2:
        return x
    if x.dim() == 1:
        return x.view(1, K) if x.stride(0) == 1 else x.reshape(1, K)
    try:
        return x.view(-1, K)
    except RuntimeError:
        return x.reshape(-1, K)


def _seeds(generator, device) -> torch.Tensor:
    """Two 63-bit Philox keys (rowwise, columnwise) on ``device``: from an :class:`~nvfp4lab.rounding.SRStream`
    (its state read in place by the kernel, which the caller follows with ``generator.advance()``:
    device operations only, capturable), else drawn from ``generator`` (default: ``device``'s
    default generator; a CUDA graph captures that one, other generators must be registered with it)."""
    if isinstance(generator, SRStream):
        if generator.device != torch.device(device):
            raise ValueError(f"the SRStream lives on {generator.device}, the tensor on {device}: "
                             "make the stream on the tensor's device (SRStream.to)")
        return generator.next_keys()
    if generator is None:
        return torch.randint(0, 2**62, (2,), device=device, dtype=torch.int64)
    s = torch.randint(0, 2**62, (2,), generator=generator, device=generator.device, dtype=torch.int64)
    return s.to(device, non_blocking=True)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch_opts() -> dict:
    return {} if interpreter_mode() else {"enable_fp_fusion": False}


#: Compiled kernels by launch signature (:func:`_launch`), filled on each signature's first launch.
_LAUNCHES: dict[tuple, tuple[Any, ...]] = {}
#: What Triton specialises an integer argument on, by value (:func:`_launch_signature`).
_INT_SPECS: dict[int, int] = {}


def _int_spec(a: int) -> int:
    """An integer's specialisation as bits: == 1, divisible by 16, outside int32, outside int64."""
    spec = _INT_SPECS[a] = (a == 1) | (a & 15 == 0) << 1 | (not -2**31 <= a < 2**31) << 2 | (a >= 2**63) << 3
    if len(_INT_SPECS) > 65536:   # shapes that never repeat: start again rather than grow
        _INT_SPECS.clear()
    return spec


def _launch_signature(args: tuple) -> list:
    """What Triton's launch specialises each runtime argument on, or more (a refinement), as one
    flat list: a tensor's dtype and 16-byte alignment; an integer's being 1, its divisibility by 16
    and its width (i32 / i64 / u64), kept per value in ``_INT_SPECS``; a float is a float; anything
    else its type and value. Triton 3.6 ``runtime/jit.py`` ``create_function_from_signature``
    (``specialize_impl``). A plain loop: this runs on every launch."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append(a.dtype)
            key.append(a.data_ptr() & 15 == 0)
        elif type(a) is int:
            spec = _INT_SPECS.get(a)
            key.append(_int_spec(a) if spec is None else spec)
        elif type(a) is float:
            key.append(float)
        else:
            key.append(type(a))
            key.append(a)
    return key


#: Triton's ``knobs.runtime`` (its launch hooks), found on the first direct launch.
_TRITON_RUNTIME: Any = None


@functools.cache
def _launch_cache_release() -> bool:
    """(Read once: it is on every launch's path.) Whether the installed Triton is 3.6, the release whose specialisation rules
    :func:`_launch_signature` follows and whose launcher :func:`_direct_launch` binds, and on which
    the GPU tests ran. On any other release (the ``kernels`` extra allows 3.7, which no GPU here has
    run) every launch takes Triton's own path: slower on the host, specialised by Triton itself."""
    return _kernels().triton.__version__.startswith("3.6.")


def _direct_launch(compiled: Any) -> Any:
    """The launcher Triton's ``CompiledKernel[grid](*args)`` ends in, with what it passes bound
    (``compiler/compiler.py`` ``CompiledKernel.__getitem__``, then ``backends/nvidia/driver.py``
    ``CudaLauncher.__call__``, whose only work besides calling the C launch function is to
    allocate scratch buffers), or None where the kernel needs what that path adds (a global or
    profiling scratch buffer). Triton 3.6 passes its launch-hook chains and their metadata on every
    launch; :func:`_launch` calls this only while both chains are empty, when they do nothing. None
    as well on any Triton other than 3.6 (:func:`_launch_cache_release`).

    The C function takes a pointer argument as a tensor (it calls ``data_ptr()`` and asks the
    driver whether the address is device memory) or as an integer address, taken as it is."""
    global _TRITON_RUNTIME
    meta = compiled.metadata
    knobs = getattr(_kernels().triton, "knobs", None)
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0) \
            or knobs is None or not hasattr(compiled, "packed_metadata") or not hasattr(compiled.run, "launch") \
            or not _launch_cache_release():
        return None   # a scratch buffer to allocate, or not the Triton release this was written for
    _TRITON_RUNTIME = knobs.runtime
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    # CudaLauncher.__call__ allocates the scratch buffers (none here) and calls its C function
    c_launch, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl

    def launch(grid: tuple, stream: int, args: tuple, tail: tuple) -> None:
        c_launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, function,
                 coop, pdl, None, None, packed, None, None, None, *args, *tail)

    return launch


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int, **constexprs: Any) -> tuple | None:
    """``kernel[grid](*args, num_warps=num_warps, **constexprs)``: every kernel of this package is
    launched here. ``args`` are the kernel's runtime arguments in order; ``constexprs`` the rest.

    Triton's own launch binds the arguments, builds its cache key from them and checks the
    kernel's globals on every call: 25–35 µs of host time per kernel on the lent H200's hosts
    (``benchmarks/host_breakdown.py``), and an eager ``quantize`` call launches two kernels.
    So the compiled kernel Triton returns on a signature's first launch is kept, keyed by the
    kernel, the current device, ``num_warps``, the constexprs and what Triton specialises each
    runtime argument on (:func:`_launch_signature`); a later launch with the same key goes to the
    launcher that Triton's public ``CompiledKernel[grid](*args)`` calls, on the current stream,
    with the same binary and arguments (:func:`_direct_launch`; through ``CompiledKernel[grid]``
    itself while a Triton launch hook is installed, e.g. by a profiler). Triton's path is taken in
    the interpreter, with ``options().launch_cache`` off and on any Triton other than 3.6
    (:func:`_launch_cache_release`).

    Returns:
        The cache entry ``(compiled kernel, constexpr values, direct launcher or None)`` of this
        launch signature (what :func:`_quantize_rows` keeps in its plans); None on Triton's path.

    Raises:
        TypeError: a keyword argument that is not one of the kernel's constexpr parameters.
    """
    if (_INTERPRETED if _INTERPRETED is not None else interpreter_mode()) or not _state.options.launch_cache \
            or not _launch_cache_release():
        kernel[grid](*args, num_warps=num_warps, **constexprs, **_launch_opts())
        return
    device = torch.cuda.current_device()
    key = _launch_signature(args)
    key += (id(kernel), device, num_warps, *constexprs.items())
    key = tuple(key)
    hit = _LAUNCHES.get(key)
    if hit is not None:
        compiled, tail, direct = hit
        if direct is None or _hooks_installed():
            compiled[grid + (1,) * (3 - len(grid))](*args, *tail)
        else:
            direct(grid, torch._C._cuda_getCurrentRawStream(device), args, tail)   # Triton's own stream query
        return hit
    names = kernel.arg_names[len(args):]
    params = {p.name: p for p in kernel.params}
    if set(constexprs) - set(names) or any(not params[n].is_constexpr for n in names):
        raise TypeError(f"{kernel.__name__}: keyword arguments must be its constexprs, in order after the "
                        f"runtime arguments; got {sorted(constexprs)} for {names}")
    compiled = kernel[grid](*args, num_warps=num_warps, **constexprs, **_launch_opts())
    tail = tuple(constexprs[n] if n in constexprs else params[n].default for n in names)
    entry = _LAUNCHES[key] = (compiled, tail, _direct_launch(compiled))
    return entry


def _hooks_installed() -> bool:
    """Whether a Triton launch hook is installed (Triton 3.6 ``knobs.runtime``: hook chains; a
    plain function in older releases)."""
    enter, leave = _TRITON_RUNTIME.launch_enter_hook, _TRITON_RUNTIME.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


#: Zeroed float32 pools for the amax kernels by device: (tensor, slot counter).
_AMAX_POOLS: dict[int, tuple[torch.Tensor, Iterator[int]]] = {}
_AMAX_POOL_FLOATS = 4096   # 1024 slots of 16 bytes


def _amax_slot(device: torch.device) -> tuple[torch.Tensor, int]:
    """:func:`_amax_buffer` as ``(tensor, i)``, the buffer being ``tensor[i:i + 2]``, without the
    slicing (a tensor operation): the address ``tensor.data_ptr() + 4 * i`` is all a launch needs."""
    if device.type != "cuda":
        return torch.zeros(2, dtype=torch.float32, device=device), 0
    index = torch.cuda.current_device() if device.index is None else device.index
    if torch._C._cuda_getCurrentRawStream(index) != 0:   # not the default (legacy) stream
        return torch.zeros(2, dtype=torch.float32, device=device), 0
    pool = _AMAX_POOLS.get(index)
    if pool is not None:
        i = 4 * next(pool[1])   # one C call: two threads never get the same slot
        if i < _AMAX_POOL_FLOATS:
            return pool[0], i
    zeros = torch.zeros(_AMAX_POOL_FLOATS, dtype=torch.float32, device=device)
    _AMAX_POOLS[index] = (zeros, itertools.count(1))
    return zeros, 0


def _amax_buffer(device: torch.device) -> torch.Tensor:
    """A zeroed float32 ``[2]`` for the amax kernels to accumulate into (``[0]`` rowwise, ``[1]``
    columnwise), 16-byte aligned.

    On a GPU's default stream it is the next 16-byte slot of a zeroed pool kept per device: one
    ``torch.zeros`` per 1024 calls instead of an allocation and a fill kernel each (about 12 µs of
    host time, spent before the first kernel of an eager call can start). A slot is handed out
    once; the pool's fill ran on that stream before any kernel that uses its slots; the pool lives
    as long as a slot does (the ``amax`` of a result is a view of it). On any other stream — a CUDA
    graph capture (whose replays must accumulate into zeros, not into the previous replay's
    maximum), ``torch.compile``'s CUDA graphs, whose warm-up allocates from the graphs' own memory
    pool — and on the CPU, it is a ``torch.zeros`` of its own (:func:`_amax_slot`).
    """
    t, i = _amax_slot(device)
    return t[i:i + 2]


def _int32(t: torch.Tensor | int) -> torch.Tensor | int:
    """A tensor viewed as int32 (the pointer type the kernel was compiled for); an address as it is."""
    return t.view(torch.int32) if isinstance(t, torch.Tensor) else t


def _amax_args(x2: torch.Tensor, buf: torch.Tensor | int, x_arg: torch.Tensor | int | None = None) -> tuple:
    """The runtime arguments of ``amax_kernel`` / ``amax_slices_kernel`` for x2 [M, K] into ``buf``
    (a tensor, or its address where the kernel is already compiled: see :func:`_direct_launch`;
    ``x_arg``: x2's address likewise, default x2)."""
    M, K = x2.shape
    return x2 if x_arg is None else x_arg, _int32(buf), M, K, x2.stride(0), x2.stride(1)


def _rows_args(x2: torch.Tensor, a_row: torch.Tensor | int, seeds: torch.Tensor | int, d: torch.Tensor | int,
               s: torch.Tensor | int, v32: torch.Tensor | int, obs: torch.Tensor | int,
               x_arg: torch.Tensor | int | None = None) -> tuple:
    """The runtime arguments of ``quantize_rows_kernel`` for x2 [M, K] (``d``: packed codes
    ``uint8 [M, K/2]``; ``v32``: the BF16 values ``[M, K]`` viewed as int32, or any pointer when
    the kernel does not write them; ``obs``: a zeroed float32 tensor whose first element gets
    max |x| with ``OBSERVE``, or any pointer without). Each pointer as a tensor or, where the
    kernel is already compiled, as its address (:func:`_direct_launch`); ``x_arg`` likewise for
    x2 (default x2)."""
    M, K = x2.shape
    return (x2 if x_arg is None else x_arg, M, K, x2.stride(0), a_row, seeds, _int32(d), s, v32, _int32(obs),
            K // 8, K // 16, K // 2, _INV6)


def _rows_config(config: Mapping, K: int, values: bool, after_amax: bool) -> Mapping:
    """The one-block-per-thread kernel's tile for rows of K elements: with the BF16 values, after an
    amax pass, or with the amax given; ``_narrow`` where K/16 is not a multiple of that tile's NB."""
    key = "rows_values" if values else ("rows" if after_amax else "rows_amax_given")
    if (K // 16) % config[key]["NB"]:
        return config[("rows_values" if values else "rows") + "_narrow"]
    return config[key]


def _launch_amax(x2: torch.Tensor, buf: torch.Tensor, config: Mapping, *, row: bool, row_rht: bool, col_rht: bool,
                 mask: int, rht_f64: bool, i64: bool) -> tuple[tuple | None, tuple]:
    """Launch ``amax_kernel`` on x2 [M, K] into ``buf`` (its tile from ``config["amax"]``, or
    ``config["amax_rht"]`` with an RHT); returns :func:`_launch`'s cache entry and the grid."""
    M, K = x2.shape
    cfg = config["amax_rht" if row_rht or col_rht else "amax"]
    BM, BK = cfg["BM"], cfg["BK"]
    grid = (_cdiv(M, BM) * _cdiv(K, BK),)
    entry = _launch(_kernels().amax_kernel, grid, *_amax_args(x2, buf), ROW=row, ROW_RHT=row_rht, COL_RHT=col_rht,
                    SIGN_MASK=mask, RHT_F64=rht_f64, ROUND_BF16=x2.dtype == torch.bfloat16, BM=BM, BK=BK,
                    EVEN=(M % BM == 0 and K % BK == 0), I64=i64, num_warps=cfg["num_warps"])
    return entry, grid


def _launch_rows(x2: torch.Tensor, args: tuple, config: Mapping, *, sr: bool, values: bool, after_amax: bool,
                 i64: bool, codes: bool = True, observe: bool = False) -> tuple[tuple | None, tuple]:
    """Launch ``quantize_rows_kernel`` on x2 [M, K] with ``args`` (:func:`_rows_args`), its tile from
    :func:`_rows_config` (``codes=False``: the BF16 values alone, with ``values``); returns
    :func:`_launch`'s cache entry and the grid."""
    M, K = x2.shape
    cfg = _rows_config(config, K, values, after_amax)
    BM, NB = cfg["BM"], cfg["NB"]
    grid = (_cdiv(M, BM), _cdiv(K // 16, NB))
    # BF16 pairs loaded as int32 words where the rows are 4-byte aligned
    words = x2.dtype == torch.bfloat16 and x2.data_ptr() % 4 == 0 and x2.stride(0) % 2 == 0
    entry = _launch(_kernels().quantize_rows_kernel, grid, *args, SR=sr, VALUES=values, WORDS=words, BM=BM, NB=NB,
                    REVERSE=after_amax, EVEN=(M % BM == 0 and (K // 16) % NB == 0), I64=i64,
                    CODES=codes or not values, OBSERVE=observe, num_warps=cfg["num_warps"])
    return entry, grid


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 2 elsewhere (Triton's interpreter on CPU
    tensors), so that the CPU tests run the grid-stride loops that a GPU's grids take."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def _amax_slices_programs(cfg: Mapping, n_tiles: int, device: torch.device) -> int:
    """The grid of ``amax_slices_kernel`` over ``n_tiles`` tiles: at most ``programs_per_sm``
    programs per SM (then each takes every P-th tile: ``STRIDED``, see
    :func:`~nvfp4lab.kernels.triton_kernels.amax_slices_kernel`); one program per tile without
    ``programs_per_sm`` in ``cfg``."""
    per_sm = cfg.get("programs_per_sm")
    return n_tiles if per_sm is None else min(n_tiles, per_sm * _sm_count(device))


def _launch_amax_slices(x2: torch.Tensor, buf: torch.Tensor, cfg: Mapping, *, row: bool, mask: int, rht_f64: bool,
                        round_bf16: bool, i64: bool) -> None:
    """Launch ``amax_slices_kernel`` on x2 [M, K] (M % 16 == 0) into ``buf``: the columnwise
    post-RHT amax into ``buf[1]``, and max |x| into ``buf[0]`` when ``row``; its tile and grid from
    ``cfg`` (``config["amax_slices"]``, :func:`_amax_slices_programs`)."""
    M, K = x2.shape
    G, BK = cfg["G"], cfg["BK"]
    n_tiles = _cdiv(M, 16 * G) * _cdiv(K, BK)
    programs = _amax_slices_programs(cfg, n_tiles, x2.device)
    _launch(_kernels().amax_slices_kernel, (programs,), *_amax_args(x2, buf), ROW=row, COL_RHT=True, SIGN_MASK=mask,
            RHT_F64=rht_f64, ROUND_BF16=round_bf16, G=G, BK=BK, FB=min(cfg["FB"], BK),
            EVEN=(M % (16 * G) == 0 and K % BK == 0), I64=i64, STRIDED=programs < n_tiles, num_warps=cfg["num_warps"])


def _launch_gemm_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launch ``gemm_alpha_kernel``: ``out`` (float32 [2]) gets the (alpha, beta) of a GEMM whose
    operands have the float32 amaxes ``amax_a`` and ``amax_b`` (one element each); returns ``out``."""
    _launch(_kernels().gemm_alpha_kernel, (1,), amax_a.reshape(1), amax_b.reshape(1), out, _GEMM_FACTOR, num_warps=1)
    return out


def _rows_kernel_runs(x2: torch.Tensor, opts: "KernelOptions", row_rht: bool, block2d: bool) -> bool:
    """Whether the one-block-per-thread kernel makes a rowwise copy of x2 [M, K] that
    :func:`_run` quantizes alone (1x16 blocks, no RHT, ``K % 16 == 0``, unit column stride)."""
    return opts.rows_kernel and not row_rht and not block2d and x2.shape[1] % 16 == 0 and x2.stride(1) == 1


def _i64(x2: torch.Tensor) -> bool:
    """Whether the kernels must index x2 [M, K] (or outputs of M*K elements) in 64 bits."""
    M, K = x2.shape
    span = (M - 1) * abs(x2.stride(0)) + (K - 1) * abs(x2.stride(1)) + 1
    return max(span, M * K) >= 2**31 - 1


#: Launch plans of :func:`_quantize_rows` by call signature (at most ``_PLANS_MAX``).
_ROWS_PLANS: dict[tuple, tuple] = {}
_PLANS_MAX = 256


def _quantize_rows(x2: torch.Tensor, sr: bool, generator, amax: torch.Tensor | None,
                   on_amax: Callable[[torch.Tensor], Any] | None = None, observe: bool = False) -> tuple | None:
    """:func:`quantize_rowwise` where the one-block-per-thread kernel runs (1x16 blocks, no RHT,
    ``K % 16 == 0``, unit column stride): the public ``quantize(x)``'s usual case, at a host cost
    near that of its launches alone.

    Everything that depends only on the call's signature — x2's shape, strides, dtype and
    alignment, the device, the options in force, SR, whether ``amax`` is given — is planned on the
    signature's first call: the kernels' tiles and constexprs, their grids and their compiled
    kernels (the entries :func:`_launch` caches). A later call (:func:`_quantize_rows_planned`)
    launches the amax kernel (unless ``amax`` is given), allocates the outputs and launches the rows
    kernel directly, with the arguments :func:`_run` passes (:func:`_amax_args`, :func:`_rows_args`)
    given as addresses: the same binaries, bit-identical results (``tests/gpu/test_kernels_gpu.py``).
    Returns None where the plan does not apply — the interpreter, ``options().launch_cache`` off,
    a Triton launch hook installed, a kernel Triton launches with a scratch buffer — and the
    caller runs :func:`_run`. Otherwise ``(data, scale,
    amax, observed)``: ``observed`` is the input's max |x| that the kernel observed where
    ``observe`` and ``amax`` is given (``OBSERVE``; 0-d float32, NaN where x holds NaN), else None.
    """
    opts = _state.options
    M, K = x2.shape
    dev = x2.device
    if (K & 15 or x2.stride(1) != 1 or not opts.rows_kernel or not opts.launch_cache
            or (_INTERPRETED if _INTERPRETED is not None else interpreter_mode())):
        return None
    ptr = x2.data_ptr()
    cur = torch.cuda.current_device()   # where Triton launches (its current stream), as in _launch
    observe = observe and amax is not None
    sig = (M, K, x2.stride(0), x2.dtype, ptr & 15 == 0, ptr & 3 == 0, cur, id(opts), sr,
           None if amax is None else (amax.dtype, amax.data_ptr() & 15 == 0), type(generator), observe)
    plan = _ROWS_PLANS.get(sig)
    if plan is not None and _TRITON_RUNTIME is not None and _hooks_installed():
        plan = None
    if plan is not None:
        planned = _quantize_rows_planned(x2, ptr, plan, cur, sr, generator, amax, on_amax, observe)
        if planned is not None:
            return planned
    # zeroed where a kernel accumulates into it: the amax kernel, or the observing rows kernel
    buf = _amax_buffer(dev) if amax is None or observe else torch.empty(2, dtype=torch.float32, device=dev)
    amax_step = None
    if amax is None:
        entry, grid = _launch_amax(x2, buf, opts.config, row=True, row_rht=False, col_rht=False, mask=0,
                                   rht_f64=opts.rht_f64, i64=_i64(x2))
        amax_step = None if entry is None or entry[2] is None else (entry[2], grid, entry[1])
    a_row = buf[0] if amax is None else amax   # (after the amax launch: the GPU starts sooner)
    if on_amax is not None and amax is None:
        on_amax(a_row)
    d = torch.empty(M, K // 2, dtype=torch.uint8, device=dev)
    s = torch.empty(M, K // 16, dtype=torch.uint8, device=dev)
    seeds = _seeds(generator, dev) if sr else buf   # buf: a dummy pointer when not SR (as in _run)
    entry, grid = _launch_rows(x2, _rows_args(x2, a_row, seeds, d, s, buf, buf), opts.config, sr=sr, values=False,
                               after_amax=amax is None, i64=_i64(x2), observe=observe)
    if plan is None and entry is not None and entry[2] is not None and (amax is not None or amax_step is not None) \
            and seeds.data_ptr() & 15 == 0:
        if len(_ROWS_PLANS) >= _PLANS_MAX:
            _ROWS_PLANS.clear()
        _ROWS_PLANS[sig] = (opts, amax_step, (entry[2], grid, entry[1]))   # opts kept: its id stays its own
    if sr and isinstance(generator, SRStream):
        generator.advance()   # after the kernel that read its keys in place (same stream)
    return d, s.view(torch.float8_e4m3fn), a_row, buf[0] if observe else None


def _quantize_rows_planned(x2: torch.Tensor, ptr: int, plan: tuple, cur: int, sr: bool, generator,
                           amax: torch.Tensor | None, on_amax: Callable[[torch.Tensor], Any] | None,
                           observe: bool) -> tuple | None:
    """:func:`_quantize_rows` on a call whose plan is made (``ptr``: x2's address, ``cur``: the
    current device, as that function found them): the same launches with the same
    arguments, passed to the compiled kernels' launchers as addresses (:func:`_direct_launch`),
    so that no tensor operation and no driver query of the pointers comes before the first
    launch. The amax buffer is a pool slot's address (:func:`_amax_slot`; the 0-d amax is made
    from it after the launch) or none where no kernel accumulates into one (a given amax, not
    observed: the kernel reads no such pointer, so 0). None, with nothing launched, where SR keys
    are not 16-byte aligned as the plan's kernel assumes: the caller launches through Triton's
    checks instead (only an SRStream's keys, a view of its state, can be; fresh draws are aligned,
    so no generator is drawn from twice)."""
    M, K = x2.shape
    dev = x2.device
    _, amax_step, rows_step = plan
    seeds = _seeds(generator, dev) if sr else None
    if seeds is not None and seeds.data_ptr() & 15:
        return None
    stream = torch._C._cuda_getCurrentRawStream(cur)
    pool, i = _amax_slot(dev) if amax is None or observe else (None, 0)
    buf = 0 if pool is None else pool.data_ptr() + 4 * i
    if amax_step is not None:
        direct, grid, tail = amax_step
        direct(grid, stream, _amax_args(x2, buf, ptr), tail)
    a_row = pool[i] if amax is None else amax   # (after the amax launch: the GPU starts sooner)
    if on_amax is not None and amax is None:
        on_amax(a_row)
    d = torch.empty(M, K // 2, dtype=torch.uint8, device=dev)
    s = torch.empty(M, K // 16, dtype=torch.uint8, device=dev)
    direct, grid, tail = rows_step
    direct(grid, stream, _rows_args(x2, buf if amax is None else amax.data_ptr(), buf if seeds is None else
                                    seeds.data_ptr(), d.data_ptr(), s.data_ptr(), buf, buf, ptr), tail)
    if sr and isinstance(generator, SRStream):
        generator.advance()   # after the kernel that read its keys in place (same stream)
    return d, s.view(torch.float8_e4m3fn), a_row, pool[i] if observe else None


def _run(x2: torch.Tensor, *, row: bool, col: bool, row_rht: bool, col_rht: bool, block2d: bool,
         sr: bool, mask: int, generator, amax_row, amax_col, values: tuple[bool, bool] = (False, False),
         on_amax: Callable[[torch.Tensor], Any] | None = None,
         col_out: tuple[torch.Tensor, torch.Tensor] | None = None, values_out: torch.Tensor | None = None,
         amax_out: torch.Tensor | None = None, row_codes: bool = True, col_codes: bool = True,
         coefs: Sequence[tuple[torch.Tensor, bool, torch.Tensor]] = ()):
    """Launch the amax (if needed) and quantize kernels on x2 [M, K]; return raw outputs.

    ``values``: also write the BF16 block values of the (rowwise, columnwise) copy where the
    kernel that runs can (the one-block-per-thread rowwise kernel, the 16-slice kernel); the
    last two results are those tensors or ``None``. ``row_codes=False`` (with ``values[0]``):
    leave out the rowwise codes and scales where the one-block-per-thread kernel makes that copy
    (:func:`_rows_kernel_runs`); ``data`` and ``scale`` are then None. ``col_codes=False`` (with
    ``values[1]``, without ``col_out``): the same for the columnwise copy where the 16-slice kernel
    makes it with 1x16 blocks (``data_t`` and ``scale_t`` None). ``on_amax``: called with the rowwise amax
    (the columnwise one without ``row``) once the amax kernel is launched, when it runs.
    ``col_out``: (codes, scales as uint8) for the columnwise copy to be written into, checked by
    :func:`check_col_out`, or None for new tensors. ``values_out``: a contiguous BF16 [M, K] tensor
    for the rowwise values (with ``values[0]``) to be written into, or None for a new one.
    ``amax_out``: a zeroed float32 [2] tensor the amax kernel accumulates into (as
    :func:`_amax_buffer`'s), or None for one of the pool's. ``coefs``: at most two
    ``(partner amax, columnwise, out)``: write into ``out`` (float32 [2]) the (alpha, beta) of the
    GEMM of this pair's rowwise (``columnwise`` False) or columnwise copy with an operand of amax
    ``partner`` (0-d float32, final before this call's kernels run): by the last quantize kernel
    where that is the 16-slice kernel, else by :func:`_launch_gemm_alpha` after it."""
    if len(coefs) > 2:
        raise ValueError(f"at most two GEMM factors per call, got {len(coefs)}")
    k = _kernels()
    M, K = x2.shape
    dev = x2.device
    opts = options()
    rf64 = opts.rht_f64
    config = opts.config
    round_bf16 = x2.dtype == torch.bfloat16
    need_row_amax = (row or block2d) and amax_row is None
    need_col_amax = col and not block2d and amax_col is None
    # amax buffers: [0] rowwise, [1] columnwise (post-RHT); without RHT both are max|x|. Zeroed (a
    # slot of the pool) only when the amax kernel accumulates into them (else a dummy pointer)
    if need_row_amax or need_col_amax:
        buf = _amax_buffer(dev) if amax_out is None else amax_out
    else:
        buf = torch.empty(2, dtype=torch.float32, device=dev)
    i64 = _i64(x2)
    if need_row_amax or need_col_amax:
        do_row = need_row_amax or (need_col_amax and not col_rht)
        do_col_rht = need_col_amax and col_rht
        if do_col_rht and opts.slices and M % 16 == 0 and not row_rht:
            _launch_amax_slices(x2, buf, config["amax_slices"], row=do_row, mask=mask, rht_f64=rf64,
                                round_bf16=round_bf16, i64=i64)
        else:
            _launch_amax(x2, buf, config, row=do_row, row_rht=row_rht, col_rht=do_col_rht, mask=mask, rht_f64=rf64,
                         i64=i64)
    a_row = amax_row if amax_row is not None else buf[0]
    if block2d:
        a_col = a_row
    elif amax_col is not None:
        a_col = amax_col
    else:
        a_col = buf[1] if col_rht else buf[0]
    if on_amax is not None and (need_row_amax if row else need_col_amax):
        on_amax(a_row if row else a_col)

    Mh, Kh, M16, K16 = -(-M // 2), -(-K // 2), -(-M // 16), -(-K // 16)
    u8 = torch.uint8
    split = row and col and not block2d and not opts.fuse_row_col   # two kernels: rowwise, then columnwise
    rows_kernel = row and (split or not col) and _rows_kernel_runs(x2, opts, row_rht, block2d)
    row_codes = row_codes or not (values[0] and rows_kernel)

    def uses_slices(row_: bool, col_: bool) -> bool:
        """Whether :func:`launch` ``(row_, col_)`` runs the 16-slice kernel."""
        return opts.slices and col_ and M % 16 == 0 and not (row_ and row_rht) and not (block2d and sr)

    slices_col = col and not block2d and uses_slices(row and not split, True)   # launch()'s kernel for that copy
    col_codes = col_codes or not (values[1] and slices_col) or col_out is not None
    d = torch.empty(M, Kh, dtype=u8, device=dev) if row and row_codes else None
    s = torch.empty((M16 if block2d else M), K16, dtype=u8, device=dev) if row and row_codes else None
    if col and col_out is not None:
        dt, st = col_out
    else:
        dt = torch.empty(K, Mh, dtype=u8, device=dev) if col and col_codes else None
        st = torch.empty((K16 if block2d else K), M16, dtype=u8, device=dev) if col and col_codes else None
    seeds = _seeds(generator, dev) if sr else buf  # buf: a dummy pointer when not SR
    dummy = buf
    out_v: list = [None, None]
    even = lambda BM, BK: M % BM == 0 and K % BK == 0  # noqa: E731
    reverse = need_row_amax or need_col_amax

    def new_values() -> torch.Tensor:
        return values_out if values_out is not None else torch.empty(M, K, dtype=torch.bfloat16, device=dev)

    def launch(row_: bool, col_: bool, last: bool, rev: bool) -> bool:
        """Launch the kernel for these copies, reading x's tiles in reverse order where ``rev``; True
        where it also wrote ``coefs`` (the last, 16-slice)."""
        if row_ and not col_ and rows_kernel:
            v = new_values() if values[0] else None
            _launch_rows(x2, _rows_args(x2, a_row, seeds, dummy if d is None else d, dummy.view(u8) if s is None else s,
                                        dummy if v is None else v.view(torch.int32), dummy), config,
                         sr=sr, values=v is not None, after_amax=rev, i64=i64, codes=row_codes)
            out_v[0] = v
            return False
        if uses_slices(row_, col_):
            mode = "slices2d" if block2d else ("slices_both" if row_ else ("slices_col_sr" if sr else "slices_col"))
            cfg = config[mode]
            G, BK = cfg["G"], cfg["BK"]
            v = new_values() if values[0] and row_ and block2d else None
            vt = torch.empty(K, M, dtype=torch.bfloat16, device=dev) if values[1] else None
            folded = coefs if last else ()
            c_args = [a for p, c, o in folded for a in (p.reshape(1), (a_col if c else a_row), o)]
            c_args += [dummy] * (6 - len(c_args))
            _launch(k.quantize_slices_kernel, (_cdiv(M, 16 * G) * _cdiv(K, BK),),
                x2, M, K, x2.stride(0), x2.stride(1), a_row, a_col, seeds,
                d if row_ else dummy, s if row_ else dummy, dummy.view(torch.int32) if dt is None else dt.view(torch.int32),
                dummy.view(u8) if st is None else st,
                dummy if v is None else v.view(torch.int16), dummy if vt is None else vt.view(torch.int16),
                Kh, K16, Mh // 4, M16, K, M, _INV6, *c_args, _GEMM_FACTOR, VALUES_ROW=v is not None,
                VALUES_COL=vt is not None,
                ROW=row_, COL=col_, COL_RHT=col_rht, BLOCK2D=block2d, SR=sr,
                SIGN_MASK=mask, RHT_F64=rf64, ROUND_BF16=round_bf16, G=G, BK=BK,
                REVERSE=rev, E2M1_BITS=opts.e2m1_bits,
                EVEN=even(16 * G, BK), I64=i64, COL_CODES=col_codes or not col_, N_COEF=len(folded),
                num_warps=cfg["num_warps"])
            if v is not None:
                out_v[0] = v
            out_v[1] = vt
            return last
        else:
            cfg = config["2d" if block2d else ("both" if row_ and col_ else ("row" if row_ else "col"))]
            BM, BK = cfg["BM"], cfg["BK"]
            _launch(k.quantize_kernel, (_cdiv(M, BM) * _cdiv(K, BK),),
                x2, M, K, x2.stride(0), x2.stride(1), a_row, a_col, seeds,
                d if row_ else dummy, s if row_ else dummy, dt if col_ else dummy, st if col_ else dummy,
                Kh, K16, Mh, M16, _INV6,
                ROW=row_, COL=col_, ROW_RHT=row_rht, COL_RHT=col_rht, BLOCK2D=block2d, SR=sr,
                SIGN_MASK=mask, RHT_F64=rf64, ROUND_BF16=round_bf16, BM=BM, BK=BK,
                REVERSE=rev, E2M1_BITS=opts.e2m1_bits,
                EVEN=even(BM, BK), I64=i64, num_warps=cfg["num_warps"])
            return False

    if split:
        launch(True, False, False, reverse)
        # the second read of x: in the order opposite to the first's, to start where it ended (in the L2)
        coefs_written = launch(False, True, True, reverse != opts.alternate_reads)
    else:
        coefs_written = launch(row, col, True, reverse)
    if not coefs_written:   # no 16-slice kernel wrote the GEMM factors: a launch each
        for partner, c, out in coefs:
            _launch_gemm_alpha(partner, a_col if c else a_row, out)
    if sr and isinstance(generator, SRStream):
        generator.advance()   # after the kernels that read its keys in place (same stream)
    f8 = torch.float8_e4m3fn
    scalar = lambda t: t if t.dim() == 0 else t.reshape(())  # noqa: E731  (buf[i] is 0-d already)
    return (d, None if s is None else s.view(f8), scalar(a_row),
            dt, None if st is None else st.view(f8), scalar(a_col), out_v[0], out_v[1])


# ----------------------------------------------------------------------------- public API
def covers_quantize(x: torch.Tensor, *, block: str, rounding: str, rht: bool, sign_mask: int | None,
                    four_over_six: bool = False, row_scaled: bool = False) -> bool:
    """Whether :func:`quantize_rowwise` computes ``quantize(x, ...)`` for these options.

    Never for 4over6 or row-scaled quantization (TE ``nvfp4_use_4over6``, ``row_scaled_nvfp4``):
    the kernels do not implement them, so ``nvfp4lab.quantize`` runs its reference.

    ``x`` [..., K] must be float32/bfloat16/float16 on a device the kernels run on
    (:func:`available`), non-empty and at least 1-D (2-D for ``block="2d"``); the RHT needs
    ``K % 16 == 0``, a valid sign mask and no float16 input. The caller (``nvfp4lab.quantize``,
    the only one that decides between these kernels and the reference) has already validated
    the options themselves.
    """
    if four_over_six or row_scaled:
        return False
    if not isinstance(x, torch.Tensor) or not available(x.device):
        return False
    if block not in ("1d", "2d") or rounding not in ("nearest", "stochastic"):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() == 0 or x.numel() == 0:
        return False
    if block == "2d" and x.dim() < 2:
        return False
    if rht and (x.shape[-1] % RHT_SIZE or sign_mask is None or x.dtype == torch.float16):
        return False
    return True


def covers_rowwise_columnwise(x: torch.Tensor, *, block: str, rounding: str, rht: bool,
                              sign_mask: int | None, four_over_six: bool = False, row_scaled: bool = False) -> bool:
    """Whether :func:`quantize_rowwise_columnwise` computes both copies of ``x`` [..., K].

    Never for 4over6 or row-scaled quantization (see :func:`covers_quantize`).

    As :func:`covers_quantize` for the rowwise copy (never RHT'd), plus: ``x`` at least 2-D;
    a columnwise RHT needs ``M % 16 == 0`` (M = rows of ``x`` flattened) and no float16 input;
    ``block="2d"`` takes neither the RHT nor SR.
    """
    if four_over_six or row_scaled:
        return False
    if not covers_quantize(x, block=block, rounding=rounding, rht=False, sign_mask=0) or x.dim() < 2:
        return False
    if rht and (math.prod(x.shape[:-1]) % RHT_SIZE or sign_mask is None or x.dtype == torch.float16):
        return False
    if block == "2d" and (rht or rounding == "stochastic"):
        return False
    return True


def quantize_rowwise(x: torch.Tensor, *, block2d: bool = False, rht: bool = False, sr: bool = False,
                     sign_mask: int = 0, generator: torch.Generator | None = None,
                     amax: torch.Tensor | None = None,
                     on_amax: Callable[[torch.Tensor], Any] | None = None,
                     observe: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """NVFP4 codes, block scales and amax of ``x`` [..., K] quantized along ``K``.

    The kernels behind ``nvfp4lab.quantize(x, block=, rht=, rounding=, amax=)``: one amax
    kernel (unless ``amax``, a 0-d float32 tensor on ``x``'s device, is given), then one
    quantize kernel. A transposed view (``x = y.t()``, ``y`` contiguous) is read in place
    through the columnwise kernel. Call only where :func:`covers_quantize` is true.

    ``on_amax``, when the amax kernel runs, is called with the 0-d amax it computes as soon as that
    kernel is launched, before the quantize kernel: a host read started there (``quantize``'s NaN
    check) waits for the amax alone, while the quantize kernel runs.

    ``observe`` (with ``amax`` given): where the one-block-per-thread rowwise kernel runs (1x16
    blocks, no RHT), it also reports the input's max |x|, so that a caller's NaN/Inf check of the
    input needs no pass of its own.

    Returns:
        ``(data, scale, amax, observed)``: ``uint8 [M, ceil(K/2)]`` packed E2M1 codes (low nibble
        first), ``float8_e4m3fn`` block scales (``[M, ceil(K/16)]``, or ``[ceil(M/16), ceil(K/16)]``
        with ``block2d``) and the float32 0-d amax (post-RHT with ``rht``), as plain tensors; and
        the max |x| that ``observe`` asked for (0-d float32, NaN-propagating, ±Inf kept), or None
        where it did not or the kernel that ran does not observe. No NaN scan: a NaN in ``x`` gives
        a NaN amax and unspecified codes.
    """
    x2 = _as_2d(x)
    M = x2.shape[0]
    if x2.stride(1) != 1 and x2.stride(0) == 1 and M > 1:
        # x2 = y.t() with y [K, M] contiguous: quantize x2 along K == columnwise of y along its rows
        _, _, _, data, scale, amax_t, _, _ = _run(
            x2.t(), row=False, col=True, row_rht=False, col_rht=rht, block2d=block2d, sr=sr, mask=sign_mask,
            generator=generator, amax_row=amax if block2d else None, amax_col=amax, on_amax=on_amax)
    else:
        fast = None if block2d or rht else _quantize_rows(x2, sr, generator, amax, on_amax, observe)
        if fast is not None:
            return fast
        data, scale, amax_t, _, _, _, _, _ = _run(
            x2, row=True, col=False, row_rht=rht, col_rht=False, block2d=block2d, sr=sr, mask=sign_mask,
            generator=generator, amax_row=amax, amax_col=None, on_amax=on_amax)
    return data, scale, amax_t, None


def check_col_out(col_out: tuple[torch.Tensor, torch.Tensor], x2: torch.Tensor, block2d: bool) -> None:
    """Raise ValueError unless ``col_out`` is (codes ``uint8 [K, ceil(M/2)]``, block scales
    ``float8_e4m3fn`` or ``uint8`` ``[K or ceil(K/16) with block2d, ceil(M/16)]``), both
    contiguous, 16-byte aligned and on ``x2``'s device: where the columnwise kernels can write the
    copy of ``x2`` [M, K]."""
    M, K = x2.shape
    want = (((K, -(-M // 2)), (torch.uint8,)),
            (((-(-K // 16) if block2d else K), -(-M // 16)), (torch.uint8, torch.float8_e4m3fn)))
    if not (isinstance(col_out, (tuple, list)) and len(col_out) == 2):
        raise ValueError("col_out must be a pair (codes, block scales)")
    for name, t, (shape, dtypes) in zip(("codes", "block scales"), col_out, want):
        _check_out(f"col_out {name}", t, shape, dtypes, x2.device)


def _check_out(name: str, t: Any, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    """Raise ValueError naming ``name`` unless ``t`` is a contiguous, 16-byte aligned tensor of
    ``shape``, one of ``dtypes``, on ``device``: a tensor the kernels can write into."""
    if (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype not in dtypes
            or not t.is_contiguous() or t.device != device or t.data_ptr() % 16):
        got = (t.dtype, tuple(t.shape), t.device) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a contiguous, 16-byte aligned {tuple(shape)} tensor of "
                         f"{' or '.join(map(str, dtypes))} on {device}, got {got}")


def quantize_rowwise_columnwise(
    x: torch.Tensor, *, block2d: bool = False, rht: bool = False, sr: bool = False, sign_mask: int = 0,
    generator: torch.Generator | None = None, amax: torch.Tensor | None = None,
    amax_t: torch.Tensor | None = None, values: tuple[bool | str, bool | str] = (False, False),
    col_out: tuple[torch.Tensor, torch.Tensor] | None = None, values_out: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None, coefs: Sequence[tuple[torch.Tensor, bool, torch.Tensor]] = (),
) -> tuple[torch.Tensor | None, ...]:
    """Both NVFP4 copies a training step needs from ``x`` [..., K], one read of ``x`` per kernel.

    The rowwise copy (blocks along ``K``, never RHT'd, as in TE) and the columnwise copy
    (``x2dᵀ`` quantized along the token axis ``M``, with the RHT along ``M`` when ``rht``, and
    its own post-RHT amax); with ``block2d`` the columnwise copy is the exact transpose of the
    rowwise one (same tiles, same amax). One amax kernel (skipped when ``amax``/``amax_t``,
    0-d float32 tensors, are given) and one or two quantize kernels
    (:attr:`KernelOptions.fuse_row_col`). SR draws independent streams for the two copies.
    Call only where :func:`covers_rowwise_columnwise` is true.

    Args:
        values: (rowwise, columnwise): also write that copy's BF16 block values where the kernel
            that runs can (rowwise: 1x16 with ``K % 16 == 0``, or 2D; columnwise: ``M % 16 == 0``).
            ``"only"``: that copy's values alone, without its codes and scales (``data`` and
            ``scale``, or ``data_t`` and ``scale_t``, None), where the kernel that makes it can:
            the one-block-per-thread rowwise kernel (1x16, ``K % 16 == 0``) and the 16-slice
            columnwise kernel (1x16, ``M % 16 == 0``, no ``col_out``); elsewhere ``"only"`` is
            ``True``. The values are the same bits (``CODES=False`` / ``COL_CODES=False``). For
            an operand a GEMM uses at once.
        col_out: (codes, block scales) tensors the columnwise copy is written into (contiguous,
            16-byte aligned, the shapes below; scales as ``uint8`` or ``float8_e4m3fn``), or None
            for new ones: a caller that keeps the copy in a buffer of its own saves a copy pass.
        values_out: a contiguous, 16-byte aligned ``bfloat16 [M, K]`` tensor the rowwise BF16 block
            values are written into (with ``values[0]``; with ``block2d`` the columnwise values are
            its transpose), or None for a new one. Where the kernel that runs writes no values the
            result's ``values`` is None and ``values_out`` is left as it was.
        amax_out: a zeroed, contiguous, 16-byte aligned ``float32 [2]`` tensor on ``x``'s device the
            amax kernel accumulates into (``[0]`` rowwise, ``[1]`` columnwise post-RHT amax; the
            results' amaxes are views of it), or None for a buffer of the kernels' own: a caller
            that keeps the amaxes in a buffer of its own, zeroed once for several pairs, saves the
            fills and copies. Not read when both amaxes are given.
        coefs: at most two ``(partner amax, columnwise, out)``: the (alpha, beta) of the GEMM of
            the rowwise (``columnwise`` False) or columnwise copy with an operand whose amax is
            ``partner`` (a 0-d float32 tensor on ``x``'s device, already computed) are written
            into ``out`` (a float32 ``[2]`` tensor there), for :func:`gemm`'s ``coef``: by the last
            quantize kernel where that is the 16-slice kernel (no launch of their own), else by
            one small kernel each.

    Returns:
        ``(data, scale, amax, data_t, scale_t, amax_t, values, values_t)``: as
        :func:`quantize_rowwise` for each copy (the columnwise ``data_t`` is ``[K, ceil(M/2)]``,
        ``col_out``'s tensors when given), then the BF16 block values ``[M, K]`` / ``[K, M]`` or
        ``None``.

    Raises:
        ValueError: ``col_out``, ``values_out`` or ``amax_out`` is not as described.
    """
    x2 = _as_2d(x)
    if x2.stride(1) != 1 and x2.stride(0) == 1:
        x2 = x2.contiguous()  # a transposed view: one copy, then the row-major kernels
    if col_out is not None:
        check_col_out(col_out, x2, block2d)
        col_out = (col_out[0], col_out[1].view(torch.uint8))
    if values_out is not None:
        _check_out("values_out", values_out, x2.shape, (torch.bfloat16,), x2.device)
    if amax_out is not None:
        _check_out("amax_out", amax_out, (2,), (torch.float32,), x2.device)
    d, s, am, dt, st, amt, v, vt = _run(
        x2, row=True, col=True, row_rht=False, col_rht=rht, block2d=block2d, sr=sr, mask=sign_mask,
        generator=generator, amax_row=amax, amax_col=amax_t, values=(bool(values[0]), bool(values[1])),
        col_out=col_out, values_out=values_out, amax_out=amax_out, row_codes=values[0] != "only",
        col_codes=values[1] != "only", coefs=coefs)
    if block2d and vt is None and v is not None:
        vt = v.t()  # 2D: the columnwise copy is the exact transpose of the rowwise one (no extra pass)
    return d, s, am, dt, st, amt, v, vt


def covers_decode(data: torch.Tensor, rows: int, cols: int, sign_mask: int | None) -> bool:
    """Whether :func:`block_values` / :func:`dequantize` decode this packed tensor (non-empty, on
    a device the kernels run on, with a valid sign mask when the RHT is to be undone)."""
    return available(data.device) and rows * cols > 0 and sign_mask is not None


def block_values(data: torch.Tensor, scale: torch.Tensor, rows: int, cols: int, *,
                 block2d: bool = False) -> torch.Tensor:
    """``code × E4M3 block scale`` as BF16 ``[rows, cols]`` (exact): the operand an NVFP4 tensor
    core multiplies, without the per-tensor factor. ``data`` ``uint8 [rows, ceil(cols/2)]``,
    ``scale`` ``float8_e4m3fn`` (1x16 or 16x16 layout per ``block2d``). Call only where
    :func:`covers_decode` is true."""
    return _decode(data, scale, None, rows, cols, block2d, global_scale=False, mask=0)


def dequantize(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, rows: int, cols: int, *,
               block2d: bool = False, undo_rht_mask: int | None = None) -> torch.Tensor:
    """Decode to BF16 ``[rows, cols]``: ``RN(code · RN(RN(sf · amax) · RN(1/2688)))`` in FP32
    (``sf`` alone when ``amax`` is not finite), the inverse RHT with these signs (FP64 butterfly
    rounded to FP32) unless ``undo_rht_mask`` is ``None``, then RNE to BF16 — TE's
    ``dequantize_nvfp4.cuh`` order. Call only where :func:`covers_decode` is true."""
    return _decode(data, scale, amax, rows, cols, block2d, global_scale=True,
                   mask=undo_rht_mask, undo_rht=undo_rht_mask is not None)


def _decode(data, scale, amax, M, K, block2d, *, global_scale: bool, mask: int | None,
            undo_rht: bool = False) -> torch.Tensor:
    k = _kernels()
    out = torch.empty(M, K, dtype=torch.bfloat16, device=data.device)
    opts = options()
    config = opts.config
    if (opts.rows_kernel and not global_scale and not undo_rht and K % 16 == 0 and data.is_contiguous()
            and data.data_ptr() % 16 == 0):
        cfg = config["values"]
        BM, NB = cfg["BM"], cfg["NB"]
        _launch(k.block_values_rows_kernel, (_cdiv(M, BM), _cdiv(K // 16, NB)),
            data.view(torch.int32), scale.view(torch.uint8), out.view(torch.int16), M, K,
            K // 8, scale.stride(0), out.stride(0), BLOCK2D=block2d, BM=BM, NB=NB,
            num_warps=cfg["num_warps"])
        return out
    cfg = config["dequant"]
    BM, BK = cfg["BM"], cfg["BK"]
    amax_arg = out if amax is None else amax.reshape(1).to(torch.float32)  # unused pointer without GLOBAL
    _launch(k.dequantize_kernel, (_cdiv(M, BM), _cdiv(K, BK)),
        data, scale.view(torch.uint8), amax_arg, out.view(torch.int16),
        M, K, data.stride(0), scale.stride(0), out.stride(0), _INV2688,
        BLOCK2D=block2d, GLOBAL=global_scale, UNDO_RHT=undo_rht, SIGN_MASK=mask or 0, BM=BM, BK=BK,
        num_warps=cfg["num_warps"])
    return out


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ bᵀ`` of BF16 operands with FP32 accumulation and FP32 output."""
    if a.is_cuda:
        try:
            return torch.mm(a, b.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return a.float() @ b.float().t()


def covers_gemm(device_a: torch.device, device_b: torch.device, out_dtype: torch.dtype,
                bias: torch.Tensor | None) -> bool:
    """Whether :func:`gemm` runs this GEMM: both operands on one device the kernels run on, an
    FP32 or BF16 output, and a bias (if any) on that device."""
    return (device_a == device_b and available(device_a) and out_dtype in (torch.float32, torch.bfloat16)
            and (bias is None or bias.device == device_a))


def gemm(a_values: torch.Tensor, b_values: torch.Tensor, amax_a: torch.Tensor, amax_b: torch.Tensor,
         out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, coef: torch.Tensor | None = None) -> torch.Tensor:
    """The emulated NVFP4 GEMM ``cast(RN(RN(acc · alpha) + bias))`` from BF16 block values.

    ``a_values`` [M, K] and ``b_values`` [N, K] are the BF16 block values (``code × block
    scale``, exact in BF16), so a BF16 GEMM with FP32 accumulation computes the product up to
    FP32 accumulation order; ``alpha = RN(RN(amax_a · amax_b) / (6²·448²))`` (``amax_*``
    0-d float32) is applied in FP32, the ``bias`` [N] added in FP32 and the sum rounded once to
    ``out_dtype`` (float32 or bfloat16) — the order of the reference
    ``nvfp4lab.quantize.nvfp4_matmul``. Without a bias (and with ``options().cublas_alpha``)
    cuBLAS applies alpha itself, read from device memory (:mod:`nvfp4lab.kernels.cublas`);
    otherwise the GEMM writes FP32 and one epilogue kernel does the rest. Call only where
    :func:`covers_gemm` is true. ``out``: a contiguous [M, N] tensor of ``out_dtype`` to write the
    result into (what :mod:`nvfp4lab.cuda_graphs` replays into), or None for a new one. ``coef``:
    the float32 [2] (alpha, beta) of these amaxes already on the device (written by the quantize
    kernels, :func:`quantize_rowwise_columnwise`'s ``coefs``), for the cuBLAS path to read instead
    of computing them in a launch of its own; None to compute them.

    A fused GEMM reading the packed FP4 operands was not written: the emulation's GEMM is
    compute-bound (the BF16 tensor-core rate is its ceiling) and a Triton mixed-input GEMM would
    have to match cuBLAS's BF16 rate while decoding in its main loop.
    """
    am_a, am_b = amax_a.reshape(1).float(), amax_b.reshape(1).float()
    if options().cublas_alpha and bias is None and a_values.is_cuda:
        from . import cublas

        if cublas.available():
            if coef is None:
                coef = _launch_gemm_alpha(am_a, am_b, torch.empty(2, dtype=torch.float32, device=a_values.device))
            done = cublas.gemm_device_alpha(a_values, b_values, coef, out_dtype, out)
            if done is not None:
                return done
    acc = _mm_fp32(a_values, b_values)
    M, N = acc.shape
    if out is not None and (out.shape != (M, N) or out.dtype != out_dtype or not out.is_contiguous()):
        raise ValueError(f"gemm: out must be a contiguous [{M}, {N}] tensor of {out_dtype}, got "
                         f"{out.dtype} {tuple(out.shape)} with strides {out.stride()}")
    if out is None:
        out = acc if out_dtype == torch.float32 else torch.empty(M, N, dtype=out_dtype, device=acc.device)
    bf16 = out_dtype == torch.bfloat16
    bias_c = None if bias is None else bias.contiguous()
    BM, BN = 32, 128
    _launch(_kernels().gemm_epilogue_kernel, (_cdiv(M, BM), _cdiv(N, BN)),
        acc, am_a, am_b, acc if bias_c is None else bias_c,
        out.view(torch.int16) if bf16 else out, M, N, acc.stride(0), N, _GEMM_FACTOR,
        HAS_BIAS=bias is not None, OUT_BF16=bf16, BM=BM, BN=BN, num_warps=4)
    return out
