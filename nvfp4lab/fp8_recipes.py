"""FP8 block scaling and FP8 delayed scaling by emulation: TE's ``Float8BlockScaling`` and
``DelayedScaling`` recipes on any device (:mod:`nvfp4lab.fp8` holds ``Float8CurrentScaling``).

**Block scaling** (:class:`FP8BlockRecipe`, :class:`FP8BlockLinear`) is the FP8 baseline of the
NVFP4 paper (arXiv 2509.25149, appendix A.1). TE 2.20's ``recipe.Float8BlockScaling()`` defaults:

* ``fp8_format=E4M3``: every operand, grad_output included, in E4M3 (``HYBRID`` puts
  grad_output in E5M2).
* Activations (``x_block_scaling_dim=1``) and gradients (``grad_block_scaling_dim=1``): one fp32
  scale per 1x128 vector along the contraction axis; the columnwise copies used by Wgrad are the
  transposes quantized *separately* in 1x128 vectors along the token axis
  (``transformer_engine/common/transpose/quantize_transpose_vector_blockwise.cu``).
* Weights (``w_block_scaling_dim=2``): one scale per 128x128 tile, so the Dgrad copy ``Wᵀ`` is
  exactly the transpose (``quantize_transpose_square_blockwise.cu``).
* Scales: ``compute_scale_from_amax`` of the block amax (``recipe_common.cuh``), with
  ``power_2_scale=True`` by default (each ``QParams``; TE's env
  ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` turns it off) and ``amax_epsilon=0``; an overflowing
  quotient becomes the *input dtype's* largest finite value (``compute_scale_from_types``);
  ``scale_inv = RN(1/scale)``. The block amax ignores NaN (``fmaxf``); the cast saturates.
* TE only allows 2-D blocks on one operand of each GEMM (``Float8BlockScaling.__post_init__``).

**Delayed scaling** (:class:`DelayedScalingRecipe`, :class:`DelayedScalingLinear`): per-tensor
scales computed from an amax *history* instead of the current tensor
(``transformer_engine/common/recipe/delayed_scaling.cu``, ``amax_and_scale_update``):

* A cast uses the tensor's current ``scale`` and writes its amax into slot 0 of the history.
* After the forward pass (input, weight) and after the backward pass (grad_output) each history is
  rolled: slot ``i`` takes slot ``i + 1``, the last slot takes the just-recorded amax, slot 0 is
  zeroed. The amax used is the max over the window (``amax_compute_algo="max"``) or the
  just-recorded one (``"most_recent"``), and ``scale = RN((fp8_max * 2**-margin) / amax)``; a
  non-finite or zero amax keeps the old scale, an overflowing quotient gives ``FLT_MAX``. As in TE's
  default, fused update (``kernel_bulk``, used unless ``NVTE_UNFUSED_FP8_UPDATE=1`` or a callable
  algorithm), a recorded amax of exactly 0 leaves both the history and the scale unchanged.
* Defaults (TE 2.20 ``DelayedScaling``): ``margin=0``, ``fp8_format=HYBRID``,
  ``amax_history_len=1024``, ``amax_compute_algo="max"``. The history starts at zeros and the
  scales at 1.
* The state lives in the layer's buffers ``amax_history`` (fp32 ``[amax_history_len, 3]``, columns
  input, weight, grad_output) and ``scale`` (fp32 ``[3]``), so it is saved in checkpoints.
  Forward updates run only with autograd on, as TE's ``autocast_exit`` (``quantization.py``) checks
  ``torch.is_grad_enabled()``. A forward under ``torch.no_grad`` (the trainer's evaluation
  forwards among them) records nothing here, whereas TE's cast still writes its amax into slot 0,
  where the next training step's amax is max-ed into it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn as nn

from .emulated import BlockScaledTensor, EmulatedLinear, LinearScheme, block_amax, expand_blocks
from .formats import E4M3_MAX, E5M2_MAX, FLT_MAX, FP8_BLOCK_LEN
from .fp8 import FP8Tensor, compute_scale, fp8_matmul, quantize_fp8_with_scale
from .recipe import recipe_from_dict

__all__ = [
    "QParams", "FP8BlockRecipe", "quantize_fp8_block", "FP8BlockScheme", "FP8BlockLinear",
    "DelayedScalingRecipe", "DelayedScalingScheme", "DelayedScalingLinear", "ROLES", "DELAYED_SCALING_BUFFERS",
]

_FP8_MAX = {torch.float8_e4m3fn: E4M3_MAX, torch.float8_e5m2: E5M2_MAX}
#: The per-tensor roles of a linear layer, in the column order of the delayed-scaling buffers.
ROLES = ("input", "weight", "grad")
#: Buffer names a :class:`DelayedScalingLinear` adds to a model's ``state_dict``.
DELAYED_SCALING_BUFFERS = ("amax_history", "scale")


def _check_format(cls: str, value: Any) -> None:
    if value not in ("E4M3", "HYBRID"):
        raise ValueError(f"{cls}.fp8_format must be 'E4M3' or 'HYBRID', got {value!r}")


def _check_bool(cls: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{cls}.{name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class QParams:
    """TE's ``recipe.QParams``, the fields FP8 block scaling uses.

    Attributes:
        power_2_scale: round each scale down to a power of two (clear its mantissa bits).
        amax_epsilon: floor for the block amax before the scale is computed (>= 0).

    Raises:
        ValueError: a non-bool ``power_2_scale`` or a negative / non-number ``amax_epsilon``.
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        _check_bool("QParams", "power_2_scale", self.power_2_scale)
        if not isinstance(self.amax_epsilon, (int, float)) or isinstance(self.amax_epsilon, bool) \
                or not self.amax_epsilon >= 0.0:
            raise ValueError(f"QParams.amax_epsilon must be a float >= 0, got {self.amax_epsilon!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "QParams" | None) -> "QParams":
        return recipe_from_dict(cls, data)


def _pow2_qparams() -> QParams:
    return QParams(power_2_scale=True, amax_epsilon=0.0)


@dataclass(frozen=True)
class FP8BlockRecipe:
    """Mirror of TE 2.20's ``Float8BlockScaling`` fields that change numerics (same names, defaults).

    Attributes:
        fp8_format: ``"E4M3"`` (every operand E4M3; TE's default) or ``"HYBRID"`` (grad_output E5M2).
        fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad: :class:`QParams` of the
            input, the weight and grad_output; default power-of-two scales, ``amax_epsilon=0``.
        x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 (1x128 vectors along the
            contraction axis, the columnwise copy quantized separately) or 2 (128x128 tiles);
            defaults 1, 2, 1.

    Raises:
        ValueError: naming the field: unknown format, a dimension not 1 or 2, or two 2-D operands in
            one GEMM (x and w, x and grad, w and grad: TE's "2D by 2D block gemm not supported").
    """

    fp8_format: str = "E4M3"
    fp8_quant_fwd_inp: QParams = field(default_factory=_pow2_qparams)
    fp8_quant_fwd_weight: QParams = field(default_factory=_pow2_qparams)
    fp8_quant_bwd_grad: QParams = field(default_factory=_pow2_qparams)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        _check_format("FP8BlockRecipe", self.fp8_format)
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            if not isinstance(getattr(self, name), QParams):
                raise ValueError(f"FP8BlockRecipe.{name} must be a QParams, got {getattr(self, name)!r}")
        dims = {}
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or v not in (1, 2):
                raise ValueError(f"FP8BlockRecipe.{name} must be 1 or 2, got {v!r}")
            dims[name] = v
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if dims[f"{a}_block_scaling_dim"] == 2 and dims[f"{b}_block_scaling_dim"] == 2:
                raise ValueError(f"FP8BlockRecipe.{a}_block_scaling_dim and {b}_block_scaling_dim are both 2; "
                                 "TE has no 2D-by-2D block GEMM")

    def dtype_for(self, role: str) -> torch.dtype:
        """The FP8 dtype of ``role`` (``"input"``, ``"weight"``, ``"grad"``)."""
        return torch.float8_e5m2 if role == "grad" and self.fp8_format == "HYBRID" else torch.float8_e4m3fn

    def qparams_for(self, role: str) -> QParams:
        return {"input": self.fp8_quant_fwd_inp, "weight": self.fp8_quant_fwd_weight,
                "grad": self.fp8_quant_bwd_grad}[role]

    def block_dim_for(self, role: str) -> int:
        return {"input": self.x_block_scaling_dim, "weight": self.w_block_scaling_dim,
                "grad": self.grad_block_scaling_dim}[role]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "FP8BlockRecipe" | None) -> "FP8BlockRecipe":
        if isinstance(data, Mapping):
            data = {k: QParams.from_dict(v) if k.startswith("fp8_quant_") and isinstance(v, Mapping) else v
                    for k, v in data.items()}
        return recipe_from_dict(cls, data)


