"""Test helpers for NVFP4 code: bit-for-bit equality of quantized tensors.

Used by nvfp4lab's own tests and the book (chapter 8), and meant for code that builds on nvfp4lab:
a kernel, a fused path or another framework's quantizer is checked against :func:`nvfp4lab.quantize`
with :func:`assert_nvfp4_equal`.
"""

from __future__ import annotations

import torch

from .hadamard import WGRAD_SIGNS
from .quantize import NVFP4Tensor

__all__ = ["assert_nvfp4_equal"]


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a != b).nonzero()
    first = tuple(int(i) for i in diff[0])
    return f"{len(diff)} of {a.numel()} differ, first at {first}: {a[first].item()} vs {b[first].item()}"


def assert_nvfp4_equal(actual: NVFP4Tensor | None, expected: NVFP4Tensor, *, check_dtype: bool = True,
                       msg: str = "") -> None:
    """Assert that two NVFP4 tensors are bit-identical.

    Compared, in this order: the logical shape, the block layout (``"1d"``/``"2d"``), the RHT flag
    and its signs, the original dtype (if ``check_dtype``), the FP32 amax (bits), the E4M3 block
    scales (as bytes) and the packed E2M1 codes. Tensors on different devices are compared on the
    CPU. The rounding mode is not compared: RNE and SR results are compared through their codes.

    Args:
        actual: the tensor under test (``None`` fails: e.g. a fast path that declined).
        expected: the reference, usually from :func:`nvfp4lab.quantize`.
        check_dtype: also require the same original dtype.
        msg: prefix for the failure message (which operand, which case).

    Raises:
        AssertionError: naming the first field that differs; for scales and codes also how many
            bytes differ and where the first one is.
    """
    where = f"{msg}: " if msg else ""
    assert actual is not None, f"{where}got None instead of an NVFP4Tensor"
    assert tuple(actual.shape) == tuple(expected.shape), f"{where}shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert actual.block == expected.block, f"{where}block {actual.block!r} vs {expected.block!r}"
    assert actual.rht == expected.rht, f"{where}rht {actual.rht} vs {expected.rht}"
    if actual.rht:
        signs = [torch.as_tensor(WGRAD_SIGNS if t.rht_signs is None else t.rht_signs, dtype=torch.float32).cpu()
                 for t in (actual, expected)]   # None: TE's default Wgrad signs
        assert torch.equal(*signs), f"{where}RHT signs differ"
    if check_dtype:
        assert actual.dtype == expected.dtype, f"{where}dtype {actual.dtype} vs {expected.dtype}"
    a_amax, e_amax = actual.amax.detach().cpu(), expected.amax.detach().cpu()
    assert a_amax.shape == e_amax.shape and torch.equal(a_amax.view(torch.int32), e_amax.view(torch.int32)), \
        f"{where}amax {a_amax.tolist()} vs {e_amax.tolist()}"
    for name, a, e in (("E4M3 scale bytes", actual.scale.view(torch.uint8), expected.scale.view(torch.uint8)),
                       ("packed E2M1 codes", actual.data, expected.data)):
        a, e = a.detach().cpu(), e.detach().cpu()
        assert a.shape == e.shape, f"{where}{name}: shape {tuple(a.shape)} vs {tuple(e.shape)}"
        assert torch.equal(a, e), f"{where}{name}: {_first_difference(a, e)}"
