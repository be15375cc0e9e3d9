"""Error metrics between a reference tensor and its quantized approximation.

All metrics compute in float64 on the flattened tensors and return Python floats.
``x`` is the reference and ``y`` the approximation; they must have the same shape (``y`` is
moved to ``x``'s device). Non-finite values follow IEEE arithmetic: a NaN in either tensor gives
NaN; ±Inf gives inf or NaN (``inf - inf``), as each function says.
"""

from __future__ import annotations

import math

import torch

__all__ = ["mse", "sqnr_db", "relative_error", "max_abs_error"]


_ARGS = """
    Args:
        x: the reference, a real tensor of any shape.
        y: its approximation, a tensor of the same shape.

    Raises:
        TypeError: ``x`` or ``y`` is not a tensor.
        ValueError: the shapes differ, or the tensors are empty.
    """


def _pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError("metrics take two torch.Tensors")
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    if x.numel() == 0:
        raise ValueError("metrics of an empty tensor are undefined")
    return x.detach().double().flatten(), y.detach().double().flatten().to(x.device)


def mse(x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean squared error ``mean((x - y)²)``, in the squared units of ``x``.

    ``inf`` where one of the two holds ±Inf at a place the other does not; NaN with a NaN, or
    with ±Inf in both at one place.
    """
    x, y = _pair(x, y)
    return float(((x - y) ** 2).mean())


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10·log10(Σx² / Σ(x - y)²)`` in decibels.

    ``+inf`` when ``y == x`` exactly; ``-inf`` when ``x`` is all zero but ``y`` is not, or when
    the noise is infinite and the signal finite (``y`` holds ±Inf where ``x`` does not); NaN when
    either tensor holds NaN or both sums are infinite. Higher is better; each extra bit of a uniform
    quantizer adds ~6.02 dB.
    """
    x, y = _pair(x, y)
    signal = float((x**2).sum())
    noise = float(((x - y) ** 2).sum())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    ratio = signal / noise
    return -math.inf if ratio == 0 else 10.0 * math.log10(ratio)   # log10 keeps NaN and inf


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """Relative Frobenius error ``‖x - y‖₂ / ‖x‖₂``, dimensionless.

    0 when ``y == x`` exactly (both zero included); inf when only ``x`` is zero, or when the
    difference is infinite and ``x`` finite; NaN with a NaN, or when both norms are infinite.
    """
    x, y = _pair(x, y)
    num = float(torch.linalg.vector_norm(x - y))
    den = float(torch.linalg.vector_norm(x))
    if num == 0:
        return 0.0
    return math.inf if den == 0 else num / den


def max_abs_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest absolute difference ``max |x - y|``, in the units of ``x`` (NaN with a NaN)."""
    x, y = _pair(x, y)
    return float((x - y).abs().max())


for _f in (mse, sqnr_db, relative_error, max_abs_error):
    if _f.__doc__:   # None under python -OO
        _f.__doc__ += _ARGS