def quantize_fp8_block(x: torch.Tensor, block: tuple[int, int] = (1, FP8_BLOCK_LEN),
                       fp8_dtype: torch.dtype = torch.float8_e4m3fn, *, power_2_scale: bool = True,
                       amax_epsilon: float = 0.0) -> BlockScaledTensor:
    """FP8 blockwise quantization of a 2-D tensor, as TE's ``Float8BlockQuantizer`` rowwise output.

    Per block: ``amax`` (NaN ignored), ``scale = compute_scale_from_amax(amax, fp8_max, power_2_scale,
    amax_epsilon, value_for_inf=finfo(x.dtype).max)``, ``data = saturate(RN(x_fp32 * scale))``,
    ``scale_inv = RN(1 / scale)``. For the columnwise (Wgrad) copy of 1x128 quantization call this on
    ``x.t()``; for 128x128 tiles the columnwise copy is ``.t()`` of the result.

    Args:
        x: ``[R, C]`` float32, bfloat16 or float16 (float64 is treated as float32). Partial edge
            blocks are allowed (TE pads them the same way).
        block: ``(1, 128)`` or ``(128, 128)``.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        power_2_scale, amax_epsilon: the :class:`QParams`.

    Returns:
        :class:`BlockScaledTensor` with ``data`` ``[R, C]`` FP8 and fp32 ``scale_inv``
        ``[ceil(R / block[0]), ceil(C / block[1])]``.

    Raises:
        TypeError: ``x`` is not floating point.
        ValueError: ``x`` is not 2-D, an unsupported ``block`` or ``fp8_dtype``.

    Source: ``transformer_engine/common/transpose/quantize_transpose_{vector,square}_blockwise.cu``.
    """
    if not torch.is_floating_point(x):
        raise TypeError(f"quantize_fp8_block expects a floating-point tensor, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_block needs a 2-D tensor, got shape {tuple(x.shape)}")
    if tuple(block) not in ((1, FP8_BLOCK_LEN), (FP8_BLOCK_LEN, FP8_BLOCK_LEN)):
        raise ValueError(f"block must be (1, {FP8_BLOCK_LEN}) or ({FP8_BLOCK_LEN}, {FP8_BLOCK_LEN}), got {block}")
    if fp8_dtype not in _FP8_MAX:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    fp8_max = _FP8_MAX[fp8_dtype]
    in_dtype = torch.float32 if x.dtype == torch.float64 else x.dtype
    value_for_inf = float(torch.tensor(torch.finfo(in_dtype).max, dtype=torch.float32))
    xf = x.to(in_dtype).to(torch.float32)
    amax = block_amax(xf, tuple(block), ignore_nan=True)
    scale = compute_scale(amax, fp8_max, use_power_2_scales=power_2_scale, amax_epsilon=amax_epsilon,
                          value_for_inf=value_for_inf)
    data = torch.clamp(xf * expand_blocks(scale, tuple(block), tuple(xf.shape)), -fp8_max, fp8_max).to(fp8_dtype)
    return BlockScaledTensor(data=data, scale_inv=torch.reciprocal(scale), block=tuple(block))


