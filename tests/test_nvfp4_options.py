"""4over6, the 256 bound and row-scaled NVFP4 (TE 2.20 ``NVFP4BlockScaling`` options, issue 15).

Exact answers worked out by hand, no TE needed. With ``e4m3_max=256`` and a tensor amax of 6 every
FP32 step below is exact: ``S_enc = 1536/6 = 256``, ``S_dec = 2^-8``, a block whose amax is 6 has
``base = RN(6/6)·256 = 256``, so map-to-6 uses scale 256 (encode scale 1: ``x`` itself is rounded to
E2M1) and map-to-4 uses scale ``384 = 1.5·256`` (encode scale ``RN(1/1.5)``: ``x/1.5`` is rounded).
The bit-exactness against TE's own reference is checked by ``test_te_golden_nvfp4_options.py``.
"""

import pytest
import torch

from nvfp4lab import kernels
from nvfp4lab.formats import decode_e2m1
from nvfp4lab.quantize import nvfp4_matmul, quantize
from nvfp4lab.recipe import NVFP4Recipe


def _row(*vals):
    return list(vals) + [0.0] * (16 - len(vals))


# map-to-4 wins: x/1.5 = [4, 3, 2, 1] is on the E2M1 grid (error 0); map-to-6 rounds 4.5 to 4 (error 0.5)
BLOCK_MAP4 = _row(6.0, 4.5, 3.0, 1.5)
# map-to-6 wins: [6, 4, 2, 1, 0.5] is on the grid (error 0); /1.5 gives 2.67 -> 3 (4.5), 1.33 -> 1.5, ...
BLOCK_MAP6 = _row(6.0, 4.0, 2.0, 1.0, 0.5)
# a tie with non-zero error: 0.25 -> 0 (RNE tie) under map-to-6 and 0.1667 -> 0 under map-to-4:
# both errors are 0.25, and a tie keeps map-to-6 (TE: pick map-to-4 iff err4 < err6)
BLOCK_TIE = _row(6.0, 0.25)


def _codes(q):
    return q.codes().tolist()


@pytest.mark.parametrize("err_mode", ["MAE", "MSE"])
def test_4over6_hand_computed_blocks(err_mode):
    x = torch.tensor([BLOCK_MAP4 + BLOCK_MAP6 + BLOCK_TIE])
    q = quantize(x, four_over_six=True, e4m3_max=256, err_mode=err_mode)
    assert q.scale.float().tolist() == [[384.0, 256.0, 256.0]]
    assert float(q.amax) == 6.0
    codes = _codes(q)[0]
    assert codes[:16] == _row(6, 5, 4, 2)            # 4, 3, 2, 1 (x 384/256 = 1.5)
    assert codes[16:32] == _row(7, 6, 4, 2, 1)       # 6, 4, 2, 1, 0.5
    assert codes[32:48] == _row(7, 0)                # 6, 0
    deq = q.dequantize()[0]
    assert deq[:16].tolist() == BLOCK_MAP4           # exact
    assert deq[16:32].tolist() == BLOCK_MAP6         # exact
    assert deq[32:48].tolist() == _row(6.0, 0.0)


def test_4over6_off_is_the_default_path_bit_for_bit():
    x = torch.randn(48, 80, generator=torch.Generator().manual_seed(1))
    a, b = quantize(x), quantize(x, four_over_six=False, row_scaled=False)
    assert torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))


def test_4over6_with_448_and_block_at_the_tensor_amax_is_a_tie():
    # base = 448: map-to-4's 672 clips to 448 = map-to-6's scale, the candidates are equal
    x = torch.tensor([BLOCK_MAP4])
    q = quantize(x, four_over_six=True, e4m3_max=448)
    assert q.scale.float().tolist() == [[448.0]]
    assert _codes(q)[0] == _row(7, 6, 5, 3)          # 6, 4 (4.5 tie -> even), 3, 1.5


def test_4over6_2d_one_choice_per_tile():
    x = torch.zeros(16, 32)
    x[0, :16] = torch.tensor(BLOCK_MAP4)
    x[5, 16:] = torch.tensor(BLOCK_MAP6)
    q = quantize(x, block="2d", four_over_six=True, e4m3_max=256)
    assert q.scale.float().tolist() == [[384.0, 256.0]]
    assert q.dequantize()[0, :16].tolist() == BLOCK_MAP4 and q.dequantize()[5, 16:].tolist() == BLOCK_MAP6


def test_4over6_underflowed_block_keeps_te_saturation():
    # block amax 1e-8 against tensor amax 6: base underflows to E4M3 0 for both candidates, the encode
    # scale is FLT_MAX and the non-zero element saturates to code 7 (TE does not special-case this)
    x = torch.tensor([_row(6.0) + _row(1e-8)])
    q = quantize(x, four_over_six=True, e4m3_max=256)
    assert q.scale.float().tolist() == [[256.0, 0.0]]
    assert _codes(q)[0][16] == 7
    assert q.dequantize()[0, 16].item() == 0.0


def test_row_scaled_amax_per_row_and_power_of_two_rows():
    base = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    x = torch.cat([base * 2.0 ** k for k in (-3, 0, 5)])
    q = quantize(x, row_scaled=True)
    assert q.amax.shape == (3,)
    assert q.amax.tolist() == x.abs().amax(dim=1).tolist()
    # scaling a row by a power of two leaves its codes and block scales unchanged (per-row S_enc)
    assert torch.equal(q.data[0], q.data[1]) and torch.equal(q.data[1], q.data[2])
    assert torch.equal(q.scale.view(torch.uint8)[0], q.scale.view(torch.uint8)[2])
    # and rows with equal amax quantize as with one per-tensor amax, bit for bit
    y = torch.cat([base, -base])
    assert torch.equal(quantize(y, row_scaled=True).data, quantize(y).data)
    # dequantize and the GEMM use each row's own amax
    deq = q.dequantize()
    assert torch.equal(deq[2], deq[1] * 32.0)
    w = quantize(torch.randn(16, 64, generator=torch.Generator().manual_seed(3)))
    y = nvfp4_matmul(q, w)
    assert torch.allclose(y, q.dequantize() @ w.dequantize().T, rtol=1e-5, atol=1e-5)


