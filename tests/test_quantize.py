"""NVFP4 quantization: known answers from the spec, edge cases, shapes, errors, SR statistics."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvfp4lab import fake_quantize, nvfp4_matmul, quantize
from nvfp4lab.formats import decode_e2m1, to_e4m3
from nvfp4lab.hadamard import random_hadamard_transform
from nvfp4lab.quantize import NVFP4Tensor, block_decode_scales, global_decode_scale, global_encode_scale

F32 = torch.float32


def T(v):
    return torch.tensor(v, dtype=F32)


def f32_from_bits(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(F32)[0]


# ---------------------------------------------------------------- worked examples


def test_ties_block_worked_example():
    """amax 2688 gives S_enc = 1; a block with amax 6 gets scale RN(6·RN(1/6)) = 1 exactly,
    so its elements are rounded unscaled and every tie goes to the even code (TE reference_nvfp4.py::cast_to_fp4x2)."""
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0
    ties = T([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -0.0])
    x[0, 16:] = ties
    q = quantize(x)
    assert q.global_encode_scale.item() == 1.0 and q.global_decode_scale.item() == 1.0
    assert q.scale.float().tolist() == [[448.0, 1.0]]
    assert decode_e2m1(q.codes()[0, 16:]).tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, 0]
    assert q.codes()[0, 31].item() == 0  # exact -0.0 -> code 0, as TE's reference


def test_block_scale_operation_order_is_tes():
    """The block scale is RN(bamax · RN(S_enc · RN(1/6))), not (bamax/6)·S_enc (TE reference_nvfp4.py).

    This input was found by search so that the two orders land on different E4M3 values;
    the test re-derives the expected byte with the spec's fp32 operations and checks that
    the docs' formula would give another byte (so a change of order fails this test)."""
    amax, bamax = f32_from_bits(1112178861), f32_from_bits(1040804249)  # 50.6257, 0.134192
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = amax, bamax
    s_enc = T(2688.0) / amax
    spec = to_e4m3(bamax * (s_enc * (T(1.0) / T(6.0)))).view(torch.uint8).item()
    docs = to_e4m3((bamax / T(6.0)) * s_enc).view(torch.uint8).item()
    assert spec != docs
    assert quantize(x).scale.view(torch.uint8)[0, 1].item() == spec


def test_global_scale_is_tensor_division_not_reciprocal_times():
    """torch's `2688.0 / t` computes reciprocal(t)·2688 and is one ulp off for this amax;
    TE divides two fp32 tensors (torch.div). A silent one-ulp change here flips bits."""
    amax = f32_from_bits(1089852603)  # 7.682218, found by a random search
    exact = T(2688.0) / amax
    assert global_encode_scale(amax).item() == exact.item()
    assert (2688.0 / amax).item() != exact.item()


def test_global_scale_edges():
    assert global_encode_scale(T(0.0)).item() == 1.0  # kernel's amax == 0 rule
    assert global_encode_scale(T(float("inf"))).item() == 1.0  # 2688/inf = 0 -> 1
    tiny = T(1e-39)  # 2688/amax overflows fp32 -> FLT_MAX
    assert global_encode_scale(tiny).item() == torch.finfo(F32).max
    assert global_decode_scale(T(2688.0)).item() == 1.0


def test_underflowed_block_gives_plus_minus_six_with_zero_scale():
    x = torch.zeros(1, 32)
    x[0, 0] = 1000.0
    x[0, 16:] = torch.linspace(-1e-7, 1e-7, 16)
    q = quantize(x)
    assert q.scale[0, 1].float().item() == 0.0
    codes = q.codes()[0, 16:]
    nonzero = x[0, 16:] != 0
    assert ((codes[nonzero] & 7) == 7).all()  # ±6, not special-cased (TE reference_nvfp4.py)
    assert (q.dequantize()[0, 16:] == 0).all()  # ... yet the block dequantizes to 0