class FP8BlockScheme(LinearScheme):
    """The :class:`~nvfp4lab.emulated.LinearScheme` of :class:`FP8BlockRecipe`."""

    def __init__(self, recipe: FP8BlockRecipe) -> None:
        self.recipe = recipe

    def quantize(self, x: torch.Tensor, role: str, *, rowwise: bool = True, columnwise: bool = True):
        q = self.recipe.qparams_for(role)
        opts = dict(fp8_dtype=self.recipe.dtype_for(role), power_2_scale=q.power_2_scale,
                    amax_epsilon=q.amax_epsilon)
        if self.recipe.block_dim_for(role) == 2:
            tile = quantize_fp8_block(x, (FP8_BLOCK_LEN, FP8_BLOCK_LEN), **opts)
            return (tile if rowwise else None), (tile.t() if columnwise else None)
        row = quantize_fp8_block(x, (1, FP8_BLOCK_LEN), **opts) if rowwise else None
        col = quantize_fp8_block(x.t(), (1, FP8_BLOCK_LEN), **opts) if columnwise else None
        return row, col



class FP8BlockLinear(EmulatedLinear):
    """Drop-in ``nn.Linear`` whose three GEMMs run in emulated FP8 block scaling
    (:class:`FP8BlockRecipe`; see :class:`nvfp4lab.emulated.EmulatedLinear`)."""

    precision = "fp8-block"
    recipe_class = FP8BlockRecipe

    def scheme(self) -> FP8BlockScheme:
        return FP8BlockScheme(self.recipe)


