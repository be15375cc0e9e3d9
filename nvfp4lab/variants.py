"""FP4 (E2M1) quantizers with other scaling schemes, for comparison with NVFP4.

The book compares NVFP4 with the designs it improves on. Every variant here
stores E2M1 elements (RNE with ties to the even code, saturating at ±6: the
rounding of :func:`nvfp4lab.formats.encode_e2m1`) and differs only in how the
scale is chosen and stored:

==========================  ==========  =======================  ==============
variant                     block       block scale              per-tensor
==========================  ==========  =======================  ==============
NVFP4 (TE, ``quantize``)    16          E4M3                     FP32 (amax)
NVFP4-style, any block      ``B``       E4M3                     FP32 (amax)
single-level E4M3           ``B``       E4M3 of ``amax_b / 6``   none
ideal FP32 block scale      ``B``       FP32 ``amax_b / 6``      none
MXFP4 (OCP MX v1.0)         32          E8M0 (power of two)      none
per-tensor FP4              whole       FP32 ``amax / 6``        (the only one)
==========================  ==========  =======================  ==============

**NVFP4-style blocks of any size** (``scale_format="e4m3"``, two-level) reuse the
library's TE-exact scale functions
(:func:`nvfp4lab.quantize.block_decode_scales`,
:func:`~nvfp4lab.quantize.block_encode_scales`), so with ``block_size=16`` the codes,
scales and dequantized values equal :func:`nvfp4lab.quantize` bit for bit.

**MXFP4 scale rule.** The OCP Microscaling Formats (MX) Specification v1.0
(Open Compute Project, Sept. 2023), §6.3 "Conversion from scalar formats", sets
the shared scale of a block ``V`` to

    ``X = 2^(floor(log2(max_i |V_i|)) - emax_elem)``,  ``emax_elem = 2`` for E2M1,

then quantizes each ``V_i / X`` to the element format, saturating normal values
to the element's largest magnitude (6). Its reference implementation,
``microsoft/microxcaling`` ``mx/mx_ops.py::_quantize_mx``, does the same
(``shared_exp = floor(log2(amax)) - emax``, clamped to ``[-127, 127]``, an all-zero
block gets ``-127``). With this rule the scaled block maximum lands in ``[4, 8)``,
so elements in ``(6, 8)`` are clipped to 6. ``scale_rule="ceil"`` instead picks
``X = 2^ceil(log2(amax / 6))``, the smallest power of two that avoids clipping
(scaled block maximum in ``(3, 6]``); it is what TE's reference quantizer uses for
its MXFP4-style ``pow_2_scales`` mode (``cast_to_e8``).

All results are float32 emulations on any device; nothing here needs a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Literal

import torch
import torch.nn.functional as F

from .formats import (
    E2M1_EMAX,
    E2M1_MAX,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    FLT_MAX,
    MX_BLOCK_SIZE,
    check_float_tensor,
    decode_e2m1,
    encode_e2m1,
    to_e4m3,
)
from .hadamard import RHT_SIZE, WGRAD_SIGNS, inverse_random_hadamard_transform, random_hadamard_transform
from .quantize import block_decode_factors, block_decode_scales, block_encode_scales
from .rounding import stochastic_round_e2m1

__all__ = [
    "FP4BlockTensor",
    "MX_BLOCK_SIZE",
    "E2M1_EMAX",
    "quantize_fp4",
    "quantize_mxfp4",
    "quantize_per_tensor_fp4",
    "fake_quantize_fp4",
    "SYNTHETIC_KINDS",
    "synthetic_tensor",
]

# MX_BLOCK_SIZE (OCP MX v1.0: k = 32) and E2M1_EMAX (emax_elem = 2) come from nvfp4lab.formats and are
# re-exported here; E8M0 encodes exponents -127..127 (0xFF is NaN).
_E8M0_EMIN, _E8M0_EMAX = E8M0_MIN_EXP, E8M0_MAX_EXP

ScaleFormat = Literal["e4m3", "e8m0", "fp32"]
_SCALE_BYTES = {"e4m3": 1, "e8m0": 1, "fp32": 4}


@dataclasses.dataclass(frozen=True, eq=False)
class FP4BlockTensor:
    """E2M1 codes plus block scales of one of the variants (see :func:`quantize_fp4`).

    Attributes:
        codes: ``uint8 [M, K]`` unpacked E2M1 codes of the input flattened to
            ``[M, K]`` (``[1, numel]`` for per-tensor scaling).
        scales: float32 ``[M, ceil(K / block_size)]``: each block's decode scale as a
            number (an E4M3 value, a power of two, or an FP32 value). For two-level
            E4M3 it is the stored E4M3 block scale, still to be multiplied by the
            per-tensor factor ``amax / 2688``.
        amax: float32 0-d per-tensor amax for two-level E4M3 scaling, else ``None``.
        block_size: elements per block along the last dimension.
        scale_format: ``"e4m3"``, ``"e8m0"`` or ``"fp32"``.
        shape: the logical shape of the input. dtype: its dtype.
        rht: whether the 16-point random Hadamard transform was applied first.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor | None
    block_size: int
    scale_format: str
    shape: torch.Size
    dtype: torch.dtype
    rht: bool = False

    @property
    def num_blocks(self) -> int:
        return self.scales.numel()

    @property
    def storage_bytes(self) -> float:
        """Bytes to store the tensor: 4-bit codes, one scale per block, plus 4 for an FP32 amax.

        Codes are counted at half a byte each (two per byte); padding is not counted.
        """
        n = math.prod(self.shape)
        return n / 2 + self.num_blocks * _SCALE_BYTES[self.scale_format] + (4 if self.amax is not None else 0)

    @property
    def bits_per_element(self) -> float:
        """``8 * storage_bytes / numel``: 4 bits plus the amortised scales."""
        n = math.prod(self.shape)
        return 8 * self.storage_bytes / n if n else float("nan")

    def block_scale_values(self) -> torch.Tensor:
        """Each block's full decode factor (block scale × per-tensor factor), float32 ``[M, nb]``."""
        if self.amax is None:
            return self.scales
        return block_decode_factors(self.scales, self.amax)   # as NVFP4Tensor.dequantize

    def dequantize(self, dtype: torch.dtype | None = None, *, undo_rht: bool = True) -> torch.Tensor:
        """Decode to the logical shape: ``code × block decode factor`` in float32, then cast.

        For two-level E4M3 the factor is ``RN(RN(sf · amax) · RN(1/2688))``, the
        order of TE's ``dequantize_nvfp4.cuh`` (and :meth:`nvfp4lab.NVFP4Tensor.dequantize`).
        """
        dtype = dtype or torch.float32
        M, K = self.codes.shape
        d = self.block_scale_values().repeat_interleave(self.block_size, dim=-1)[:, :K]
        x = decode_e2m1(self.codes) * d
        if self.rht and undo_rht:
            x = inverse_random_hadamard_transform(x.reshape(-1, self.shape[-1])).reshape(x.shape)
        return x.to(dtype).reshape(self.shape)


