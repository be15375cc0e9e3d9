"""NVFP4Linear under torch.compile: two custom ops (``nvfp4lab::linear_fprop`` / ``linear_bprop``),
no graph break at the layer, the eager numerics bit for bit (CPU here; the GPU test runs the kernels)."""

import copy

import pytest
import torch

from nvfp4lab.linear import NVFP4Linear, convert_model
from nvfp4lab.model import GPT, GPTConfig
from nvfp4lab.recipe import NVFP4Recipe


def _fwd_bwd(layer, x, gy):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(gy)
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [NVFP4Recipe(), NVFP4Recipe(disable_rht=True, disable_2d_quantization=True,
                                                               disable_stochastic_rounding=True)],
                         ids=["paper", "rne-1d"])
def test_compiled_layer_equals_eager_bit_for_bit(recipe):
    """Inductor compiles around the two custom ops; Y, dX, dW and db equal eager's (SR included:
    the same SR stream state, so the same draws)."""
    torch.manual_seed(0)
    eager = NVFP4Linear(64, 48, recipe=recipe, seed=3)
    compiled = copy.deepcopy(eager)
    x, gy = torch.randn(2, 24, 64), torch.randn(2, 24, 48)   # 48 tokens: the RHT's 16-token chunks
    ref = _fwd_bwd(eager, x, gy)
    got = _fwd_bwd(torch.compile(compiled, fullgraph=True), x, gy)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_no_graph_break_in_an_nvfp4_gpt():
    """Dynamo sees each quantized layer as one node: a whole NVFP4 GPT traces in one graph."""
    torch._dynamo.reset()
    cfg = GPTConfig(block_size=32, n_layer=3, n_head=2, n_embd=32)
    model = convert_model(GPT(cfg), "nvfp4", NVFP4Recipe(bf16_first_layers=0, bf16_last_layers=0))
    idx = torch.randint(0, 256, (2, 32))
    explanation = torch._dynamo.explain(model)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_custom_ops_registration_opcheck():
    """torch.library.opcheck on both ops (schema, fake shapes, autograd registration, AOT dispatch):
    the saved copies travel as one uint8 buffer, so no float8 tensor (which PyTorch's CPU ops
    cannot sum or multiply) crosses an op boundary."""
    torch.manual_seed(0)
    layer = NVFP4Linear(32, 48, recipe=NVFP4Recipe(disable_stochastic_rounding=True))
    x = torch.randn(32, 32, requires_grad=True)
    args = (x, layer.weight, layer.bias, layer._state.key, layer._state.saved_code, True, True)
    torch.library.opcheck(torch.ops.nvfp4lab.linear_fprop.default, args)
    y, saved = torch.ops.nvfp4lab.linear_fprop(*args)
    assert y.shape == (32, 48) and saved.dtype == torch.uint8
    dy = torch.randn(32, 48)
    bargs = (dy, saved.detach(), layer._state.key, 32, torch.float32, torch.float32, torch.float32,
             True, True, True, True, True)
    torch.library.opcheck(torch.ops.nvfp4lab.linear_bprop.default, bargs)


def test_state_keys_survive_deepcopy():
    layer = NVFP4Linear(16, 16)
    twin = copy.deepcopy(layer)
    assert twin._state.key != layer._state.key and twin._state is not layer._state
