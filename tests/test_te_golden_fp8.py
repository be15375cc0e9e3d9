"""nvfp4lab vs golden outputs of Transformer Engine 2.20's FP8 quantizers: current scaling
(``Float8CurrentScalingQuantizer``), FP8 block scaling (``Float8BlockQuantizer``, 1x128 and 128x128)
and MXFP8 (``MXFP8Quantizer``), rowwise and columnwise.

The fixture is written on a GPU machine by ``tests/fixtures/make_te_golden_fp8.py`` (``meta``
records TE/torch versions, device, date, seed, and the cases TE refused). Comparisons are exact:
FP8 data as ``uint8``, scales bit for bit, in TE's layouts (see :func:`_block_scales`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).parent / "fixtures" / "te_golden_fp8.pt"
pytestmark = pytest.mark.skipif(
    not FIXTURE.exists(),
    reason="tests/fixtures/te_golden_fp8.pt is not generated yet: run "
           "`PYTHONPATH=. python3 tests/fixtures/make_te_golden_fp8.py --out tests/fixtures/te_golden_fp8.pt` "
           "on a Hopper GPU with Transformer Engine 2.20")

from nvfp4lab.fp8 import quantize_fp8  # noqa: E402
from nvfp4lab.fp8_recipes import quantize_fp8_block  # noqa: E402
from nvfp4lab.mx import quantize_mxfp8  # noqa: E402

GOLDEN = torch.load(FIXTURE, weights_only=True) if FIXTURE.exists() else {"meta": {}, "inputs": {}, "cases": []}
CASES = GOLDEN["cases"]
DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _ids(c):
    extra = "-".join(f"{k}={c[k]}" for k in ("block_scaling_dim", "power_2_scale", "amax_epsilon") if k in c)
    return f'{c["kind"]}-{c["input"]}-{c["fp8_format"]}-{extra}'


def _x2d(case) -> torch.Tensor:
    x = GOLDEN["inputs"][case["input"]]
    return x.reshape(-1, x.shape[-1])


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_fixture_provenance():
    meta = GOLDEN["meta"]
    assert meta["transformer_engine"].startswith("2.20")
    assert "Float8BlockQuantizer" in meta["oracle"]
    kinds = {c["kind"] for c in CASES}
    assert {"current", "block"} <= kinds, f"TE refused: {[f['error'] for f in meta['failures']][:3]}"


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "current"], ids=_ids)
def test_current_scaling_matches_te(case):
    x2 = _x2d(case)
    ours = quantize_fp8(x2, DTYPE[case["fp8_format"]], use_power_2_scales=case["power_2_scale"],
                        amax_epsilon=case["amax_epsilon"])
    assert torch.equal(_u8(ours.data), case["data"].reshape(x2.shape)), "data"
    assert torch.equal(ours.scale_inv.reshape(1), case["scale_inv"].reshape(-1)[:1]), "scale_inv"
    if case.get("data_t") is not None:
        assert torch.equal(_u8(ours.data.t()), case["data_t"].reshape(x2.shape[1], x2.shape[0])), "transpose"
    if "dequant_rowwise" in case:
        assert torch.equal(ours.dequantize(), case["dequant_rowwise"].reshape(x2.shape))


def _block_scales(te_scale: torch.Tensor, rows: int, cols: int, dim: int) -> torch.Tensor:
    """TE's padded GEMM-ready scale layout -> nvfp4lab's ``[row blocks, col blocks]`` of an ``[rows, cols]``
    operand quantized along ``cols``: 1x128 scales are stored transposed, ``[ceil(cols/128),
    round_up(rows, 4)]``; 128x128 ones as ``[ceil(rows/128), round_up(ceil(cols/128), 4)]``
    (``Float8BlockQuantizer.get_scale_shape``)."""
    nb = -(-cols // 128)
    if dim == 1:
        return te_scale[:nb, :rows].t()
    return te_scale[: -(-rows // 128), :nb]


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "block"], ids=_ids)
def test_block_scaling_matches_te(case):
    x2 = _x2d(case)
    m, k = x2.shape
    dim = case["block_scaling_dim"]
    opts = dict(fp8_dtype=DTYPE[case["fp8_format"]], power_2_scale=case["power_2_scale"],
                amax_epsilon=case["amax_epsilon"])
    block = (1, 128) if dim == 1 else (128, 128)
    row = quantize_fp8_block(x2, block, **opts)
    col = quantize_fp8_block(x2.t().contiguous(), block, **opts) if dim == 1 else row.t()
    assert torch.equal(_u8(row.data), case["data"].reshape(m, k)), "rowwise data"
    assert torch.equal(row.scale_inv, _block_scales(case["scale_inv"], m, k, dim)), "rowwise scale_inv"
    assert torch.equal(_u8(col.data), case["data_t"].reshape(k, m)), "columnwise data (stored transposed)"
    te_col_scale = _block_scales(case["scale_inv_t"], k, m, dim)
    assert torch.equal(col.scale_inv, te_col_scale), "columnwise scale_inv"
    if "dequant_rowwise" in case:
        assert torch.equal(row.dequantize(), case["dequant_rowwise"].reshape(m, k))


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "mxfp8"], ids=_ids)
def test_mxfp8_matches_te(case):
    x2 = _x2d(case)
    m, k = x2.shape
    dtype = DTYPE[case["fp8_format"]]
    row = quantize_mxfp8(x2, dtype)
    col = quantize_mxfp8(x2.t().contiguous(), dtype)
    # MXFP8Quantizer layouts (get_scale_shape): rowwise data [m, k], E8M0 scales [round_up(m, 128),
    # round_up(k/32, 4)]; columnwise data in the input's layout [m, k], scales [round_up(m/32, 4),
    # round_up(k, 128)] (unswizzled: optimize_for_gemm=False)
    assert torch.equal(_u8(row.data), case["data"].reshape(m, k)), "rowwise data"
    assert torch.equal(row.scale_e8m0, case["scale_inv"][:m, : k // 32]), "rowwise E8M0 scales"
    assert torch.equal(_u8(col.data).t(), case["data_t"].reshape(m, k)), "columnwise data"
    assert torch.equal(col.scale_e8m0.t(), case["scale_inv_t"][: m // 32, :k]), "columnwise E8M0 scales"
    if "dequant_rowwise" in case:
        assert torch.equal(row.dequantize(), case["dequant_rowwise"].reshape(m, k))
