"""nvfp4lab's quantizer on CUDA: bit-identical to its CPU path and to TE 2.20's reference.

Run on a GPU machine: ``pytest -m gpu tests/gpu``. The TE comparison needs
Transformer Engine 2.20 installed and is skipped otherwise.
"""

import functools
import pytest
import torch

from nvfp4lab import quantize
from nvfp4lab.testing import assert_nvfp4_equal

pytestmark = pytest.mark.gpu

# TE's test_nvfp4_quantize_exact.py shape list (tests/pytorch/nvfp4), plus odd shapes.
TE_SHAPES = [(128, 128), (256, 256), (256, 1024), (1024, 256), (256, 272), (304, 304), (320, 256),
             (2048, 2048), (1024, 2048), (2048, 1024), (8192, 8192)]
CPU_SHAPES = [(128, 128), (256, 272), (304, 304), (1024, 2048), (3, 40, 48), (17, 33)]


_same = functools.partial(assert_nvfp4_equal, check_dtype=False)

@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block,rht", [("1d", False), ("2d", False), ("1d", True)])
def test_cuda_equals_cpu(shape, dtype, block, rht):
    if rht and shape[-1] % 16:
        pytest.skip("RHT needs K % 16 == 0")
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    _same(quantize(x.cuda(), block=block, rht=rht), quantize(x, block=block, rht=rht))


def _te_ref(tile, rht):
    te_ref = pytest.importorskip("transformer_engine.pytorch.custom_recipes.reference_nvfp4")
    from transformer_engine.pytorch.custom_recipes import reference_utils
    return te_ref.NVFP4QuantizerRef(dtype=reference_utils.Fp4Formats.E2M1, rowwise=True, columnwise=True,
                                    quant_tile_shape=tile, pow_2_scales=False, with_rht=rht)


@pytest.mark.parametrize("shape", TE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block", ["1d", "2d"])
def test_cuda_equals_te_reference(shape, dtype, block):
    ref = _te_ref((1, 16) if block == "1d" else (16, 16), False)
    x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(dtype)
    r = ref.quantize(x)
    M, N = shape
    row, col = quantize(x, block=block), quantize(x.t(), block=block)
    assert torch.equal(row.data, r.data)
    assert torch.equal(row.rowwise_scale.view(torch.uint8), r.scale.view(torch.uint8)[:M])
    assert torch.equal(col.data, r.data_t)
    assert torch.equal(col.rowwise_scale.view(torch.uint8), r.scale_t.view(torch.uint8)[:N])
    assert torch.equal(row.amax.reshape(1), r.global_amax_row)
    assert torch.equal(col.amax.reshape(1), r.global_amax_col)


@pytest.mark.parametrize("shape", [(128, 128), (256, 1024), (1024, 256), (304, 304), (2048, 2048), (8192, 8192)], ids=str)
def test_cuda_rht_equals_te_reference(shape):
    ref = _te_ref((1, 16), True)
    x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(torch.bfloat16)
    r = ref.quantize(x)
    col = quantize(x.t(), rht=True)
    assert torch.equal(col.amax.reshape(1), r.global_amax_col)
    assert torch.equal(col.data, r.data_t)
    assert torch.equal(col.scale.view(torch.uint8), r.scale_t.view(torch.uint8)[: shape[1]])


def test_sr_same_seed_same_codes_on_cuda():
    x = torch.randn(256, 256, device="cuda")
    a = quantize(x, rounding="stochastic", generator=torch.Generator("cuda").manual_seed(7))
    b = quantize(x, rounding="stochastic", generator=torch.Generator("cuda").manual_seed(7))
    assert torch.equal(a.data, b.data)