def test_saturating_block_scale_is_448():
    x = torch.randn(4, 64)
    q = quantize(x)
    row, blk = divmod(int(x.abs().argmax()), 64)
    assert q.scale[row, blk // 16].float().item() == 448.0
    assert q.codes()[row, blk].item() & 7 == 7


def test_all_zero_tensor():
    q = quantize(torch.zeros(32, 48))
    assert q.amax.item() == 0.0
    assert (q.data == 0).all() and (q.scale.float() == 0).all()
    assert (q.dequantize() == 0).all()


def test_infinities():
    x = torch.randn(16, 32)
    x[2, 3], x[5, 20] = float("inf"), -float("inf")
    with pytest.warns(RuntimeWarning, match="contains ±Inf"):
        q = quantize(x)
    assert math.isinf(q.amax.item())
    assert q.codes()[2, 3].item() == 7 and q.codes()[5, 20].item() == 15
    assert q.scale[2, 0].float().item() == 448.0
    assert torch.isfinite(q.dequantize()).all()


def test_dequantize_formula_is_tes_native():
    """x̂ = RN(code · RN(RN(sf · amax) · RN(1/2688))) (dequantize_nvfp4.cuh)."""
    x = torch.randn(8, 64) * 3
    q = quantize(x)
    sf = q.scale.float().repeat_interleave(16, 1)
    expect = decode_e2m1(q.codes()) * ((sf * q.amax) * (T(1.0) / T(2688.0)))
    assert torch.equal(q.dequantize(), expect)


def test_amax_override():
    x = torch.randn(16, 64)
    assert torch.equal(quantize(x, amax=x.abs().max()).data, quantize(x).data)
    q = quantize(x, amax=2 * x.abs().max())
    assert q.amax.item() == 2 * x.abs().max().item()
    assert not torch.equal(q.scale.view(torch.uint8), quantize(x).scale.view(torch.uint8))
    with pytest.raises(ValueError, match="non-negative"):
        quantize(x, amax=-1.0)
    with pytest.raises(ValueError, match="finite"):
        quantize(x, amax=float("inf"))


@pytest.mark.parametrize("amax", [0.0, torch.tensor(0.0)])
def test_zero_amax_for_a_non_zero_input_raises(amax):
    """A zero amax decodes every element to 0: given with non-zero values it is an error; with an
    all-zero input it is the input's own amax and quantizes to zeros."""
    x = torch.randn(16, 64)
    with pytest.raises(ValueError, match="amax=0 was given but the input holds non-zero values"):
        quantize(x, amax=amax)
    with pytest.raises(ValueError, match="amax=0 was given"):
        quantize(x, amax=amax, rht=True)
    z = quantize(torch.zeros(16, 64), amax=amax)
    assert torch.equal(z.dequantize(), torch.zeros(16, 64))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_given_amax_tensor_is_checked_with_the_input(bad):
    """A tensor amax is validated by the check's one host read (after the kernels), not before;
    check=False reads neither it nor x. A NaN in x still raises with a valid given amax."""
    x = torch.randn(16, 64)
    with pytest.raises(ValueError, match="amax must be a finite, non-negative number"):
        quantize(x, amax=torch.tensor(bad))
    quantize(x, amax=torch.tensor(bad), check=False)   # unchecked: no read, no error
    xn = x.clone()
    xn[3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize(xn, amax=torch.tensor(4.0))
    with pytest.warns(RuntimeWarning, match="Inf"):
        xi = x.clone()
        xi[0, 0] = float("inf")
        quantize(xi, amax=torch.tensor(4.0))


# ---------------------------------------------------------------- shapes and layout


def test_padding_preserves_logical_shape():
    x = torch.randn(17, 33)
    q = quantize(x)
    assert q.data.shape == (17, 17) and q.scale.shape == (17, 3)
    padded = torch.zeros(17, 48)
    padded[:, :33] = x
    p = quantize(padded)
    assert torch.equal(q.codes(), p.codes()[:, :33])
    assert torch.equal(q.scale.view(torch.uint8), p.scale.view(torch.uint8))
    assert q.dequantize().shape == x.shape
    q2 = quantize(x, block="2d")
    assert q2.scale.shape == (2, 3) and q2.dequantize().shape == x.shape


def test_three_d_input_flattens_leading_dims():
    x = torch.randn(3, 5, 32)
    q, q2 = quantize(x), quantize(x.reshape(15, 32))
    assert torch.equal(q.data, q2.data) and torch.equal(q.scale.view(torch.uint8), q2.scale.view(torch.uint8))
    assert q.dequantize().shape == (3, 5, 32)


def test_one_d_input_is_one_row():
    x = torch.randn(48)
    assert torch.equal(quantize(x).data, quantize(x[None]).data)
    assert quantize(x).dequantize().shape == (48,)


def test_non_contiguous_input():
    x = torch.randn(64, 48)
    for block in ("1d", "2d"):
        a, b = quantize(x.t(), block=block), quantize(x.t().contiguous(), block=block)
        assert torch.equal(a.data, b.data)


def test_2d_blocks_make_w_and_wt_agree_exactly():
    w = torch.randn(48, 64)
    q, qt = quantize(w, block="2d"), quantize(w.t(), block="2d")
    assert torch.equal(q.codes().t(), qt.codes())
    assert torch.equal(q.scale.view(torch.uint8).t(), qt.scale.view(torch.uint8))
    assert torch.equal(q.dequantize().t(), qt.dequantize())
    # 1x16 blocks do not have this property
    assert not torch.equal(quantize(w).dequantize().t(), quantize(w.t()).dequantize())


def test_2d_rowwise_scale_layout_replicates_tiles():
    q = quantize(torch.randn(40, 32), block="2d")
    rs = q.rowwise_scale.view(torch.uint8)
    assert rs.shape == (40, 2)
    assert torch.equal(rs[17], q.scale.view(torch.uint8)[1])


def test_bf16_and_fp16_inputs():
    x = torch.randn(32, 64)
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(quantize(x.to(dt)).data, quantize(x.to(dt).float()).data)
        assert fake_quantize(x.to(dt)).dtype == dt


def test_empty_tensor():
    q = quantize(torch.empty(0, 32))
    assert q.data.shape == (0, 16) and q.amax.item() == 0.0
    assert q.dequantize().shape == (0, 32)
    assert quantize(torch.empty(4, 0)).dequantize().shape == (4, 0)


# ---------------------------------------------------------------- RHT


def test_rht_records_and_undoes_itself():
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    q = quantize(x, rht=True)
    assert q.rht and q.amax.item() == random_hadamard_transform(x).float().abs().max().item()
    assert torch.equal(q.data, quantize(random_hadamard_transform(x)).data)
    rel = (q.dequantize() - x.float()).norm() / x.float().norm()
    assert rel < 0.2
    assert not torch.allclose(q.dequantize(undo_rht=False), q.dequantize())


# ---------------------------------------------------------------- GEMM emulation


def test_nvfp4_matmul_equals_dequantized_product():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    qa, qb = quantize(a), quantize(b, block="2d")
    y = nvfp4_matmul(qa, qb)
    exact = (qa.block_values(torch.float64) @ qb.block_values(torch.float64).T) * (
        qa.amax.double() * qb.amax.double() / (6 * 6 * 448 * 448))
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-6)
    assert torch.equal(qa.block_values(torch.bfloat16).float(), qa.block_values())  # exact in BF16


def test_nvfp4_matmul_rht_cancels():
    g = torch.Generator().manual_seed(2)
    dy, x = torch.randn(16, 128, generator=g), torch.randn(24, 128, generator=g)  # [N, tokens], [K, tokens]
    y = nvfp4_matmul(quantize(dy, rht=True), quantize(x, rht=True))
    ref = dy @ x.T
    assert (y - ref).norm() / ref.norm() < 0.25
    with pytest.raises(ValueError, match="RHT"):
        nvfp4_matmul(quantize(dy, rht=True), quantize(x))


# ---------------------------------------------------------------- stochastic rounding


def test_sr_scales_and_amax_equal_rne():
    x = torch.randn(32, 64)
    a, b = quantize(x), quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8)) and torch.equal(a.amax, b.amax)


