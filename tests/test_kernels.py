"""The Triton kernels of nvfp4lab.kernels, run by Triton's CPU interpreter, vs the reference.

``TRITON_INTERPRET=1`` must be set before Triton builds the kernels; this module sets it when
Triton has not been imported yet (run it in its own process, or first in the session:
``TRITON_INTERPRET=1 pytest tests/test_kernels.py``). Round-to-nearest results must be
bit-identical to :func:`nvfp4lab.quantize.quantize` (packed bytes, scale bytes, amax bits);
stochastic rounding is checked statistically. Shapes are small: the interpreter is numpy.
"""

import os
import sys
import warnings

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from nvfp4lab import kernels  # noqa: E402
from nvfp4lab.testing import assert_nvfp4_equal, rht_rounding_boundary_block
from nvfp4lab.formats import E2M1_VALUES, decode_e2m1  # noqa: E402
from nvfp4lab.hadamard import WGRAD_SIGNS  # noqa: E402
from nvfp4lab.rounding import SRStream  # noqa: E402
from nvfp4lab.linear import NVFP4GemmQuantizer  # noqa: E402
from nvfp4lab.quantize import (  # noqa: E402
    block_encode_scales, nvfp4_matmul, quantize, quantize_rowwise_columnwise, uses_kernels)

if not kernels.interpreter_mode():
    pytest.skip("Triton kernels were built for the GPU (set TRITON_INTERPRET=1 before importing triton)",
                allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy 1/0 = inf in the interpreter

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "te_golden.pt")


@pytest.fixture(autouse=True)
def _kernels_on_cpu(kernel_options):
    """Every test here runs the kernels on CPU tensors, in Triton's interpreter."""
    kernel_options(interpret_on_cpu=True)


def fast(x, **kw):
    """``quantize_ref(x, **kw)`` through the kernels (asserting that they cover these options)."""
    assert uses_kernels(x, **kw), kw
    return quantize(x, **kw)


def ref(fn, *args, **kw):
    """``fn(*args, **kw)`` with the kernels off: the PyTorch reference path."""
    with kernels.disabled():
        return fn(*args, **kw)


def quantize_ref(x, **kw):
    return ref(quantize, x, **kw)


def pair(x, *, block="1d", rht=False, rounding="nearest", generator=None, amax=None, amax_t=None,
         values=(False, False), fallback=False):
    """Both copies through :func:`quantize_rowwise_columnwise` (None where the kernels decline and
    ``fallback`` is False)."""
    row = dict(block=block, rounding=rounding, amax=amax)
    col = dict(block=block, rht=rht, rounding=rounding, amax=amax_t)
    return quantize_rowwise_columnwise(x, row, col, generator=generator, values=values, fallback=fallback)


