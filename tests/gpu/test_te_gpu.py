"""GPU tests for nvfp4lab.te and nvfp4lab.capabilities against the real Transformer Engine.

Run on the GPU machine: ``PYTHONPATH=. python -m pytest -m gpu tests/gpu/test_te_gpu.py -q``.
Skipped without a CUDA GPU or without an importable TE 2.20 (the skip message says why).

What is checked:

* the probe's per-format answers are TE's own ``is_*_available(return_reason=True)``;
* ``make_recipe`` builds the real TE recipes with the NVFP4 flags carried over;
* FP8 recipes (current, delayed, block when available) train a small GPT-like stack
  (embedding → ``te.Linear(bias=True)`` → ``te.TransformerLayer`` → BF16 head via nested
  ``autocast(enabled=False)``) for 20 steps: finite losses that fall;
* ``NVFP4BlockScaling`` below SM 10.0 is refused by ``nvfp4lab.te.autocast`` with the
  probe's message, before TE is entered, and FP8 still works afterwards;
* ``CustomRecipe(qfactory=nvfp4_ref_rht_2d_factory)`` (TE's NVFP4 reference emulation)
  runs forward and backward through bias-free ``te.Linear`` / ``te.LayerNormLinear``
  with K % 32 == 0 and tokens % 16 == 0 (TE reference qgemm), and the result differs from
  BF16 by what NVFP4 quantization should cost (relative Frobenius error in 2 %–30 %;
  ~14 % expected for Gaussian operands with 1x16 activation and 16x16 weight blocks);
* nvfp4lab's quantizers equal TE's reference quantizers bit for bit on the GPU, and
  nvfp4lab's ``NVFP4Linear`` (SR off, RHT and 2D on) agrees with the reference recipe on a
  bias-free ``te.Linear`` (y, dX, dW within 1e-3 relative; the reason is given below);
* the TE GPT of ``nvfp4lab.te_model`` (``--backend te``): weights copied from nvfp4lab's GPT
  give the same block outputs, it trains 20 steps under FP8 current scaling with a falling
  loss (both block implementations), NVFP4 is refused when it is built on Hopper, and TE's
  NVFP4 reference runs one step through its ``te.LayerNormLinear`` / ``te.Linear`` blocks;
* TE 2.20.2 cannot train ``te.LayerNormMLP`` under the NVFP4 reference recipe (a known-bug test
  that fails once TE fixes it).
"""

from __future__ import annotations

import importlib
import math
import types

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

T = importlib.import_module("nvfp4lab.te")
P = importlib.import_module("nvfp4lab.capabilities")

try:
    te = T.require_te()
except T.TransformerEngineUnavailable as exc:  # not installed, or a broken install
    pytest.skip(str(exc), allow_module_level=True)

NVFP4_REASON = "Device compute capability 10.0 or higher required for NVFP4 execution."
CC = torch.cuda.get_device_capability()
BF16 = torch.bfloat16