def test_sr_picks_one_of_the_two_bracketing_grid_points():
    x = torch.randn(64, 64) * 2
    rne = quantize(x)
    enc = (1.0 / (rne.scale.float() * rne.global_decode_scale)).repeat_interleave(16, 1)
    y = (x * enc).clamp(-6, 6)  # in E2M1 units
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    a = y.abs()
    lo = grid[torch.searchsorted(grid, a, right=True) - 1]
    hi = grid[torch.clamp(torch.searchsorted(grid, a, right=False), max=7)]
    for seed in range(5):
        sr = decode_e2m1(quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(seed)).codes()).abs()
        assert ((sr == lo) | (sr == hi)).all()


def test_sr_same_seed_same_codes_and_different_seeds_differ():
    x = torch.randn(32, 64)
    q = lambda s: quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(s)).data
    assert torch.equal(q(3), q(3))
    assert not torch.equal(q(3), q(4))


def test_sr_is_unbiased():
    """Mean of n SR draws of each element converges to the element.

    Per element the draws are Bernoulli on {lo, hi}: the mean's standard deviation is
    (hi - lo)·sqrt(p(1-p)/n) ≤ (hi - lo)/(2·sqrt(n)). With n = 4000 and a 6-sigma bound
    on each of 256 elements, a false failure has probability < 256·2e-9 ≈ 5e-7.
    RNE on the same inputs is biased far beyond that bound (checked below)."""
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(1, 256)
    x[0, ::16] = 6.0  # block amax 6, tensor amax 6: the other values are in fixed E2M1 units
    vals = torch.rand(256, generator=g) * 5.5
    vals[::16] = 6.0
    x[0] = vals
    n = 4000
    q = quantize(x.expand(n, 256).contiguous(), rounding="stochastic", generator=g)
    mean = q.dequantize().double().mean(0)
    ref = x[0].double()
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    unit = float(q.scale.float()[0, 0] * q.global_decode_scale)  # E2M1 unit -> value
    gap = torch.ones(256, dtype=torch.float64) * 2 * unit  # widest gap, an upper bound
    assert ((mean - ref).abs() <= 6 * gap / (2 * math.sqrt(n)) + 1e-6).all()
    rne_err = (quantize(x).dequantize()[0].double() - ref).abs()
    assert (rne_err > 6 * gap / (2 * math.sqrt(n))).sum() > 50  # RNE's error is a bias, not noise