def test_kernels_do_not_cover_the_options():
    x = torch.randn(32, 32)
    for kw in (dict(four_over_six=True), dict(row_scaled=True)):
        assert not kernels.covers_quantize(x, block="1d", rounding="nearest", rht=False, sign_mask=0, **kw)
        assert not kernels.covers_rowwise_columnwise(x, block="1d", rounding="nearest", rht=False, sign_mask=0, **kw)


@pytest.mark.parametrize("kw, field", [
    (dict(four_over_six=True, rht=True), "four_over_six"),
    (dict(four_over_six=True, rounding="stochastic"), "four_over_six"),
    (dict(row_scaled=True, rht=True), "row_scaled"),
    (dict(row_scaled=True, block="2d"), "row_scaled"),
    (dict(row_scaled=True, amax=1.0), "row_scaled"),
    (dict(e4m3_max=256), "e4m3_max"),
    (dict(four_over_six=True, e4m3_max=300), "e4m3_max"),
    (dict(four_over_six=True, err_mode="L1"), "err_mode"),
])
def test_quantize_option_errors_name_the_keyword(kw, field):
    with pytest.raises(ValueError, match=field):
        quantize(torch.randn(32, 32), **kw)


def test_recipe_fields_defaults_and_validation():
    r = NVFP4Recipe()
    assert (r.nvfp4_4over6, r.nvfp4_4over6_e4m3_use_256, r.nvfp4_4over6_err_mode, r.row_scaled_activation,
            r.backward_override) == ("none", "all", "MAE", False, None)
    with pytest.raises(ValueError, match="nvfp4_4over6"):
        NVFP4Recipe(nvfp4_4over6="activations")          # RHT on: TE 2.20 rejects it
    with pytest.raises(ValueError, match="row_scaled_activation"):
        NVFP4Recipe(row_scaled_activation=True)
    with pytest.raises(ValueError, match="nvfp4_4over6_err_mode"):
        NVFP4Recipe(nvfp4_4over6_err_mode="mae")
    with pytest.raises(ValueError, match="backward_override"):
        NVFP4Recipe(backward_override="fp32")
    with pytest.raises(ValueError, match="nvfp4_4over6_e4m3_use_256"):
        NVFP4Recipe(nvfp4_4over6_e4m3_use_256="grads")
    NVFP4Recipe(nvfp4_4over6="weights")                  # fine with the RHT


def test_recipe_quantize_options_roles():
    r = NVFP4Recipe(nvfp4_4over6="all", nvfp4_4over6_e4m3_use_256="weights", nvfp4_4over6_err_mode="MSE",
                    row_scaled_activation=True, disable_rht=True)
    assert r.quantize_options("weight")["e4m3_max"] == 256
    assert r.quantize_options("weight_columnwise")["four_over_six"] is True
    assert r.quantize_options("input_rowwise") == dict(block="1d", rht=False, rounding="nearest", four_over_six=True,
                                                       e4m3_max=448, err_mode="MSE", row_scaled=True)
    assert "row_scaled" not in r.quantize_options("input_columnwise")
    for role in ("grad_output_rowwise", "grad_output_columnwise"):
        assert "four_over_six" not in r.quantize_options(role) and "row_scaled" not in r.quantize_options(role)
    assert NVFP4Recipe.from_dict(r.to_dict()) == r
    env = {"NVTE_NVFP4_4OVER6": "weights", "NVTE_NVFP4_4OVER6_ERR_MODE": "mse"}
    assert NVFP4Recipe.from_te_env(env).nvfp4_4over6_err_mode == "MSE"


def test_linear_runs_with_the_options():
    from nvfp4lab.linear import NVFP4Linear
    torch.manual_seed(0)
    r = NVFP4Recipe(nvfp4_4over6="all", row_scaled_activation=True, disable_rht=True)
    layer = NVFP4Linear(64, 32, recipe=r)
    x = torch.randn(4, 16, 64, requires_grad=True)
    y = layer(x)
    y.square().mean().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()


def test_cli_train_flags_reach_the_recipe():
    from nvfp4lab import cli
    args = cli.build_parser().parse_args(
        ["train", "--nvfp4-4over6", "all", "--nvfp4-4over6-e4m3-use-256", "weights", "--nvfp4-4over6-err-mode", "MSE",
         "--row-scaled-activation", "--disable-rht"])
    r = cli.config_from_args(args).recipe
    assert (r.nvfp4_4over6, r.nvfp4_4over6_e4m3_use_256, r.nvfp4_4over6_err_mode, r.row_scaled_activation) == (
        "all", "weights", "MSE", True)
    bad = cli.build_parser().parse_args(["train", "--nvfp4-4over6", "activations"])
    with pytest.raises(ValueError, match="nvfp4_4over6"):
        cli.config_from_args(bad)


def test_backward_override_is_refused_by_the_emulated_layer():
    from nvfp4lab.linear import NVFP4Linear
    with pytest.raises(NotImplementedError, match="backward_override"):
        NVFP4Linear(32, 16, recipe=NVFP4Recipe(backward_override="high_precision"))
