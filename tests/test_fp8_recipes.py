"""FP8 block scaling (TE ``Float8BlockScaling``) and FP8 delayed scaling (TE ``DelayedScaling``),
emulated: hand-computed blocks, the columnwise copies, the GEMM, the layer's three GEMMs, the amax
history over steps, and short training runs."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from nvfp4lab.emulated import scaled_matmul
from nvfp4lab.formats import FLT_MAX
from nvfp4lab.fp8 import FP8Tensor, fp8_matmul, quantize_fp8_with_scale
from nvfp4lab.fp8_recipes import (DelayedScalingLinear, DelayedScalingRecipe, FP8BlockLinear, FP8BlockRecipe,
                                  FP8BlockScheme, QParams, quantize_fp8_block)
from nvfp4lab.linear import convert_model, layer_precisions
from nvfp4lab.model import GPT, get_preset
from nvfp4lab.precisions import EMULATED, TE_BACKEND, get_precision
from nvfp4lab.training import TrainConfig, load_checkpoint, train

ROW, TILE = (1, 128), (128, 128)
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)


# ----------------------------------------------------------------------------- recipe

def test_block_recipe_defaults_are_te_2_20():
    r = FP8BlockRecipe()
    assert r.fp8_format == "E4M3"
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    for q in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad):
        assert q == QParams(power_2_scale=True, amax_epsilon=0.0)
    assert r.dtype_for("grad") == E4 and FP8BlockRecipe(fp8_format="HYBRID").dtype_for("grad") == E5
    d = r.to_dict()
    json.dumps(d)
    assert FP8BlockRecipe.from_dict(d) == r
    custom = FP8BlockRecipe(fp8_quant_bwd_grad=QParams(power_2_scale=False, amax_epsilon=1e-6), w_block_scaling_dim=1)
    assert FP8BlockRecipe.from_dict(custom.to_dict()) == custom


@pytest.mark.parametrize("kw, field", [
    (dict(fp8_format="E5M2"), "fp8_format"),
    (dict(x_block_scaling_dim=3), "x_block_scaling_dim"),
    (dict(grad_block_scaling_dim=True), "grad_block_scaling_dim"),
    (dict(x_block_scaling_dim=2), "x_block_scaling_dim and w_block_scaling_dim"),
    (dict(w_block_scaling_dim=2, grad_block_scaling_dim=2), "w_block_scaling_dim and grad_block_scaling_dim"),
    (dict(fp8_quant_fwd_inp={"power_2_scale": True}), "fp8_quant_fwd_inp"),
])
def test_block_recipe_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        FP8BlockRecipe(**kw)
    with pytest.raises(ValueError, match="amax_epsilon"):
        QParams(amax_epsilon=-1.0)
    with pytest.raises(ValueError, match="unknown FP8BlockRecipe field"):
        FP8BlockRecipe.from_dict({"block_len": 64})


def test_delayed_recipe_defaults_and_validation():
    r = DelayedScalingRecipe()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (0, "HYBRID", 1024, "max")
    assert DelayedScalingRecipe.from_dict(r.to_dict()) == r
    assert r.scaled_max("input") == 448.0 and r.scaled_max("grad") == 57344.0
    assert DelayedScalingRecipe(margin=2).scaled_max("input") == 112.0
    for kw, field in ((dict(margin=-1), "margin"), (dict(amax_history_len=0), "amax_history_len"),
                      (dict(amax_compute_algo="mean"), "amax_compute_algo"), (dict(fp8_format="E5M2"), "fp8_format")):
        with pytest.raises(ValueError, match=field):
            DelayedScalingRecipe(**kw)


def test_precision_table_rows():
    for name in ("fp8-delayed", "fp8-block", "mxfp8", "mxfp4"):
        assert get_precision(name).emulated and name in EMULATED
    assert get_precision("mxfp4").te_recipe is None and "mxfp4" not in TE_BACKEND
    assert "fp8" in EMULATED and "fp8-block" in TE_BACKEND


# ----------------------------------------------------------------------------- block quantization

def test_block_known_answers_power_of_two_scales():
    x = torch.zeros(2, 256)
    x[0, :128] = torch.linspace(-1, 1, 128)          # amax 1: 448/1 -> pow2 256
    x[0, 128:] = 448.0                                # amax 448: scale 1
    x[1, 128:] = 3.0                                  # amax 3: 448/3 = 149.33 -> 128
    q = quantize_fp8_block(x, ROW)                    # defaults: E4M3, power-of-two scales
    assert q.scale_inv.shape == (2, 2)
    assert q.scale_inv.tolist() == [[1 / 256, 1.0], [1.0, 1 / 128]]   # zero block: scale 1
    assert torch.all(q.data[1, :128].float() == 0)
    assert torch.all(q.data[0, 128:].float() == 448) and torch.all(q.data[1, 128:].float() == 384)
    assert torch.equal(q.data[0, :128], (x[0, :128] * 256).to(E4))
    assert torch.equal(q.dequantize(), (x[:, :] * torch.tensor([[256, 1], [1, 128]]).repeat_interleave(128, 1))
                       .to(E4).float() * q.scale_inv.repeat_interleave(128, 1))


def test_block_known_answers_fp32_scales_and_epsilon():
    x = torch.full((1, 128), 0.5)
    q = quantize_fp8_block(x, ROW, power_2_scale=False)
    assert q.scale_inv.item() == torch.reciprocal(torch.tensor(896.0)).item()     # scale 448/0.5 = 896
    assert torch.all(q.data.float() == 448)
    q = quantize_fp8_block(x * 1e-3, ROW, amax_epsilon=1.0)                         # amax floored to 1
    assert q.scale_inv.item() == 1 / 256
    q = quantize_fp8_block(torch.full((1, 128), 3.0), ROW, E5)                      # 57344/3 -> 16384
    assert q.scale_inv.item() == 2.0 ** -14 and torch.all(q.data.float() == 49152)


def test_block_overflowing_scale_uses_input_dtype_max():
    tiny = torch.full((1, 128), 1e-39)               # 448 / 1e-39 overflows fp32
    assert quantize_fp8_block(tiny, ROW, power_2_scale=False).scale_inv.item() == torch.reciprocal(
        torch.tensor(FLT_MAX)).item()
    bf16_max = float(torch.tensor(torch.finfo(torch.bfloat16).max, dtype=torch.float32))
    q = quantize_fp8_block(tiny.bfloat16(), ROW, power_2_scale=False)
    assert q.scale_inv.item() == torch.reciprocal(torch.tensor(bf16_max)).item()
    assert quantize_fp8_block(tiny, ROW).scale_inv.item() == 2.0 ** -127           # pow2 clears the mantissa


def test_block_saturation_inf_and_nan():
    x = torch.ones(1, 128)
    x[0, 0] = float("inf")                            # amax inf -> scale 1; inf saturates to 448
    x[0, 1] = float("nan")                            # NaN ignored by the amax, stays NaN
    q = quantize_fp8_block(x, ROW)
    assert q.scale_inv.item() == 1.0
    assert q.data[0, 0].float().item() == 448 and torch.isnan(q.data[0, 1].float())
    assert torch.all(q.data[0, 2:].float() == 1)


def test_partial_blocks_and_2d_tiles():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 300, generator=g)
    q = quantize_fp8_block(x, ROW)
    assert q.scale_inv.shape == (200, 3) and q.data.shape == (200, 300)
    t = quantize_fp8_block(x, TILE)
    assert t.scale_inv.shape == (2, 3)
    amax = x[128:, 256:].abs().max()
    assert t.scale_inv[1, 2].item() == 2.0 ** -torch.floor(torch.log2(448 / amax)).item()
    # a 128x128 tile's amax does not depend on orientation: its transpose IS the columnwise copy
    tt = quantize_fp8_block(x.t().contiguous(), TILE)
    assert torch.equal(bits(t.t().data), bits(tt.data)) and torch.equal(t.t().scale_inv, tt.scale_inv)


def test_scheme_columnwise_is_the_transpose_quantized_separately():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 384, generator=g) * torch.exp(2 * torch.randn(256, 1, generator=g))
    scheme = FP8BlockScheme(FP8BlockRecipe())
    row, col = scheme.quantize(x, "input")
    assert torch.equal(bits(row.data), bits(quantize_fp8_block(x, ROW).data))
    ref = quantize_fp8_block(x.t().contiguous(), ROW)
    assert torch.equal(bits(col.data), bits(ref.data)) and torch.equal(col.scale_inv, ref.scale_inv)
    # ... which is not the transpose of the rowwise copy (1x128 blocks differ along the other axis)
    assert not torch.equal(col.dequantize(), row.dequantize().t())
    w_row, w_col = scheme.quantize(x, "weight")         # 2-D: exact transpose
    assert torch.equal(w_col.dequantize(), w_row.dequantize().t())


def test_block_gemm_equals_blockwise_partial_sums_in_fp64():
    g = torch.Generator().manual_seed(2)
    a = quantize_fp8_block(torch.randn(64, 384, generator=g) * 3, ROW)
    b = quantize_fp8_block(torch.randn(256, 384, generator=g), TILE)
    got = scaled_matmul(a, b)
    # cuBLASLt's block-scaled GEMM: per 128-wide K block, (A_k @ B_kᵀ) * sa_k * sb_k, summed
    ref = torch.zeros(64, 256, dtype=torch.float64)
    for k in range(3):
        ak = a.data[:, 128 * k:128 * (k + 1)].double()
        bk = b.data[:, 128 * k:128 * (k + 1)].double()
        sa = a.scale_inv[:, k].double()[:, None]
        sb = b.scale_inv[:, k].double().repeat_interleave(128)[None, :256]
        ref += (ak @ bk.t()) * sa * sb
    assert got.dtype == torch.float32 and torch.equal(got, ref.float())
    assert torch.equal(got, (a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()).float())


def test_block_linear_runs_te_gemms():
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(256, 128)
    layer = FP8BlockLinear.from_linear(lin)
    assert layer.weight is lin.weight
    x = torch.randn(4, 64, 256, generator=g, requires_grad=True)
    y = layer(x)
    x2 = x.detach().reshape(-1, 256)
    qx, qw = quantize_fp8_block(x2, ROW), quantize_fp8_block(lin.weight.detach(), TILE)
    assert torch.equal(y.detach().reshape(-1, 128), scaled_matmul(qx, qw) + lin.bias.detach())
    dy = torch.randn(4, 64, 128, generator=g)
    y.backward(dy)
    dy2 = dy.reshape(-1, 128)
    dx = scaled_matmul(quantize_fp8_block(dy2, ROW), qw.t())                                  # Dgrad
    dw = scaled_matmul(quantize_fp8_block(dy2.t().contiguous(), ROW),
                       quantize_fp8_block(x2.t().contiguous(), ROW))                           # Wgrad
    assert torch.equal(x.grad.reshape(-1, 256), dx) and torch.equal(lin.weight.grad, dw)
    assert torch.equal(lin.bias.grad, dy2.sum(0))
    with pytest.raises(ValueError, match="FP8BlockRecipe"):
        FP8BlockLinear(8, 8, recipe=DelayedScalingRecipe())


# ----------------------------------------------------------------------------- delayed scaling

def _step(layer, amax_x: float, amax_dy: float):
    x = torch.full((4, 32), amax_x / 2)
    x[0, 0] = amax_x
    x.requires_grad_(True)
    y = layer(x)
    dy = torch.full_like(y, amax_dy / 2)
    dy[1, 1] = -amax_dy
    y.backward(dy)
    return x.detach(), y.detach()


def test_delayed_scaling_history_over_steps():
    torch.manual_seed(0)
    layer = DelayedScalingLinear(32, 16, bias=False, recipe=DelayedScalingRecipe(amax_history_len=3))
    with torch.no_grad():
        layer.weight.fill_(0.25)                      # weight amax 0.25 every step
    assert torch.equal(layer.scale, torch.ones(3)) and torch.all(layer.amax_history == 0)
    amaxes = [8.0, 4.0, 2.0, 1.0]
    seen = []
    for t, a in enumerate(amaxes):
        scale_before = layer.scale.clone()
        x, y = _step(layer, a, 2 * a)
        # the cast of step t used the scale computed after step t-1
        qx = quantize_fp8_with_scale(x, scale_before[0], E4)
        qw = quantize_fp8_with_scale(layer.weight.detach(), scale_before[1], E4)
        assert torch.equal(y, fp8_matmul(qx, qw))
        seen.append(a)
        window = seen[-3:]                            # 3 most recent steps, current one included
        assert layer.scale[0].item() == torch.tensor(448.0) / torch.tensor(max(window))
        assert layer.scale[1].item() == 448.0 / 0.25
        assert layer.scale[2].item() == torch.tensor(57344.0) / torch.tensor(2 * max(window))  # HYBRID: E5M2
        # slot 0 is zeroed for the next step; the newest amax sits in the last slot
        assert layer.amax_history[0].tolist() == [0.0, 0.0, 0.0]
        assert layer.amax_history[-1].tolist() == [a, 0.25, 2 * a]
    assert layer.amax_history[:, 0].tolist() == [0.0, 2.0, 1.0]    # 8 and 4 left the window


def test_delayed_scaling_zero_amax_step_changes_nothing():
    layer = DelayedScalingLinear(32, 16, bias=False, recipe=DelayedScalingRecipe(amax_history_len=3))
    _step(layer, 4.0, 1.0)
    history, scale = layer.amax_history.clone(), layer.scale.clone()
    x = torch.zeros(4, 32, requires_grad=True)       # input amax 0: TE's fused update skips the roll
    layer(x).backward(torch.ones(4, 16))
    assert torch.equal(layer.amax_history[:, 0], history[:, 0]) and layer.scale[0] == scale[0]
    assert layer.amax_history[-1, 2].item() == 1.0 and layer.amax_history[-2, 2].item() == 1.0  # grads rolled


def test_delayed_scaling_most_recent_margin_and_no_grad():
    layer = DelayedScalingLinear(32, 16, bias=False, recipe=DelayedScalingRecipe(
        amax_history_len=4, amax_compute_algo="most_recent", margin=1))
    _step(layer, 8.0, 1.0)
    _step(layer, 2.0, 1.0)
    assert layer.scale[0].item() == 448.0 / 2 / 2.0      # most recent amax, 2**-margin
    history = layer.amax_history.clone()
    with torch.no_grad():                                # evaluation forwards record nothing
        layer(torch.full((2, 32), 100.0))
    assert torch.equal(layer.amax_history, history)


def test_delayed_scaling_state_is_checkpointed():
    layer = DelayedScalingLinear(32, 16, recipe=DelayedScalingRecipe(amax_history_len=5))
    for a in (3.0, 5.0):
        _step(layer, a, 1.0)
    sd = layer.state_dict()
    assert set(sd) == {"weight", "bias", "amax_history", "scale"} and sd["amax_history"].shape == (5, 3)
    fresh = DelayedScalingLinear(32, 16, recipe=DelayedScalingRecipe(amax_history_len=5))
    fresh.load_state_dict(sd)
    x = torch.randn(8, 32)
    assert torch.equal(fresh(x), layer(x))


# ----------------------------------------------------------------------------- conversion and training

def test_convert_model_block_and_delayed():
    cfg = get_preset("ci")
    for precision, cls in (("fp8-block", FP8BlockLinear), ("fp8-delayed", DelayedScalingLinear)):
        model = GPT(cfg)
        keys = list(model.state_dict())
        convert_model(model, precision)
        kinds = layer_precisions(model)
        assert set(kinds.values()) == {"fp8", "high"} and kinds["lm_head"] == "high"
        assert all(v == "fp8" for n, v in kinds.items() if n.startswith("blocks."))
        assert all(isinstance(m, cls) for n, m in model.named_modules() if kinds.get(n) == "fp8")
        if precision == "fp8-block":
            assert list(model.state_dict()) == keys
        convert_model(model, "bf16")                  # back to plain layers
        assert set(layer_precisions(model).values()) == {"high"} and list(model.state_dict()) == keys
    model = GPT(cfg)
    convert_model(model, "fp8-block", block_recipe=FP8BlockRecipe(fp8_format="HYBRID"))
    assert {m.recipe.fp8_format for m in model.modules() if isinstance(m, FP8BlockLinear)} == {"HYBRID"}
    with pytest.raises(ValueError, match="FP8BlockRecipe"):
        convert_model(GPT(cfg), "fp8-block", block_recipe=DelayedScalingRecipe())


def tiny(out, **kw) -> TrainConfig:
    base = dict(preset="ci", n_layer=3, n_embd=32, n_head=2, seq_len=32, batch_size=4, steps=12, lr=1e-2,
                warmup_steps=2, eval_interval=6, eval_batches=1, log_interval=1, out=str(out), progress=False,
                plot=False)
    base.update(kw)
    return TrainConfig(**base)


def _losses(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if r["type"] == "train"]


@pytest.mark.parametrize("precision", ["fp8-block", "fp8-delayed"])
def test_trains_with_finite_decreasing_loss(tmp_path, precision):
    r = train(tiny(tmp_path / precision, precision=precision))
    assert r.status == "completed"
    losses = _losses(r.out_dir)
    assert len(losses) == 12 and all(map(lambda v: v == v and abs(v) < float("inf"), losses))
    assert losses[-1] < losses[0] - 0.5


def test_delayed_scaling_resume_is_bit_identical_and_interchangeable(tmp_path, monkeypatch):
    """6 steps straight == 3 steps, checkpoint, resume for 3 more: the amax history is restored."""
    loop = importlib.import_module("nvfp4lab.training.loop")
    full = train(tiny(tmp_path / "full", precision="fp8-delayed", steps=6, eval_interval=3))
    real_save, ck3 = loop.save_checkpoint, tmp_path / "step3.pt"

    class Stop(Exception):
        pass

    def save_and_stop(path, state):
        real_save(path, state)
        if state["step"] == 3:
            real_save(ck3, state)
            raise Stop

    monkeypatch.setattr(loop, "save_checkpoint", save_and_stop)
    with pytest.raises(Stop):
        train(tiny(tmp_path / "b", precision="fp8-delayed", steps=6, eval_interval=3))
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    assert any(k.endswith("amax_history") for k in load_checkpoint(ck3)["model"])
    resumed = train(tiny(tmp_path / "b", precision="fp8-delayed", steps=6, eval_interval=3, resume=str(ck3)))
    a, b = load_checkpoint(full.out_dir)["model"], load_checkpoint(resumed.out_dir)["model"]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(resumed.out_dir) == _losses(full.out_dir)
    # checkpoints stay interchangeable: delayed -> bf16 drops the buffers, bf16 -> delayed starts them fresh
    other = train(tiny(tmp_path / "c", precision="bf16", steps=8, eval_interval=4, resume=str(ck3)))
    assert other.status == "completed" and other.steps_completed == 8
    back = train(tiny(tmp_path / "d", precision="fp8-delayed", steps=10, eval_interval=5, resume=other.out_dir))
    assert back.status == "completed" and back.steps_completed == 10