# ----------------------------------------------------------------------------- delayed scaling

@dataclass(frozen=True)
class DelayedScalingRecipe:
    """Mirror of TE 2.20's ``DelayedScaling`` fields that change numerics (same names, defaults).

    Attributes:
        margin: the scale is ``fp8_max / amax / 2**margin`` (int >= 0; default 0).
        fp8_format: ``"HYBRID"`` (E4M3 forward, E5M2 grad_output; default) or ``"E4M3"``.
        amax_history_len: length of the amax window (default 1024).
        amax_compute_algo: ``"max"`` (largest amax in the window; default) or ``"most_recent"``.

    Not mirrored: ``scaling_factor_compute_algo`` and callables for ``amax_compute_algo`` (code, not
    data), ``reduce_amax`` (a single process has nothing to reduce), ``fp8_dpa``/``fp8_mha``.

    Raises:
        ValueError: naming the field (negative margin, bad format, history length < 1, unknown algo).
    """

    margin: int = 0
    fp8_format: str = "HYBRID"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScalingRecipe.margin must be an int >= 0, got {self.margin!r}")
        _check_format("DelayedScalingRecipe", self.fp8_format)
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"DelayedScalingRecipe.amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"DelayedScalingRecipe.amax_compute_algo must be 'max' or 'most_recent', "
                             f"got {self.amax_compute_algo!r}")

    def dtype_for(self, role: str) -> torch.dtype:
        return torch.float8_e5m2 if role == "grad" and self.fp8_format == "HYBRID" else torch.float8_e4m3fn

    def scaled_max(self, role: str) -> float:
        """``fp8_max * 2**-margin`` in fp32 (``delayed_scaling.cu``: ``fp8_dtype_max(..) * std::pow(2.f, -margin)``)."""
        return float(torch.tensor(_FP8_MAX[self.dtype_for(role)] * 2.0 ** -self.margin, dtype=torch.float32))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "DelayedScalingRecipe" | None) -> "DelayedScalingRecipe":
        return recipe_from_dict(cls, data)


