"""Stochastic rounding (SR) to the E2M1 grid.

Round-to-nearest-even (RNE, :func:`nvfp4lab.formats.encode_e2m1`) is the best
choice for a single value but is *biased* for a sum of many small ones: an update
smaller than half a grid step is lost every time. Stochastic rounding picks one of
the two E2M1 grid points that bracket a value, going up with probability equal to
the value's fractional position between them, so the expected result equals the
input. NVFP4 training uses it on the **gradient** operands only (grad_output,
rowwise for Dgrad and columnwise for Wgrad); weights and activations keep RNE
(paper arXiv 2509.25149 §4; TE ``NVFP4BlockScaling.fp4_quant_bwd_grad``).

TE draws its random bits from a Philox stream tied to its kernel's thread mapping
(8 bits per element on Blackwell's ``cvt.rs``), which cannot be reproduced outside
the kernel, so SR is checked statistically, not bit for bit. Here a uniform float32
draw from a ``torch.Generator`` is used: the same generator state reproduces the
same codes on the same device.
"""

from __future__ import annotations

import torch

from .formats import E2M1_MAX, check_no_nan, check_float_tensor

__all__ = ["stochastic_round_e2m1", "sr_codes"]


def stochastic_round_e2m1(
    x: torch.Tensor, *, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """Stochastically round already-scaled values to E2M1 codes.

    For ``a = min(|x|, 6)`` between neighbouring grid points ``lo <= a < hi``, the
    result is ``hi`` with probability ``(a - lo) / (hi - lo)`` and ``lo`` otherwise;
    grid points map to themselves. Values beyond ±6 saturate to ±6 (the hardware's
    ``cvt.rs.satfinite``). The sign is kept: a negative value that rounds to 0 gives
    code 8 (−0), while an exact ``-0.0`` gives code 0, as in the RNE path.

    Args:
        x: float tensor of any shape, in E2M1 units.
        generator: ``torch.Generator`` on ``x``'s device for the uniform draws
            (``None``: torch's default generator).
        uniform: optional float32 tensor of ``x``'s shape with values in ``[0, 1)``
            to use instead of drawing (for tests and for kernels that bring their own).

    Returns:
        ``uint8`` codes (0..15) of ``x``'s shape.

    Raises:
        TypeError: non-float ``x``. ValueError: NaN in ``x``, or ``uniform`` of the
        wrong shape.
    """
    check_float_tensor(x)
    check_no_nan(x, "stochastic_round_e2m1 input")
    if uniform is not None and uniform.shape != x.shape:
        raise ValueError(f"uniform has shape {tuple(uniform.shape)}, expected {tuple(x.shape)}")
    return sr_codes(x.float(), generator=generator, uniform=uniform)


def sr_codes(
    x: torch.Tensor, *, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """SR E2M1 codes (uint8, 0..15) of a float32 tensor known to hold no NaN.

    :func:`stochastic_round_e2m1` without its checks, for callers that already validated (the hot
    path of :func:`nvfp4lab.quantize`). ``uniform``: the U[0, 1) draws to use instead of the
    ``generator``'s (one per element).

    The E2M1 grid is uniform within each binade-like segment: step 0.5 on [0, 2),
    1 on [2, 4) and 2 on [4, 6]. So ``lo = floor(a / step) · step`` (exact: the step
    is a power of two), the probability of rounding up is ``(a - lo) / step``, and a
    grid value ``v`` has the magnitude code ``2v`` below 2, ``v + 2`` below 4, and
    ``v / 2 + 4`` from 4 on (4 -> 6, 6 -> 7).
    """
    a = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(a >= 4, 2.0, torch.where(a >= 2, 1.0, 0.5))
    lo = torch.floor(a / step) * step
    p_up = (a - lo) / step
    if uniform is None:
        uniform = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
    v = torch.where(uniform < p_up, lo + step, lo)
    mag_code = torch.where(v < 2, 2 * v, torch.where(v < 4, v + 2, v / 2 + 4)).to(torch.uint8)
    return mag_code | ((x < 0).to(torch.uint8) << 3)
