"""Test helpers for NVFP4 code: bit-for-bit equality of quantized tensors.

Used by nvfp4lab's own tests and the book (book/08_nvfp4_linear_layer), and meant for code that builds on nvfp4lab:
a kernel, a fused path or another framework's quantizer is checked against :func:`nvfp4lab.quantize`
with :func:`assert_nvfp4_equal`.
"""

from __future__ import annotations

import torch

from .hadamard import WGRAD_SIGNS
from .quantize import NVFP4Tensor

__all__ = ["assert_nvfp4_equal", "rht_rounding_boundary_block"]


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


def rht_rounding_boundary_block(generator: torch.Generator, columns: int = 8,
                                device: torch.device | str = "cpu") -> torch.Tensor:
    """A BF16 ``[16, columns]`` input whose columnwise RHT only an exact butterfly gets right.

    All zero but one column (chosen by ``generator``), a 16-row block holding four non-zeros at
    random rows with random signs: ±4, ±2⁻⁶, ±2⁻²² and ±2⁻⁴⁰. Whatever the RHT's signs, its largest
    output has magnitude (4 + 2⁻⁶ ± 2⁻²² ± 2⁻⁴⁰)/4, a hair from the BF16 rounding boundary
    1 + 2⁻⁸; the exact sum rounded once to FP32 (then to BF16, as TE's reference and
    :func:`nvfp4lab.hadamard.random_hadamard_transform` do) falls on the side the tiny terms say,
    while an FP32 butterfly, rounding at each of its four stages, loses one of them in most draws.
    For checking that a fast RHT (a kernel's butterfly) equals the exact one on the post-RHT amax
    and codes: ``tests/test_kernels.py`` shows that this package's kernels do (their butterfly runs
    in FP64) and that an FP32 butterfly does not.

    Args:
        generator: CPU ``torch.Generator`` for the column, rows and signs.
        columns: width of the block (>= 1); the other columns are zero.
        device: where the result lives.

    Raises:
        ValueError: ``columns < 1``.
    """
    if columns < 1:
        raise ValueError(f"columns must be >= 1, got {columns}")
    x = torch.zeros(16, columns)
    col = int(torch.randint(0, columns, (1,), generator=generator))
    rows = torch.randperm(16, generator=generator)[:4]
    signs = torch.where(torch.rand(4, generator=generator) < 0.5, -1.0, 1.0)
    x[rows, col] = signs * torch.tensor([4.0, 2.0 ** -6, 2.0 ** -22, 2.0 ** -40])
    return x.to(torch.bfloat16).to(device)
