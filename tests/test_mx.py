"""MXFP8 (TE ``MXFP8BlockScaling``) and MXFP4, emulated: E8M0 rounding, hand-computed blocks, the two
MXFP4 scale rules, rowwise vs columnwise, the GEMM, shape errors and short training runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from nvfp4lab.emulated import scaled_matmul
from nvfp4lab.formats import (E8M0_NAN, RCP_E4M3_MAX, decode_e2m1, e8m0_from_exponent, e8m0_inverse,
                              e8m0_round_up, e8m0_to_float)
from nvfp4lab.linear import convert_model, layer_precisions
from nvfp4lab.model import GPT, get_preset
from nvfp4lab.mx import (MXFP4Linear, MXFP4Recipe, MXFP8Linear, MXFP8Recipe, MXScheme, mxfp4_scale_codes,
                         quantize_mxfp4, quantize_mxfp8)
from nvfp4lab.training import TrainConfig, train
from nvfp4lab import variants

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def f32(*v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def above(v: float) -> float:
    """The next float32 above ``v``."""
    return torch.nextafter(f32(v), f32(float("inf"))).item()


# ----------------------------------------------------------------------------- E8M0

def test_e8m0_round_up_exact_powers_and_just_above():
    assert e8m0_round_up(f32(1.0, 2.0, 0.5, 2.0 ** -126, 2.0 ** 127)).tolist() == [127, 128, 126, 1, 254]
    assert e8m0_round_up(f32(above(1.0), above(2.0), 1.5, 3.0)).tolist() == [128, 129, 128, 129]
    # zero, NaN, inf and values past 2**127 saturate (satfinite); subnormals round to 2**-127 or 2**-126
    assert e8m0_round_up(f32(0.0, float("nan"), float("inf"), 3e38)).tolist() == [0, 255, 254, 254]
    assert e8m0_round_up(f32(2.0 ** -127, 2.0 ** -149, 1.5 * 2.0 ** -127)).tolist() == [0, 0, 1]


def test_e8m0_decode_and_inverse():
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = e8m0_to_float(codes)
    assert v[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127] and torch.isnan(v[6])
    inv = e8m0_inverse(codes)
    assert inv[:6].tolist() == [2.0 ** 127, 2.0 ** 126, 2.0, 1.0, 0.5, 2.0 ** -127] and torch.isnan(inv[6])
    assert e8m0_from_exponent(torch.tensor([-200, -127, 0, 127, 300])).tolist() == [0, 0, 127, 254, 254]
    with pytest.raises(TypeError):
        e8m0_round_up(torch.ones(2, dtype=torch.float64))


# ----------------------------------------------------------------------------- MXFP8

def test_mxfp8_known_blocks():
    x = torch.zeros(1, 128)
    x[0, :32] = 448.0                                # 448 * RN(1/448) == 1 exactly -> code 127, no rounding up
    x[0, 32:64] = torch.linspace(-1, 1, 32)          # amax 1 -> RN(1/448) = 2**-8.8 -> up to 2**-8
    x[0, 64] = 449.0                                 # just above 448 -> 2**1
    q = quantize_mxfp8(x)
    assert (torch.tensor(448.0) * RCP_E4M3_MAX).item() == 1.0
    assert q.scale_e8m0.tolist() == [[127, 119, 128, 0]]    # last block all zero: code 0
    assert torch.all(q.data[0, :32].float() == 448)
    assert torch.equal(q.data[0, 32:64], (x[0, 32:64] * 256).to(E4))
    assert q.data[0, 64].float().item() == 224.0 and q.scale_inv[0, 2].item() == 2.0
    assert torch.all(q.data[0, 96:].float() == 0)
    assert torch.equal(q.dequantize(), q.data.float() * q.scale_inv.repeat_interleave(32, 1))
    q5 = quantize_mxfp8(torch.full((1, 32), 57344.0), E5)
    assert q5.scale_e8m0.item() == 127 and torch.all(q5.data.float() == 57344)


def test_mxfp8_nan_and_inf():
    x = torch.ones(1, 64)
    x[0, 0], x[0, 40] = float("nan"), float("inf")
    q = quantize_mxfp8(x)
    assert q.scale_e8m0[0, 0].item() == 119          # NaN ignored by the amax (fmaxf)
    assert torch.isnan(q.data[0, 0].float()) and q.data[0, 1].float().item() == 256
    assert q.scale_e8m0[0, 1].item() == 254          # inf amax: saturated code; inf saturates to 448
    assert q.data[0, 40].float().item() == 448


def test_mxfp8_rowwise_vs_columnwise_bit_equal_paths():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.exp(3 * torch.randn(64, 1, generator=g))
    row, col = MXScheme(MXFP8Recipe()).quantize(x, "input")
    ref = quantize_mxfp8(x.t().contiguous())
    assert torch.equal(row.data.view(torch.uint8), quantize_mxfp8(x).data.view(torch.uint8))
    assert torch.equal(col.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(col.scale_e8m0, ref.scale_e8m0) and col.scale_e8m0.shape == (96, 2)
    assert not torch.equal(col.dequantize(), row.dequantize().t())    # separate quantizations
    w_row, w_col = MXScheme(MXFP8Recipe(enable_2d_quantization=True)).quantize(x, "weight")
    assert w_row.scale_e8m0.shape == (2, 3) and torch.equal(w_col.dequantize(), w_row.dequantize().t())


def test_mx_gemm_equals_blockwise_partial_sums_in_fp64():
    g = torch.Generator().manual_seed(1)
    for quant in (quantize_mxfp8, quantize_mxfp4):
        a = quant(torch.randn(48 * 2, 128, generator=g) * 5)
        b = quant(torch.randn(64, 128, generator=g))
        ref = torch.zeros(96, 64, dtype=torch.float64)
        for k in range(4):
            ak, bk = a.values()[:, 32 * k:32 * (k + 1)].double(), b.values()[:, 32 * k:32 * (k + 1)].double()
            ref += (ak @ bk.t()) * a.scale_inv[:, k].double()[:, None] * b.scale_inv[:, k].double()[None, :]
        assert torch.equal(scaled_matmul(a, b), ref.float())


# ----------------------------------------------------------------------------- MXFP4

def test_mxfp4_scale_rules_known_answers():
    amax = f32(6.0, above(6.0), 3.0, 4.0, 7.0, 8.0, 1.0, 0.0, float("nan"), float("inf"), 2.0 ** -130)
    up = mxfp4_scale_codes(amax, "up")
    ocp = mxfp4_scale_codes(amax, "ocp")
    # "up": smallest 2**e with amax / 2**e <= 6 (paper appendix B.4)
    assert up.tolist() == [127, 128, 126, 127, 128, 128, 125, 0, E8M0_NAN, 254, 0]
    # "ocp": 2**(floor(log2 amax) - 2) (OCP MX v1.0 section 6.3)
    assert ocp.tolist() == [127, 127, 126, 127, 127, 128, 125, 0, E8M0_NAN, 254, 0]
    with pytest.raises(ValueError, match="scale_rounding"):
        mxfp4_scale_codes(amax, "nearest")


def test_mxfp4_block_amax_saturates_only_with_the_ocp_rule():
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(0, 7, 32)             # amax 7
    x[0, 32:64] = 6.0 * torch.linspace(-1, 1, 32)    # amax exactly 6
    up, ocp = quantize_mxfp4(x), quantize_mxfp4(x, scale_rounding="ocp")
    assert up.scale_inv.tolist() == [[2.0, 1.0]] and ocp.scale_inv.tolist() == [[1.0, 1.0]]
    assert up.dequantize()[0, 31].item() == 8.0      # 7 / 2 = 3.5 is a tie -> 4 (even) -> 8
    assert ocp.dequantize()[0, 31].item() == 6.0     # 7 / 1 saturates at 6
    assert torch.equal(up.dequantize()[0, 32:], ocp.dequantize()[0, 32:])
    assert up.dequantize()[0, 32].item() == -6.0 and up.data[0, 32].item() == 15   # code 0b1111 = -6
    assert up.dequantize().abs().max() <= 8.0


def test_mxfp4_elements_and_special_blocks():
    x = torch.zeros(2, 64)
    row = f32(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0)           # the E2M1 ties (and the max), scale 1
    x[0, :8] = row
    x[1, :32] = 1.0
    x[1, 3] = float("nan")                                            # NaN block: NaN scale
    q = quantize_mxfp4(x)
    assert decode_e2m1(q.data[0, :8]).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert q.scale_e8m0.tolist() == [[127, 0], [E8M0_NAN, 0]]       # zero blocks: code 0
    assert torch.all(torch.isnan(q.dequantize()[1, :32])) and torch.all(q.dequantize()[1, 32:] == 0)


def test_mxfp4_rowwise_vs_columnwise_bit_equal_paths():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=g)
    for rounding in ("up", "ocp"):
        row, col = MXScheme(MXFP4Recipe(scale_rounding=rounding)).quantize(x, "grad")
        ref = quantize_mxfp4(x.t().contiguous(), scale_rounding=rounding)
        assert torch.equal(row.data, quantize_mxfp4(x, scale_rounding=rounding).data)
        assert torch.equal(col.data, ref.data) and torch.equal(col.scale_e8m0, ref.scale_e8m0)


def test_mxfp4_matches_the_variants_quantizer():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 256, generator=g) * torch.exp(4 * torch.randn(64, 8, generator=g)).repeat_interleave(32, 1)
    x[0, :32] = 6.0 * 2.0 ** -3                       # exact power-of-two edges
    x[1, :32] = above(6.0)
    x[2, :32] = 0.0
    for ours, theirs in (("up", "ceil"), ("ocp", "floor")):
        a = quantize_mxfp4(x, scale_rounding=ours)
        b = variants.quantize_mxfp4(x, scale_rule=theirs)
        assert torch.equal(a.data, b.codes)
        nonzero = x.reshape(64, 8, 32).abs().amax(-1) > 0
        assert torch.equal(a.scale_inv[nonzero], b.scales[nonzero])
        assert torch.equal(a.dequantize(), b.dequantize().float())


# ----------------------------------------------------------------------------- recipes, shapes, layers

def test_mx_recipes():
    assert MXFP8Recipe() == MXFP8Recipe(fp8_format="E4M3", enable_2d_quantization=False)   # TE 2.20 defaults
    assert MXFP8Recipe(fp8_format="HYBRID").dtype_for("grad") == E5 and MXFP8Recipe().dtype_for("grad") == E4
    assert MXFP4Recipe().scale_rounding == "up"
    for r in (MXFP8Recipe(fp8_format="HYBRID"), MXFP4Recipe(scale_rounding="ocp")):
        assert type(r).from_dict(json.loads(json.dumps(r.to_dict()))) == r
    with pytest.raises(ValueError, match="fp8_format"):
        MXFP8Recipe(fp8_format="E5M2")
    with pytest.raises(ValueError, match="scale_rounding"):
        MXFP4Recipe(scale_rounding="down")
    with pytest.raises(ValueError, match="enable_2d_quantization"):
        MXFP4Recipe(enable_2d_quantization=1)


def test_dimensions_not_divisible_by_32_are_named():
    with pytest.raises(ValueError, match="dimension 1.*48"):
        quantize_mxfp8(torch.ones(4, 48))
    with pytest.raises(ValueError, match="dimension 0.*40"):
        quantize_mxfp4(torch.ones(40, 64), two_d=True)
    with pytest.raises(ValueError, match="in_features=48"):
        MXFP8Linear(48, 64)
    with pytest.raises(ValueError, match="out_features=100"):
        MXFP4Linear.from_linear(nn.Linear(64, 100))
    with pytest.raises(ValueError, match="tokens.*=10"):
        MXFP4Linear(64, 64)(torch.randn(2, 5, 64))
    with pytest.raises(ValueError, match="layer 'blocks.0.*in_features=40"):
        convert_model(GPT(dataclasses.replace(get_preset("ci"), n_embd=40, n_head=2)), "mxfp8")


@pytest.mark.parametrize("cls, quant", [(MXFP8Linear, quantize_mxfp8), (MXFP4Linear, quantize_mxfp4)])
def test_mx_linear_runs_the_three_gemms(cls, quant):
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(64, 96)
    layer = cls.from_linear(lin)
    x = torch.randn(2, 32, 64, generator=g, requires_grad=True)
    y = layer(x)
    x2, w = x.detach().reshape(-1, 64), lin.weight.detach()
    assert torch.equal(y.detach().reshape(-1, 96), scaled_matmul(quant(x2), quant(w)) + lin.bias.detach())
    dy = torch.randn(2, 32, 96, generator=g)
    y.backward(dy)
    dy2 = dy.reshape(-1, 96)
    dx = scaled_matmul(quant(dy2), quant(w.t().contiguous()))                               # Dgrad
    dw = scaled_matmul(quant(dy2.t().contiguous()), quant(x2.t().contiguous()))             # Wgrad
    assert torch.equal(x.grad.reshape(-1, 64), dx) and torch.equal(lin.weight.grad, dw)


def test_convert_model_mx():
    for precision, kind, cls in (("mxfp8", "fp8", MXFP8Linear), ("mxfp4", "mxfp4", MXFP4Linear)):
        model = GPT(get_preset("ci"))
        keys = list(model.state_dict())
        convert_model(model, precision)
        kinds = layer_precisions(model)
        assert set(kinds.values()) == {kind, "high"} and kinds["lm_head"] == "high"
        assert all(isinstance(m, cls) for n, m in model.named_modules() if n.startswith("blocks.") and
                   isinstance(m, nn.Linear))
        assert list(model.state_dict()) == keys
    model = GPT(get_preset("ci"))
    convert_model(model, "mxfp4", block_recipe=MXFP4Recipe(scale_rounding="ocp"))
    assert {m.recipe.scale_rounding for m in model.modules() if isinstance(m, MXFP4Linear)} == {"ocp"}


@pytest.mark.parametrize("precision", ["mxfp8", "mxfp4"])
def test_trains_with_finite_decreasing_loss(tmp_path, precision):
    cfg = TrainConfig(preset="ci", n_layer=3, n_embd=32, n_head=2, seq_len=32, batch_size=4, steps=12, lr=1e-2,
                      warmup_steps=2, eval_interval=6, eval_batches=1, log_interval=1, out=str(tmp_path / precision),
                      progress=False, plot=False, precision=precision)
    r = train(cfg)
    assert r.status == "completed"
    with open(Path(r.out_dir) / "metrics.jsonl") as f:
        losses = [x["loss"] for x in map(json.loads, f) if x["type"] == "train"]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5


def test_train_config_block_recipe_and_variants():
    c = TrainConfig(precision="mxfp4", block_recipe={"scale_rounding": "ocp"}).resolved()
    assert TrainConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    for bad, match in ((dict(precision="nvfp4", block_recipe={}), "no block/delayed-scaling recipe"),
                       (dict(precision="mxfp4", block_recipe={"scale_rounding": "x"}), "scale_rounding"),
                       (dict(precision="mxfp8", block_recipe={"foo": 1}), "foo")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad).resolved()
    v = TrainConfig().with_variant("mxfp4-ocp")
    assert (v.precision, v.block_recipe, v.name) == ("mxfp4", {"scale_rounding": "ocp"}, "mxfp4-ocp")
    assert v.with_variant("fp8-block").block_recipe is None      # not carried to another precision


def test_train_uses_the_block_recipe(tmp_path, monkeypatch):
    from nvfp4lab.training import loop
    seen = {}
    real = loop.convert_model

    def spy(model, precision, *a, **kw):
        seen["recipe"] = kw.get("block_recipe")
        return real(model, precision, *a, **kw)

    monkeypatch.setattr(loop, "convert_model", spy)
    cfg = TrainConfig(preset="ci", n_layer=2, n_embd=32, n_head=2, seq_len=32, batch_size=2, steps=1, eval_interval=1,
                      eval_batches=1, out=str(tmp_path / "r"), progress=False, plot=False, precision="mxfp4",
                      block_recipe={"scale_rounding": "ocp"})
    assert train(cfg).status == "completed" and seen["recipe"] == MXFP4Recipe(scale_rounding="ocp")