# ---------------------------------------------------------------- error bound (property)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.floats(-30, 30), st.integers(0, 2**31 - 1))
def test_error_within_half_a_step_of_the_block(rows, blocks, log2scale, seed):
    """Every element whose block scale is a normal E4M3 number is within half the widest
    E2M1 step (1 unit) times the block's decode scale, plus the scale's rounding (≤ 1/16)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16 * blocks, generator=g) * 2.0**log2scale
    q = quantize(x)
    unit = (q.scale.float() * q.global_decode_scale).repeat_interleave(16, 1)
    normal = q.scale.float().repeat_interleave(16, 1) >= 2.0**-6
    err = (q.dequantize() - x).abs()
    assert (err[normal] <= unit[normal] * (1 + 1 / 16) * 1.0001).all()


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_rejects_non_float_dtypes(dtype):
    with pytest.raises(TypeError, match=str(dtype)):
        quantize(torch.zeros(4, 16, dtype=dtype))


def test_rejects_nan():
    x = torch.randn(4, 16)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize(x)


@pytest.mark.parametrize("kwargs,match", [
    ({"block": "3d"}, "block must be"),
    ({"rounding": "up"}, "rounding must be"),
    ({"rht": True}, "multiple of 16"),
])
def test_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(torch.randn(4, 20), **kwargs)


def test_rejects_2d_on_1d_tensor_and_scalars():
    with pytest.raises(ValueError, match="2 dimensions"):
        quantize(torch.randn(32), block="2d")
    with pytest.raises(ValueError, match="1-D"):
        quantize(torch.tensor(1.0))


def test_block_decode_scales_keeps_subnormals():
    s = block_decode_scales(T([0.02, 0.0]), T(448.0 * 6))  # S_enc = 1: scales 0.02/6 and 0
    assert s.float().tolist()[1] == 0.0
    assert 0 < s.float().tolist()[0] < 2.0**-6  # subnormal kept, no floor (unlike torchao)


def test_assert_nvfp4_equal_names_the_first_difference():
    import dataclasses

    from nvfp4lab.testing import assert_nvfp4_equal

    x = torch.randn(32, 64)
    q = quantize(x)
    assert_nvfp4_equal(q, quantize(x.clone()))
    data = q.data.clone()
    data[3, 5] ^= 1                                           # one bit of one code
    with pytest.raises(AssertionError, match=r"packed E2M1 codes: 1 of 1024 differ, first at \(3, 5\)"):
        assert_nvfp4_equal(dataclasses.replace(q, data=data), q)
    with pytest.raises(AssertionError, match="amax"):
        assert_nvfp4_equal(quantize(x, amax=q.amax * 2), q)
    with pytest.raises(AssertionError, match="block"):
        assert_nvfp4_equal(quantize(x, block="2d"), q)
    with pytest.raises(AssertionError, match="got None"):
        assert_nvfp4_equal(None, q)


def test_decode_and_gemm_refuse_non_float_dtypes_and_plain_tensors():
    """An integer or FP8 output dtype would silently truncate the decoded values; a plain tensor
    is not an NVFP4 operand."""
    x = torch.randn(16, 64)
    q = quantize(x)
    for bad in (torch.int8, torch.int32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="dequantize dtype must be one of"):
            q.dequantize(bad)
        with pytest.raises(TypeError, match="block_values dtype must be one of"):
            q.block_values(bad)
        with pytest.raises(TypeError, match="out_dtype must be one of"):
            nvfp4_matmul(q, q, out_dtype=bad)
    with pytest.raises(TypeError, match="operand b must be an NVFP4Tensor"):
        nvfp4_matmul(q, x)
    assert q.dequantize(torch.float64).dtype == torch.float64   # every float dtype still decodes
    assert torch.equal(q.dequantize(torch.float64), q.dequantize().double())


def test_non_bool_flags_are_refused():
    x = torch.randn(4, 32)
    with pytest.raises(TypeError, match="rht must be a bool"):
        quantize(x, rht=1)
    with pytest.raises(TypeError, match="check must be a bool"):
        quantize(x, check="no")


def _fields(q):
    return {f.name: getattr(q, f.name) for f in dataclasses.fields(q)}


@pytest.mark.parametrize("change, err, match", [
    (lambda f: dict(f, block="3d"), ValueError, "block must be"),
    (lambda f: dict(f, rounding="up"), ValueError, "rounding must be"),
    (lambda f: dict(f, e4m3_max=300), ValueError, "e4m3_max"),
    (lambda f: dict(f, dtype=torch.int8), TypeError, "dtype must be a floating-point"),
    (lambda f: dict(f, shape=()), ValueError, "at least one dimension"),
    (lambda f: dict(f, scale=None), ValueError, "come together"),
    (lambda f: dict(f, data=None, scale=None), ValueError, "values_bf16"),
    (lambda f: dict(f, data=f["data"][:, :-1]), ValueError, r"data must have shape \[48, 40\]"),
    (lambda f: dict(f, data=f["data"].view(torch.int8)), TypeError, "data must be torch.uint8"),
    (lambda f: dict(f, scale=f["scale"][:-1]), ValueError, r"scale must have shape \[48, 5\]"),
    (lambda f: dict(f, scale=f["scale"].float()), TypeError, "scale must be torch.float8_e4m3fn"),
    (lambda f: dict(f, block="2d"), ValueError, r"scale must have shape \[3, 5\]"),
    (lambda f: dict(f, amax=f["amax"].reshape(1)), ValueError, r"amax must have shape \[\]"),
    (lambda f: dict(f, amax=f["amax"].double()), TypeError, "amax must be torch.float32"),
    (lambda f: dict(f, row_scaled=True), ValueError, r"amax must have shape \[48\]"),
    (lambda f: dict(f, values_bf16=torch.zeros(48, 79, dtype=torch.bfloat16)), ValueError, "values_bf16 must have"),
    (lambda f: dict(f, values_bf16=torch.zeros(48, 80)), TypeError, "values_bf16 must be torch.bfloat16"),
    (lambda f: dict(f, rht_signs=torch.ones(8)), ValueError, "16 signs"),
])
def test_nvfp4_tensor_built_by_hand_is_checked(change, err, match):
    """A hand-built NVFP4Tensor with, e.g., a scale of the wrong shape decoded truncated or
    broadcast without a word; its fields' structure is now checked (never their values)."""
    q = quantize(torch.randn(6, 8, 80))
    NVFP4Tensor(**_fields(q))   # the fields quantize made pass
    with pytest.raises(err, match=match):
        NVFP4Tensor(**change(_fields(q)))
    values = q.block_values(torch.bfloat16).reshape(48, 80)   # a GEMM operand holding its values alone
    v = NVFP4Tensor(**dict(_fields(q), data=None, scale=None, values_bf16=values))
    assert torch.equal(v.block_values(), q.block_values())