TE_CHECKS = {
    "fp8-delayed": "is_fp8_available",
    "fp8-current": "is_fp8_available",
    "fp8-block": "is_fp8_block_scaling_available",
    "mxfp8": "is_mxfp8_available",
    "nvfp4": "is_nvfp4_available",
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error ||a - b|| / ||b||, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _require_native(key: str) -> None:
    support = P.recipe_support(key, te)
    if not support.native:
        pytest.skip(f"{key} not native here: {support.reason}")


# --------------------------------------------------------------------------- probe


def test_probe_reports_te_own_answers():
    caps = P.probe()
    assert caps.gpu_available and caps.compute_capability == CC
    assert caps.transformer_engine.importable and caps.transformer_engine.version
    for key, fn_name in TE_CHECKS.items():
        ok, reason = getattr(te, fn_name)(return_reason=True)
        f = caps.format(key)
        assert (f.native, f.reason) == (ok, "" if ok else reason), key
        assert f.source == P.SOURCE_TE
    # The CPU-side rules agree with TE on this machine.
    rules = P.format_support(caps.compute_capability, caps.cuda_version)
    for key in TE_CHECKS:
        assert rules[key].native == caps.format(key).native, (key, rules[key], caps.format(key))
    assert caps.mode == ("native-te" if caps.format("nvfp4").native else "fast-emulation")
    if CC < (10, 0):
        assert caps.format("nvfp4").reason == NVFP4_REASON
    assert "recommendation:" in P.format_table(caps)


# --------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("sr", [False, True])
@pytest.mark.parametrize("two_d", [False, True])
def test_make_recipe_against_real_te(rht, sr, two_d):
    from transformer_engine.common import recipe as R

    ours = types.SimpleNamespace(disable_rht=rht, disable_stochastic_rounding=sr, disable_2d_quantization=two_d)
    r = T.make_recipe("nvfp4", ours)
    assert isinstance(r, R.NVFP4BlockScaling)
    assert (r.disable_rht, r.disable_stochastic_rounding, r.disable_2d_quantization) == (rht, sr, two_d)
    assert r.fp4_quant_fwd_inp.random_hadamard_transform is (not rht)
    assert r.fp4_quant_bwd_grad.random_hadamard_transform is (not rht)
    assert r.fp4_quant_bwd_grad.stochastic_rounding is (not sr)
    assert r.fp4_quant_fwd_weight.fp4_2d_quantization is (not two_d)
    for name, cls in [
        ("fp8-current", R.Float8CurrentScaling),
        ("fp8-delayed", R.DelayedScaling),
        ("fp8-block", R.Float8BlockScaling),
        ("mxfp8", R.MXFP8BlockScaling),
        ("nvfp4-reference", R.CustomRecipe),
    ]:
        assert isinstance(T.make_recipe(name), cls)


def test_reference_factory_roles_with_real_quantizers():
    from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import nvfp4_ref_rht_2d_factory

    assert T.make_recipe("nvfp4-reference").qfactory is nvfp4_ref_rht_2d_factory
    flags = types.SimpleNamespace(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    q = T.make_recipe("nvfp4-reference", flags).qfactory
    weight = q(types.SimpleNamespace(module_type="linear", tensor_type="weight", name=""))
    act = q(types.SimpleNamespace(module_type="linear", tensor_type="input", name=""))
    assert weight.quant_tile_shape == (1, 16) and not weight.with_rht
    assert act.quant_tile_shape == (1, 16) and not act.with_rht
    ref_w = nvfp4_ref_rht_2d_factory(types.SimpleNamespace(module_type="linear", tensor_type="weight", name=""))
    assert ref_w.quant_tile_shape == (16, 16)


# --------------------------------------------------------------------------- FP8 training


class TinyTEGPT(torch.nn.Module):
    """Embedding → te.Linear(bias=True) → te.TransformerLayer → te.Linear head in BF16.

    Shapes: tokens ``[seq, batch]`` (TE's default "sbhd" layout) → logits ``[seq, batch, vocab]``.
    All GEMM dimensions are multiples of 128, as FP8 block scaling likes them.
    """

    def __init__(self, vocab: int = 256, hidden: int = 128, ffn: int = 512, heads: int = 4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden, device="cuda", dtype=BF16)
        self.proj = te.Linear(hidden, hidden, bias=True, params_dtype=BF16)
        self.block = te.TransformerLayer(
            hidden,
            ffn,
            heads,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            self_attn_mask_type="causal",
            params_dtype=BF16,
        )
        self.head = te.Linear(hidden, vocab, bias=True, params_dtype=BF16)

    def forward(self, tokens: torch.Tensor, recipe) -> torch.Tensor:
        x = self.emb(tokens)
        with T.autocast(recipe):
            x = self.block(self.proj(x))
            with T.autocast(recipe, enabled=False):  # last layer kept in BF16
                return self.head(x)


@pytest.mark.parametrize("name", ["fp8-current", "fp8-delayed", "fp8-block"])
def test_fp8_recipe_trains_small_gpt(name):
    _require_native(name)
    torch.manual_seed(0)
    model = TinyTEGPT()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (32, 4), device="cuda")  # 128 tokens, fixed batch
    recipe = T.make_recipe(name)
    losses = []
    for _ in range(20):
        logits = model(tokens, recipe)
        loss = torch.nn.functional.cross_entropy(logits[:-1].float().reshape(-1, 256), tokens[1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    assert abs(losses[0] - math.log(256)) < 1.0, losses  # starts near chance
    assert losses[-1] < 0.5 * losses[0], losses  # a fixed batch is memorized
    for p in model.parameters():
        assert torch.isfinite(p).all()


def test_fp8_linear_fwd_bwd_with_bias():
    _require_native("fp8-current")
    torch.manual_seed(0)
    lin = te.Linear(256, 128, bias=True, params_dtype=BF16)
    x = torch.randn(64, 256, device="cuda", dtype=BF16, requires_grad=True)
    with T.autocast("fp8-current"):
        y = lin(x)
    y.float().square().mean().backward()
    ref = torch.nn.functional.linear(x.detach(), lin.weight.detach(), lin.bias.detach())
    assert _rel(y, ref) < 0.1  # FP8 E4M3: ~2^-4 relative per operand
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all() and lin.bias.grad is not None


# --------------------------------------------------------------------------- NVFP4 refused


@pytest.mark.skipif(CC >= (10, 0), reason="NVFP4 is native on SM >= 10.0")
def test_nvfp4_block_scaling_refused_with_probe_message():
    lin = te.Linear(128, 128, bias=True, params_dtype=BF16)
    x = torch.randn(32, 128, device="cuda", dtype=BF16)
    with pytest.raises(T.NVFP4NotSupported) as info:
        with T.autocast(T.make_recipe("nvfp4")):
            pytest.fail("the body must not run")
    msg = str(info.value)
    probe_reason = P.probe().format("nvfp4").reason
    assert probe_reason == NVFP4_REASON == info.value.reason
    assert te.is_nvfp4_available(return_reason=True) == (False, NVFP4_REASON)
    assert probe_reason in msg
    assert T.FALLBACKS in msg  # "use --precision fp8 with --backend te, or ... --backend nvfp4lab"
    # TE's global state was never touched: FP8 works right after.
    with T.autocast("fp8-current"):
        y = lin(x)
    assert torch.isfinite(y).all()


# --------------------------------------------------------------------------- NVFP4 reference emulation


@pytest.mark.parametrize(
    "flags",
    [
        None,  # TE's nvfp4_ref_rht_2d_factory itself
        types.SimpleNamespace(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True),
    ],
    ids=["rht-2d", "no-rht-1d"],
)
def test_nvfp4_reference_recipe_on_bias_free_linear(flags):
    _require_native("fp8-current")  # TE gates CustomRecipe on its generic FP8 check (SM >= 8.9)
    torch.manual_seed(0)
    tokens, k, n = 64, 256, 128  # K % 32 == 0 for every GEMM (k, n, tokens); tokens % 16 == 0 for RHT
    lin = te.Linear(k, n, bias=False, params_dtype=BF16)
    w = lin.weight.detach().clone().requires_grad_()
    x = torch.randn(tokens, k, device="cuda", dtype=BF16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    g = torch.randn(tokens, n, device="cuda", dtype=BF16)
    with T.autocast(T.make_recipe("nvfp4-reference", flags)):
        y = lin(x)
    y.backward(g)
    y_ref = torch.nn.functional.linear(x_ref, w)
    y_ref.backward(g)
    assert y.shape == (tokens, n) and y.dtype == BF16
    for what, got, want in [("y", y, y_ref), ("dx", x.grad, x_ref.grad), ("dw", lin.weight.grad, w.grad)]:
        assert torch.isfinite(got).all(), what
        err = _rel(got, want)
        # NVFP4 costs ~10 % per Gaussian operand (E2M1 has 1 mantissa bit); BF16-vs-BF16 is ~0.3 %.
        assert 0.02 < err < 0.30, (what, err)


def test_nvfp4_reference_recipe_on_layernorm_linear():
    _require_native("fp8-current")
    torch.manual_seed(0)
    mod = te.LayerNormLinear(256, 128, bias=False, params_dtype=BF16)
    x = torch.randn(4, 16, 256, device="cuda", dtype=BF16, requires_grad=True)  # 64 tokens
    with T.autocast("nvfp4-reference"):
        y = mod(x)
    y.float().square().mean().backward()
    assert y.shape == (4, 16, 128) and torch.isfinite(y).all()
    assert torch.isfinite(x.grad).all() and torch.isfinite(mod.weight.grad).all()
    assert x.grad.abs().sum() > 0


# --------------------------------------------------------------------------- nvfp4lab vs TE's NVFP4 reference
#
# nvfp4lab's NVFP4Linear with SR disabled (TE's reference has no SR), RHT and 2D weights on, must
# compute what TE's CustomRecipe(nvfp4_ref_rht_2d_factory) computes on a bias-free te.Linear.
# The quantizers agree bit for bit (codes, E4M3 scales, amaxes), and the per-tensor factor is the
# same FP32 expression, so the GEMM results differ only in FP32 summation order: TE's reference
# qgemm adds one exact 16-wide block product per K block in a Python loop, nvfp4lab runs one FP32
# matmul over code*scale values. Every product is exact in FP32 and, for data like these, so are
# the partial sums, so the outputs come out bit-identical (measured on an H100 and an H200,
# 2026-11-22); in general an order difference is ~1e-7 relative per element before the BF16
# output cast and at most one BF16 ulp after it, in a small fraction of elements. Tolerance: relative
# Frobenius difference <= 1e-3 and no element off by more than one BF16 ulp of the largest
# output (2^-7 * max|out|) - 8x below TE's own NVFP4 GEMM tolerance (atol = rtol = 8e-3) and ~100x
# below NVFP4's quantization error (~10 %), so a wrong tile, scale, RHT sign or transpose fails.

REF_REL_TOL = 1e-3


def _ref_role(tensor_type: str):
    return types.SimpleNamespace(module_type="linear", tensor_type=tensor_type, name="")


def test_nvfp4lab_quantizers_bit_exact_with_te_reference_on_gpu():
    from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import nvfp4_ref_rht_2d_factory

    from nvfp4lab.quantize import quantize

    torch.manual_seed(0)
    w = 0.02 * torch.randn(256, 512, device="cuda", dtype=BF16)
    x = torch.randn(128, 512, device="cuda", dtype=BF16)
    qw = nvfp4_ref_rht_2d_factory(_ref_role("weight")).quantize(w)
    assert qw._quantizer.quant_tile_shape == (16, 16) and not qw._quantizer.with_rht
    ow, owt = quantize(w, block="2d"), quantize(w.t().contiguous(), block="2d")
    assert torch.equal(ow.data, qw.data) and torch.equal(owt.data, qw.data_t)
    assert torch.equal(ow.rowwise_scale.view(torch.uint8), qw.scale.view(torch.uint8)[:256])
    assert torch.equal(owt.rowwise_scale.view(torch.uint8), qw.scale_t.view(torch.uint8)[:512])
    assert torch.equal(ow.amax.reshape(1), qw.global_amax_row.reshape(1))
    qx = nvfp4_ref_rht_2d_factory(_ref_role("input")).quantize(x)
    ox, oxt = quantize(x), quantize(x.t().contiguous(), rht=True)
    assert torch.equal(ox.data, qx.data) and torch.equal(ox.scale.view(torch.uint8), qx.scale.view(torch.uint8))
    assert torch.equal(oxt.data, qx.data_t) and torch.equal(oxt.scale.view(torch.uint8), qx.scale_t.view(torch.uint8))
    assert torch.equal(ox.amax.reshape(1), qx.global_amax_row.reshape(1))
    assert torch.equal(oxt.amax.reshape(1), qx.global_amax_col.reshape(1))  # post-RHT amax


def test_nvfp4linear_matches_te_nvfp4_reference_linear():
    _require_native("fp8-current")  # CustomRecipe is gated on TE's generic FP8 check
    from nvfp4lab.linear import NVFP4Linear
    from nvfp4lab.recipe import NVFP4Recipe

    torch.manual_seed(0)
    M, K, N = 256, 512, 256  # K % 32 == 0 for all three GEMMs (K, N and M), M % 16 == 0 for the RHT
    lin = te.Linear(K, N, bias=False, params_dtype=BF16)
    w = lin.weight.detach().clone()
    x = torch.randn(M, K, device="cuda", dtype=BF16)
    g = torch.randn(M, N, device="cuda", dtype=BF16)
    x_te = x.clone().requires_grad_()
    with T.autocast(T.make_recipe("nvfp4-reference")):
        y_te = lin(x_te)
    y_te.backward(g)

    ours = NVFP4Linear(K, N, bias=False, device="cuda", dtype=BF16,
                       recipe=NVFP4Recipe(disable_stochastic_rounding=True))  # RHT and 2D stay on
    with torch.no_grad():
        ours.weight.copy_(w)
    x_l = x.clone().requires_grad_()
    y_l = ours(x_l)
    y_l.backward(g)

    exact = {"y": x.double() @ w.double().t(), "dx": g.double() @ w.double(), "dw": g.double().t() @ x.double()}
    for what, got, want in [("y", y_l, y_te), ("dx", x_l.grad, x_te.grad), ("dw", ours.weight.grad, lin.weight.grad)]:
        assert got.dtype == want.dtype == BF16 and got.shape == want.shape, what
        rel = _rel(got, want)
        assert rel <= REF_REL_TOL, (what, rel)
        max_diff = (got.float() - want.float()).abs().max().item()
        assert max_diff <= 2.0**-7 * want.float().abs().max().item(), (what, max_diff)
        # Both carry NVFP4's error against the unquantized product (not a trivially passing test).
        assert 0.02 < _rel(want, exact[what]) < 0.30, what


# --------------------------------------------------------------------------- the TE GPT (nvfp4lab.te_model)


def _byte_batches(batch: int, seq: int, steps: int, seed: int = 0):
    from nvfp4lab.data import ByteTokenizer, get_batch, load_corpus, split_tokens

    split = split_tokens(ByteTokenizer().encode(load_corpus(None).text))
    gen = torch.Generator().manual_seed(seed)
    return [get_batch(split.train, batch, seq, gen) for _ in range(steps)]


@pytest.mark.parametrize("block_impl, tol", [("transformer_layer", 2e-2), ("modules", 1e-3)])
def test_te_gpt_blocks_match_nvfp4lab_gpt_blocks(block_impl, tol):
    """Weights copied from nvfp4lab's GPT give the same residual-branch outputs (FP32, no autocast).

    What remains: the attention backend (~1e-6) and, for te.TransformerLayer only, TE's
    tanh-approximated GELU (vs torch's erf GELU, ~1e-3 relative). A wrong QKV layout or a
    swapped weight would be O(1).
    """
    from nvfp4lab.model import GPT, get_preset
    from nvfp4lab.te_model import build_te_model

    cfg = get_preset("ci")
    torch.manual_seed(0)
    gpt = GPT(cfg).cuda()
    torch.manual_seed(0)
    tem = build_te_model(cfg, "fp32", device="cuda", block_impl=block_impl)  # same seed -> same weights
    assert tem.block_impl == block_impl
    assert torch.equal(tem.wte.weight.cpu(), gpt.wte.weight.cpu())
    x = torch.randn(2, 64, cfg.n_embd, device="cuda")
    for i in range(cfg.n_layer):
        want = gpt.blocks[i](x) - x
        got = tem.blocks[i](x) - x
        assert _rel(got, want) < tol, (i, _rel(got, want))
    idx, tgt = _byte_batches(4, 64, 1)[0]
    _, l_gpt = gpt(idx.cuda(), tgt.cuda())
    _, l_te = tem(idx.cuda(), tgt.cuda())
    assert abs(l_gpt.item() - l_te.item()) < 1e-2


@pytest.mark.parametrize("block_impl", ["transformer_layer", "modules"])
def test_te_gpt_trains_20_steps_under_fp8_current_scaling(block_impl):
    _require_native("fp8-current")
    from transformer_engine.common import recipe as R

    from nvfp4lab.model import get_preset
    from nvfp4lab.te_model import build_te_model

    cfg = get_preset("ci")  # 3 blocks, width 64, context 64
    torch.manual_seed(0)
    model = build_te_model(cfg, "fp8", device="cuda", block_impl=block_impl)
    assert isinstance(model.te_recipe, R.Float8CurrentScaling) and model.block_quantized == [True] * 3
    assert model.layer_counts() == {"nvfp4": 0, "fp8": 12, "high": 1}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    losses = []
    for idx, tgt in _byte_batches(8, 64, 20):
        with torch.autocast("cuda", dtype=BF16):
            _, loss = model(idx.cuda(), tgt.cuda())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    assert abs(losses[0] - math.log(256)) < 0.5, losses  # starts at chance
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, losses  # byte statistics are learned within 20 steps
    for p in model.parameters():
        assert torch.isfinite(p).all()


@pytest.mark.skipif(CC >= (10, 0), reason="NVFP4 is native on SM >= 10.0")
def test_te_gpt_nvfp4_refused_at_build_time():
    from nvfp4lab.model import get_preset
    from nvfp4lab.te_model import build_te_model

    with pytest.raises(T.NVFP4NotSupported) as info:
        build_te_model(get_preset("ci"), "nvfp4", device="cuda")
    assert info.value.reason == NVFP4_REASON and T.FALLBACKS in str(info.value)


def _layernorm_mlp_step(recipe) -> torch.Tensor:
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(64, 256, bias=False, params_dtype=BF16)
    x = torch.randn(4, 64, 64, device="cuda", dtype=BF16, requires_grad=True)  # 256 tokens
    with T.autocast(recipe):
        y = mlp(x)
    y.float().square().mean().backward()
    return mlp.fc2_weight.grad


def test_te_reference_factory_cannot_train_layernorm_mlp():
    """TE 2.20.2 bug (why nvfp4lab.te_model uses block_impl="modules" for nvfp4-reference):
    te.LayerNormMLP's backward under nvfp4_ref_rht_2d_factory fails in a Wgrad GEMM (FC2: the
    FC2 input has no columnwise copy and NVFP4TensorRef._create_transpose transposes packed FP4
    bytes; FC1: custom_gemm takes grad=False as an Fprop). If this starts passing, TE fixed it."""
    _require_native("fp8-current")
    with pytest.raises(ValueError, match="K dimension mismatch"):
        _layernorm_mlp_step(T.make_recipe("nvfp4-reference"))


def test_te_gpt_nvfp4_reference_step():
    """TE's NVFP4 emulation through the TE GPT (te.LayerNormLinear / te.Linear blocks): one finite step."""
    _require_native("fp8-current")
    from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import nvfp4_ref_rht_2d_factory

    from nvfp4lab.model import get_preset
    from nvfp4lab.te_model import build_te_model

    cfg = get_preset("ci")
    torch.manual_seed(0)
    model = build_te_model(cfg, "nvfp4-reference", device="cuda")  # block_impl "auto" -> "modules"
    assert model.block_impl == "modules" and model.block_quantized == [False, True, False]
    assert model.te_recipe.qfactory is nvfp4_ref_rht_2d_factory
    idx, tgt = _byte_batches(4, 64, 1)[0]  # 256 tokens: % 32 for the Wgrad GEMM, % 16 for the RHT
    with torch.autocast("cuda", dtype=BF16):
        _, loss = model(idx.cuda(), tgt.cuda())
    loss.backward()
    assert math.isfinite(loss.item())
    for layer in (model.blocks[1].attn.qkv, model.blocks[1].attn.proj, model.blocks[1].mlp.fc,
                  model.blocks[1].mlp.proj):
        g = layer.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