class DelayedScalingScheme(LinearScheme):
    """The :class:`~nvfp4lab.emulated.LinearScheme` of a :class:`DelayedScalingLinear`.

    Casts with the layer's current ``scale`` buffer and, when ``record``, writes amaxes into slot 0
    of ``amax_history``; :meth:`after_forward` / :meth:`after_backward` run TE's
    ``amax_and_scale_update`` on the forward / backward columns.
    """

    def __init__(self, recipe: DelayedScalingRecipe, amax_history: torch.Tensor, scale: torch.Tensor,
                 record: bool) -> None:
        self.recipe, self.amax_history, self.scale, self.record = recipe, amax_history, scale, record

    def quantize(self, x: torch.Tensor, role: str, *, rowwise: bool = True, columnwise: bool = True):
        i = ROLES.index(role)
        xf = x.to(torch.float32)
        amax = torch.nan_to_num(xf.abs(), nan=0.0, posinf=float("inf")).amax() if xf.numel() else \
            torch.zeros((), dtype=torch.float32, device=x.device)
        q = quantize_fp8_with_scale(xf, self.scale[i].detach(), self.recipe.dtype_for(role), amax=amax)
        if self.record:
            with torch.no_grad():
                self.amax_history[0, i] = torch.maximum(self.amax_history[0, i], amax)
        return (q if rowwise else None), (q.t() if columnwise else None)

    def matmul(self, a: FP8Tensor, b: FP8Tensor) -> torch.Tensor:
        return fp8_matmul(a, b)

    def update(self, roles: tuple[str, ...]) -> None:
        """Roll the history columns of ``roles`` and recompute their scales (TE ``amax_and_scale_update``)."""
        if not self.record:
            return
        with torch.no_grad():
            for role in roles:
                i = ROLES.index(role)
                h = self.amax_history[:, i]
                last = h[0].clone()
                recorded = last != 0   # TE's fused kernel neither rolls nor rescales after a zero amax
                rolled = torch.cat([h[1:], last.reshape(1)])
                amax = rolled.amax() if self.recipe.amax_compute_algo == "max" else last
                amax = torch.where(recorded, amax, torch.zeros_like(amax))
                rolled[0] = 0.0
                h.copy_(torch.where(recorded, rolled, h))
                scaled_max = torch.tensor(self.recipe.scaled_max(role), dtype=torch.float32, device=h.device)
                ok = torch.isfinite(amax) & (amax > 0)
                new = scaled_max / torch.where(ok, amax, torch.ones_like(amax))
                new = torch.where(torch.isinf(new), torch.full_like(new, FLT_MAX), new)
                self.scale[i] = torch.where(ok, new, self.scale[i])

    def after_forward(self) -> None:
        self.update(("input", "weight"))

    def after_backward(self) -> None:
        self.update(("grad",))


class DelayedScalingLinear(EmulatedLinear):
    """Drop-in ``nn.Linear`` in emulated FP8 delayed scaling (:class:`DelayedScalingRecipe`).

    Buffers (persistent, so checkpointed): ``amax_history`` fp32 ``[amax_history_len, 3]`` and
    ``scale`` fp32 ``[3]``, columns in :data:`ROLES` order; created on the weight's device.
    """

    precision = "fp8-delayed"
    recipe_class = DelayedScalingRecipe

    def setup(self, recipe: Any) -> None:
        super().setup(recipe)
        device = self.weight.device
        self.register_buffer("amax_history", torch.zeros(self.recipe.amax_history_len, len(ROLES),
                                                         dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.ones(len(ROLES), dtype=torch.float32, device=device))

    def scheme(self) -> DelayedScalingScheme:
        return DelayedScalingScheme(self.recipe, self.amax_history, self.scale, record=torch.is_grad_enabled())