def _e8m0_exponents(block_amax: torch.Tensor, rule: str) -> torch.Tensor:
    """Integer shared exponents ``X`` (float32 tensor) of the MX scale ``2^X``."""
    safe = torch.where(block_amax > 0, block_amax, torch.ones_like(block_amax))
    if rule == "floor":  # OCP MX v1.0 §6.3
        e = torch.floor(torch.log2(safe)) - E2M1_EMAX
    else:  # ceil(log2(amax / 6)): TE reference pow_2_scales / cast_to_e8
        e = torch.ceil(torch.log2(safe / E2M1_MAX))
    e = torch.where(block_amax > 0, e, torch.full_like(e, _E8M0_EMIN))
    return e.clamp(_E8M0_EMIN, _E8M0_EMAX)


def quantize_fp4(
    x: torch.Tensor,
    block_size: int | None = 16,
    scale_format: ScaleFormat = "e4m3",
    *,
    tensor_scale: bool | None = None,
    scale_rule: Literal["floor", "ceil"] = "floor",
    rht: bool = False,
    rounding: Literal["nearest", "stochastic"] = "nearest",
    generator: torch.Generator | None = None,
) -> FP4BlockTensor:
    """Quantize ``x`` to E2M1 with blocks of ``block_size`` along the last dimension.

    Args:
        x: float tensor ``[..., K]`` (flattened to ``[M, K]``; a 1-D tensor is one row).
        block_size: elements per block (any positive integer; ``K`` is zero-padded to a
            whole number of blocks and the padding never shows). ``None``: one block
            for the whole tensor, i.e. per-tensor scaling.
        scale_format: how each block's decode scale is stored:
            ``"e4m3"`` FP8 E4M3 (NVFP4); ``"e8m0"`` a power of two (MX);
            ``"fp32"`` the exact ``block_amax / 6`` (an idealised reference that
            costs 32 bits per block; each value is divided by it).
        tensor_scale: only for ``"e4m3"``: use NVFP4's FP32 per-tensor scale
            (default ``True``), computed in TE's exact order
            (:func:`nvfp4lab.quantize.block_decode_scales`); ``False`` gives
            single-level ``e4m3(block_amax / 6)`` scales, which underflow for small
            tensors and saturate at 448 for large ones.
        scale_rule: only for ``"e8m0"``: ``"floor"`` (OCP MX v1.0,
            ``2^(floor(log2 amax) - 2)``) or ``"ceil"`` (``2^ceil(log2(amax / 6))``).
        rht: apply the 16-point random Hadamard transform (TE's fixed signs) along
            ``K`` first; :meth:`FP4BlockTensor.dequantize` undoes it. Needs ``K % 16 == 0``.
        rounding: ``"nearest"`` (RNE) or ``"stochastic"``
            (:func:`nvfp4lab.stochastic_round_e2m1`); the scales are the same.
        generator: ``torch.Generator`` for stochastic rounding.

    Returns:
        :class:`FP4BlockTensor`. For ``block_size=16, scale_format="e4m3"`` (two-level)
        its codes, scales and dequantized values equal :func:`nvfp4lab.quantize`'s.

    Raises:
        TypeError: non-float ``x``. ValueError: NaN in ``x``, ±Inf with ``scale_format="fp32"`` or
            with ``"e8m0"`` and ``rht`` (±Inf otherwise warns, RuntimeWarning), a 0-d or empty input,
        ``block_size < 1``, an unknown ``scale_format`` / ``scale_rule`` /
        ``rounding``, ``tensor_scale=True`` with a non-E4M3 format, ``rht`` with
        ``K % 16 != 0``.
    """
    check_float_tensor(x)
    if scale_format not in _SCALE_BYTES:
        raise ValueError(f"scale_format must be 'e4m3', 'e8m0' or 'fp32', got {scale_format!r}")
    if scale_rule not in ("floor", "ceil"):
        raise ValueError(f"scale_rule must be 'floor' (OCP MX) or 'ceil', got {scale_rule!r}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if tensor_scale is None:
        tensor_scale = scale_format == "e4m3"
    if tensor_scale and scale_format != "e4m3":
        raise ValueError("tensor_scale (NVFP4's FP32 per-tensor scale) only applies to scale_format='e4m3'")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"quantize_fp4 needs a non-empty tensor with at least one dimension, got shape {tuple(x.shape)}")
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive integer or None (per-tensor), got {block_size!r}")
    if not torch.isfinite(x).all():
        if torch.isnan(x).any():
            raise ValueError("quantize_fp4 input contains NaN; E2M1 has no NaN encoding")
        if scale_format == "fp32":
            raise ValueError("quantize_fp4 input contains ±Inf: scale_format='fp32' would store the scale "
                             "block_amax / 6 = inf and decode the block to NaN; remove the Inf")
        if scale_format == "e8m0" and rht:
            raise ValueError("quantize_fp4 input contains ±Inf: the RHT spreads it over its 16 elements, "
                             "which decode to ±inf with an E8M0 scale, and the inverse RHT to NaN; remove the Inf")
        warnings.warn(
            "quantize_fp4 input contains ±Inf: the other elements of its block decode to 0 and the Inf to "
            "its block's largest value (±6 × the saturated scale; inf where that overflows float32)"
            + ("; the per-tensor amax is inf, so the global encode scale falls back to 1 and the tensor "
               "loses its per-tensor range, as nvfp4lab.quantize and TE's reference" if tensor_scale
               and scale_format == "e4m3" else "") + ". Remove the Inf.",
            RuntimeWarning, stacklevel=2)
    K = x.shape[-1]
    if rht and K % RHT_SIZE:
        raise ValueError(f"rht=True needs the last dimension to be a multiple of {RHT_SIZE}, got {K}")

    x2 = x.reshape(-1, K)
    if rht:  # in the input dtype, as nvfp4lab.quantize (and TE, for BF16) does
        x2 = random_hadamard_transform(x2, signs=WGRAD_SIGNS)
    x2 = x2.float()
    if block_size is None:  # per-tensor: a single block holding every element
        x2 = x2.reshape(1, -1)
        block_size = x2.shape[1]
    M, Kx = x2.shape
    nb = -(-Kx // block_size)
    xp = F.pad(x2, (0, nb * block_size - Kx)) if nb * block_size != Kx else x2
    blocks = xp.view(M, nb, block_size)
    block_amax = blocks.abs().amax(dim=-1)
    flt_max = torch.tensor(FLT_MAX, device=x.device)

    amax = None
    if scale_format == "e4m3" and tensor_scale:
        amax = x2.abs().amax()
        sf = block_decode_scales(block_amax, amax)
        enc = block_encode_scales(sf, amax)
        scales = sf.float()
    elif scale_format == "e4m3":
        sf = to_e4m3(block_amax / E2M1_MAX)
        scales = sf.float()
        enc = torch.minimum(torch.reciprocal(scales), flt_max)
    elif scale_format == "fp32":
        scales = block_amax / E2M1_MAX
        enc = None   # x / scale itself: 1 / scale overflows FP32 where the scale is subnormal (amax < 6·2^-126)
    else:  # e8m0
        e = _e8m0_exponents(block_amax, scale_rule)
        scales = torch.ldexp(torch.ones_like(block_amax), e)
        enc = torch.ldexp(torch.ones_like(block_amax), -e)  # exact: a power of two
    if enc is None:
        # a zero scale means an all-zero block: divide it by 1 (its zeros keep their signs, as before)
        y = (blocks / torch.where(scales > 0, scales, 1.0)[:, :, None]).reshape(M, -1)[:, :Kx]
    else:
        y = (blocks * enc[:, :, None]).reshape(M, -1)[:, :Kx]
    if rounding == "nearest":
        codes = encode_e2m1(y)
    else:
        codes = stochastic_round_e2m1(y.clamp(-E2M1_MAX, E2M1_MAX), generator=generator)
    return FP4BlockTensor(
        codes=codes, scales=scales, amax=amax, block_size=block_size, scale_format=scale_format,
        shape=x.shape, dtype=x.dtype, rht=rht,
    )


def quantize_mxfp4(x: torch.Tensor, *, scale_rule: Literal["floor", "ceil"] = "floor", **options) -> FP4BlockTensor:
    """MXFP4 (OCP MX v1.0): 32-element blocks, E8M0 scale ``2^(floor(log2 amax) - 2)``, no per-tensor scale.

    ``scale_rule="ceil"`` gives ``2^ceil(log2(amax / 6))`` instead. Other keyword
    options as :func:`quantize_fp4`.
    """
    return quantize_fp4(x, MX_BLOCK_SIZE, "e8m0", scale_rule=scale_rule, **options)


def quantize_per_tensor_fp4(x: torch.Tensor, **options) -> FP4BlockTensor:
    """Per-tensor FP4: one FP32 scale ``amax / 6`` for the whole tensor, E2M1 elements.

    Keyword options as :func:`quantize_fp4` (``rht``, ``rounding``, ``generator``).
    """
    return quantize_fp4(x, None, "fp32", **options)


def fake_quantize_fp4(x: torch.Tensor, block_size: int | None = 16, scale_format: ScaleFormat = "e4m3", **options) -> torch.Tensor:
    """Quantize with :func:`quantize_fp4` and dequantize to ``x``'s shape and dtype."""
    return quantize_fp4(x, block_size, scale_format, **options).dequantize(x.dtype)


#: The synthetic distributions of :func:`synthetic_tensor`.
SYNTHETIC_KINDS = ("gaussian", "student_t", "outlier_channels", "lognormal_rows")


def synthetic_tensor(
    kind: str,
    rows: int,
    cols: int,
    *,
    generator: torch.Generator | None = None,
    outlier_scale: float = 30.0,
    outlier_fraction: float = 1 / 128,
) -> torch.Tensor:
    """A float32 ``[rows, cols]`` test tensor with one of four distributions.

    These are *synthetic* stand-ins, not tensors from a trained model (torch ships
    no pretrained weights and the book builds offline). Blocks run along ``cols``.

    * ``"gaussian"``: ``N(0, 0.02²)``, a freshly initialised weight (GPT-2-style std 0.02).
    * ``"student_t"``: Student-t with 3 degrees of freedom times 0.02: heavy tails,
      a stand-in for trained weights, which are often heavier-tailed than their init.
    * ``"outlier_channels"``: ``N(0, 1)`` activations in which a ``outlier_fraction`` of
      the columns (hidden channels; at least one) is multiplied by ``outlier_scale``,
      the pattern of outlier features reported in LLM activations.
    * ``"lognormal_rows"``: ``N(0, 1)`` rows each multiplied by ``exp(2·N(0, 1))``: rows
      (tokens) whose magnitudes span orders of magnitude, a stress test for scaling.

    Raises:
        ValueError: unknown ``kind``, non-positive sizes, ``outlier_scale`` not a finite
        positive number (an infinite one makes the outlier channels Inf), or
        ``outlier_fraction`` outside ``[0, 1]``.
    """
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"kind must be one of {SYNTHETIC_KINDS}, got {kind!r}")
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be positive, got {rows}x{cols}")
    if not 0 < outlier_scale < math.inf or not 0 <= outlier_fraction <= 1:
        raise ValueError(f"outlier_scale must be finite and > 0 and outlier_fraction in [0, 1], got "
                         f"{outlier_scale!r} and {outlier_fraction!r}")
    g = generator

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    if kind == "gaussian":
        return 0.02 * randn(rows, cols)
    if kind == "student_t":
        df = 3
        chi2 = (randn(df, rows, cols) ** 2).sum(0)
        return 0.02 * randn(rows, cols) / torch.sqrt(chi2 / df)
    if kind == "outlier_channels":
        x = randn(rows, cols)
        n_out = max(1, round(cols * outlier_fraction))
        idx = torch.randperm(cols, generator=g)[:n_out]
        x[:, idx] *= outlier_scale
        return x
    return randn(rows, cols) * torch.exp(2.0 * randn(rows, 1))
