"""Tests for nvfp4lab.variants: the comparison FP4 quantizers used by the book."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import nvfp4lab as nv
from nvfp4lab.variants import (
    E2M1_EMAX,
    MX_BLOCK_SIZE,
    fake_quantize_fp4,
    quantize_fp4,
    quantize_mxfp4,
    quantize_per_tensor_fp4,
    SYNTHETIC_KINDS,
    synthetic_tensor,
)

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _heavy(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp(2 * torch.randn(shape[:-1] + (1,), generator=g))
    return (torch.randn(shape, generator=g) * rows).to(dtype)


# ---- NVFP4-style blocks reduce to nvfp4lab.quantize at block size 16 ----------------

@pytest.mark.parametrize("shape, rht", [((64, 64), False), ((64, 64), True), ((33, 50), False),
                                         ((4, 16, 48), False), ((4, 16, 48), True), ((7,), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block16_e4m3_is_bit_exact_with_quantize(shape, dtype, rht):
    x = _heavy(shape, dtype=dtype)
    ref = nv.quantize(x, rht=rht)
    ours = quantize_fp4(x, 16, "e4m3", rht=rht)
    assert torch.equal(ours.codes, ref.codes())
    assert torch.equal(ours.scales, ref.scale.float())
    assert torch.equal(ours.amax, ref.amax)
    assert torch.equal(ours.dequantize(), ref.dequantize())
    assert torch.equal(ours.dequantize(dtype), ref.dequantize(dtype))


def test_storage_matches_nvfp4_tensor():
    x = torch.randn(64, 128)
    q = nv.quantize(x)
    nvfp4_bytes = q.data.numel() + q.scale.numel() + 4
    assert quantize_fp4(x, 16).storage_bytes == nvfp4_bytes
    assert quantize_fp4(x, 16).bits_per_element == pytest.approx(4 + 8 / 16 + 32 / x.numel())
    assert quantize_mxfp4(x).bits_per_element == 4 + 8 / 32
    assert quantize_per_tensor_fp4(x).storage_bytes == x.numel() / 2 + 4


@pytest.mark.parametrize("block_size", [1, 3, 8, 16, 32, 64, 100])
def test_any_block_size_two_level(block_size):
    x = _heavy((8, 96))
    q = quantize_fp4(x, block_size)
    assert q.scales.shape == (8, math.ceil(96 / block_size))
    xd = q.dequantize()
    assert xd.shape == x.shape
    # each block's largest element is within one E2M1 half-step (plus E4M3 scale rounding) of itself
    assert nv.metrics.relative_error(x, xd) < 0.2


# ---- MXFP4 (OCP MX v1.0) --------------------------------------------------------------

def _one_block(amax, n=MX_BLOCK_SIZE):
    x = torch.zeros(1, n)
    x[0, 0] = amax
    x[0, 1] = -amax / 3
    return x


@pytest.mark.parametrize("amax, expo", [(6.0, 0), (4.0, 0), (7.9, 0), (8.0, 1), (1.0, -2), (0.7, -3), (1e30, 97)])
def test_mx_floor_rule(amax, expo):
    q = quantize_mxfp4(_one_block(amax))
    assert q.scales.item() == 2.0 ** expo == 2.0 ** (math.floor(math.log2(amax)) - E2M1_EMAX)
    assert q.amax is None and q.scale_format == "e8m0"


def test_mx_floor_rule_clips_between_6_and_8():
    q = quantize_mxfp4(_one_block(7.0))
    assert q.dequantize()[0, 0].item() == 6.0  # 7 / 2^0 = 7 saturates to 6


@pytest.mark.parametrize("amax, expo", [(6.0, 0), (7.0, 1), (3.1, 0), (3.0, -1), (12.0, 1)])
def test_mx_ceil_rule_never_clips(amax, expo):
    q = quantize_mxfp4(_one_block(amax), scale_rule="ceil")
    assert q.scales.item() == 2.0 ** expo
    assert (q.codes[0, 0] & 7).item() <= 7
    scaled_max = amax / q.scales.item()
    assert 3 < scaled_max <= 6


def test_mx_zero_block_and_tiny_values():
    x = torch.zeros(2, 32)
    x[1, 5] = 2.0 ** -140  # fp32 subnormal: exponent clamps at -127
    q = quantize_mxfp4(x)
    assert q.scales[0, 0].item() == 2.0 ** -127
    assert q.scales[1, 0].item() == 2.0 ** -127
    assert torch.equal(q.dequantize()[0], torch.zeros(32))


def test_mx_values_lie_on_scaled_grid():
    x = _heavy((16, 64), seed=3)
    q = quantize_mxfp4(x)
    xd = q.dequantize()
    per_elem = q.scales.repeat_interleave(32, dim=1)
    ratio = (xd / per_elem).abs()
    assert torch.isin(ratio, GRID).all()
    # scales are powers of two
    assert torch.equal(torch.exp2(torch.log2(q.scales).round()), q.scales)


# ---- per-tensor and single-level ---------------------------------------------------

def test_per_tensor_one_scale_maps_amax_to_6():
    x = torch.randn(32, 32)
    x[3, 4] = 100.0
    q = quantize_per_tensor_fp4(x)
    assert q.scales.numel() == 1
    assert q.scales.item() == pytest.approx(100.0 / 6)
    assert q.dequantize()[3, 4].item() == pytest.approx(100.0)
    # the rounding threshold to the first non-zero value is 0.25 * 100/6 ≈ 4.2 sigma: all else flushes
    assert (q.dequantize() == 0).float().mean() > 0.99


def test_per_tensor_fails_where_blocks_do_not():
    x = torch.randn(64, 64)
    x[0, 0] = 100.0
    per_tensor = nv.metrics.sqnr_db(x, quantize_per_tensor_fp4(x).dequantize())
    nvfp4 = nv.metrics.sqnr_db(x, nv.fake_quantize(x))
    assert nvfp4 > per_tensor + 5


def test_single_level_e4m3_underflows_small_tensors():
    x = torch.randn(32, 64) * 1e-6
    single = quantize_fp4(x, 16, "e4m3", tensor_scale=False)
    assert single.amax is None
    assert torch.equal(single.dequantize(), torch.zeros_like(x))  # every block scale rounds to 0
    two_level = quantize_fp4(x, 16, "e4m3")
    assert nv.metrics.sqnr_db(x, two_level.dequantize()) > 15


def test_fp32_block_scale_maps_block_max_to_code_7():
    x = _heavy((8, 64), seed=1)
    q = quantize_fp4(x, 16, "fp32")
    blocks = x.view(8, 4, 16).abs()
    idx = blocks.argmax(dim=-1)
    codes = q.codes.view(8, 4, 16).gather(-1, idx[..., None]).squeeze(-1)
    assert torch.equal(codes & 7, torch.full_like(codes, 7))


def test_fake_quantize_keeps_shape_and_dtype():
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    for bs, fmt in [(16, "e4m3"), (32, "e8m0"), (None, "fp32"), (8, "fp32")]:
        y = fake_quantize_fp4(x, bs, fmt)
        assert y.shape == x.shape and y.dtype == x.dtype


def test_rht_round_trip_improves_outlier_blocks():
    x = torch.randn(64, 256) * 0.01
    x[:, ::16] = 1.0  # one outlier per 16-block
    plain = nv.metrics.sqnr_db(x, fake_quantize_fp4(x, 32, "e8m0"))
    rotated = nv.metrics.sqnr_db(x, fake_quantize_fp4(x, 32, "e8m0", rht=True))
    assert rotated > plain


def test_stochastic_rounding_brackets_and_is_unbiased():
    x = torch.full((1, 16), 0.3)
    x[0, 0] = 6.0  # scale 1 with fp32 scales: 0.3 lies between grid points 0 and 0.5
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([quantize_fp4(x, 16, "fp32", rounding="stochastic", generator=g).dequantize()
                         for _ in range(400)])
    vals = draws[:, 0, 1:]
    assert torch.isin(vals, torch.tensor([0.0, 0.5])).all()
    assert vals.mean().item() == pytest.approx(0.3, abs=0.03)


# ---- errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, err", [
    (dict(scale_format="int8"), ValueError),
    (dict(scale_format="e8m0", tensor_scale=True), ValueError),
    (dict(block_size=0), ValueError),
    (dict(scale_rule="round"), ValueError),
    (dict(rounding="up"), ValueError),
])
def test_bad_arguments(kwargs, err):
    with pytest.raises(err):
        quantize_fp4(torch.randn(4, 32), **kwargs)


def test_bad_inputs():
    with pytest.raises(TypeError):
        quantize_fp4(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN"):
        quantize_fp4(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_fp4(torch.randn(4, 24), rht=True)
    with pytest.raises(ValueError):
        quantize_fp4(torch.tensor(1.0))


# ---- properties ---------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=80),
    st.sampled_from([(4, "fp32"), (16, "e4m3"), (32, "e8m0"), (None, "fp32"), (7, "e4m3")]),
)
@example([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 896.0, 0.001953125], (7, "e4m3"))  # found by CI: a flushed block
@example([0.0, 1.1754943508222875e-38], (4, "fp32"))  # found by CI: a subnormal FP32 scale (1/scale overflows)
def test_error_bounded_by_block_amax(values, cfg):
    block_size, fmt = cfg
    x = torch.tensor(values, dtype=torch.float32)[None]
    q = quantize_fp4(x, block_size, fmt)
    xd = q.dequantize()
    B = q.block_size
    K = x.shape[1]
    pad = (-K) % B
    bam = torch.nn.functional.pad(x.abs(), (0, pad)).view(1, -1, B).amax(-1).repeat_interleave(B, -1)[:, :K]
    # A block whose E4M3 scale underflows to 0 (block amax below ~2^-10 * 6 / S_enc; TE keeps zero
    # scales, chapter 4) dequantizes to exactly 0. Every other element moves by at most half its
    # block's amax (half the top E2M1 step is amax/6, MX clipping loses at most a quarter of amax,
    # E4M3 scale rounding adds 1/16).
    flushed = (q.block_scale_values() == 0).repeat_interleave(B, -1)[:, :K]
    assert (xd[flushed] == 0).all()
    assert ((x - xd).abs() <= bam * 0.5 + 1e-30)[~flushed].all()


# ---- synthetic data -----------------------------------------------------------------

@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_synthetic_tensor_is_reproducible(kind):
    a = synthetic_tensor(kind, 32, 256, generator=torch.Generator().manual_seed(1))
    b = synthetic_tensor(kind, 32, 256, generator=torch.Generator().manual_seed(1))
    assert a.shape == (32, 256) and a.dtype == torch.float32
    assert torch.equal(a, b) and torch.isfinite(a).all()


def test_synthetic_outlier_channels():
    x = synthetic_tensor("outlier_channels", 512, 256, generator=torch.Generator().manual_seed(0),
                         outlier_scale=50.0, outlier_fraction=2 / 256)
    col_rms = x.pow(2).mean(0).sqrt()
    assert (col_rms > 10).sum() == 2


def test_synthetic_kurtosis_ordering():
    g = torch.Generator().manual_seed(0)

    def kurt(x):
        x = x.flatten().double()
        return float(((x - x.mean()) ** 4).mean() / x.var() ** 2)

    assert abs(kurt(synthetic_tensor("gaussian", 256, 256, generator=g)) - 3) < 0.2
    assert kurt(synthetic_tensor("student_t", 256, 256, generator=g)) > 6


def test_synthetic_bad_kind():
    with pytest.raises(ValueError, match="kind"):
        synthetic_tensor("uniform", 4, 4)


@pytest.mark.parametrize("scale", [math.inf, math.nan, 0.0, -2.0])
def test_synthetic_outlier_scale_must_be_finite_and_positive(scale):
    # an infinite scale made the outlier channels Inf without a word
    with pytest.raises(ValueError, match="outlier_scale must be finite"):
        synthetic_tensor("outlier_channels", 4, 64, outlier_scale=scale)


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_inf_input_warns_and_two_level_e4m3_still_equals_quantize(rht, dtype):
    # quantize keeps TE's numerics for ±Inf (S_enc falls back to 1); quantize_fp4's two-level E4M3
    # decoded such a tensor to NaN (amax · 0) before its dequantize took the same rule
    x = _heavy((8, 64), dtype=dtype)
    x[2, 5] = float("inf")
    x[6, 40] = -float("inf")
    with pytest.warns(RuntimeWarning, match="Inf"):
        ref = nv.quantize(x, rht=rht)
    with pytest.warns(RuntimeWarning, match="global encode scale falls back to 1"):
        ours = quantize_fp4(x, 16, "e4m3", rht=rht)
    assert torch.equal(ours.codes, ref.codes())
    assert torch.equal(ours.scales, ref.scale.float())
    assert torch.equal(ours.dequantize(), ref.dequantize())
    assert not ours.dequantize().isnan().any()


def test_an_inf_input_per_format():
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    x[0, 3] = float("inf")
    with pytest.warns(RuntimeWarning, match="Inf") as rec:
        single = quantize_fp4(x, 16, "e4m3", tensor_scale=False).dequantize()
        mx = quantize_mxfp4(x).dequantize()
    assert not any("falls back" in str(w.message) for w in rec)   # no per-tensor scale to fall back
    # the Inf saturates to its block's top value: 6 × 448 (E4M3 scale), 6 × 2^127 = inf (E8M0)
    assert single[0, 3] == 2688 and mx[0, 3] == float("inf")
    assert (single[0, :16].ne(0).sum(), mx[0, :32].ne(0).sum()) == (1, 1)
    assert torch.equal(single[1], quantize_fp4(x[1:], 16, "e4m3", tensor_scale=False).dequantize()[0])
    with pytest.raises(ValueError, match="fp32.*inf"):
        quantize_fp4(x, 16, "fp32")
    with pytest.raises(ValueError, match="fp32.*inf"):
        quantize_per_tensor_fp4(x)
    with pytest.raises(ValueError, match="E8M0.*NaN"):
        quantize_fp4(x, 32, "e8m0", rht=True)
