"""NVFP4Linear, its autograd function, convert_model and NVFP4Recipe.

The key tests instrument the layer (``capture_gemm_operands``) and check that every GEMM operand
is bit-identical to ``quantize(...)`` of the right high-precision tensor with the options the
recipe prescribes (spec sections 3-6), written out here independently of the recipe table.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nvfp4lab.fp8 import FP8Linear
from nvfp4lab.linear import (
    IdentityQuantizer,
    NVFP4Linear,
    capture_gemm_operands,
    convert_model,
    layer_precisions,
    set_quantization_enabled,
)
from nvfp4lab.model import GPT, get_preset
from nvfp4lab.quantize import nvfp4_matmul, quantize
from nvfp4lab.recipe import NVFP4Recipe
from nvfp4lab.testing import assert_nvfp4_equal


assert_same_quant = functools.partial(assert_nvfp4_equal, check_dtype=False)


def run_layer(layer, x, seed=0):
    """Forward + backward with a fixed upstream gradient; returns (y, g, operands by name)."""
    x = x.detach().clone().requires_grad_(True)
    with capture_gemm_operands() as ops:
        y = layer(x)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
        y.backward(g)
    by = {(o.gemm, o.operand): o for o in ops}
    assert len(by) == len(ops) == 6, [(o.gemm, o.operand) for o in ops]
    return x, y, g, by


def pad_tokens(t, multiple=16):
    return F.pad(t, (0, (-t.shape[-1]) % multiple))


@pytest.mark.parametrize("tokens", [(2, 24), (3, 7)])  # M = 48 (multiple of 16) and 21 (padded)
def test_every_gemm_operand_is_quantize_of_the_right_tensor(tokens):
    torch.manual_seed(0)
    K, N = 64, 48
    layer = NVFP4Linear(K, N, bias=True, generator=torch.Generator().manual_seed(7))
    x0 = torch.randn(*tokens, K).to(torch.bfloat16)
    x, y, g, ops = run_layer(layer, x0)
    x2 = x0.reshape(-1, K)
    dy = g.reshape(-1, N)
    W = layer.weight.detach()

    # Fprop: X rowwise 1x16 RNE; W 2D 16x16 RNE
    assert_same_quant(ops["fprop", "x"].tensor, quantize(x2, block="1d"))
    assert_same_quant(ops["fprop", "w"].tensor, quantize(W, block="2d"))
    # Dgrad: dY rowwise 1x16 SR; W^T with the same 2D quantization
    o = ops["dgrad", "dy"]
    assert o.rng_state is not None
    assert_same_quant(o.tensor, quantize(dy, block="1d", rounding="stochastic",
                                         generator=o.rng()))
    assert_same_quant(ops["dgrad", "wt"].tensor, quantize(W.t().contiguous(), block="2d"))
    # 2D: W^T's quantization is exactly the transpose of W's
    assert torch.equal(ops["dgrad", "wt"].tensor.block_values(), ops["fprop", "w"].tensor.block_values().t())
    # Wgrad: columnwise (tokens last) copies with RHT; dY with SR, X with RNE; own post-RHT amax
    assert_same_quant(ops["wgrad", "xt"].tensor, quantize(pad_tokens(x2.t()), block="1d", rht=True))
    o = ops["wgrad", "dyt"]
    assert_same_quant(o.tensor, quantize(pad_tokens(dy.t()), block="1d", rht=True, rounding="stochastic",
                                         generator=o.rng()))
    assert not torch.equal(ops["wgrad", "xt"].tensor.amax, ops["fprop", "x"].tensor.amax)  # post-RHT amax

    # The outputs are exactly the three emulated GEMMs of those operands
    y_ref = (nvfp4_matmul(ops["fprop", "x"].tensor, ops["fprop", "w"].tensor) + layer.bias.detach()).to(x0.dtype)
    assert torch.equal(y.reshape(-1, N), y_ref)
    dx_ref = nvfp4_matmul(ops["dgrad", "dy"].tensor, ops["dgrad", "wt"].tensor).to(x0.dtype)
    assert torch.equal(x.grad.reshape(-1, K), dx_ref)
    dw_ref = nvfp4_matmul(ops["wgrad", "dyt"].tensor, ops["wgrad", "xt"].tensor)
    assert torch.equal(layer.weight.grad, dw_ref)
    assert torch.equal(layer.bias.grad, dy.sum(0, dtype=torch.float32))   # FP32 accumulation, no FP32 copy
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_operands_without_2d_rht_sr():
    torch.manual_seed(1)
    recipe = NVFP4Recipe(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    layer = NVFP4Linear(32, 32, bias=False, recipe=recipe)
    x0 = torch.randn(40, 32)
    _, _, g, ops = run_layer(layer, x0)
    W = layer.weight.detach()
    assert_same_quant(ops["fprop", "w"].tensor, quantize(W, block="1d"))
    assert_same_quant(ops["dgrad", "wt"].tensor, quantize(W.t().contiguous(), block="1d"))  # independent
    assert_same_quant(ops["dgrad", "dy"].tensor, quantize(g, block="1d"))
    assert ops["dgrad", "dy"].rng_state is None
    assert_same_quant(ops["wgrad", "xt"].tensor, quantize(x0.t().contiguous(), block="1d"))  # no padding
    assert_same_quant(ops["wgrad", "dyt"].tensor, quantize(g.t().contiguous(), block="1d"))


def integer_tensor(shape, seed, lo=-4, hi=5):
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("shape", [(5, 7, 32), (48, 32)])
def test_identity_quantizer_gives_nn_linear_gradients_exactly(shape):
    """All features off + identity quantizer: the plumbing of the three GEMMs equals nn.Linear.

    Small-integer data makes every FP32 sum exact, so equality does not depend on summation order.
    """
    off = NVFP4Recipe(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    ref = nn.Linear(32, 24, bias=True)
    with torch.no_grad():
        ref.weight.copy_(integer_tensor((24, 32), 1))
        ref.bias.copy_(integer_tensor((24,), 2))
    layer = NVFP4Linear.from_linear(nn.Linear(32, 24), recipe=off, quantizer=IdentityQuantizer())
    with torch.no_grad():
        layer.weight.copy_(ref.weight)
        layer.bias.copy_(ref.bias)
    x = integer_tensor(shape, 3)
    g = integer_tensor((*shape[:-1], 24), 4)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = ref(xa), layer(xb)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(ref.weight.grad, layer.weight.grad)
    assert torch.equal(ref.bias.grad, layer.bias.grad)


def test_identity_quantizer_random_data_close_to_nn_linear_with_rht_padding():
    """Random FP32 data, RHT flag on (identity ignores it but tokens get padded): same up to FP32 order."""
    torch.manual_seed(2)
    ref = nn.Linear(48, 16)
    layer = NVFP4Linear.from_linear(ref, recipe=NVFP4Recipe(), quantizer=IdentityQuantizer())
    x = torch.randn(3, 11, 48)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya = F.linear(xa, ref.weight, ref.bias)
    ga = torch.autograd.grad(ya.sum(), [xa, ref.weight, ref.bias])
    gb = torch.autograd.grad(layer(xb).sum(), [xb, layer.weight, layer.bias])
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_gemms_agree_with_dequantized_reference():
    """Hand-written reference of the three GEMMs from dequantize() (with the RHT undone explicitly)."""
    torch.manual_seed(3)
    M, K, N = 64, 48, 32
    layer = NVFP4Linear(K, N, bias=False, generator=torch.Generator().manual_seed(1))
    x0 = torch.randn(M, K).to(torch.bfloat16)
    x, y, g, ops = run_layer(layer, x0)
    deq = {k: o.tensor.dequantize(torch.float64) for k, o in ops.items()}
    y_ref = deq["fprop", "x"] @ deq["fprop", "w"].T
    dx_ref = deq["dgrad", "dy"] @ deq["dgrad", "wt"].T
    dw_ref = deq["wgrad", "dyt"] @ deq["wgrad", "xt"].T        # RHT undone on both sides
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-2, atol=1e-2)   # y is bf16
    torch.testing.assert_close(x.grad.double(), dx_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(layer.weight.grad.double(), dw_ref, rtol=1e-5, atol=1e-5)
    # and the NVFP4 gradient is a sane estimate of the exact one (loose statistical bound)
    x_hp = x0.float().requires_grad_(True)
    w_hp = layer.weight.detach().clone().requires_grad_(True)
    (F.linear(x_hp, w_hp) * g.float()).sum().backward()
    rel = (layer.weight.grad - w_hp.grad).norm() / w_hp.grad.norm()
    assert rel < 0.25, rel


@pytest.mark.parametrize("M,K,N", [(21, 40, 24), (16, 20, 36), (1, 16, 16)])
def test_shapes_not_multiple_of_16_work(M, K, N):
    torch.manual_seed(4)
    layer = NVFP4Linear(K, N, bias=True, generator=torch.Generator().manual_seed(0))
    x0 = torch.randn(M, K).to(torch.bfloat16)
    x, y, g, ops = run_layer(layer, x0)
    assert y.shape == (M, N) and torch.isfinite(y.float()).all()
    assert torch.isfinite(layer.weight.grad).all() and torch.isfinite(x.grad.float()).all()
    assert_same_quant(ops["fprop", "x"].tensor, quantize(x0, block="1d"))
    assert_same_quant(ops["fprop", "w"].tensor, quantize(layer.weight.detach(), block="2d"))
    assert ops["wgrad", "xt"].source.shape == (K, math.ceil(M / 16) * 16)
    assert torch.equal(layer.weight.grad, nvfp4_matmul(ops["wgrad", "dyt"].tensor, ops["wgrad", "xt"].tensor))


def test_autocast_input_cast_and_fp32_accumulation():
    torch.manual_seed(5)
    layer = NVFP4Linear(32, 32, bias=False)
    x = torch.randn(16, 32)
    with capture_gemm_operands() as ops, torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert ops[0].source.dtype == torch.bfloat16            # activations quantized from BF16
    assert ops[1].source.dtype == torch.float32             # master weight quantized from FP32
    assert torch.equal(y, nvfp4_matmul(ops[0].tensor, ops[1].tensor).to(torch.bfloat16))
    # eval-mode forward (no grad) quantizes only the two Fprop operands
    with capture_gemm_operands() as ops, torch.no_grad():
        layer(x)
    assert [(o.gemm, o.operand) for o in ops] == [("fprop", "x"), ("fprop", "w")]


def test_sr_reproducible_from_generator_and_different_across_seeds():
    torch.manual_seed(6)
    base = nn.Linear(32, 32, bias=False)
    x = torch.randn(32, 32)

    def wgrad(seed):
        layer = NVFP4Linear.from_linear(base, generator=torch.Generator().manual_seed(seed))
        base.weight.grad = None
        layer(x).pow(2).sum().backward()
        return base.weight.grad.clone()

    assert torch.equal(wgrad(1), wgrad(1))
    assert not torch.equal(wgrad(1), wgrad(2))


def test_nan_input_gives_nan_output_not_an_exception():
    layer = NVFP4Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    xn = x.detach().clone()
    xn[0, 0] = float("nan")
    xn.requires_grad_(True)
    y = layer(xn)
    assert torch.isnan(y).all()
    y.sum().backward()
    assert torch.isnan(layer.weight.grad).all()


def test_bad_input_raises_clear_errors():
    layer = NVFP4Linear(16, 16)
    with pytest.raises(ValueError, match=r"expects input \[\.\.\., 16\]"):
        layer(torch.randn(4, 32))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(4, 16, dtype=torch.int64))
    with pytest.raises(TypeError, match="NVFP4Recipe"):
        NVFP4Linear(16, 16, recipe={"disable_rht": True})


def test_disabled_layer_is_plain_linear():
    layer = NVFP4Linear(16, 8)
    layer.quantize_enabled = False
    x = torch.randn(3, 16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


# ----------------------------------------------------------------------------- convert_model
def test_convert_model_selects_layers_and_shares_parameters():
    model = GPT(get_preset("laptop"))            # 4 blocks
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    convert_model(model, "nvfp4", NVFP4Recipe(), seed=0)
    prec = layer_precisions(model)
    nvfp4 = sorted(n for n, p in prec.items() if p == "nvfp4")
    assert nvfp4 == sorted(f"blocks.{b}.{l}" for b in (1, 2) for l in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"))
    assert prec["lm_head"] == "high"
    assert list(model.state_dict()) == keys                                # checkpoints interchangeable
    assert all(p is params[n] for n, p in model.named_parameters())       # parameters shared, not copied
    assert model.lm_head.weight is model.wte.weight                       # tying kept
    seeds = {model.get_submodule(n)._state.seed for n in nvfp4}           # distinct default SR streams
    assert len(seeds) == len(nvfp4)

    convert_model(model, "nvfp4", NVFP4Recipe(bf16_first_layers=0, bf16_last_layers=0, quantize_lm_head=True))
    assert set(layer_precisions(model).values()) == {"nvfp4"}
    assert isinstance(model.lm_head, NVFP4Linear) and model.lm_head.weight is model.wte.weight

    convert_model(model, "fp8")
    prec = layer_precisions(model)
    assert all(isinstance(model.get_submodule(n), FP8Linear) for n, p in prec.items() if n != "lm_head")
    assert prec["lm_head"] == "high"

    assert set(layer_precisions(model).values()) == {"fp8", "high"}
    assert set_quantization_enabled(model, False) == 16
    assert set(layer_precisions(model).values()) == {"high"}

    convert_model(model, "bf16")
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if isinstance(m, nn.Linear))
    assert all(p is params[n] for n, p in model.named_parameters())


def test_convert_model_errors():
    model = GPT(get_preset("ci"))                # 3 blocks
    with pytest.raises(ValueError, match="precision"):
        convert_model(model, "fp4")
    with pytest.raises(ValueError, match="only 3 blocks"):
        convert_model(model, "nvfp4", NVFP4Recipe(bf16_first_layers=2, bf16_last_layers=2))
    with pytest.raises(ValueError, match="no linear layer would be NVFP4"):
        convert_model(model, "nvfp4", NVFP4Recipe(bf16_first_layers=2, bf16_last_layers=1))
    with pytest.raises(ValueError, match="no transformer blocks"):
        convert_model(nn.Sequential(nn.Linear(16, 16)), "nvfp4")


# ----------------------------------------------------------------------------- recipe
def test_recipe_defaults_mirror_te_and_paper():
    r = NVFP4Recipe()
    assert (r.disable_rht, r.disable_stochastic_rounding, r.disable_2d_quantization) == (False, False, False)
    assert (r.bf16_first_layers, r.bf16_last_layers, r.quantize_lm_head) == (1, 1, False)
    assert r.quantize_options("input_rowwise") == dict(block="1d", rht=False, rounding="nearest")
    assert r.quantize_options("input_columnwise") == dict(block="1d", rht=True, rounding="nearest")
    assert r.quantize_options("weight") == dict(block="2d", rht=False, rounding="nearest")
    assert r.quantize_options("grad_output_rowwise") == dict(block="1d", rht=False, rounding="stochastic")
    assert r.quantize_options("grad_output_columnwise") == dict(block="1d", rht=True, rounding="stochastic")
    assert NVFP4Recipe.from_dict(r.to_dict()) == r
    assert [r.block_is_quantized(i, 4) for i in range(4)] == [False, True, True, False]


@pytest.mark.parametrize("kwargs,match", [
    (dict(disable_rht=1), "must be a bool"),
    (dict(quantize_lm_head="yes"), "must be a bool"),
    (dict(bf16_first_layers=-1), ">= 0"),
    (dict(bf16_last_layers=1.5), "must be an int"),
    (dict(bf16_last_layers=True), "must be an int"),
])
def test_recipe_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NVFP4Recipe(**kwargs)


def test_recipe_misc_errors_and_te_env():
    with pytest.raises(ValueError, match="unknown NVFP4Recipe field"):
        NVFP4Recipe.from_dict({"disable_hadamard": True})
    with pytest.raises(ValueError, match="unknown quantization role"):
        NVFP4Recipe().quantize_options("bias")
    with pytest.raises(ValueError, match="unknown NVFP4Recipe field"):
        NVFP4Recipe().replace(rht=False)
    r = NVFP4Recipe.from_te_env({"NVTE_NVFP4_DISABLE_RHT": "1", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "0"})
    assert r.disable_rht and not r.disable_2d_quantization and not r.disable_stochastic_rounding
    with pytest.raises(ValueError, match="NVTE_NVFP4_DISABLE_RHT"):
        NVFP4Recipe.from_te_env({"NVTE_NVFP4_DISABLE_RHT": "yes"})


def test_one_layer_selection_rule():
    """convert_model and the TE model builder select exactly the layers of recipe.layer_is_quantized."""
    from nvfp4lab.recipe import layer_is_quantized
    from nvfp4lab.te_model import quantized_blocks

    cfg = get_preset("ci")                       # 3 blocks: first and last stay BF16 by default
    assert [layer_is_quantized(f"blocks.{i}.mlp.fc", "nvfp4", 3) for i in range(3)] == [False, True, False]
    assert [layer_is_quantized(f"blocks.{i}.mlp.fc", "fp8", 3) for i in range(3)] == [True, True, True]
    assert not any(layer_is_quantized(n, p, 3) for n in ("lm_head", "blocks.1.attn.qkv") for p in ("bf16", "fp32"))
    assert not layer_is_quantized("lm_head", "fp8-block", 3)
    assert layer_is_quantized("lm_head", "nvfp4", 3, NVFP4Recipe(quantize_lm_head=True))
    for precision, recipe in (("nvfp4", NVFP4Recipe()), ("nvfp4", NVFP4Recipe(bf16_first_layers=0)), ("fp8", None)):
        model = convert_model(GPT(cfg), precision, recipe)
        got = {name: p != "high" for name, p in layer_precisions(model).items()}
        assert got == {name: layer_is_quantized(name, precision, cfg.n_layer, recipe) for name in got}
        assert quantized_blocks(precision, cfg.n_layer, recipe) == [
            layer_is_quantized(f"blocks.{i}.attn.qkv", precision, cfg.n_layer, recipe) for i in range(cfg.n_layer)]


def test_recipe_and_generator_are_checked_on_assignment_too():
    """The constructor's checks hold for later assignments and for convert_model: nothing that the
    layer would not emulate, and no generator it cannot draw from, gets in."""
    with pytest.raises(NotImplementedError, match="backward_override"):
        NVFP4Linear(32, 16, recipe=NVFP4Recipe(backward_override="high_precision"))
    layer = NVFP4Linear(32, 16)
    with pytest.raises(NotImplementedError, match="backward_override"):
        layer.recipe = NVFP4Recipe(backward_override="high_precision")
    with pytest.raises(TypeError, match="recipe must be an NVFP4Recipe"):
        layer.recipe = {"disable_rht": True}
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        NVFP4Linear(32, 16, generator=123)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        layer.generator = 123
    assert layer.recipe == NVFP4Recipe() and layer.generator is None   # the refused values left no trace
    layer.generator = torch.Generator().manual_seed(1)
    model = GPT(get_preset("ci"))
    with pytest.raises(TypeError, match="recipe must be an NVFP4Recipe"):
        convert_model(model, "nvfp4", recipe={"disable_rht": True})
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        convert_model(model, "nvfp4", generator=123)
