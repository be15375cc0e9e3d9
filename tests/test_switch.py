"""Precision switch by scope (paper appendix D): exactly the named GEMMs run in high precision."""

import pytest
import torch
import torch.nn.functional as F

from nvfp4lab.linear import NVFP4Linear, capture_gemm_operands, convert_model, set_high_precision_scope
from nvfp4lab.model import GPT, GPTConfig
from nvfp4lab.quantize import nvfp4_matmul


def _run(layer, x, gy):
    x = x.clone().requires_grad_()
    with capture_gemm_operands() as ops:
        y = layer(x)
        y.backward(gy)
    return y.detach(), x.grad, layer.weight.grad.clone(), {(o.gemm, o.operand): o for o in ops}


@pytest.fixture
def setup():
    torch.manual_seed(0)
    layer = NVFP4Linear(64, 48, bias=False)
    return layer, torch.randn(32, 64), torch.randn(32, 48)


def test_fprop_scope_quantizes_only_the_backward(setup):
    layer, x, gy = setup
    set_high_precision_scope(layer, "fprop")
    layer.weight.grad = None
    y, dx, dw, ops = _run(layer, x, gy)
    assert set(ops) == {("dgrad", "dy"), ("dgrad", "wt"), ("wgrad", "dyt"), ("wgrad", "xt")}
    assert torch.equal(y, F.linear(x, layer.weight.detach()))
    assert torch.equal(dx, nvfp4_matmul(ops["dgrad", "dy"].tensor, ops["dgrad", "wt"].tensor))
    assert torch.equal(dw, nvfp4_matmul(ops["wgrad", "dyt"].tensor, ops["wgrad", "xt"].tensor))


def test_bwd_scope_quantizes_only_the_forward(setup):
    layer, x, gy = setup
    set_high_precision_scope(layer, "bwd")
    layer.weight.grad = None
    y, dx, dw, ops = _run(layer, x, gy)
    assert set(ops) == {("fprop", "x"), ("fprop", "w")}
    assert torch.equal(y, nvfp4_matmul(ops["fprop", "x"].tensor, ops["fprop", "w"].tensor))
    assert torch.equal(dx, gy @ layer.weight.detach())
    assert torch.equal(dw, gy.t() @ x)


def test_all_and_none(setup):
    layer, x, gy = setup
    set_high_precision_scope(layer, "all")
    _, _, _, ops = _run(layer, x, gy)
    assert not ops and not layer.quantize_enabled
    set_high_precision_scope(layer, "none")
    layer.weight.grad = None
    _, _, _, ops = _run(layer, x, gy)
    assert len(ops) == 6 and layer.quantize_enabled


def test_scope_errors():
    model = convert_model(GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)), "fp8")
    with pytest.raises(ValueError, match="implemented for NVFP4 layers"):
        set_high_precision_scope(model, "fprop")
    assert set_high_precision_scope(model, "all") > 0
    with pytest.raises(ValueError, match="unknown switch scope"):
        set_high_precision_scope(model, "forward")


def test_training_switches_the_named_gemms_at_the_step(tmp_path):
    """cooldown_step + cooldown_scope='fprop': from that step on the forward GEMMs are BF16 (the event
    is logged with its scope) and the run still learns."""
    import json

    from nvfp4lab.training import TrainConfig, train

    res = train(TrainConfig(preset="ci", precision="nvfp4", steps=8, cooldown_step=5, cooldown_scope="fprop",
                            out=str(tmp_path), progress=False, plot=False, eval_interval=8))
    assert res.status == "completed"
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    cool = [e for e in events if e.get("event") == "bf16 cooldown"]
    assert cool == [{"type": "event", "event": "bf16 cooldown", "scope": "fprop", "step": 5}]
    with pytest.raises(ValueError, match="switches single GEMMs"):
        TrainConfig(preset="ci", precision="fp8", cooldown_step=5, cooldown_scope="fprop").resolved()
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(preset="ci", precision="nvfp4", cooldown_step=5, cooldown_frac=0.2).resolved()