def _x(shape, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# ----------------------------------------------------------------------------- numerics helpers
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nvfp4lab.kernels import triton_kernels as tk  # noqa: E402


@triton.jit
def _e4m3_probe(x_ptr, v_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    v, c = tk._e4m3_rne(tl.load(x_ptr + i))
    tl.store(v_ptr + i, v)
    tl.store(c_ptr + i, c)
    tl.store(x_ptr + i, tk._e4m3_decode(c))


@triton.jit
def _bf16_probe(x_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(x_ptr + i, tk._round_bf16(tl.load(x_ptr + i)))


@triton.jit
def _certain_max_probe(bits_ptr, ok_ptr):
    i = tl.program_id(0)
    bits, ok = tk._certain_bf16_max(tl.load(bits_ptr + i))
    tl.store(bits_ptr + i, bits)
    tl.store(ok_ptr + i, ok.to(tl.int32))


def test_fp32_first_rht_amax_certifies_only_what_it_can():
    """``_certain_bf16_max`` (the FP32-butterfly amax with an FP64 fallback): where it says ok, its
    BF16 value is torch's rounding of the max; within 64 FP32 ulps of a BF16 rounding boundary
    (inside the 2⁻¹⁸ error bound of the butterfly, with room) it never says ok, and 512 ulps or
    more away from one it always does; Inf, NaN, zero and maxima below 2⁻¹⁰⁰ go to the fallback."""
    g = torch.Generator().manual_seed(3)
    mid = (torch.randint(0x0E00, 0x7F00, (256,), generator=g, dtype=torch.int32) << 16) | 0x8000
    near = mid + torch.randint(-64, 65, (256,), generator=g, dtype=torch.int32)
    far = mid + torch.randint(512, 0x7FFF - 512, (256,), generator=g, dtype=torch.int32) * \
        torch.where(torch.rand(256, generator=g) < 0.5, -1, 1).int()
    special = torch.tensor([0x7F800000, 0x7FC00000, 0x7FFFFFFF, 0, 1, 0x0D000000, 0x0D7FFFFF], dtype=torch.int32)
    bits = torch.cat([near, far, special])
    ok = torch.empty_like(bits)
    out = bits.clone()
    _certain_max_probe[(bits.numel(),)](out, ok)
    n = near.numel()
    assert not ok[:n].any() and ok[n:2 * n].all() and not ok[2 * n:].any()
    want = bits[ok.bool()].view(torch.float32).to(torch.bfloat16).float().view(torch.int32)
    assert torch.equal(out[ok.bool()], want)


def test_e4m3_rounding_matches_torch():
    """The integer RNE to E4M3 (normal and subnormal) equals torch's float8_e4m3fn cast on [0, 448]."""
    g = torch.Generator().manual_seed(1)
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every E4M3 value 0..448
    mids = (grid[1:] + grid[:-1]) / 2
    ulp = lambda t, d: torch.nextafter(t, torch.full_like(t, d))  # noqa: E731
    vals = torch.cat([grid, mids, ulp(mids, 0.0), ulp(mids, 1e9), torch.rand(2**14, generator=g) * 448,
                      torch.rand(2**12, generator=g) * 0.02, torch.exp2(-torch.rand(2**12, generator=g) * 30)])
    vals = vals.clamp(0, 448)
    n = 1 << (vals.numel() - 1).bit_length()
    x = torch.zeros(n)
    x[: vals.numel()] = vals
    v, c, back = torch.empty(n), torch.empty(n, dtype=torch.int32), x.clone()
    _e4m3_probe[(1,)](back, v, c, N=n)
    ref = x.to(torch.float8_e4m3fn)
    assert torch.equal(v, ref.float())
    assert torch.equal(c, ref.view(torch.uint8).int())
    assert torch.equal(back, ref.float())  # decode(encode(s)) == float(e4m3(s))


def test_bf16_rounding_matches_torch():
    g = torch.Generator().manual_seed(2)
    b = torch.randint(0, 2**16, (4096,), generator=g, dtype=torch.int32)
    base = (b << 16).view(torch.float32)
    base = base[torch.isfinite(base)]
    x = torch.cat([base + base * 2**-9, base * (1 + 2**-8), base * (1 - 2**-8), torch.randn(2048, generator=g)])
    x = x[torch.isfinite(x)][:4096]
    x = torch.cat([x, torch.zeros(4096 - x.numel())])
    y = x.clone()
    _bf16_probe[(1,)](y, N=4096)
    assert torch.equal(y, x.to(torch.bfloat16).float())
    # NaNs, the GPU's canonical 0x7FFFFFFF among them, stay NaN (integer rounding alone gives -0.0)
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, 0x7F800001] * 4, dtype=torch.int32)
    y = nans.view(torch.float32).clone()
    _bf16_probe[(1,)](y, N=nans.numel())
    assert torch.equal(y.view(torch.int32), torch.full_like(nans, 0x7FC00000))


# ----------------------------------------------------------------------------- bit-exactness
SHAPES = [(128, 128), (64, 512), (256, 272), (32, 48), (17, 33), (3, 32, 48)]
CONFIGS = [("1d", False), ("2d", False), ("1d", True)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block,rht", CONFIGS, ids=["1d", "2d", "1d-rht"])
def test_quantize_fast_bit_exact(shape, dtype, block, rht):
    x = _x(shape, dtype)
    if rht and shape[-1] % 16:
        assert not uses_kernels(x, rht=True)  # the reference raises ValueError
        return
    assert_nvfp4_equal(fast(x, block=block, rht=rht), quantize_ref(x, block=block, rht=rht))


def test_float16_and_given_amax_and_signs():
    x = _x((32, 64), torch.float16)
    assert_nvfp4_equal(fast(x), quantize_ref(x))
    assert not uses_kernels(x, rht=True)  # fp16 + RHT: reference path
    y = _x((32, 64), torch.float32)
    for amax in (1.5, torch.tensor(20.0)):
        assert_nvfp4_equal(fast(y, amax=amax), quantize_ref(y, amax=amax))
    # a zero amax for non-zero values raises with the check (every element would decode to 0); unchecked,
    # the kernels still follow the reference's zero-amax numerics (global scale 1), bit for bit
    zero = torch.tensor([0.0])
    assert uses_kernels(y, amax=zero)
    assert_nvfp4_equal(quantize(y, amax=zero, check=False), quantize_ref(y, amax=zero, check=False))
    assert_nvfp4_equal(fast(y, rht=True, rht_signs=None), quantize_ref(y, rht=True, rht_signs=None))
    signs = torch.tensor([1.0, -1.0] * 8)
    assert_nvfp4_equal(fast(y, rht=True, rht_signs=signs), quantize_ref(y, rht=True, rht_signs=signs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_columnwise_rht_bit_exact_for_any_signs(dtype):
    """The 16-slice kernels' butterfly (the columnwise copy of ``x.t()`` and its amax pass) keeps
    the RHT's signs at compile time and applies the first one to every output with the final 1/4:
    bit-exact with the reference for no sign flips, all flipped, the first flipped (the outputs'
    common sign negative) and random signs, on data that holds a block at a BF16 rounding boundary
    (where the BF16 amax pass needs its FP64 fallback)."""
    g = torch.Generator().manual_seed(11)
    x = _x((64, 48), torch.float32, seed=12)
    x[16:32] = rht_rounding_boundary_block(g, columns=48).float()
    x = x.to(dtype)
    for signs in (torch.ones(16), -torch.ones(16), torch.tensor([-1.0, 1.0] * 8),
                  torch.where(torch.rand(16, generator=g) < 0.5, -1.0, 1.0)):
        assert_nvfp4_equal(fast(x.t(), rht=True, rht_signs=signs), quantize_ref(x.t(), rht=True, rht_signs=signs))


@pytest.mark.parametrize("block,rht", CONFIGS, ids=["1d", "2d", "1d-rht"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous(block, rht, dtype):
    base = _x((64, 96), dtype)
    views = [base.t(), base[:, ::2], base[::2], _x((4, 32, 48), dtype).permute(1, 0, 2)]
    for v in views:
        if rht and v.shape[-1] % 16:
            continue
        assert_nvfp4_equal(fast(v, block=block, rht=rht), quantize_ref(v, block=block, rht=rht))


@pytest.mark.parametrize("shape", [(64, 96), (48, 80), (3, 16, 48), (40, 24)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block,rht", CONFIGS, ids=["1d", "2d", "1d-rht"])
def test_fused_rowwise_columnwise(shape, dtype, block, rht):
    x = _x(shape, dtype, seed=3)
    x2 = x.reshape(-1, x.shape[-1])
    out = pair(x, block=block, rht=rht)
    if rht and x2.shape[0] % 16:
        assert out is None
        return
    row, col = out
    assert_nvfp4_equal(row, quantize_ref(x, block=block))
    assert_nvfp4_equal(col, quantize_ref(x2.t(), block=block, rht=rht))


def test_fused_given_amax_and_fallback():
    x = _x((32, 64), torch.bfloat16)
    assert pair(x, rht=True, amax=7.0, amax_t=torch.tensor(9.0)) is None  # a given amax: not fused
    row, col = pair(x, rht=True, amax=7.0, amax_t=torch.tensor(9.0), fallback=True)
    assert_nvfp4_equal(row, quantize_ref(x, amax=7.0))
    assert_nvfp4_equal(col, quantize_ref(x.t(), rht=True, amax=9.0))
    x64 = x.double()
    assert pair(x64) is None
    row, col = pair(x64, rht=True, fallback=True)
    assert_nvfp4_equal(row, quantize_ref(x64))
    assert_nvfp4_equal(col, quantize_ref(x64.t(), rht=True))


@pytest.mark.parametrize("block,rht", CONFIGS, ids=["1d", "2d", "1d-rht"])
def test_pair_writes_the_columnwise_copy_into_given_tensors(block, rht):
    """``col_out``: the kernels write the columnwise codes and scales into the caller's tensors and
    the amax is copied there, bit-equal to a pair made into new tensors; the reference path
    (kernels declining: float64) copies into them as well; tensors of the wrong shape, dtype or
    alignment, or ``col_out`` without a columnwise copy, are refused by name."""
    x = _x((48, 64), torch.bfloat16, seed=5)
    row = dict(block=block)
    col = dict(block=block, rht=rht)
    srows = 4 if block == "2d" else 64
    for xin, path_fallback in ((x, False), (x.double(), True)):
        fresh = quantize_rowwise_columnwise(xin, row, col, fallback=path_fallback)[1]
        out = (torch.full((64, 24), 0xAB, dtype=torch.uint8), torch.full((srows, 3), 0x7E, dtype=torch.uint8)
               .view(torch.float8_e4m3fn), torch.tensor(-1.0))
        q_row, q_col = quantize_rowwise_columnwise(xin, row, col, fallback=path_fallback, col_out=out)
        assert_nvfp4_equal(q_col, fresh)
        assert q_col.data is out[0] and q_col.scale.data_ptr() == out[1].data_ptr() and q_col.amax is out[2]
        assert torch.equal(out[2], fresh.amax)
    good = (torch.empty(64, 24, dtype=torch.uint8), torch.empty(srows, 3, dtype=torch.float8_e4m3fn),
            torch.tensor(0.0))
    for bad, what in (((torch.empty(64, 23, dtype=torch.uint8),) + good[1:], "codes"),
                      ((good[0], torch.empty(srows, 3, dtype=torch.float16)) + good[2:], "block scales"),
                      ((torch.empty(64 * 24 + 1, dtype=torch.uint8)[1:].view(64, 24),) + good[1:], "codes")):
        with pytest.raises(ValueError, match=what):
            quantize_rowwise_columnwise(x, row, col, col_out=bad)
    with pytest.raises(ValueError, match="amax"):
        quantize_rowwise_columnwise(x, row, col, col_out=good[:2] + (torch.tensor(0.0, dtype=torch.float64),))
    with pytest.raises(ValueError, match="col is None"):
        quantize_rowwise_columnwise(x, row, None, col_out=good)


@pytest.mark.parametrize("block,rht", CONFIGS, ids=["1d", "2d", "1d-rht"])
def test_pair_accumulates_its_amaxes_into_a_given_buffer(block, rht):
    """``amax_out``: the amax kernel accumulates into the caller's zeroed float32 [2] (rowwise amax at
    [0], the columnwise copy's at [1] after an RHT, else [0]); both copies' ``amax`` are views of it,
    a ``col_out`` amax that already is that view is not copied into, and the copies are bit-equal to
    a pair made with the kernels' own buffer. A buffer of another dtype or shape is refused by name."""
    x = _x((48, 64), torch.bfloat16, seed=7)
    row, col = dict(block=block), dict(block=block, rht=rht)
    fresh = quantize_rowwise_columnwise(x, row, col)
    buf = torch.zeros(4)[:2]
    column = 1 if rht else 0
    srows = 4 if block == "2d" else 64
    out = (torch.empty(64, 24, dtype=torch.uint8), torch.empty(srows, 3, dtype=torch.float8_e4m3fn), buf[column])
    q_row, q_col = quantize_rowwise_columnwise(x, row, col, col_out=out, amax_out=buf)
    assert_nvfp4_equal(q_row, fresh[0])
    assert_nvfp4_equal(q_col, fresh[1])
    assert q_row.amax.data_ptr() == buf.data_ptr() and q_col.amax.data_ptr() == buf[column].data_ptr()
    assert torch.equal(buf[0], fresh[0].amax) and torch.equal(buf[column], fresh[1].amax)
    for bad in (torch.zeros(2, dtype=torch.float64), torch.zeros(3)):
        with pytest.raises(ValueError, match="amax_out"):
            quantize_rowwise_columnwise(x, row, col, amax_out=bad)


@pytest.mark.parametrize("values", [(True, False), (False, False)], ids=["written", "decoded"])
def test_pair_writes_2d_values_into_a_given_tensor(values):
    """With 2D blocks ``col_out`` may carry a fourth tensor, ``bfloat16 [K, M]`` (the transpose of a
    contiguous ``[M, K]``): the columnwise copy's block values land there (the kernel writes them
    with ``values[0]``, else they are decoded into it; the reference path too), bit-equal to
    :meth:`block_values` of a pair made into new tensors, and both copies' ``values_bf16`` are views
    of it. 1D blocks, or a tensor laid out otherwise, are refused by name."""
    x = _x((48, 64), torch.bfloat16, seed=6)
    row = col = dict(block="2d")
    for xin, path_fallback in ((x, False), (x.double(), True)):
        fresh = quantize_rowwise_columnwise(xin, row, col, fallback=path_fallback)[1]
        vals = torch.full((48, 64), 7.0, dtype=torch.bfloat16).t()
        out = (torch.empty(64, 24, dtype=torch.uint8), torch.empty(4, 3, dtype=torch.float8_e4m3fn),
               torch.tensor(0.0), vals)
        q_row, q_col = quantize_rowwise_columnwise(xin, row, col, fallback=path_fallback, values=values, col_out=out)
        assert torch.equal(vals, fresh.block_values(torch.bfloat16))
        assert q_col.values_bf16.data_ptr() == q_row.values_bf16.data_ptr() == vals.data_ptr()
        assert torch.equal(q_row.values_bf16, vals.t())
        assert_nvfp4_equal(q_col, fresh)
    good = out[:3]
    for bad_row, bad_vals in ((dict(block="1d"), torch.empty(48, 64, dtype=torch.bfloat16).t()),
                              (row, torch.empty(64, 48, dtype=torch.bfloat16))):
        with pytest.raises(ValueError, match="values"):
            quantize_rowwise_columnwise(x, bad_row, dict(block=bad_row["block"]), col_out=good + (bad_vals,))
    with pytest.raises(ValueError, match="values_out"):
        quantize_rowwise_columnwise(x, row, col, values=(True, False),
                                    col_out=good + (torch.empty(48, 64, dtype=torch.float32).t(),))


def test_golden_special_inputs():
    """TE golden inputs (zeros, finfo.max, ±inf, ties, boundary, denormal block, tiny amax, 3-D)."""
    inputs = torch.load(FIXTURE, weights_only=True)["inputs"]
    names = ["zeros_128x128_bf16", "max_128x128_fp32", "inf_32x64_fp32", "inf_32x64_bf16",
             "ties_16x64_fp32", "boundary_16x128_fp32", "denormal_block_32x64_fp32",
             "tiny_amax_32x64_fp32", "lognormal_rows_64x128_fp32", "three_d_4x32x64_bf16"]
    for name in names:
        x = inputs[name]
        x2 = x.reshape(-1, x.shape[-1])
        for block, rht in CONFIGS:
            assert_nvfp4_equal(fast(x, block=block, rht=rht), quantize_ref(x, block=block, rht=rht))
        if x2.shape[0] % 16 == 0:  # columnwise (16-slice kernel) with the RHT
            assert_nvfp4_equal(fast(x2.t(), rht=True), quantize_ref(x2.t(), rht=True))


def test_negative_zero_and_underflowed_scale():
    x = torch.zeros(16, 32)
    x[0, 0] = -0.0
    x[1, :16] = 1e-3  # block scale underflows to 0 next to a large block: codes ±6, scale 0
    x[1, 16] = 1e4
    x[2, :16] = -1e-3
    assert_nvfp4_equal(fast(x), quantize_ref(x))
    assert int(fast(x).data[0, 0]) == 0  # exact -0.0 -> code 0, as TE's reference


# ----------------------------------------------------------------------------- decode and GEMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block,rht", CONFIGS, ids=["1d", "2d", "1d-rht"])
def test_dequantize_and_block_values(dtype, block, rht):
    for x in (_x((48, 80), dtype), _x((17, 40), dtype), torch.load(FIXTURE, weights_only=True)["inputs"]["inf_32x64_bf16"]):
        if rht and x.shape[-1] % 16:
            continue
        q = quantize_ref(x, block=block, rht=rht)
        assert torch.equal(q.dequantize(torch.bfloat16), ref(q.dequantize, torch.bfloat16))
        assert torch.equal(q.dequantize(torch.bfloat16, undo_rht=False),
                           ref(q.dequantize, torch.bfloat16, undo_rht=False))
        assert torch.equal(q.block_values(torch.bfloat16), ref(q.block_values, torch.bfloat16))


def test_matmul_fast_equals_reference_on_cpu():
    a = quantize_ref(_x((48, 64), torch.bfloat16, seed=5))
    b = quantize_ref(_x((32, 64), torch.float32, seed=6), block="2d")
    assert torch.equal(nvfp4_matmul(a, b), ref(nvfp4_matmul, a, b))
    with pytest.raises(ValueError):
        nvfp4_matmul(a, quantize_ref(_x((32, 48), torch.float32)))


def test_gemm_quantizer_in_nvfp4linear():
    linear = pytest.importorskip("nvfp4lab.linear")
    from nvfp4lab.recipe import NVFP4Recipe

    recipe = NVFP4Recipe(disable_stochastic_rounding=True)
    torch.manual_seed(0)
    ref = linear.NVFP4Linear(64, 48, recipe=recipe, quantizer=ReferenceQuantizer())
    fast = linear.NVFP4Linear.from_linear(ref, recipe=recipe)
    x = _x((2, 16, 64), torch.float32, seed=7).requires_grad_()
    y_ref = ref(x)
    y_ref.square().sum().backward()
    g_ref = (x.grad.clone(), ref.weight.grad.clone(), ref.bias.grad.clone())
    x.grad = None
    ref.weight.grad = ref.bias.grad = None
    y = fast(x)
    y.square().sum().backward()
    assert torch.equal(y, y_ref)
    for a, b in zip((x.grad, fast.weight.grad, fast.bias.grad), g_ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(48, 64), (17, 256), (3, 5, 32)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_block_per_thread_kernels_equal_tile_kernels(kernel_options, shape, dtype):
    """quantize_rows_kernel / block_values_rows_kernel (options().rows_kernel) give the tile kernels' bytes,
    RNE and SR alike (same Philox counters, so the same stochastic draws)."""
    x = _x(shape, dtype, seed=16)
    outs = []
    for rows_kernel in (True, False):
        kernel_options(rows_kernel=rows_kernel)
        g = torch.Generator().manual_seed(3)
        q2 = quantize_ref(x, block="2d")
        outs.append((fast(x), fast(x, rounding="stochastic", generator=g),
                     q2.block_values(torch.bfloat16), quantize_ref(x).block_values(torch.bfloat16)))
    (rne, sr, bv2, bv1), (rne_t, sr_t, bv2_t, bv1_t) = outs
    assert_nvfp4_equal(rne, quantize_ref(x))
    assert_nvfp4_equal(rne, rne_t)
    assert_nvfp4_equal(sr, sr_t)
    assert torch.equal(bv2, bv2_t) and torch.equal(bv1, bv1_t)


@pytest.mark.parametrize("special", ["none", "nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_kernel_observes_max_abs_with_a_given_amax(special, dtype):
    """OBSERVE (quantize's check with a given amax): the rows kernel also writes max |x| (NaN
    propagated, Inf kept) to its observation slot, and without NaN its codes and scales are those
    of the kernel without OBSERVE."""
    x = _x((48, 256), dtype, seed=23)
    if special != "none":
        x[7, 100] = float(special)
    x2, a = x.reshape(-1, x.shape[-1]), torch.tensor(3.0)
    out = []
    for observe in (False, True):
        d = torch.empty(48, 128, dtype=torch.uint8)
        s = torch.empty(48, 16, dtype=torch.uint8)
        obs = torch.zeros(2)
        kernels._launch_rows(x2, kernels._rows_args(x2, a, obs, d, s, obs, obs), kernels.options().config,
                             sr=False, values=False, after_amax=False, i64=False, observe=observe)
        out.append((d, s, obs[0]))
    (d0, s0, unobserved), (d1, s1, seen) = out
    assert unobserved == 0   # without OBSERVE the slot is not written
    if special == "nan":
        assert torch.isnan(seen)
    else:
        assert seen == x2.float().abs().max()   # exact: a max, with +Inf for either infinity
        assert torch.equal(d0, d1) and torch.equal(s0, s1)


@pytest.mark.parametrize("shape", [(64, 64), (32, 48), (48, 256)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", [dict(), dict(rht=True), dict(block="2d"), dict(rht=True, rounding="stochastic")],
                         ids=["1d", "1d-rht", "2d", "1d-rht-sr"])
def test_kernels_write_block_values_with_the_codes(shape, dtype, kw):
    """values=(True, True): both copies carry BF16 block values equal to block_values() of their own
    codes, block_values_bf16 returns that cache, and the codes are those written without it."""
    x = _x(shape, dtype, seed=17)
    row, col = pair(x, values=(True, True), **kw)
    for q in (row, col):
        assert q.values_bf16 is not None and q.values_bf16.dtype == torch.bfloat16
        assert torch.equal(q.values_bf16, q.block_values(torch.bfloat16))
        assert q.block_values(torch.bfloat16) is q.values_bf16
    if kw.get("block") == "2d":  # rowwise values only: the columnwise copy gets their transpose
        row1, col1 = pair(x, values=(True, False), **kw)
        assert torch.equal(col1.values_bf16, col1.block_values(torch.bfloat16))
        assert col1.values_bf16.data_ptr() == row1.values_bf16.data_ptr()
    if kw.get("rounding") != "stochastic":
        row0, col0 = pair(x, **kw)
        assert_nvfp4_equal(row, row0)
        assert_nvfp4_equal(col, col0)
        assert row0.values_bf16 is None and col0.values_bf16 is None


def _with_specials(x):
    """``x`` with the values the float-domain decode must get right: -0.0 (a +0 code), all-zero
    and all -0.0 blocks (scale 0), TE's rounding thresholds and a block that underflows."""
    x = x.clone()
    x[::7, ::5] = -0.0
    x[1, :16] = 0.0
    x[2, 16:32] = -0.0
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[3, :16] = torch.cat([t, -t]).to(x.dtype)
    x[4, :] *= 1e-30
    return x


@pytest.mark.parametrize("shape", [(64, 256), (48, 96), (32, 48)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", [dict(), dict(rht=True), dict(rht=True, rounding="stochastic")],
                         ids=["1d", "1d-rht", "1d-rht-sr"])
def test_values_only_copies(shape, dtype, kw):
    """values=("only", "only"): both copies hold their BF16 block values alone (no codes, no
    scales), bit-identical to the values written with the codes (the same generator state for SR)
    and to block_values() of those codes; the GEMMs are unchanged; what needs the codes raises."""
    x = _with_specials(_x(shape, dtype, seed=23))
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    row, col = pair(x, values=(True, True), generator=g1, **kw)
    row_v, col_v = pair(x, values=("only", "only"), generator=g2, **kw)
    for q, q_v in ((row, row_v), (col, col_v)):
        assert q_v.data is None and q_v.scale is None
        assert torch.equal(q_v.values_bf16.view(torch.int16), q.values_bf16.view(torch.int16))
        with kernels.disabled():
            assert torch.equal(q_v.values_bf16.view(torch.int16), q.block_values(torch.bfloat16).view(torch.int16))
        assert torch.equal(q_v.amax, q.amax) and q_v.device == q.device
        assert q_v.rht == q.rht and q_v.shape == q.shape
        assert torch.equal(q_v.block_values(torch.float32), q.block_values(torch.float32))
        for call in (q_v.codes, q_v.dequantize, lambda: q_v.rowwise_scale):
            with pytest.raises(ValueError, match="holds only its BF16 block values"):
                call()
        repr(q_v)
    w = fast(_x((40, shape[1]), torch.float32, seed=24), block="2d")
    assert torch.equal(nvfp4_matmul(row_v, w, out_dtype=torch.bfloat16), nvfp4_matmul(row, w, out_dtype=torch.bfloat16))
    _, xt = pair(_x((40, shape[0]), torch.float32, seed=26).t().contiguous(), rht=kw.get("rht", False))
    assert torch.equal(nvfp4_matmul(col_v, xt), nvfp4_matmul(col, xt))   # a Wgrad GEMM


def test_slices_pattern_probe_writes_the_transpose():
    """``benchmarks/slices_parts.py``'s probe, the 16-slice kernel's loads and its values'
    transposed stores (the kernel's own helpers) without arithmetic, writes exactly xᵀ: whole and
    partial tiles; other shapes raise."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.slices_parts import transpose_by_pattern
    for M, K, cfg in [(64, 128, dict(G=4, BK=64, num_warps=4)), (48, 80, dict(G=2, BK=32, num_warps=2))]:
        x = torch.randn(M, K).to(torch.bfloat16)
        vt = torch.full((K, M), float("nan"), dtype=torch.bfloat16)
        transpose_by_pattern(x, vt, cfg)
        assert torch.equal(vt.view(torch.int16), x.t().contiguous().view(torch.int16)), (M, K, cfg)
    with pytest.raises(ValueError, match="M % 16"):
        transpose_by_pattern(torch.zeros(40, 32, dtype=torch.bfloat16), torch.zeros(32, 40, dtype=torch.bfloat16),
                             dict(G=1, BK=32, num_warps=1))


def test_values_only_falls_back_to_codes_and_checks_its_argument():
    """Where the kernel that makes a copy writes codes anyway (2D blocks; a columnwise copy with
    M % 16 != 0, made by the tile kernel), "only" is True; a values argument that is not a pair of
    False / True / "only" is refused by name."""
    x = _x((32, 64), torch.float32, seed=25)
    row, _ = pair(x, values=("only", False), block="2d")
    assert row.data is not None and torch.equal(row.values_bf16, row.block_values(torch.bfloat16))
    _, col = pair(_x((40, 64), torch.float32, seed=25), values=(False, "only"))
    assert col.data is not None
    for bad in (("yes", False), (True,), "only"):
        with pytest.raises(ValueError, match="values must be a pair of False, True or 'only'"):
            pair(x, values=bad)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_matmul_fast_epilogue_bias_and_cast(out_dtype):
    a = quantize_ref(_x((48, 64), torch.bfloat16, seed=8))
    b = quantize_ref(_x((40, 64), torch.float32, seed=9), block="2d")
    bias = _x((40,), torch.float32, seed=10)
    for bb in (None, bias, bias.to(torch.bfloat16)):
        got = nvfp4_matmul(a, b, out_dtype=out_dtype, bias=bb)
        assert got.dtype == out_dtype
        want = ref(nvfp4_matmul, a, b, out_dtype=out_dtype, bias=bb)
        assert torch.equal(got, want)
        for fn in (nvfp4_matmul, lambda *a, **k: ref(nvfp4_matmul, *a, **k)):   # out=: the same bits, in place
            out = torch.full((48, 40), float("nan"), dtype=out_dtype)
            assert fn(a, b, out_dtype=out_dtype, bias=bb, out=out) is out
            assert torch.equal(out, want)
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \[N\] = \[40\]"):
        nvfp4_matmul(a, b, bias=torch.zeros(41))
    with pytest.raises(ValueError, match=r"out must be a contiguous \[48, 40\] tensor"):
        nvfp4_matmul(a, b, out_dtype=out_dtype, out=torch.empty(40, 48, dtype=out_dtype))


def test_amax_pass_propagates_nan():
    x = _x((32, 64), torch.bfloat16, seed=11)
    x[3, 5] = float("nan")
    q = fast(x, check=False)
    assert torch.isnan(q.amax)
    with pytest.raises(ValueError, match="NaN"):
        fast(x)  # checked: one read of the amax
    row, col = pair(x, rht=True)
    assert torch.isnan(row.amax) and torch.isnan(col.amax)
    # and through the GEMM's per-tensor factor, every output
    w = quantize_ref(_x((16, 64), torch.float32, seed=12), block="2d")
    assert torch.isnan(nvfp4_matmul(row, w)).all()


class ReferenceQuantizer(NVFP4GemmQuantizer):
    """The default quantizer with the kernels off: the layer's reference path."""

    def quantize(self, x, **options):
        return ref(super().quantize, x, **options)

    def quantize_pair(self, *args, **kwargs):
        return None

    def matmul(self, a, b, **kwargs):
        return ref(super().matmul, a, b, **kwargs)


def _fast_and_reference_layers(recipe, dtype_w=torch.float32):
    linear = pytest.importorskip("nvfp4lab.linear")
    torch.manual_seed(0)
    ref_layer = linear.NVFP4Linear(64, 48, recipe=recipe, dtype=dtype_w, quantizer=ReferenceQuantizer())
    fast_layer = linear.NVFP4Linear.from_linear(ref_layer, recipe=recipe)  # the default quantizer
    return ref_layer, fast_layer


@pytest.mark.parametrize("M, dtype, two_d", [(32, torch.bfloat16, True), (48, torch.float32, False),
                                             (24, torch.bfloat16, True)])
def test_nvfp4linear_fused_pair_path_equals_reference(fused_pair_calls, M, dtype, two_d):
    """NVFP4Linear through quantize_pair (X, W, dY each read once for both copies) gives the
    reference path's Y, dX, dW, db bit for bit (RNE); with M % 16 != 0 it declines the pair
    (the RHT needs whole 16-token chunks) and quantizes operand by operand."""
    from nvfp4lab.recipe import NVFP4Recipe

    recipe = NVFP4Recipe(disable_stochastic_rounding=True, disable_2d_quantization=not two_d)
    ref, fast = _fast_and_reference_layers(recipe)
    calls = fused_pair_calls
    x = _x((M, 64), dtype, seed=13).requires_grad_()
    out = []
    for layer in (ref, fast):
        x.grad = None
        layer.weight.grad = layer.bias.grad = None
        y = layer(x)
        y.float().square().sum().backward()
        out.append((y, x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()))
    for a, b in zip(*out):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert sum(calls) == (3 if M % 16 == 0 else 0)  # X, W, dY each read once for both copies


@pytest.mark.parametrize("two_d", [True, False], ids=["2d", "1d"])
def test_packed_forward_buffer_is_the_same_written_by_the_kernels_or_copied(fused_pair_calls, two_d):
    """The custom op's saved buffer (Xᵀ and Wᵀ codes, scales, amaxes): written straight into by the
    kernels, it holds the same bytes as when the reference path's copies are copied in (padding
    bytes zero in both), and Y is the same."""
    from nvfp4lab.recipe import NVFP4Recipe

    recipe = NVFP4Recipe(disable_stochastic_rounding=True, disable_2d_quantization=not two_d)
    _, fast = _fast_and_reference_layers(recipe)
    x = _x((32, 64), torch.bfloat16, seed=21)
    args = (x, fast.weight, fast.bias, fast._state.key, fast._state.saved_code, True, True)
    y, saved = torch.ops.nvfp4lab.linear_fprop(*args)
    assert len(fused_pair_calls) == 2   # X and W each through the pair kernels (the direct writes)
    with kernels.disabled():
        y_ref, saved_ref = torch.ops.nvfp4lab.linear_fprop(*args)
    assert torch.equal(y, y_ref) and torch.equal(saved, saved_ref)


def test_nvfp4linear_fused_path_nan_gives_nan_without_scanning(monkeypatch):
    from nvfp4lab.recipe import NVFP4Recipe

    _, fast = _fast_and_reference_layers(NVFP4Recipe())
    monkeypatch.setattr(torch, "isnan", lambda *a: pytest.fail("the fused path must not scan for NaN"))
    x = _x((32, 64), torch.bfloat16, seed=14)
    x[0, 0] = float("nan")
    x.requires_grad_()
    y = fast(x)
    y.float().sum().backward()
    monkeypatch.undo()
    assert torch.isnan(y).all() and torch.isnan(fast.weight.grad).all()


def test_nvfp4linear_fused_path_records_operands():
    """capture_gemm_operands on the fused path: every RNE operand equals quantize_ref(source)."""
    from nvfp4lab.linear import capture_gemm_operands
    from nvfp4lab.recipe import NVFP4Recipe

    _, fast = _fast_and_reference_layers(NVFP4Recipe(disable_stochastic_rounding=True))
    x = _x((32, 64), torch.bfloat16, seed=15).requires_grad_()
    with capture_gemm_operands() as ops:
        fast(x).float().square().sum().backward()
    assert sorted((o.gemm, o.operand) for o in ops) == sorted(
        [("fprop", "x"), ("wgrad", "xt"), ("fprop", "w"), ("dgrad", "wt"), ("dgrad", "dy"), ("wgrad", "dyt")])
    for o in ops:
        assert_nvfp4_equal(o.tensor, quantize_ref(o.source, **o.options))


# ----------------------------------------------------------------------------- stochastic rounding
def _sr_check(codes, y, n_draws):
    """codes [n_draws, *y.shape] E2M1 codes drawn for the scaled values y (fp32, in E2M1 units)."""
    yc = y.clamp(-6, 6)
    a = yc.abs()
    grid = E2M1_VALUES
    lo_i = torch.searchsorted(grid, a, right=True) - 1
    lo, hi = grid[lo_i], grid[(lo_i + 1).clamp(max=7)]
    vals = decode_e2m1(codes)
    mag = vals.abs()
    # 1. every code is one of the two bracketing grid points, with y's sign (-0 for small negatives)
    assert bool(((mag == lo) | (mag == hi)).all())
    assert bool((((codes & 8) != 0) == (yc < 0)).all())
    # 2. unbiased: ups ~ Binomial(n, p) per element; chi-square over elements with 0 < p < 1
    gap = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    p = torch.where(hi > lo, (a - lo) / gap, torch.zeros_like(a))
    ups = (mag == hi).double().sum(0) * (hi > lo)
    live = (p > 0) & (p < 1)
    var = n_draws * p * (1 - p)
    chi2 = (((ups - n_draws * p) ** 2)[live] / var[live]).sum()
    d = int(live.sum())
    assert d > 100
    # chi2 ~ d ± sqrt(2d): a 6-sigma band (false-failure probability ~1e-9 in the normal limit)
    assert abs(float(chi2) - d) < 6 * (2 * d) ** 0.5, (float(chi2), d)
    # the mean of the draws converges to y: overall z-score of the summed deviation
    z = float((ups - n_draws * p)[live].sum() / var[live].sum().sqrt())
    assert abs(z) < 5, z
    return float(chi2), d, z


def test_sr_rowwise_statistics(kernel_options):
    n = 64
    x = _x((16, 64), torch.bfloat16, seed=11)
    xr = x.repeat(n, 1)  # n copies of the same rows: same global amax and block scales
    # One program per kernel: the interpreter's cost is per program (256 by default here: 80 s),
    # and the draws do not depend on the tile (Philox counters by element; see
    # test_one_block_per_thread_kernels_equal_tile_kernels).
    kernel_options(config={"rows_narrow": dict(BM=1024, NB=4, num_warps=4), "amax": dict(BM=1024, BK=64, num_warps=4)})
    gen = torch.Generator().manual_seed(0)
    q = fast(xr, rounding="stochastic", generator=gen)
    ref = quantize_ref(xr, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8)) and torch.equal(q.amax, ref.amax)
    y = x.float().view(16, 4, 16) * block_encode_scales(q.scale[:16], q.amax)[:, :, None]
    _sr_check(q.codes().view(n, 16, 64), y.view(16, 64), n)
    _sr_check(ref.codes().view(n, 16, 64), y.view(16, 64), n)  # the reference passes the same test
    # reproducible from the generator state; a second draw differs
    again = fast(xr, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.data, q.data)
    other = fast(xr, rounding="stochastic", generator=gen)
    assert not torch.equal(other.data, q.data)


def test_sr_stream_keys_are_read_in_place_and_advanced_once_per_quantization():
    """With an SRStream the kernels read the next keys in place and the stream advances once per
    quantization (rowwise and columnwise copies share one call's two keys): call c of a stream
    equals call 0 of a stream restored to counter c, and the counter counts the calls."""
    x = _x((32, 64), torch.bfloat16, seed=5)
    s = SRStream(3)
    first = fast(x, rounding="stochastic", generator=s)
    second = fast(x, rounding="stochastic", generator=s)
    r1, c1 = pair(x, rht=True, rounding="stochastic", generator=s)
    key, counter = s.get_state().tolist()
    assert counter == 3
    assert not torch.equal(first.data, second.data)
    assert_nvfp4_equal(fast(x, rounding="stochastic", generator=SRStream(3)), first)
    restored = SRStream(0).set_state(torch.tensor([key, 1]))
    assert_nvfp4_equal(fast(x, rounding="stochastic", generator=restored), second)
    r2, c2 = pair(x, rht=True, rounding="stochastic", generator=SRStream(0).set_state(torch.tensor([key, 2])))
    assert_nvfp4_equal(r1, r2)
    assert_nvfp4_equal(c1, c2)


def test_sr_fused_columnwise_rht_statistics(kernel_options):
    n = 64
    x = _x((32, 16), torch.bfloat16, seed=12)  # M=32 tokens, K=16 features
    xr = x.repeat(1, n)  # n copies of each feature column: columnwise rows repeat
    kernel_options(config={"slices_both": dict(G=2, BK=1024, num_warps=4)})  # one program
    row, col = pair(xr, rht=True, rounding="stochastic",
                                                          generator=torch.Generator().manual_seed(1),
                                                          fallback=False)
    ref_col = quantize_ref(xr.t(), rht=True)
    assert torch.equal(col.scale.view(torch.uint8), ref_col.scale.view(torch.uint8))
    assert torch.equal(col.amax, ref_col.amax)
    from nvfp4lab.hadamard import random_hadamard_transform

    xt = random_hadamard_transform(x.t().contiguous()).float()  # [16, 32]
    y = xt.view(16, 2, 16) * block_encode_scales(col.scale[:16], col.amax)[:, :, None]
    _sr_check(col.codes().view(n, 16, 32), y.view(16, 32), n)
    ref_row = quantize_ref(xr)
    assert torch.equal(row.scale.view(torch.uint8), ref_row.scale.view(torch.uint8))
    yr = (x.float().view(32, 1, 16) * block_encode_scales(row.scale.view(torch.uint8)[:, :1].view(torch.float8_e4m3fn),
                                                          row.amax)[:, :, None]).view(32, 16)
    _sr_check(row.codes().view(32, n, 16).transpose(0, 1), yr, n)


# ----------------------------------------------------------------------------- dispatch
def test_dispatch_takes_the_kernels_only_where_they_apply():
    """uses_kernels (the one decision, in nvfp4lab.quantize) says no where the kernels do not
    cover the call, and quantize() then still answers, from the reference."""
    x = _x((32, 48), torch.float32)
    assert not uses_kernels(x.double())
    assert not uses_kernels(torch.tensor(1.0))
    assert not uses_kernels(torch.empty(0, 16))
    assert not uses_kernels(_x((32, 40), torch.float32), rht=True)  # K % 16
    assert not uses_kernels(x[0], block="2d")
    assert not uses_kernels(x, block="3d")
    assert not uses_kernels(_x((32, 64), torch.float32), rht=True, rht_signs=torch.ones(8))
    assert not uses_kernels(torch.zeros(4, 16, dtype=torch.int32))
    assert uses_kernels(x) and kernels.available("cpu")
    with kernels.disabled():
        assert not uses_kernels(x) and not kernels.available("cpu")
    with kernels.use_options(interpret_on_cpu=False):
        assert not uses_kernels(x)  # the default outside these tests: CPU runs the reference
    assert_nvfp4_equal(quantize(x.double()), quantize_ref(x.double()))
    y = _x((32, 64), torch.float32)
    assert_nvfp4_equal(quantize(y, rht=True, rht_signs=torch.ones(16) * torch.tensor([1.0, -1.0]).repeat(8)),
                       quantize_ref(y, rht=True, rht_signs=torch.tensor([1.0, -1.0] * 8)))
    with pytest.raises(ValueError, match="amax must be a finite, non-negative number"):
        quantize(x, amax=-1.0)


def test_rht_fp32_butterfly_mode_is_close_for_bf16():
    """rht_f64=False: float32 butterfly; bit-exact for ordinary bf16 data, documented otherwise."""
    x = _x((64, 128), torch.bfloat16, seed=9)
    with kernels.use_options(rht_f64=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = fast(x, rht=True)
    assert kernels.options().rht_f64          # restored
    assert_nvfp4_equal(q, quantize_ref(x, rht=True))


@triton.jit
def _e2m1_probe(y_ptr, c_ptr, c2_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    y = tl.load(y_ptr + i)
    tl.store(c_ptr + i, tk._e2m1_rne_fast(y))
    tl.store(c2_ptr + i, tk._e2m1_rne(tk._clamp6(y)))


def test_e2m1_fast_encoder_matches_thresholds():
    """The min-of-three-candidates encoder equals TE's thresholds: grid points, midpoints (ties)
    and their float32 neighbours, both signs, -0.0, values that round to ±0, beyond ±6 and ±inf
    (saturating), denormals. (Every float32 in [0, 6] was checked once with numpy; here, the
    kernel helper itself in Triton's interpreter.)"""
    from nvfp4lab.formats import encode_e2m1

    grid = E2M1_VALUES
    pts = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([6.5, 7.0, 12.0, 1e30])])
    pts = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, -1.0)), torch.nextafter(pts, torch.full_like(pts, 7.0))])
    tiny = torch.tensor([1e-30, 1e-40, 1.4e-45, 0.1, 0.2499999])
    y = torch.cat([pts, -pts, tiny, -tiny, torch.rand(4000, generator=torch.Generator().manual_seed(3)) * 24 - 12,
                   torch.tensor([-0.0, 0.0, float("inf"), float("-inf")])])
    k = y.numel()
    n = 1 << (k - 1).bit_length()
    y = torch.cat([y, torch.zeros(n - y.numel())])
    c, c2 = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    _e2m1_probe[(1,)](y, c, c2, N=n)
    ref = encode_e2m1(y).int()
    assert torch.equal(c2, ref)
    assert torch.equal(c, ref)
    assert c[k - 4:k].tolist() == [0, 0, 7, 15]  # -0.0, +0.0: code 0; ±inf saturate to ±6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
def test_fused_single_kernel_mode(kernel_options, dtype, rht):
    """fuse_row_col=True: one 16-slice kernel writes both copies (bit-identical too)."""
    kernel_options(fuse_row_col=True)
    x = _x((48, 80), dtype, seed=4)
    row, col = pair(x, rht=rht)
    assert_nvfp4_equal(row, quantize_ref(x))
    assert_nvfp4_equal(col, quantize_ref(x.t(), rht=rht))
    n = 32
    xr = _x((32, 16), dtype, seed=5).repeat(1, n)
    kernel_options(config={"slices_both": dict(G=2, BK=512, num_warps=4)})
    row, col = pair(xr, rht=rht, rounding="stochastic")
    ref = quantize_ref(xr.t(), rht=rht)
    assert torch.equal(col.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    src = quantize_ref(xr.t(), rht=rht)  # same scales; the scaled values y follow from the reference
    from nvfp4lab.hadamard import random_hadamard_transform

    xt = xr.t().contiguous()
    xt = (random_hadamard_transform(xt) if rht else xt).float()
    y = xt.view(16 * n, 2, 16) * block_encode_scales(src.scale, src.amax)[:, :, None]
    _sr_check(col.codes().view(n, 16, 32), y.view(n, 16, 32)[0], n)


@pytest.mark.parametrize("amax_given", [False, True], ids=["amax_pass", "amax_given"])
def test_second_read_order_changes_no_bit(amax_given):
    """alternate_reads (the columnwise kernel of a split pair reads its tiles in the order opposite
    to the rowwise kernel's) against both in one order, through the kernels' own pair function: the
    same codes, scales, amaxes and BF16 values, RNE with the RHT (the forward's X pair) and SR with
    values only (the backward's dY pair), after the amax kernel and with the amaxes given. Shape
    96 x 80: several tiles of each kernel, some partial, so that the two orders differ."""
    from nvfp4lab.hadamard import random_hadamard_transform

    x = _x((96, 80), torch.bfloat16, seed=11)
    a = x.float().abs().amax() if amax_given else None
    at = random_hadamard_transform(x.t().contiguous()).float().abs().amax() if amax_given else None
    out = {}
    for alt in (True, False):
        with kernels.use_options(alternate_reads=alt):
            out[alt] = (*kernels.quantize_rowwise_columnwise(x, rht=True, sign_mask=kernels.sign_mask(WGRAD_SIGNS), amax=a,
                                                              amax_t=at, values=("only", False)),
                        *kernels.quantize_rowwise_columnwise(x, rht=True, sr=True, sign_mask=kernels.sign_mask(WGRAD_SIGNS),
                                                              generator=SRStream(7, device="cpu"), amax=a, amax_t=at,
                                                              values=("only", "only")))
    present = [t is not None for t in out[True]]
    assert present == [t is not None for t in out[False]]
    # X: rowwise amax and values; columnwise codes, scales and amax. dY: the amaxes and both values
    assert sum(present) == 9
    for t, u in zip(out[True], out[False]):
        if t is not None:
            assert torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8))


@triton.jit
def _sr_probe(y_ptr, c_ptr, u_ptr, NY: tl.constexpr, SHIFT: tl.constexpr):
    iy = tl.arange(0, NY)
    k = tl.arange(0, 256)
    u = tk._sr_byte_offsets(k << SHIFT, SHIFT // 8)  # the byte in lane SHIFT / 8 of a random word
    y = tl.load(y_ptr + iy)
    c = tk._e2m1_sr_fast(y[:, None], u[None, :])
    tl.store(c_ptr + iy[:, None] * 256 + k[None, :], c)
    tl.store(u_ptr + k, u)


def test_sr_encoder_probabilities_over_all_random_bytes():
    """Over all 256 values of a draw's byte (in each lane of the random word), the offset uniform
    is exactly (k + 1/2)/256 - 1/2 + 2^-16, every code brackets y with y's sign, grid points never
    move, and the fraction rounding up is p = (|y| - lo) / step to within 2^-9 + 2^-16."""
    g = torch.Generator().manual_seed(8)
    y = torch.cat([torch.rand(16, generator=g) * 12 - 6,
                   torch.tensor([0.0, -0.0, 6.0, -6.0, 1.0, 0.3, 5.0, -2.75, 9.0, float("-inf")]),
                   torch.rand(6, generator=g) * 0.5 - 0.25])
    a = y.abs().clamp(max=6)
    grid = E2M1_VALUES
    lo_i = torch.searchsorted(grid, a, right=True) - 1
    lo, hi = grid[lo_i], grid[(lo_i + 1).clamp(max=7)]
    p = torch.where(hi > lo, (a - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi)), torch.zeros_like(a))
    k = torch.arange(256, dtype=torch.float64)
    for shift in (0, 8, 16, 24):
        c = torch.empty(y.numel(), 256, dtype=torch.int32)
        u = torch.empty(256)
        _sr_probe[(1,)](y, c, u, NY=y.numel(), SHIFT=shift)
        assert torch.equal(u.double(), (k + 0.5) / 256 - 0.5 + 2**-16)
        vals = decode_e2m1(c.to(torch.uint8))
        assert bool(((vals.abs() == lo[:, None]) | (vals.abs() == hi[:, None])).all())
        assert bool(((((c & 8) != 0) == (y < 0)[:, None])).all())
        frac = (vals.abs() == hi[:, None]).double().mean(1) * (hi > lo)
        assert torch.allclose(frac, p.double(), atol=2**-9 + 2**-16 + 1e-9), (frac - p).abs().max()
        on_grid = a == lo
        assert bool((frac[on_grid] == 0).all())


@triton.jit
def _grid_values_probe(y_ptr, a_ptr, b_ptr, sfv, NY: tl.constexpr, SR: tl.constexpr):
    iy = tl.arange(0, NY)
    k = tl.arange(0, 256)
    y = tk._scaled(tl.load(y_ptr + iy), 1.0)[:, None] + tl.zeros([NY, 256], tl.float32)
    u = tk._sr_byte_offsets(k, 0)[None, :] + tl.zeros([NY, 256], tl.float32)
    if SR:
        codes = tk._e2m1_sr_fast(y, u)
    else:
        codes = tk._e2m1_rne_fast(y)
    out = iy[:, None] * 256 + k[None, :]
    tl.store(a_ptr + out, tk._values_bits(codes, sfv))
    tl.store(b_ptr + out, (tk._grid_values_bits(y, u, sfv, SR) >> 16).to(tl.int16))


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
def test_grid_values_equal_the_decoded_codes(sr):
    """The values-only kernels' rounding on the E2M1 grid (``_grid_values_bits``: a magic number
    per binade) gives the BF16 bits of decoding the codes of ``_e2m1_rne_fast`` / ``_e2m1_sr_fast``
    times the scale: at the grid points, the midpoints and the binade edges 2 and 4 and their
    float32 neighbours, both signs, -0.0, tiny and saturating values, for all 256 SR offsets.
    (Every float32 in [0, 6] was checked once with numpy for RNE, 5M values per offset for SR.)"""
    grid = E2M1_VALUES
    pts = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([6.5, 7.0, 12.0, 1e30, float("inf")])])
    for _ in range(3):
        pts = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, -1.0)),
                         torch.nextafter(pts, torch.full_like(pts, 1e38))]).unique()
    tiny = torch.tensor([1e-30, 1e-40, 1.4e-45, 0.1, 0.2499999])
    y = torch.cat([pts, -pts, tiny, -tiny, torch.rand(200, generator=torch.Generator().manual_seed(5)) * 14 - 7,
                   torch.tensor([-0.0, 0.0])])
    n = 1 << (y.numel() - 1).bit_length()
    y = torch.cat([y, torch.zeros(n - y.numel())])
    for sfv in (1.0, 0.375, 448.0, 2.0**-9):
        a = torch.empty(n, 256, dtype=torch.int16)
        b = torch.empty(n, 256, dtype=torch.int16)
        _grid_values_probe[(1,)](y, a, b, sfv, NY=n, SR=sr)
        assert torch.equal(a, b), (sfv, y[(a != b).any(1)][:8])


def test_kernel_options_are_immutable_and_scoped():
    """One immutable options object: use_options changes it for a block, then it is back."""
    import dataclasses

    base = kernels.options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.slices = False
    with pytest.raises(TypeError):
        base.config["rows"]["NB"] = 1
    with kernels.use_options(slices=False, config={"rows": dict(BM=2, NB=8, num_warps=1)}) as opts:
        assert kernels.options() is opts and not opts.slices and opts.config["rows"]["NB"] == 8
        assert opts.config["amax"] == base.config["amax"]          # the other modes keep their values
    assert kernels.options() is base
    with pytest.raises(TypeError):
        with kernels.use_options(no_such_option=True):
            pass


def test_launch_signature_separates_what_triton_specialises_on():
    """The launch cache's key (``kernels._launch_signature``) refines Triton's specialisation: a
    tensor's dtype and 16-byte alignment, an integer equal to 1, divisible by 16, or wider than
    32 bits; so a cached kernel is only reused where Triton would pick the same one."""
    spec = lambda v: kernels._launch_signature((v,))  # noqa: E731
    buf = torch.zeros(64, dtype=torch.bfloat16)
    assert buf.data_ptr() % 16 == 0
    assert spec(buf) == spec(buf[8:]) != spec(buf[1:])
    assert spec(buf) != spec(buf.float())
    assert spec(16) == spec(32) != spec(17) != spec(1) != spec(16)
    assert spec(2**31 - 16) != spec(2**31) != spec(2**63)
    assert spec(True) != spec(1) and spec(0.5) == spec(1.0)
    assert spec(torch.nn.Parameter(buf.float())) == spec(buf.float())  # a Parameter is a tensor



def _rht_copy(x):
    """The columnwise RHT copy of ``x`` [M, K] (bf16), through the kernels (the 16-slice amax pass
    and quantize kernel) or, with the kernels off, the reference."""
    copies = pair(x, rht=True) if kernels.available(x.device) else ref(
        quantize_rowwise_columnwise, x, dict(block="1d"), dict(block="1d", rht=True))
    return copies[1]


def _rht_amax(x):
    """The columnwise RHT copy's amax bits of ``x`` (:func:`_rht_copy`)."""
    return _rht_copy(x).amax.view(torch.int32)


def test_amax_pass_grid_stride_equals_one_program_per_tile():
    """The 16-slice amax pass with fewer programs than tiles (each taking every P-th tile, the next
    one's loads in flight: ``programs_per_sm``; on CPU tensors 2 "SMs") gives the bits of one
    program per tile and of the reference, rowwise and post-RHT: where the post-RHT maximum sits
    in a block at a BF16 rounding boundary (its tile certified no, re-run in FP64), in the last
    tile or the first, with K not a multiple of the tile (masked loads), and with a NaN."""
    g = torch.Generator().manual_seed(5)
    cfg = dict(kernels.options().config["amax_slices"])
    assert cfg.get("programs_per_sm"), "the default no longer takes a grid-stride loop: test what it does"
    one_per_tile = dict(cfg, programs_per_sm=None)
    cases = []
    for M, K, at in ((128, 1024, (64, 300)), (128, 1024, (112, 1020)), (160, 800, (0, 5))):
        x = (torch.randn(M, K, generator=g) * 0.01).to(torch.bfloat16)
        r, c = at
        x[r:r + 16, c:c + 1] = rht_rounding_boundary_block(g, columns=1)
        cases.append(x)
    nan = cases[0].clone()
    nan[120, 1000] = float("nan")
    for x in cases + [nan]:
        M, K = x.shape
        n_tiles = (M // (16 * cfg["G"])) * -(-K // cfg["BK"])

        def amax_pass(c):   # kernels._run's launch, alone
            buf = torch.zeros(2)
            kernels._launch_amax_slices(x, buf, c, row=True, mask=kernels.sign_mask(WGRAD_SIGNS), rht_f64=True,
                                        round_bf16=True, i64=False)
            return buf.view(torch.int32)

        assert kernels._amax_slices_programs(cfg, n_tiles, x.device) < n_tiles   # the loop runs
        got = amax_pass(cfg)
        assert torch.equal(got, amax_pass(one_per_tile))
        if x is nan:   # (the reference refuses NaN)
            assert torch.isnan(got.view(torch.float32)).all()
        else:
            want = ref(quantize_rowwise_columnwise, x, dict(block="1d"), dict(block="1d", rht=True))
            assert torch.equal(got, torch.stack([want[0].amax, want[1].amax]).view(torch.int32)), (x.shape, got)


def test_pairs_compute_their_gemm_factors():
    """``gemm_with``: the quantize kernels write each named GEMM's (alpha, 0) with alpha =
    RN(RN(amax_a · amax_b) / (6²·448²)) (the factor :func:`nvfp4_matmul` uses), from the partner's
    amax and the copy's own: by the 16-slice kernel (X's, W's and dY's pairs of a layer) and by
    a kernel of its own where the last kernel is another (M not a multiple of 16, no RHT); the
    result names its partner's amax (:attr:`NVFP4Tensor.gemm_coef`), and a partner that is not
    an NVFP4Tensor is refused."""
    from nvfp4lab.recipe import NVFP4Recipe

    opts = NVFP4Recipe().quantize_options
    x, w, dy = _x((64, 128), torch.bfloat16, seed=1), _x((96, 128), torch.bfloat16, seed=2), \
        _x((64, 96), torch.bfloat16, seed=3, scale=1e-3)
    qx, qxt = quantize_rowwise_columnwise(x, opts("input_rowwise"), opts("input_columnwise"), values=("only", False))
    qw, qwt = quantize_rowwise_columnwise(w, opts("weight"), opts("weight_columnwise"), values=(True, False),
                                          gemm_with=(qx, None))
    qdy, qdyt = quantize_rowwise_columnwise(dy, opts("grad_output_rowwise"), opts("grad_output_columnwise"),
                                            generator=SRStream(3), values=("only", "only"), gemm_with=(qwt, qxt))
    plain = dict(block="1d", rounding="nearest")
    y = _x((40, 64), torch.float32, seed=4)   # 40 rows: the columnwise copy is not the 16-slice kernel's
    qy, qyt = quantize_rowwise_columnwise(y, plain, plain, gemm_with=(qdy, qdyt))
    assert qwt.gemm_coef is None and qxt.gemm_coef is None
    for q, partner in ((qw, qx), (qdy, qwt), (qdyt, qxt), (qy, qdy), (qyt, qdyt)):
        got_partner, coef = q.gemm_coef
        assert got_partner is partner.amax
        want = (partner.amax * q.amax) / (6 * 6 * 448 * 448)   # float32: two roundings, as the kernel
        assert torch.equal(coef, torch.stack([want, torch.zeros_like(want)])), (coef, want)
    with pytest.raises(ValueError, match="gemm_with"):
        quantize_rowwise_columnwise(w, opts("weight"), opts("weight_columnwise"), gemm_with=(x, None))


def test_rht_is_exact_where_an_fp32_butterfly_is_not():
    """The columnwise RHT of the kernels (an FP64 butterfly, rounded once to FP32 and BF16) gives
    the reference's post-RHT amax bit for bit on blocks built to sit at a BF16 rounding boundary
    (:func:`nvfp4lab.testing.rht_rounding_boundary_block`), where an FP32 butterfly
    (``rht_f64=False``) is wrong in most of them, and on Inf, overflow, outputs in FP32's subnormal
    range and wide-range inputs; the finite ones give the reference's codes and scales too; a NaN
    propagates to the amax. (BF16 subnormal *inputs* are left to
    ``tests/gpu``: Triton 3.6's interpreter converts them to FP32 wrongly, 1.0102e-39 -> 4.4081e-39.)"""
    g = torch.Generator().manual_seed(0)
    wrong_fp32 = 0
    for i in range(12):
        x = rht_rounding_boundary_block(g, columns=8 if i % 4 else 256)
        if i % 4 == 0:   # whole tiles of the amax pass: its unmasked fallback
            x = torch.cat([torch.zeros_like(x), x])
        want = ref(_rht_copy, x)
        assert_nvfp4_equal(_rht_copy(x), want, msg=f"boundary blocks {i}")
        want = want.amax.view(torch.int32)
        with kernels.use_options(rht_f64=False):
            wrong_fp32 += not torch.equal(_rht_amax(x), want)
    assert wrong_fp32 >= 3, "the blocks no longer separate an exact butterfly from an FP32 one"
    big = float(torch.finfo(torch.bfloat16).max)
    tiny = torch.where(torch.rand(32, 16, generator=g) < 0.5, -1.0, 1.0) * (1 + torch.rand(32, 16, generator=g)) * 2.0 ** -126
    wide = torch.randn(32, 16, generator=g) * 1e30
    wide[::3] *= 1e-60                                  # blocks spanning ~200 binades
    specials = [torch.full((32, 16), big), tiny, wide]
    for v in (float("inf"), -float("inf")):
        y = torch.randn(32, 16, generator=g)
        y[5, 3] = v
        specials.append(y)
    for k, x in enumerate(specials):
        x = x.to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # ±Inf input
            got, want = _rht_copy(x), ref(_rht_copy, x)
        assert torch.equal(got.amax.view(torch.int32), want.amax.view(torch.int32)), x.flatten()[:4]
        if k < 3:   # the finite ones: the whole copy
            assert_nvfp4_equal(got, want, msg=f"special input {k}")
    y = torch.randn(32, 16, generator=g)
    y[5, 3] = float("nan")                                # the reference refuses NaN; the pass propagates it
    assert torch.isnan(_rht_amax(y.to(torch.bfloat16)).view(torch.float32))


@pytest.mark.parametrize("version, direct", [("3.6.0", True), ("3.7.1", False), ("3.8.0", False)])
def test_the_launch_cache_and_direct_launcher_serve_only_the_triton_release_they_were_written_for(monkeypatch, version, direct):
    # the launcher's positional arguments are Triton internals: on another release (untested on a
    # GPU here) the launches take Triton's own path
    from types import SimpleNamespace
    compiled = SimpleNamespace(metadata=SimpleNamespace(global_scratch_size=0, profile_scratch_size=0),
                               run=SimpleNamespace(launch=lambda *a: None, launch_cooperative_grid=False,
                                                   launch_pdl=False), function=0, packed_metadata=(4, 1, 0))
    monkeypatch.setattr(triton, "__version__", version)
    kernels._launch_cache_release.cache_clear()   # read once per process: read this version
    try:
        assert kernels._launch_cache_release() == direct   # _launch's cache too: Triton's own path elsewhere
        assert (kernels._direct_launch(compiled) is not None) == direct
    finally:
        kernels._launch_cache_release.cache_clear()   # the next reader reads the real version
