"""Error metrics between a reference tensor and its quantized approximation.

All metrics compute in float64 on the flattened tensors and return Python floats.
``x`` is the reference and ``y`` the approximation; they must have the same shape.
"""

from __future__ import annotations

import math

import torch

__all__ = ["mse", "sqnr_db", "relative_error", "max_abs_error"]


def _pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError("metrics take two torch.Tensors")
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    if x.numel() == 0:
        raise ValueError("metrics of an empty tensor are undefined")
    return x.detach().double().flatten(), y.detach().double().flatten().to(x.device)


def mse(x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean squared error ``mean((x - y)²)``."""
    x, y = _pair(x, y)
    return float(((x - y) ** 2).mean())


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10·log10(Σx² / Σ(x - y)²)`` in decibels.

    ``+inf`` when ``y == x`` exactly; ``-inf`` when ``x`` is all zero but ``y`` is not;
    NaN-free otherwise. Higher is better; each extra bit of a uniform quantizer adds ~6.02 dB.
    """
    x, y = _pair(x, y)
    signal = float((x**2).sum())
    noise = float(((x - y) ** 2).sum())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """Relative Frobenius error ``‖x - y‖₂ / ‖x‖₂`` (0 when both are zero, inf when only ``x`` is)."""
    x, y = _pair(x, y)
    num = float(torch.linalg.vector_norm(x - y))
    den = float(torch.linalg.vector_norm(x))
    if num == 0:
        return 0.0
    return math.inf if den == 0 else num / den


def max_abs_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest absolute difference ``max |x - y|``."""
    x, y = _pair(x, y)
    return float((x - y).abs().max())
