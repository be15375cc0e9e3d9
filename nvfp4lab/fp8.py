"""FP8 training by emulation: Transformer Engine's ``Float8CurrentScaling`` recipe on any device.

This is the FP8 baseline the NVFP4 runs are compared with. It reproduces the numerics of TE
2.20's ``recipe.Float8CurrentScaling()`` with its defaults (spec section 8):

* ``fp8_format=HYBRID``: forward tensors (input, weight) in E4M3 (max 448), the backward
  tensor grad_output in E5M2 (max 57344). ``fp8_format="E4M3"`` uses E4M3 everywhere.
* Per-tensor *current* scaling: the amax of the tensor being quantized, now (no history).
  ``scale = fp8_max / amax`` in fp32 (``compute_scale_from_amax`` in
  ``transformer_engine/common/recipe/recipe_common.cuh``): ``scale = 1`` when amax is 0, inf or
  NaN; ``FLT_MAX`` when the division overflows; with ``use_power_2_scales`` the mantissa bits are
  cleared. ``amax_epsilon`` (default 0) floors the amax first.
* Cast: ``fp8 = saturate(RN(x_fp32 * scale))`` (the CUDA ``__nv_fp8_*`` conversions saturate to
  the largest finite value), stored with ``scale_inv = RN(1 / scale)``.
* GEMM: the FP8 values are exact in fp32, products are exact, accumulation is fp32, and the
  result is multiplied by ``scale_inv_a * scale_inv_b`` (cuBLASLt's A/B scale). The emulation
  agrees with cuBLAS up to accumulation order. (TE's "split accumulator" setting only concerns
  Hopper's tensor-core accumulation precision, which an fp32 emulation does not model.)
* Per-tensor scales mean the transposed copies used by Dgrad and Wgrad are exactly the
  transposes of the rowwise ones, so each tensor is quantized once.

On a GPU, TE's real FP8 is the thing to use; this module exists so that BF16 vs FP8 vs NVFP4 can
be compared on a CPU. Casts use ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (RNE).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .emulated import EmulatedLinear, LinearScheme
from .formats import E4M3_MAX, E5M2_MAX, FLT_MAX

__all__ = [
    "FP8_E4M3_MAX", "FP8_E5M2_MAX", "FLT_MAX", "FP8Recipe", "FP8Tensor", "FP8Linear",
    "compute_scale", "quantize_fp8", "quantize_fp8_with_scale", "fp8_matmul", "CurrentScalingScheme",
]

FP8_E4M3_MAX = E4M3_MAX   # the FP8 formats' largest finite magnitudes (nvfp4lab.formats)
FP8_E5M2_MAX = E5M2_MAX
_FP8_MAX = {torch.float8_e4m3fn: FP8_E4M3_MAX, torch.float8_e5m2: FP8_E5M2_MAX}


@dataclass(frozen=True)
class FP8Recipe:
    """Mirror of TE's ``Float8CurrentScaling`` fields that change numerics.

    Attributes:
        fp8_format: ``"HYBRID"`` (E4M3 forward, E5M2 grad_output; TE's default) or ``"E4M3"``.
        use_power_2_scales: round each scale down to a power of two (TE: env
            ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``; default False).
        amax_epsilon: floor applied to the amax before computing the scale (default 0.0).

    Raises:
        ValueError: an unknown format, a non-bool flag or a negative epsilon.
    """

    fp8_format: str = "HYBRID"
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        if self.fp8_format not in ("HYBRID", "E4M3"):
            raise ValueError(f"FP8Recipe.fp8_format must be 'HYBRID' or 'E4M3', got {self.fp8_format!r}")
        if not isinstance(self.use_power_2_scales, bool):
            raise ValueError(f"FP8Recipe.use_power_2_scales must be a bool, got {self.use_power_2_scales!r}")
        if not isinstance(self.amax_epsilon, (int, float)) or isinstance(self.amax_epsilon, bool) \
                or not self.amax_epsilon >= 0.0:
            raise ValueError(f"FP8Recipe.amax_epsilon must be a float >= 0, got {self.amax_epsilon!r}")

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.fp8_format == "HYBRID" else torch.float8_e4m3fn

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "FP8Recipe":
        from .recipe import recipe_from_dict

        return recipe_from_dict(cls, data)


def compute_scale(amax: torch.Tensor, fp8_max: float, *, use_power_2_scales: bool = False,
                  amax_epsilon: float = 0.0, value_for_inf: float = FLT_MAX) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` for an fp32 ``amax`` of any shape; returns fp32 scales.

    ``scale = RN(fp8_max / max(amax, eps))``; 1.0 if amax is 0, inf or NaN; ``value_for_inf``
    (rounded to fp32) if the quotient overflows (``FLT_MAX`` for current scaling; TE's blockwise
    kernels pass the input dtype's largest finite value, ``compute_scale_from_types``); power-of-two
    rounding clears the 23 mantissa bits. Source:
    ``transformer_engine/common/recipe/recipe_common.cuh``.
    """
    amax = amax.to(torch.float32)
    if amax_epsilon > 0.0:
        amax = torch.maximum(amax, torch.tensor(amax_epsilon, dtype=torch.float32, device=amax.device))
    one = torch.ones((), dtype=torch.float32, device=amax.device)
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    safe = torch.where(bad, one, amax)
    scale = torch.tensor(fp8_max, dtype=torch.float32, device=amax.device) / safe
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    scale = torch.where(bad, one, scale)
    if use_power_2_scales:
        # keep sign and exponent bits: 0xFF800000 as a signed int32
        scale = (scale.view(torch.int32) & -0x00800000).view(torch.float32)
    return scale


@dataclass
class FP8Tensor:
    """A per-tensor-scaled FP8 tensor.

    Attributes:
        data: float8 (``float8_e4m3fn`` or ``float8_e5m2``), same shape as the source.
        scale_inv: fp32 0-d, ``RN(1/scale)``; ``dequantize() = data * scale_inv``.
        amax: fp32 0-d, ``max|x|`` of the source.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale_inv).to(dtype)

    def t(self) -> "FP8Tensor":
        """Transpose of a 2-D tensor (exact: the scale is per tensor)."""
        return FP8Tensor(self.data.t(), self.scale_inv, self.amax)


def _check_fp8_args(x: torch.Tensor, fp8_dtype: torch.dtype, name: str) -> float:
    """Raise on a non-floating ``x`` or an FP8 dtype other than E4M3/E5M2; the format's largest value."""
    if not torch.is_floating_point(x):
        raise TypeError(f"{name} expects a floating-point tensor, got {x.dtype}")
    if fp8_dtype not in _FP8_MAX:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    return _FP8_MAX[fp8_dtype]


def quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *,
                 use_power_2_scales: bool = False, amax_epsilon: float = 0.0,
                 amax: torch.Tensor | None = None) -> FP8Tensor:
    """Per-tensor current-scaling FP8 quantization of ``x`` (any shape, floating dtype).

    Raises ``TypeError`` for a non-floating ``x`` and ``ValueError`` for an unsupported
    ``fp8_dtype`` (only ``torch.float8_e4m3fn`` and ``torch.float8_e5m2``).
    """
    fp8_max = _check_fp8_args(x, fp8_dtype, "quantize_fp8")
    xf = x.to(torch.float32)
    if amax is None:
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    amax = amax.to(torch.float32).reshape(())
    scale = compute_scale(amax, fp8_max, use_power_2_scales=use_power_2_scales, amax_epsilon=amax_epsilon)
    return quantize_fp8_with_scale(xf, scale, fp8_dtype, amax=amax)


