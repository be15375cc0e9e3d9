"""MX (microscaling) formats by emulation: MXFP8 (TE's ``MXFP8BlockScaling``) and MXFP4.

Both share one power-of-two **E8M0** scale (:func:`nvfp4lab.formats.e8m0_round_up`) per block of
32 consecutive elements along the contraction axis (OCP Microscaling Formats (MX) v1.0, section 5).
As in TE, each tensor is quantized twice from its high-precision values: rowwise (blocks along the
last axis) and columnwise (blocks along the first axis, i.e. the transpose quantized along its last
axis), so the Dgrad and Wgrad operands are not transposes of the Fprop ones.

**MXFP8** (:class:`MXFP8Recipe`, TE 2.20 ``MXFP8BlockScaling``: ``fp8_format=E4M3`` by default,
``HYBRID`` puts grad_output in E5M2). The scale rule is TE's
(``transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh``)::

    code  = float_to_e8m0(RN(amax * RN(1 / fp8_max)))     # rounded UP to a power of two
    data  = saturate(RN(x * 2**(127 - code)))               # exp2f_rcp; NaN stays NaN

so the block amax never exceeds ``fp8_max`` (up to the rounding of ``1/fp8_max``). The block amax
ignores NaN (``fmaxf``). ``enable_2d_quantization`` uses 32x32 weight tiles (one scale shared by W
and Wᵀ).

**MXFP4** (:class:`MXFP4Recipe`): E2M1 elements (:func:`nvfp4lab.formats.rne_codes`, round to
nearest even, saturating at ±6), one E8M0 scale per 32 elements, no per-tensor scale. Two scale
rules (field ``scale_rounding``):

* ``"up"`` (default): ``scale = 2**ceil(log2(amax / 6))``, the smallest power of two that keeps the
  block amax within E2M1's range (NVFP4 paper, arXiv 2509.25149, appendix B.4: rounding the scale
  up avoids saturating the block's largest values). Computed exactly from the fp32 amax.
* ``"ocp"``: the OCP MX v1.0 rule (section 6.3): ``shared_exp = floor(log2(amax)) - emax_elem``
  with ``emax_elem = 2`` for E2M1, i.e. ``scale = 2**(floor(log2 amax) - 2)``; elements above 6
  after scaling saturate to ±6.

In both rules a zero block gets code 0 (``2**-127``, as TE's ``float_to_e8m0(0)``), exponents are
clamped to E8M0's ``[-127, 127]``, and a block holding NaN gets the NaN scale (code 255; OCP MX
section 6.3), so its values dequantize to NaN. GEMMs: :func:`nvfp4lab.emulated.scaled_matmul`.

:func:`nvfp4lab.variants.quantize_mxfp4` (the error-study quantizer of the book, any shape, with SR and
RHT options) computes the same values: its ``scale_rule="ceil"`` / ``"floor"`` are ``"up"`` / ``"ocp"``
here (tests check they agree bit for bit on finite inputs).

Shapes: MX quantizes whole 32-element blocks only; a dimension that is not a multiple of 32 raises
``ValueError`` naming it (TE requires the same).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .emulated import BlockScaledTensor, EmulatedLinear, LinearScheme, block_amax, expand_blocks
from .formats import (E2M1_EMAX, E2M1_MAX, E4M3_MAX, E5M2_MAX, E8M0_NAN, MX_BLOCK_SIZE, RCP_E4M3_MAX,
                      RCP_E5M2_MAX, e8m0_from_exponent, e8m0_inverse, e8m0_round_up, e8m0_to_float,
                      rne_codes)
from .recipe import recipe_from_dict

__all__ = [
    "MXFP8Recipe", "MXFP4Recipe", "quantize_mxfp8", "quantize_mxfp4", "mxfp4_scale_codes",
    "check_mx_dims", "MXScheme", "MXFP8Linear", "MXFP4Linear",
]

_FP8 = {torch.float8_e4m3fn: (E4M3_MAX, RCP_E4M3_MAX), torch.float8_e5m2: (E5M2_MAX, RCP_E5M2_MAX)}


def check_mx_dims(what: str, **dims: int) -> None:
    """Raise ``ValueError`` naming the first of ``dims`` (name=size) not divisible by 32."""
    for name, size in dims.items():
        if size % MX_BLOCK_SIZE:
            raise ValueError(f"{what}: {name}={size} is not a multiple of the MX block size {MX_BLOCK_SIZE}")


def _block(two_d: bool) -> tuple[int, int]:
    return (MX_BLOCK_SIZE, MX_BLOCK_SIZE) if two_d else (1, MX_BLOCK_SIZE)


def _check_input(x: torch.Tensor, what: str, block: tuple[int, int]) -> None:
    if not torch.is_floating_point(x):
        raise TypeError(f"{what} expects a floating-point tensor, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{what} needs a 2-D tensor, got shape {tuple(x.shape)}")
    check_mx_dims(what, **{"dimension 1 (the blocked axis)": x.shape[1]})
    if block[0] > 1:
        check_mx_dims(what, **{"dimension 0 (2-D tiles)": x.shape[0]})


def quantize_mxfp8(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *,
                   two_d: bool = False) -> BlockScaledTensor:
    """MXFP8 quantization of a 2-D tensor along its last axis (TE's ``MXFP8Quantizer`` rowwise).

    For the columnwise copy call it on ``x.t()``.

    Args:
        x: ``[R, C]`` float tensor, ``C`` (and ``R`` when ``two_d``) a multiple of 32.
        fp8_dtype: ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344).
        two_d: one scale per 32x32 tile instead of per 1x32 vector.

    Returns:
        :class:`~nvfp4lab.emulated.BlockScaledTensor`: ``data`` FP8 ``[R, C]``, ``scale_e8m0`` uint8
        ``[R, C/32]`` (or ``[R/32, C/32]``), ``scale_inv = 2**(code - 127)`` fp32.

    Raises:
        TypeError: non-float ``x``. ValueError: not 2-D, a dimension not a multiple of 32, or an
        unsupported ``fp8_dtype``.

    Source: ``transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh`` with ``ptx::float_to_e8m0`` and
    ``ptx::exp2f_rcp``.
    """
    block = _block(two_d)
    _check_input(x, "quantize_mxfp8", block)
    if fp8_dtype not in _FP8:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    fp8_max, rcp = _FP8[fp8_dtype]
    xf = x.to(torch.float32)
    amax = block_amax(xf, block, ignore_nan=True)
    codes = e8m0_round_up(amax * rcp)
    factor = expand_blocks(e8m0_inverse(codes), block, tuple(xf.shape))
    data = torch.clamp(xf * factor, -fp8_max, fp8_max).to(fp8_dtype)
    return BlockScaledTensor(data=data, scale_inv=e8m0_to_float(codes), block=block, element="fp8",
                             scale_e8m0=codes)


def mxfp4_scale_codes(amax: torch.Tensor, scale_rounding: str = "up") -> torch.Tensor:
    """E8M0 codes of MXFP4 block scales from float32 block amaxes (see the module docstring).

    ``"up"``: ``e = ceil(log2(amax / 6))``, exactly: with ``amax = m * 2**E``, ``m`` in [0.5, 1),
    ``e = E - 3`` if ``m <= 0.75`` else ``E - 2``. ``"ocp"``: ``e = floor(log2(amax)) - 2 = E - 3``.
    Zero amax gives code 0, NaN gives 255, ``+Inf`` gives 254; ``e`` is clamped to ``[-127, 127]``.

    Raises:
        ValueError: unknown ``scale_rounding``. TypeError: ``amax`` is not float32.
    """
    if scale_rounding not in ("up", "ocp"):
        raise ValueError(f"scale_rounding must be 'up' or 'ocp', got {scale_rounding!r}")
    if amax.dtype != torch.float32:
        raise TypeError(f"mxfp4_scale_codes needs float32 amaxes, got {amax.dtype}")
    finite = torch.isfinite(amax) & (amax > 0)
    m, e = torch.frexp(torch.where(finite, amax, torch.ones_like(amax)))
    exp = e - (E2M1_EMAX + 1)  # floor(log2 amax) - emax_elem, since floor(log2 amax) = E - 1
    if scale_rounding == "up":
        exp = exp + (m > 0.75).to(exp.dtype)  # amax > 6 * 2**(E-3)  <=>  m > 0.75
    codes = e8m0_from_exponent(exp)
    codes = torch.where(amax == 0, torch.zeros_like(codes), codes)
    codes = torch.where(torch.isposinf(amax), torch.full_like(codes, 254), codes)
    return torch.where(torch.isnan(amax), torch.full_like(codes, E8M0_NAN), codes)


def quantize_mxfp4(x: torch.Tensor, *, scale_rounding: str = "up", two_d: bool = False) -> BlockScaledTensor:
    """MXFP4 quantization of a 2-D tensor along its last axis: E2M1 codes and E8M0 block scales.

    ``codes = RNE_E2M1(saturate(x * 2**-e))`` per 32-element block (``e`` from
    :func:`mxfp4_scale_codes`). For the columnwise copy call it on ``x.t()``.

    Args:
        x: ``[R, C]`` float tensor, ``C`` (and ``R`` when ``two_d``) a multiple of 32.
        scale_rounding: ``"up"`` (paper appendix B.4; default) or ``"ocp"`` (OCP MX v1.0 section 6.3).
        two_d: one scale per 32x32 tile.

    Returns:
        :class:`~nvfp4lab.emulated.BlockScaledTensor` with ``element="e2m1"``: ``data`` uint8 E2M1
        codes ``[R, C]`` (one per byte; :func:`nvfp4lab.formats.pack_fp4` packs them), ``scale_e8m0``
        uint8 and ``scale_inv`` fp32 per block. A NaN block decodes to NaN through its scale.

    Raises:
        TypeError: non-float ``x``. ValueError: not 2-D, a dimension not a multiple of 32, or an
        unknown ``scale_rounding``.
    """
    block = _block(two_d)
    _check_input(x, "quantize_mxfp4", block)
    xf = x.to(torch.float32)
    codes = mxfp4_scale_codes(block_amax(xf, block, ignore_nan=False), scale_rounding)
    factor = expand_blocks(e8m0_inverse(codes), block, tuple(xf.shape))
    scaled = torch.nan_to_num(xf * factor, nan=0.0, posinf=E2M1_MAX, neginf=-E2M1_MAX)
    return BlockScaledTensor(data=rne_codes(scaled), scale_inv=e8m0_to_float(codes), block=block,
                             element="e2m1", scale_e8m0=codes)


@dataclass(frozen=True)
class MXFP8Recipe:
    """Mirror of TE 2.20's ``MXFP8BlockScaling`` fields that change numerics (same names, defaults).

    Attributes:
        fp8_format: ``"E4M3"`` (every operand E4M3; TE's default) or ``"HYBRID"`` (grad_output E5M2).
        enable_2d_quantization: 32x32 weight tiles (default False: 1x32 rowwise and columnwise).

    TE's ``margin`` field is not mirrored: the MXFP8 scale rule does not read it.

    Raises:
        ValueError: naming the field.
    """

    fp8_format: str = "E4M3"
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        if self.fp8_format not in ("E4M3", "HYBRID"):
            raise ValueError(f"MXFP8Recipe.fp8_format must be 'E4M3' or 'HYBRID', got {self.fp8_format!r}")
        if not isinstance(self.enable_2d_quantization, bool):
            raise ValueError(f"MXFP8Recipe.enable_2d_quantization must be a bool, got {self.enable_2d_quantization!r}")

    def dtype_for(self, role: str) -> torch.dtype:
        return torch.float8_e5m2 if role == "grad" and self.fp8_format == "HYBRID" else torch.float8_e4m3fn

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "MXFP8Recipe" | None) -> "MXFP8Recipe":
        return recipe_from_dict(cls, data)


@dataclass(frozen=True)
class MXFP4Recipe:
    """MXFP4 training (no TE recipe in TE 2.20): E2M1 elements, 1x32 blocks, E8M0 scales, RNE.

    Attributes:
        scale_rounding: ``"up"`` (``2**ceil(log2(amax/6))``, NVFP4 paper appendix B.4; default) or
            ``"ocp"`` (``2**(floor(log2 amax) - 2)``, OCP MX v1.0 section 6.3).
        enable_2d_quantization: 32x32 weight tiles (default False), named as MXFP8's field.

    Raises:
        ValueError: naming the field.
    """

    scale_rounding: str = "up"
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        if self.scale_rounding not in ("up", "ocp"):
            raise ValueError(f"MXFP4Recipe.scale_rounding must be 'up' or 'ocp', got {self.scale_rounding!r}")
        if not isinstance(self.enable_2d_quantization, bool):
            raise ValueError(f"MXFP4Recipe.enable_2d_quantization must be a bool, got {self.enable_2d_quantization!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "MXFP4Recipe" | None) -> "MXFP4Recipe":
        return recipe_from_dict(cls, data)


class MXScheme(LinearScheme):
    """The :class:`~nvfp4lab.emulated.LinearScheme` of :class:`MXFP8Recipe` / :class:`MXFP4Recipe`."""

    def __init__(self, recipe: MXFP8Recipe | MXFP4Recipe) -> None:
        self.recipe = recipe

    def _quantize(self, x: torch.Tensor, role: str, two_d: bool) -> BlockScaledTensor:
        if isinstance(self.recipe, MXFP4Recipe):
            return quantize_mxfp4(x, scale_rounding=self.recipe.scale_rounding, two_d=two_d)
        return quantize_mxfp8(x, self.recipe.dtype_for(role), two_d=two_d)

    def quantize(self, x: torch.Tensor, role: str, *, rowwise: bool = True, columnwise: bool = True):
        name = {"input": "input", "weight": "weight", "grad": "grad_output"}[role]
        check_mx_dims(f"MX {name}", **{"rows (tokens or out_features)": x.shape[0], "columns": x.shape[1]})
        if role == "weight" and self.recipe.enable_2d_quantization:
            tile = self._quantize(x, role, True)
            return (tile if rowwise else None), (tile.t() if columnwise else None)
        row = self._quantize(x, role, False) if rowwise else None
        col = self._quantize(x.t(), role, False) if columnwise else None
        return row, col



class _MXLinear(EmulatedLinear):
    def check_shape(self, in_features: int, out_features: int) -> None:
        check_mx_dims(type(self).__name__, in_features=in_features, out_features=out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_enabled and x.shape[-1] == self.in_features:
            check_mx_dims(type(self).__name__, **{"tokens (product of the leading dimensions)": x.numel() // self.in_features})
        return super().forward(x)

    def scheme(self) -> MXScheme:
        return MXScheme(self.recipe)


class MXFP8Linear(_MXLinear):
    """Drop-in ``nn.Linear`` in emulated MXFP8 (:class:`MXFP8Recipe`). ``in_features``,
    ``out_features`` and the token count must be multiples of 32 (``ValueError`` naming which)."""

    precision = "mxfp8"
    recipe_class = MXFP8Recipe


class MXFP4Linear(_MXLinear):
    """Drop-in ``nn.Linear`` in emulated MXFP4 (:class:`MXFP4Recipe`). ``in_features``,
    ``out_features`` and the token count must be multiples of 32 (``ValueError`` naming which)."""

    precision = "mxfp4"
    recipe_class = MXFP4Recipe
