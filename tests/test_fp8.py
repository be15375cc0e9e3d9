"""FP8 current-scaling emulation (TE Float8CurrentScaling: E4M3 forward, E5M2 gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nvfp4lab.fp8 import (
    FLT_MAX,
    FP8_E4M3_MAX,
    FP8_E5M2_MAX,
    FP8Linear,
    FP8Recipe,
    compute_scale,
    fp8_matmul,
    quantize_fp8,
)


def t(v):
    return torch.tensor(v, dtype=torch.float32)


def test_compute_scale_matches_te_rules():
    # RN(fp8_max / amax) in fp32
    assert compute_scale(t(3.0), 448.0).item() == torch.tensor(448.0 / 3.0, dtype=torch.float32).item()
    # amax 0, inf, NaN -> 1
    for a in (0.0, float("inf"), float("nan")):
        assert compute_scale(t(a), 448.0).item() == 1.0
    # quotient overflows -> FLT_MAX
    assert compute_scale(t(1e-40), 448.0).item() == FLT_MAX
    # power-of-two scales: mantissa cleared, i.e. 2^floor(log2(448/3)) = 128
    assert compute_scale(t(3.0), 448.0, use_power_2_scales=True).item() == 128.0
    assert compute_scale(t(0.001), 57344.0, use_power_2_scales=True).item() == 2.0 ** 25
    # epsilon floors the amax
    assert compute_scale(t(0.0), 448.0, amax_epsilon=2.0).item() == 224.0


@pytest.mark.parametrize("dtype,fmax,rel", [(torch.float8_e4m3fn, FP8_E4M3_MAX, 2.0 ** -4),
                                            (torch.float8_e5m2, FP8_E5M2_MAX, 2.0 ** -3)])
def test_quantize_fp8_values(dtype, fmax, rel):
    torch.manual_seed(0)
    x = torch.randn(64, 48) * 3
    q = quantize_fp8(x, dtype)
    assert q.data.dtype == dtype and q.data.shape == x.shape
    assert q.amax.item() == x.abs().max().item()
    scale = compute_scale(q.amax, fmax)
    assert torch.equal(q.scale_inv, torch.reciprocal(scale))
    # the amax element lands exactly on the format's maximum
    i = x.abs().argmax()
    assert q.data.flatten()[i].float().abs().item() == fmax
    # every element is the nearest representable value: relative error <= half an ulp (normals)
    y = x * scale
    err = (q.data.float() - y).abs()
    normal = y.abs() >= torch.finfo(dtype).tiny
    assert (err[normal] <= rel * y.abs()[normal] * 1.0000001).all()
    # RNE cast is what torch does; check against an explicit float64 nearest search on a few values
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)].double()
    for v in y.flatten()[:50].double():
        nearest = grid[(grid - v).abs().argmin()]
        got = torch.tensor(v.item()).to(dtype).double()
        assert abs(got - v) <= abs(nearest - v)


def test_quantize_fp8_saturates_instead_of_nan():
    x = torch.tensor([1.0, -2.0, 8.0])
    q = quantize_fp8(x, torch.float8_e4m3fn, amax=torch.tensor(2.0))   # delayed-style smaller amax
    assert torch.equal(q.data.float(), torch.tensor([224.0, -448.0, 448.0]))
    assert torch.isfinite(q.dequantize()).all()
    with pytest.raises(TypeError):
        quantize_fp8(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="fp8_dtype"):
        quantize_fp8(torch.ones(3), torch.float16)


def test_fp8_matmul_is_exact_for_exact_operands():
    a = torch.randint(-8, 9, (16, 32)).float()
    b = torch.randint(-8, 9, (8, 32)).float()
    # power-of-two scale 32 (448/8 = 56 rounded down): k * 32 for |k| <= 8 is exact in E4M3
    qa, qb = quantize_fp8(a, use_power_2_scales=True), quantize_fp8(b, use_power_2_scales=True)
    assert qa.scale_inv.item() == 1 / 32
    assert torch.equal(qa.dequantize(), a) and torch.equal(qb.dequantize(), b)
    assert torch.equal(fp8_matmul(qa, qb), a @ b.t())
    with pytest.raises(ValueError, match=r"\[M, K\] x \[N, K\]"):
        fp8_matmul(qa, quantize_fp8(torch.ones(8, 16)))
    # without power-of-two scales 7 * 56 = 392 is not an E4M3 value: rounding error appears
    assert not torch.equal(quantize_fp8(a).dequantize(), a)


@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_fp8_linear_three_gemms(fmt):
    torch.manual_seed(1)
    recipe = FP8Recipe(fp8_format=fmt)
    layer = FP8Linear(32, 24, bias=True, recipe=recipe)
    x = torch.randn(5, 7, 32, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    x2, dy, W = x.detach().reshape(-1, 32), g.reshape(-1, 24), layer.weight.detach()
    qx, qw = quantize_fp8(x2, torch.float8_e4m3fn), quantize_fp8(W, torch.float8_e4m3fn)
    qdy = quantize_fp8(dy, torch.float8_e5m2 if fmt == "HYBRID" else torch.float8_e4m3fn)
    assert torch.equal(y.detach().reshape(-1, 24), fp8_matmul(qx, qw) + layer.bias.detach())
    assert torch.equal(x.grad.reshape(-1, 32), fp8_matmul(qdy, qw.t()))
    assert torch.equal(layer.weight.grad, fp8_matmul(qdy.t(), qx.t()))
    assert torch.equal(layer.bias.grad, dy.sum(0))
    # and close to the FP32 linear layer: E4M3 x E5M2 errors are a few percent at most
    ref = nn.Linear(32, 24)
    ref.load_state_dict(layer.state_dict())
    xr = x.detach().clone().requires_grad_(True)
    ref(xr).backward(g)
    for a, b in ((layer.weight.grad, ref.weight.grad), (x.grad, xr.grad)):
        assert ((a - b).norm() / b.norm()).item() < 0.1


def test_fp8_linear_autocast_and_disable():
    layer = FP8Linear(16, 16)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    layer.quantize_enabled = False
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with pytest.raises(ValueError, match="expects input"):
        layer(torch.randn(4, 8))


@pytest.mark.parametrize("kwargs", [dict(fp8_format="E5M2"), dict(use_power_2_scales=1),
                                    dict(amax_epsilon=-1.0)])
def test_fp8_recipe_validation(kwargs):
    with pytest.raises(ValueError):
        FP8Recipe(**kwargs)
    assert FP8Recipe.from_dict(FP8Recipe().to_dict()) == FP8Recipe()
