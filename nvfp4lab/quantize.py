"""NVFP4 quantization: two-level scaling, bit-exact with Transformer Engine 2.20.

An NVFP4 tensor stores, for an input ``x`` of logical shape ``[..., K]``
flattened to ``[M, K]``:

* 4-bit E2M1 codes, two per byte (:mod:`nvfp4lab.formats`);
* one FP8 E4M3 **block decode scale** per 1×16 block along ``K`` (``block="1d"``,
  activations and gradients) or per 16×16 tile (``block="2d"``, weights);
* the FP32 per-tensor **amax**, from which the FP32 global encode scale
  ``S_enc = 2688 / amax`` (``2688 = 448 · 6``) and decode scale ``S_dec = 1 / S_enc``
  are recomputed.

The operation order below is TE's, one IEEE float32 operation per line
(``RN`` = round to nearest even); a one-ulp change of order changes bits
(TE ``reference_nvfp4.py::_quantize_blockwise_reference``, CUDA
``common/cast/nvfp4/core_nvfp4.cuh``)::

    amax     = max |x|                                  (exact)
    S_enc    = min(RN(2688 / amax), FLT_MAX);  1.0 if amax == 0 or S_enc == 0
    S_dec    = RN(1 / S_enc)
    mult     = RN(S_enc * RN(1/6))
    sf       = e4m3_rne(min(RN(block_amax * mult), 448))       # block decode scale, FP8
    enc      = min(RN(1 / RN(float(sf) * S_dec)), FLT_MAX)     # block encode scale
    code     = e2m1_rne(clamp(RN(x * enc), -6, 6))

Differences from torchao 0.18 ``nvfp4_quantize`` (pytorch/ao
``torchao/prototype/mx_formats/nvfp4_tensor.py``), which is *not* bit-exact with TE:
torchao floors the block scale at E4M3's smallest normal 2^-6 where TE keeps
subnormal and zero block scales; it computes the block scale in a different FP32
order (``block_amax / 6 / per_tensor_scale``) and stores ``amax / 2688`` as its
per-tensor scale where TE stores ``amax``; an exact ``-0.0`` gives code 8 there and
code 0 here (TE's reference); an all-zero block gets scale 2^-6 there and 0 here.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Literal

import torch
import torch.nn.functional as F

from .formats import (
    E2M1_MAX,
    FLT_MAX,
    GEMM_ALPHA_DENOMINATOR,
    GLOBAL_SCALE_NUMERATOR,
    rne_codes,
    check_float_tensor,
    check_no_nan,
    decode_e2m1,
    pack_fp4,
    to_e4m3,
    unpack_fp4,
)
from .hadamard import RHT_SIZE, WGRAD_SIGNS, inverse_random_hadamard_transform, random_hadamard_transform
from .rounding import sr_codes

__all__ = [
    "BLOCK_SIZE",
    "NVFP4Tensor",
    "quantize",
    "fake_quantize",
    "nvfp4_matmul",
    "global_encode_scale",
    "global_decode_scale",
    "block_decode_scales",
    "block_encode_scales",
]

#: Elements per NVFP4 block along the quantized dimension (and tile side for 2D).
BLOCK_SIZE = 16

Block = Literal["1d", "2d"]
Rounding = Literal["nearest", "stochastic"]


def _f32(value: float, device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """FP32 per-tensor encode scale ``S_enc = min(RN(2688 / amax), FLT_MAX)``.

    Args:
        amax: float32 tensor (any shape; usually 0-d), the per-tensor amax, ``>= 0``.

    Returns:
        float32 tensor of ``amax``'s shape. ``amax == 0`` or ``amax == inf`` gives
        ``1.0``, as the kernel's ``compute_global_encode_scaling_factor_FP4`` does
        (the reference gives FLT_MAX for amax 0; every output is identical because
        all block amaxes are then 0).

    Source: TE ``core_nvfp4.cuh``.
    """
    amax = amax.float()
    s_enc = torch.minimum(_f32(GLOBAL_SCALE_NUMERATOR, amax.device) / amax, _f32(FLT_MAX, amax.device))
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def global_decode_scale(amax: torch.Tensor) -> torch.Tensor:
    """FP32 per-tensor decode scale ``S_dec = RN(1 / S_enc)`` (see :func:`global_encode_scale`)."""
    return torch.reciprocal(global_encode_scale(amax))


def block_decode_scales(block_amax: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """E4M3 block decode scales ``e4m3(min(RN(block_amax * RN(S_enc * RN(1/6))), 448))``.

    Args:
        block_amax: float32 tensor of per-block amaxes (any shape).
        amax: float32 0-d per-tensor amax.

    Returns:
        ``torch.float8_e4m3fn`` tensor of ``block_amax``'s shape. Subnormal and zero
        scales are kept (a block with amax below about 2.2e-6·amax gets scale 0).

    Note the order: ``block_amax * (S_enc / 6)`` with the 1/6 folded into the
    multiplier first. ``(block_amax / 6) / S_dec`` is mathematically equal but not
    bit-identical. Source: TE ``reference_nvfp4.py`` L748–752.
    """
    s_enc = global_encode_scale(amax)
    mult = s_enc * torch.reciprocal(_f32(E2M1_MAX, amax.device))
    sf_f32 = torch.minimum(block_amax.float() * mult, _f32(FLT_MAX, amax.device))
    return to_e4m3(sf_f32)


def block_encode_scales(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """FP32 block encode scales ``min(RN(1 / RN(float(sf) * S_dec)), FLT_MAX)``.

    A zero block scale gives ``FLT_MAX``: every non-zero element of such a block
    then saturates to code ±6 although the block dequantizes to 0. TE does exactly
    this; it is not special-cased.
    """
    s_dec = global_decode_scale(amax)
    return torch.minimum(torch.reciprocal(scale.float() * s_dec), _f32(FLT_MAX, amax.device))


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """A tensor quantized to NVFP4 along its last dimension.

    Attributes:
        data: ``uint8 [M, ceil(K/2)]`` packed E2M1 codes of the input flattened to
            ``[M, K]`` (element ``2i`` in the low nibble). Padding codes are 0.
        scale: ``torch.float8_e4m3fn`` block decode scales, ``[M, ceil(K/16)]`` for
            ``block="1d"`` or ``[ceil(M/16), ceil(K/16)]`` for ``block="2d"``.
        amax: float32 0-d tensor, the per-tensor amax the global scale came from
            (post-RHT when ``rht`` is true).
        shape: the logical shape of the input.
        block: ``"1d"`` (1×16 blocks) or ``"2d"`` (16×16 tiles).
        dtype: the input's dtype (the default for :meth:`dequantize` is float32).
        rht: whether the random Hadamard transform was applied along ``K`` before
            quantizing; :meth:`dequantize` undoes it unless told not to.
        rht_signs: the 16 signs of that transform (``None`` for the plain matrix).
        rounding: ``"nearest"`` or ``"stochastic"``.
        values_bf16: optional ``bfloat16 [M, K]`` cache of the block values ``code × block
            scale`` (:meth:`block_values`, exact in BF16), written by the Triton kernels for
            the emulated GEMM when asked (:func:`nvfp4lab.kernels.fused_quantize_rowwise_columnwise`);
            ``None`` otherwise. Not part of the format: it only saves a decode pass.
    """

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    shape: torch.Size
    block: str
    dtype: torch.dtype
    rht: bool = False
    rht_signs: torch.Tensor | None = None
    rounding: str = "nearest"
    values_bf16: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    # ---- geometry -------------------------------------------------------
    @property
    def rows(self) -> int:
        """``M``: the product of all leading dimensions (1 for a 1-D input)."""
        return math.prod(self.shape[:-1])

    @property
    def cols(self) -> int:
        """``K``: the quantized (last) dimension."""
        return self.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    # ---- scales ---------------------------------------------------------
    @property
    def global_encode_scale(self) -> torch.Tensor:
        """FP32 ``S_enc`` recomputed from :attr:`amax` (see :func:`global_encode_scale`)."""
        return global_encode_scale(self.amax)

    @property
    def global_decode_scale(self) -> torch.Tensor:
        """FP32 ``S_dec = 1 / S_enc``."""
        return global_decode_scale(self.amax)

    @property
    def rowwise_scale(self) -> torch.Tensor:
        """Block scales in TE's 1×16 layout ``[M, ceil(K/16)]``; 2D tile scales replicated per row.

        This is the layout of TE's rowwise ``scale`` (for 2D, ``sf[r, j] = tile(r // 16, j)``).
        """
        if self.block == "1d":
            return self.scale
        return self.scale.view(torch.uint8).repeat_interleave(BLOCK_SIZE, dim=0)[: self.rows].view(
            torch.float8_e4m3fn
        )

    # ---- values ---------------------------------------------------------
    def codes(self) -> torch.Tensor:
        """Unpacked E2M1 codes, ``uint8 [M, K]``."""
        return unpack_fp4(self.data)[:, : self.cols]

    def _per_element(self, per_block: torch.Tensor) -> torch.Tensor:
        """Expand a ``[M or M/16, K/16]`` per-block tensor to ``[M, K]``."""
        t = per_block.repeat_interleave(BLOCK_SIZE, dim=-1)
        if self.block == "2d":
            t = t.repeat_interleave(BLOCK_SIZE, dim=0)
        return t[: self.rows, : self.cols]

    def block_values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``code × E4M3 block scale`` as ``[M, K]`` in ``dtype``, without the per-tensor factor.

        Each product has at most 5 significant bits and lies in ``[2^-10, 2688]``,
        so it is exact in BF16, FP16 (normal range permitting) and FP32: the
        operand a real NVFP4 tensor core multiplies.
        """
        vals = decode_e2m1(self.codes()) * self._per_element(self.scale.float())
        return vals.to(dtype)

    def dequantize(self, dtype: torch.dtype | None = None, *, undo_rht: bool = True) -> torch.Tensor:
        """Decode to a tensor of the logical :attr:`shape`.

        ``x̂ = RN(code · RN(RN(float(sf) · amax) · RN(1/2688)))`` in float32, as TE's
        native ``dequantize_nvfp4.cuh``; then, if :attr:`rht` and ``undo_rht``, the
        inverse RHT; then a cast to ``dtype`` (default: float32). When the amax is
        not finite (the input held ±Inf), ``S_enc`` was 1 so the block scale alone
        is used.

        Args:
            dtype: output dtype (default float32).
            undo_rht: set ``False`` to stay in the rotated domain (a Wgrad GEMM
                emulation wants this: the rotation cancels between its operands).
        """
        dtype = dtype or torch.float32
        sf = self.scale.float()
        if bool(torch.isfinite(self.amax)):
            d = (sf * self.amax) * torch.reciprocal(_f32(GLOBAL_SCALE_NUMERATOR, self.device))
        else:
            d = sf
        x = decode_e2m1(self.codes()) * self._per_element(d)
        if self.rht and undo_rht:
            x = inverse_random_hadamard_transform(x, signs=self.rht_signs)
        return x.to(dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return (
            f"NVFP4Tensor(shape={tuple(self.shape)}, block={self.block!r}, rht={self.rht}, "
            f"rounding={self.rounding!r}, amax={float(self.amax):.6g}, dtype={self.dtype}, device={self.device})"
        )


def _validate_amax(amax, device) -> torch.Tensor:
    a = torch.as_tensor(amax, dtype=torch.float32).to(device)
    if a.numel() != 1:
        raise ValueError(f"amax must be a single value, got shape {tuple(a.shape)}")
    a = a.reshape(())
    if bool(torch.isnan(a)) or bool(a < 0):
        raise ValueError(f"amax must be a non-negative number, got {float(a)}")
    return a


def _check_input_values(x2: torch.Tensor) -> None:
    """Raise on NaN and warn on ±Inf in ``x2``, from one min/max reduction and one host read.

    ``torch.aminmax`` propagates NaN, so the reduction is NaN exactly when ``x2`` holds one;
    with no NaN, an infinite extreme means ±Inf is present.
    """
    lo, hi = torch.aminmax(x2)
    lo, hi = float(lo), float(hi)
    if math.isnan(lo) or math.isnan(hi):
        check_no_nan(x2, "quantize input")   # raises, with the one NaN message
    if math.isinf(lo) or math.isinf(hi):
        warnings.warn(
            "quantize input contains ±Inf: the per-tensor amax is inf, so the global encode scale "
            "falls back to 1; the Inf's block decodes to 0 except the Inf itself (±2688) and the "
            "tensor loses its per-tensor range (TE's reference does the same). Pass amax= or remove the Inf.",
            RuntimeWarning, stacklevel=3,
        )


def quantize(
    x: torch.Tensor,
    *,
    block: Block = "1d",
    rht: bool = False,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
    amax: torch.Tensor | float | None = None,
    rht_signs: torch.Tensor | None = WGRAD_SIGNS,
) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 along its last dimension, bit-exact with TE 2.20's reference.

    Args:
        x: float16/bfloat16/float32 tensor ``[..., K]`` (float64 is first rounded to
            float32, as TE's ``.to(torch.float32)`` would). Leading dimensions are
            flattened to ``M`` as TE does; a 1-D tensor is one row. Any device,
            contiguous or not.
        block: ``"1d"``: one scale per 16 consecutive elements of a row (TE's
            activations and gradients). ``"2d"``: one scale per 16×16 tile of the
            flattened ``[M, K]`` matrix (TE's weights with 2D quantization), so that
            the quantization of ``xᵀ`` is the transpose of the quantization of ``x``.
        rht: apply the 16-point random Hadamard transform along ``K`` first (TE does
            this for the columnwise, Wgrad, copies of inputs and gradients; see
            :mod:`nvfp4lab.hadamard`). The amax is then the post-RHT amax.
        rounding: ``"nearest"`` (RNE) or ``"stochastic"`` (SR, TE's gradients).
            Scales and amax are the same for both.
        generator: ``torch.Generator`` for SR (``None``: torch's default generator).
        amax: precomputed per-tensor amax (delayed or fused scaling). Elements
            above it saturate to ±6·block scale. Default: ``max |x|`` (post-RHT if ``rht``).
        rht_signs: the RHT's 16 signs (default TE's fixed Wgrad vector).

    On CUDA the work goes to the Triton kernels of :mod:`nvfp4lab.kernels` when
    Triton is installed (RNE results bit-identical to this reference path; set
    ``NVFP4LAB_DISABLE_KERNELS=1`` to compare); elsewhere the PyTorch code below runs.

    Returns:
        :class:`NVFP4Tensor`. Shapes whose dimensions are not multiples of 16 are
        zero-padded internally; the logical shape is kept and padding never shows.
        An empty input gives an empty :class:`NVFP4Tensor` with ``amax = 0``.

    Raises:
        TypeError: integer, bool, complex or FP8 dtype.
        ValueError: NaN in ``x`` (it would show as a NaN amax; NVFP4 cannot encode
            it and TE's reference would silently emit code 0), a 0-d input,
            ``block="2d"`` on a 1-D tensor, an unknown ``block`` / ``rounding``,
            ``rht=True`` with ``K % 16 != 0``, a negative or NaN ``amax``.

    Warns:
        RuntimeWarning: ``x`` holds ±Inf (once per calling line, Python's default filter).
            The numerics are kept as TE's reference computes them: the per-tensor amax is
            ``inf``, so the global encode scale falls back to 1 (TE
            ``compute_global_encode_scaling_factor_FP4``; see :func:`global_encode_scale`)
            and every block is scaled by its E4M3 block scale alone. The block holding the
            Inf saturates to scale 448: the Inf comes back as ±2688 (= 6·448) and every other
            element of that block as 0 (``[1.0, inf, 0]`` -> ``[0, 2688, 0]``); blocks whose
            amax is below 6·2⁻⁶ get subnormal E4M3 scales and lose precision. One Inf thus
            zeroes its block and removes the per-tensor range from the whole tensor. Pass
            ``amax=`` to bound the range, or remove the Inf.

    Exact ``-0.0`` is encoded as code 0 (+0), as TE's reference does (the hardware
    may give code 8). Source: TE
    ``custom_recipes/reference_nvfp4.py``.
    """
    check_float_tensor(x)
    if block not in ("1d", "2d"):
        raise ValueError(f"block must be '1d' (1x16 blocks) or '2d' (16x16 tiles), got {block!r}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' (RNE) or 'stochastic' (SR), got {rounding!r}")
    if x.dim() == 0:
        raise ValueError("quantize needs at least a 1-D tensor (NVFP4 quantizes along the last dimension)")
    if block == "2d" and x.dim() < 2:
        raise ValueError(f"block='2d' needs a tensor with at least 2 dimensions (16x16 tiles), got shape {tuple(x.shape)}")
    K = x.shape[-1]
    if rht and K % RHT_SIZE:
        raise ValueError(
            f"rht=True needs the quantized (last) dimension to be a multiple of {RHT_SIZE}; got {K}. "
            "TE applies the RHT along the token axis in chunks of 16 and requires tokens % 16 == 0"
        )
    signs = None if rht_signs is None else torch.as_tensor(rht_signs, dtype=torch.float32)
    shape = x.shape
    M = math.prod(shape[:-1])
    x2 = x.reshape(M, K)
    device = x.device
    if x2.numel():
        _check_input_values(x2)
    if x.is_cuda and x2.numel():
        # Fast path: Triton kernels, bit-identical for RNE (nvfp4lab.kernels); None if n/a.
        from . import kernels

        fast = kernels.quantize_fast(
            x, block=block, rht=rht, rounding=rounding, generator=generator, amax=amax, rht_signs=signs
        )
        if fast is not None:
            return fast
    if rht:
        x2 = random_hadamard_transform(x2, signs=signs)

    def result(data, scale, amax_t):
        return NVFP4Tensor(
            data=data, scale=scale, amax=amax_t, shape=shape, block=block, dtype=x.dtype,
            rht=rht, rht_signs=signs if rht else None, rounding=rounding,
        )

    rows_s = -(-M // BLOCK_SIZE) if block == "2d" else M
    if x2.numel() == 0:
        return result(
            torch.zeros(M, -(-K // 2), dtype=torch.uint8, device=device),
            torch.zeros(rows_s, -(-K // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=device),
            torch.zeros((), dtype=torch.float32, device=device),
        )

    xf = x2.float().contiguous()
    # Zero-pad to whole blocks (TE reference _pad_tensor); padding has amax 0, code 0.
    Kp = _ceil_to(K, BLOCK_SIZE)
    Mp = _ceil_to(M, BLOCK_SIZE) if block == "2d" else M
    xp = F.pad(xf, (0, Kp - K, 0, Mp - M)) if (Kp, Mp) != (K, M) else xf
    xabs = xp.abs()
    amax_t = xabs.amax() if amax is None else _validate_amax(amax, device)
    if block == "1d":
        blocks = xp.view(Mp, Kp // BLOCK_SIZE, BLOCK_SIZE)
        block_amax = xabs.view(Mp, Kp // BLOCK_SIZE, BLOCK_SIZE).amax(dim=-1)
        scale = block_decode_scales(block_amax, amax_t)
        y = blocks * block_encode_scales(scale, amax_t)[:, :, None]
    else:
        tiles = xp.view(Mp // BLOCK_SIZE, BLOCK_SIZE, Kp // BLOCK_SIZE, BLOCK_SIZE)
        block_amax = xabs.view(Mp // BLOCK_SIZE, BLOCK_SIZE, Kp // BLOCK_SIZE, BLOCK_SIZE).amax(dim=(1, 3))
        scale = block_decode_scales(block_amax, amax_t)
        y = tiles * block_encode_scales(scale, amax_t)[:, None, :, None]
    y = y.reshape(Mp, Kp)
    if rounding == "nearest":
        codes = rne_codes(y)
    else:
        codes = sr_codes(y.clamp(-E2M1_MAX, E2M1_MAX), generator=generator)
    return result(pack_fp4(codes[:M, : _ceil_to(K, 2)]), scale, amax_t)


def fake_quantize(x: torch.Tensor, **options) -> torch.Tensor:
    """Quantize then dequantize: a tensor of ``x``'s shape and dtype carrying NVFP4 error.

    Takes the keyword options of :func:`quantize`; the RHT, if requested, is undone.
    Raises what :func:`quantize` raises.
    """
    return quantize(x, **options).dequantize(x.dtype)


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != n):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be a tensor of shape [N] = [{n}], got {shape}")


def nvfp4_matmul(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.float32,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Exact emulation of an NVFP4 GEMM ``a @ bᵀ (+ bias)``: ``[M, K] × [N, K] -> [M, N]``.

    Both operands are quantized along the shared contraction dimension ``K``. The
    product of the ``code × block scale`` operands (:meth:`NVFP4Tensor.block_values`,
    exact) is accumulated in FP32, then multiplied in FP32 by
    ``alpha = RN(RN(amax_a · amax_b) / (6·6·448·448))``, the factor TE's GEMM applies
    (``common/recipe/nvfp4.cu``; reference ``qgemm``); ``bias`` (``[N]``, any float
    dtype) is then added in FP32 and the sum rounded once to ``out_dtype``. Up to FP32
    accumulation order this is what an NVFP4 tensor core computes.

    Raises:
        ValueError: ``K`` differs, or one operand is RHT-rotated and the other is
            not (or with other signs): the rotation would not cancel; ``bias`` is not
            ``[N]``.
    """
    _check_bias(bias, b.rows)
    if a.cols != b.cols:
        raise ValueError(f"contraction dimensions differ: a has K={a.cols}, b has K={b.cols}")
    if a.rht != b.rht or (
        a.rht and not torch.equal(torch.as_tensor(a.rht_signs), torch.as_tensor(b.rht_signs))
    ):
        raise ValueError("both operands must use the same RHT (or none) for it to cancel in the GEMM")
    if a.device.type == "cuda":
        # Fast path: BF16 block values (exact) and a cuBLAS BF16 GEMM with FP32 accumulation.
        from . import kernels

        if kernels.available(a.device) and kernels.available(b.device):
            return kernels.nvfp4_matmul_fast(a, b, out_dtype, bias=bias)
    acc = a.block_values(torch.float32) @ b.block_values(torch.float32).T
    return _gemm_epilogue(acc, a.amax, b.amax, out_dtype, bias)


def _gemm_epilogue(acc: torch.Tensor, amax_a: torch.Tensor, amax_b: torch.Tensor, out_dtype: torch.dtype,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The tail of an emulated NVFP4 GEMM, in FP32 and in this order: ``RN(acc · alpha)`` with
    ``alpha = RN(RN(amax_a · amax_b) / (6²·448²))`` (a tensor division, IEEE), ``+ bias``, one
    rounding to ``out_dtype``. ``acc``: the FP32 product of the block values [M, N]."""
    alpha = (amax_a.float() * amax_b.float()) / _f32(GEMM_ALPHA_DENOMINATOR, acc.device)
    y = acc * alpha
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)