def quantize_fp8_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                            *, amax: torch.Tensor | None = None) -> FP8Tensor:
    """Per-tensor FP8 cast of ``x`` with a given fp32 0-d ``scale`` (delayed scaling's cast).

    ``data = saturate(RN(x_fp32 * scale))`` (the CUDA ``__nv_fp8_*`` conversions saturate to the
    largest finite value; NaN stays NaN), ``scale_inv = RN(1 / scale)``; ``amax`` defaults to
    ``max|x|`` (the value TE's cast kernel writes to the amax history).

    Raises:
        TypeError: ``x`` is not floating point.
        ValueError: ``fp8_dtype`` is not ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    """
    fp8_max = _check_fp8_args(x, fp8_dtype, "quantize_fp8_with_scale")
    xf = x.to(torch.float32)
    if amax is None:
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    scale = scale.to(torch.float32).reshape(())
    data = torch.clamp(xf * scale, -fp8_max, fp8_max).to(fp8_dtype)  # saturating RNE cast
    return FP8Tensor(data=data, scale_inv=torch.reciprocal(scale), amax=amax.to(torch.float32).reshape(()))


def fp8_matmul(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ b^T`` for ``a`` [M, K] and ``b`` [N, K] -> [M, N], emulating an FP8 GEMM.

    Operands are upcast exactly to fp32, multiplied with fp32 accumulation, then scaled by
    ``a.scale_inv * b.scale_inv`` (fp32).
    """
    if a.data.dim() != 2 or b.data.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_matmul needs [M, K] x [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    acc = a.data.to(torch.float32) @ b.data.to(torch.float32).t()
    return (acc * (a.scale_inv * b.scale_inv)).to(out_dtype)


class CurrentScalingScheme(LinearScheme):
    """The operands of TE's ``Float8CurrentScaling``: per-tensor scales, so each columnwise copy is
    the transpose of the rowwise one (quantized once); E4M3 forward, ``backward_dtype`` for grad_output.
    The GEMM is :func:`fp8_matmul` (FP32 product of the FP8 values times the two ``scale_inv``)."""

    def __init__(self, recipe: FP8Recipe) -> None:
        self.recipe = recipe

    def quantize(self, x: torch.Tensor, role: str, *, rowwise: bool = True, columnwise: bool = True):
        dtype = self.recipe.backward_dtype if role == "grad" else self.recipe.forward_dtype
        q = quantize_fp8(x, dtype, use_power_2_scales=self.recipe.use_power_2_scales,
                         amax_epsilon=self.recipe.amax_epsilon)
        return q, (q.t() if columnwise else None)

    def matmul(self, a: FP8Tensor, b: FP8Tensor) -> torch.Tensor:
        return fp8_matmul(a, b)


class FP8Linear(EmulatedLinear):
    """Drop-in ``nn.Linear`` whose three GEMMs run in emulated FP8 current scaling
    (:class:`FP8Recipe`; the layer of :class:`nvfp4lab.emulated.EmulatedLinear` with
    :class:`CurrentScalingScheme`).

    Parameters stay in their dtype (fp32 master weights). Under ``torch.autocast`` the input is
    cast to the autocast dtype first (as TE casts activations), and the output has the input's
    dtype. ``quantize_enabled = False`` turns the layer into a plain ``nn.Linear``.

    Raises:
        ValueError: (forward) the input's last dimension is not ``in_features``.
    """

    precision = "fp8-current"
    recipe_class = FP8Recipe

    def scheme(self) -> CurrentScalingScheme:
        return CurrentScalingScheme(self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_format={self.recipe.fp8_format}"
