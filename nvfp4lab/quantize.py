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

Options beyond the base recipe (TE 2.20 ``NVFP4BlockScaling`` / ``NVFP4QuantizerRef``), reference
path only (the Triton kernels do not cover them): ``four_over_six`` (per block, the better of the
map-to-4 and map-to-6 scales; its own FP32 order, see :func:`quantize_4over6_blocks`), ``e4m3_max=256``
(the global scale's E4M3 bound with 4over6) and ``row_scaled`` (one amax per row, ``S_enc`` per row,
the default path otherwise).

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
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from .formats import (
    E2M1_MAX,
    FLT_MAX,
    GEMM_ALPHA_DENOMINATOR,
    GLOBAL_SCALE_NUMERATOR,
    rne_codes,
    check_float_dtype,
    check_float_tensor,
    check_no_nan,
    decode_e2m1,
    pack_fp4,
    to_e4m3,
    unpack_fp4,
)
from . import kernels
from .hadamard import RHT_SIZE, WGRAD_SIGNS, inverse_random_hadamard_transform, random_hadamard_transform
from .rounding import SRStream, sr_codes

__all__ = [
    "BLOCK_SIZE",
    "NVFP4Tensor",
    "quantize",
    "quantize_rowwise_columnwise",
    "uses_kernels",
    "pair_uses_kernels",
    "fake_quantize",
    "nvfp4_matmul",
    "global_encode_scale",
    "global_decode_scale",
    "block_decode_scales",
    "block_encode_scales",
    "quantize_4over6_blocks",
]

#: Elements per NVFP4 block along the quantized dimension (and tile side for 2D).
BLOCK_SIZE = 16

Block = Literal["1d", "2d"]
Rounding = Literal["nearest", "stochastic"]


def _f32(value: float, device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def _numerator(e4m3_max: int) -> float:
    """``E4M3 bound · 6``: 2688 (448) or 1536 (256, 4over6's option), both exact in FP32."""
    if e4m3_max not in (448, 256):
        raise ValueError(f"e4m3_max must be 448 or 256 (TE's nvfp4_e4m3_max), got {e4m3_max!r}")
    return GLOBAL_SCALE_NUMERATOR if e4m3_max == 448 else float(e4m3_max) * E2M1_MAX


def global_encode_scale(amax: torch.Tensor, e4m3_max: int = 448) -> torch.Tensor:
    """FP32 per-tensor encode scale ``S_enc = min(RN(2688 / amax), FLT_MAX)``.

    ``e4m3_max=256`` (4over6's ``nvfp4_e4m3_max``) uses ``1536 = 256 · 6`` for 2688.

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
    s_enc = torch.minimum(_f32(_numerator(e4m3_max), amax.device) / amax, _f32(FLT_MAX, amax.device))
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def global_decode_scale(amax: torch.Tensor, e4m3_max: int = 448) -> torch.Tensor:
    """FP32 per-tensor decode scale ``S_dec = RN(1 / S_enc)`` (see :func:`global_encode_scale`)."""
    return torch.reciprocal(global_encode_scale(amax, e4m3_max))


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


def block_decode_factors(scale: torch.Tensor, amax: torch.Tensor, e4m3_max: int = 448) -> torch.Tensor:
    """Each block's full FP32 decode factor ``RN(RN(float(sf) · amax) · RN(1 / (6 · e4m3_max)))``, in
    the order of TE's ``dequantize_nvfp4.cuh``; where the amax is not finite (the input held ±Inf,
    so ``S_enc`` was 1) the block scale alone. No host read (capturable).

    Args:
        scale: float32 block scales, any shape.
        amax: float32 per-tensor amax, 0-d, or ``[M, 1]`` per row (row-scaled) against ``[M, nb]`` scales.
        e4m3_max: the E4M3 bound of the global scale, 448 or 256 (TE ``nvfp4_e4m3_max``).
    """
    scaled = (scale * amax) * torch.reciprocal(_f32(_numerator(e4m3_max), scale.device))
    return torch.where(torch.isfinite(amax), scaled, scale)


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """A tensor quantized to NVFP4 along its last dimension.

    Attributes:
        data: ``uint8 [M, ceil(K/2)]`` packed E2M1 codes of the input flattened to
            ``[M, K]`` (element ``2i`` in the low nibble). Padding codes are 0. None for a GEMM
            operand that holds only its :attr:`values_bf16` (``values="only"`` of
            :func:`quantize_rowwise_columnwise`, as a TE tensor may hold only the usage a GEMM
            needs): :meth:`block_values` and :func:`nvfp4_matmul` work from the values;
            :meth:`codes`, :meth:`dequantize` and :attr:`rowwise_scale` raise ValueError.
        scale: ``torch.float8_e4m3fn`` block decode scales, ``[M, ceil(K/16)]`` for
            ``block="1d"`` or ``[ceil(M/16), ceil(K/16)]`` for ``block="2d"``; None with ``data``.
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
            the emulated GEMM when asked (:func:`quantize_rowwise_columnwise`);
            ``None`` otherwise. Not part of the format: it only saves a decode pass.
        four_over_six: whether each block chose between the map-to-4 and map-to-6 scale
            (TE ``nvfp4_use_4over6``). The stored format is the same; it is informational.
        e4m3_max: the E4M3 bound of the global scale, 448 or 256 (TE ``nvfp4_e4m3_max``; 256
            only with 4over6). Dequantization and the GEMM use ``6 · e4m3_max`` for 2688.
        row_scaled: :attr:`amax` is a float32 ``[M]`` vector, one amax per row (TE
            ``row_scaled_nvfp4``, ``global_amax_row``), instead of one 0-d value.
        gemm_coef: optional ``(partner amax, coef)``: the float32 ``[2]`` (alpha, beta) device
            tensor of the GEMM of this tensor with the operand whose :attr:`amax` is ``partner``
            (that very tensor object), computed by the quantize kernels alongside this tensor
            (``gemm_with`` of :func:`quantize_rowwise_columnwise`); :func:`nvfp4_matmul` of the
            two reads it instead of launching a kernel for it. Not part of the format.

    Built by hand, the fields' types, dtypes and shapes are checked against ``shape`` and
    ``block`` (ValueError or TypeError naming the field; :meth:`__post_init__`), never their values.
    """

    data: torch.Tensor | None
    scale: torch.Tensor | None
    amax: torch.Tensor
    shape: torch.Size
    block: str
    dtype: torch.dtype
    rht: bool = False
    rht_signs: torch.Tensor | None = None
    rounding: str = "nearest"
    values_bf16: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    four_over_six: bool = False
    e4m3_max: int = 448
    row_scaled: bool = False
    gemm_coef: tuple[torch.Tensor, torch.Tensor] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        """Check the structure of the fields (types, dtypes, shapes; never their values, so no
        host read): a tensor built by hand with, say, a scale of the wrong shape would otherwise
        decode truncated or broadcast without a word.

        Raises:
            ValueError: an unknown ``block``/``rounding``/``e4m3_max``; an empty ``shape``;
                ``data`` without ``scale`` or the reverse; neither codes nor ``values_bf16``;
                ``data``, ``scale``, ``values_bf16``, ``amax`` or ``rht_signs`` of the wrong shape.
            TypeError: a field of the wrong type or dtype (``data`` uint8, ``scale``
                float8_e4m3fn, ``values_bf16`` bfloat16, ``amax`` float32, ``dtype`` a float dtype).
        """
        if self.block not in ("1d", "2d"):
            raise ValueError(f"NVFP4Tensor: block must be '1d' or '2d', got {self.block!r}")
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"NVFP4Tensor: rounding must be 'nearest' or 'stochastic', got {self.rounding!r}")
        if self.e4m3_max not in (448, 256):
            raise ValueError(f"NVFP4Tensor: e4m3_max must be 448 or 256, got {self.e4m3_max!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"NVFP4Tensor: dtype must be a floating-point torch.dtype, got {self.dtype!r}")
        if not isinstance(self.shape, torch.Size):
            object.__setattr__(self, "shape", torch.Size(self.shape))
        if len(self.shape) == 0:
            raise ValueError("NVFP4Tensor: shape must have at least one dimension (the quantized one)")
        M, K = self.rows, self.cols
        if (self.data is None) != (self.scale is None):
            raise ValueError("NVFP4Tensor: data (the codes) and scale come together; got one without the other")
        if self.data is None and self.values_bf16 is None:
            raise ValueError("NVFP4Tensor: needs the codes and scales (data, scale) or the block values (values_bf16)")
        if self.data is not None:
            self._check_field("data", self.data, torch.uint8, (M, -(-K // 2)))
            self._check_field("scale", self.scale, torch.float8_e4m3fn,
                              (-(-M // BLOCK_SIZE) if self.block == "2d" else M, -(-K // BLOCK_SIZE)))
        if self.values_bf16 is not None:
            self._check_field("values_bf16", self.values_bf16, torch.bfloat16, (M, K))
        self._check_field("amax", self.amax, torch.float32, (M,) if self.row_scaled else ())
        if self.rht_signs is not None and (not isinstance(self.rht_signs, torch.Tensor)
                                           or self.rht_signs.numel() != RHT_SIZE):
            raise ValueError(f"NVFP4Tensor: rht_signs must be a tensor of {RHT_SIZE} signs, got {self.rht_signs!r}")
        if self.gemm_coef is not None and not (
                isinstance(self.gemm_coef, tuple) and len(self.gemm_coef) == 2
                and all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in self.gemm_coef)
                and self.gemm_coef[1].shape == (2,)):
            raise TypeError("NVFP4Tensor: gemm_coef must be (partner amax, float32 [2] coef) tensors or None")

    def _check_field(self, name: str, t, dtype: torch.dtype, shape: tuple) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"NVFP4Tensor: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"NVFP4Tensor: {name} must be {dtype}, got {t.dtype}")
        if t.shape != shape:
            raise ValueError(f"NVFP4Tensor: {name} must have shape {list(shape)} for shape={list(self.shape)}"
                             f" and block={self.block!r}, got {list(t.shape)}")

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
        return (self.data if self.data is not None else self.values_bf16).device

    def _require_codes(self, what: str) -> None:
        if self.data is None:
            raise ValueError(f"{what} needs the codes and scales, and this copy holds only its BF16 block values "
                             "(values='only' of quantize_rowwise_columnwise: a GEMM operand); quantize with "
                             "values=True or False to keep them")

    # ---- scales ---------------------------------------------------------
    @property
    def global_encode_scale(self) -> torch.Tensor:
        """FP32 ``S_enc`` recomputed from :attr:`amax` (see :func:`global_encode_scale`)."""
        return global_encode_scale(self.amax, self.e4m3_max)

    @property
    def global_decode_scale(self) -> torch.Tensor:
        """FP32 ``S_dec = 1 / S_enc``."""
        return global_decode_scale(self.amax, self.e4m3_max)

    @property
    def rowwise_scale(self) -> torch.Tensor:
        """Block scales in TE's 1×16 layout ``[M, ceil(K/16)]``; 2D tile scales replicated per row.

        This is the layout of TE's rowwise ``scale`` (for 2D, ``sf[r, j] = tile(r // 16, j)``).
        """
        self._require_codes("rowwise_scale")
        if self.block == "1d":
            return self.scale
        return self.scale.view(torch.uint8).repeat_interleave(BLOCK_SIZE, dim=0)[: self.rows].view(
            torch.float8_e4m3fn
        )

    # ---- values ---------------------------------------------------------
    def codes(self) -> torch.Tensor:
        """Unpacked E2M1 codes, ``uint8 [M, K]``. Raises ValueError without codes (:attr:`data`)."""
        self._require_codes("codes()")
        return unpack_fp4(self.data)[:, : self.cols]

    def _per_element(self, per_block: torch.Tensor) -> torch.Tensor:
        """Expand a ``[M or M/16, K/16]`` per-block tensor to ``[M, K]``."""
        t = per_block.repeat_interleave(BLOCK_SIZE, dim=-1)
        if self.block == "2d":
            t = t.repeat_interleave(BLOCK_SIZE, dim=0)
        return t[: self.rows, : self.cols]

    def block_values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``code × E4M3 block scale`` as ``[M, K]`` in ``dtype``, without the per-tensor factor.

        Each product has at most 6 significant bits (2 of the E2M1 value, 4 of the E4M3
        scale) and lies in ``[2^-10, 2688]``, so it is exact in BF16, FP16 (normal range
        permitting) and FP32: the operand a real NVFP4 tensor core multiplies. BF16 comes from the Triton kernels where
        they run (or from :attr:`values_bf16` when the quantize kernel wrote it), bit-identical.
        A copy without codes (:attr:`data` None) converts its BF16 values (exact in any of these).

        Raises:
            TypeError: ``dtype`` is not float16, bfloat16, float32 or float64.
        """
        check_float_dtype(dtype, "block_values dtype")
        if dtype == torch.bfloat16:
            if self.values_bf16 is not None:
                return self.values_bf16
            if kernels.covers_decode(self.data, self.rows, self.cols, 0):
                return kernels.block_values(self.data, self.scale, self.rows, self.cols, block2d=self.block == "2d")
        if self.data is None:
            return self.values_bf16.to(dtype)
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

        Raises:
            ValueError: the copy holds no codes (:attr:`data` None).
            TypeError: ``dtype`` is not float16, bfloat16, float32 or float64.
        """
        self._require_codes("dequantize()")
        dtype = dtype or torch.float32
        check_float_dtype(dtype, "dequantize dtype")
        undo = self.rht and undo_rht
        mask = kernels.sign_mask(self.rht_signs) if undo else None
        plain = self.e4m3_max == 448 and not self.row_scaled  # what the Triton decode kernel covers
        if plain and dtype == torch.bfloat16 and kernels.covers_decode(self.data, self.rows, self.cols,
                                                                      mask if undo else 0):
            return kernels.dequantize(self.data, self.scale, self.amax, self.rows, self.cols,
                                      block2d=self.block == "2d", undo_rht_mask=mask).reshape(self.shape)
        sf = self.scale.float()
        # row-scaled: amax [M] -> [M, 1], one factor per row (TE row_scaled_nvfp4)
        amax = self.amax.reshape(-1, 1) if self.row_scaled else self.amax
        d = block_decode_factors(sf, amax, self.e4m3_max)
        x = decode_e2m1(self.codes()) * self._per_element(d)
        if undo:
            x = inverse_random_hadamard_transform(x, signs=self.rht_signs)
        return x.to(dtype).reshape(self.shape)

    def __repr__(self) -> str:
        amax = (f"amax=[{self.amax.numel()} rows]" if self.row_scaled else f"amax={float(self.amax):.6g}")
        extra = f", four_over_six=True, e4m3_max={self.e4m3_max}" if self.four_over_six else ""
        return (
            f"NVFP4Tensor(shape={tuple(self.shape)}, block={self.block!r}, rht={self.rht}, "
            f"rounding={self.rounding!r}, {amax}{extra}, dtype={self.dtype}, device={self.device})"
        )


def _amax_argument(amax, device) -> torch.Tensor:
    """The caller's ``amax`` as a 0-d float32 tensor on ``device``. A Python number is validated
    here (no host read); a tensor's value is not read here: :func:`_check_values` reads it with
    the input's check, once the kernels are launched (one host read for both)."""
    if isinstance(amax, torch.Tensor):
        if amax.numel() != 1:
            raise ValueError(f"amax must be a single value, got shape {tuple(amax.shape)}")
        if amax.dtype == torch.float32 and amax.dim() == 0 and not amax.requires_grad and amax.device == device:
            return amax   # what the line below returns for it, without its three tensor operations
        return amax.detach().to(device=device, dtype=torch.float32).reshape(())
    try:
        value = float(amax)
    except (TypeError, ValueError):
        raise TypeError(f"amax must be a number or a one-element tensor, got {type(amax).__name__}") from None
    _check_amax_value(value)
    return torch.full((), value, dtype=torch.float32, device=device)  # a fill kernel: capturable


def _check_amax_value(value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"amax must be a finite, non-negative number, got {value}")


def _capturing() -> bool:
    """True while a CUDA graph is being captured or ``torch.compile`` traces: no host reads then."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _start_host_read(t: torch.Tensor) -> Callable[[], float]:
    """Start copying the CUDA scalar ``t`` to the host, in stream order (into pinned memory), and
    return a function that waits for that copy alone and gives the value: work launched after this
    call keeps the GPU busy while the host waits."""
    host = t.detach().to("cpu", non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> float:
        done.synchronize()
        return float(host)

    return read


def _check_values(x2: torch.Tensor, amax_t: torch.Tensor, amax_given: bool, rht: bool,
                  read: Callable[[], float] | None = None, observed: torch.Tensor | None = None) -> None:
    """Raise on NaN and warn on ±Inf in ``x2`` [M, K].

    The computed amax (``max |x|``, post-RHT with the RHT) propagates NaN and is infinite when
    ``x2`` holds ±Inf, so one scalar read answers both (an infinite post-RHT amax is confirmed on
    ``x2``: the transform of values near float32's max overflows); ``read``, when given, is that
    read already started (:func:`_start_host_read`). A caller-given amax says nothing about
    ``x2``: its max |x| as the quantize kernel ``observed`` it (0-d, NaN-propagating; the rowwise
    kernel's ``OBSERVE``), or else one ``torch.aminmax`` pass, is read in one host read with the
    given amax, which is validated there.
    """
    if amax_given:
        if observed is None:
            lo, hi = torch.aminmax(x2)
            seen = torch.stack([lo.float(), hi.float()])
        else:
            seen = observed.reshape(1)
        given, *seen = torch.cat([amax_t.float().reshape(1), seen]).tolist()
        _check_amax_value(given)
        if given == 0 and (seen_max := max(abs(v) for v in seen)) > 0:   # NaN compares False: reported below
            raise ValueError(f"amax=0 was given but the input holds non-zero values (max |x| = {seen_max:g}): "
                             "with a zero amax every element decodes to 0; pass the input's amax or leave amax out")
        has_nan, has_inf = any(math.isnan(v) for v in seen), any(math.isinf(v) for v in seen)
    else:
        a = read() if read is not None else float(amax_t.detach())
        has_nan, has_inf = math.isnan(a), math.isinf(a)
        if has_inf and rht:  # the RHT of values near float32's max can overflow: was it an Inf?
            has_inf = bool(torch.isinf(x2).any())
    if has_nan:
        check_no_nan(x2, "quantize input")   # raises, with the one NaN message
        raise ValueError(
            "quantize: the random Hadamard transform of an input holding both +Inf and -Inf gave NaN; "
            "remove the Inf or pass amax=")
    if has_inf:
        warnings.warn(
            "quantize input contains ±Inf: the per-tensor amax is inf, so the global encode scale "
            "falls back to 1; the Inf's block decodes to 0 except the Inf itself (±2688) and the "
            "tensor loses its per-tensor range (TE's reference does the same). Pass amax= or remove the Inf.",
            RuntimeWarning, stacklevel=3,
        )


def _check_options(x: torch.Tensor, block: str, rounding: str, rht: bool) -> None:
    check_float_tensor(x)
    if not isinstance(rht, bool):
        raise TypeError(f"rht must be a bool, got {rht!r}")
    if block not in ("1d", "2d"):
        raise ValueError(f"block must be '1d' (1x16 blocks) or '2d' (16x16 tiles), got {block!r}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' (RNE) or 'stochastic' (SR), got {rounding!r}")
    if x.dim() == 0:
        raise ValueError("quantize needs at least a 1-D tensor (NVFP4 quantizes along the last dimension)")
    if block == "2d" and x.dim() < 2:
        raise ValueError(f"block='2d' needs a tensor with at least 2 dimensions (16x16 tiles), got shape {tuple(x.shape)}")
    if rht and x.shape[-1] % RHT_SIZE:
        raise ValueError(
            f"rht=True needs the quantized (last) dimension to be a multiple of {RHT_SIZE}; got {x.shape[-1]}. "
            "TE applies the RHT along the token axis in chunks of 16 and requires tokens % 16 == 0"
        )


def _signs(rht_signs) -> torch.Tensor | None:
    return None if rht_signs is None else torch.as_tensor(rht_signs, dtype=torch.float32)


def _check_nvfp4_options(block: str, rht: bool, rounding: str, four_over_six: bool, e4m3_max: int,
                         err_mode: str, row_scaled: bool, amax) -> None:
    """The 4over6 / row-scaled restrictions of TE 2.20 (reference ``NVFP4QuantizerRef.__init__`` and
    ``_quantize``; spec sections 2, 4, 5): each names the keyword at fault."""
    if not isinstance(four_over_six, bool) or not isinstance(row_scaled, bool):
        raise ValueError(f"four_over_six and row_scaled must be bools, got {four_over_six!r}, {row_scaled!r}")
    if e4m3_max not in (448, 256):
        raise ValueError(f"e4m3_max must be 448 or 256 (TE's nvfp4_e4m3_max), got {e4m3_max!r}")
    if e4m3_max != 448 and not four_over_six:
        raise ValueError("e4m3_max=256 needs four_over_six=True (TE: 'Non-4over6 NVFP4 quantization requires "
                         "E4M3 max 448')")
    if err_mode not in ("MAE", "MSE"):
        raise ValueError(f"err_mode must be 'MAE' or 'MSE' (TE's nvfp4_4over6_err_mode), got {err_mode!r}")
    for name, on in (("four_over_six", four_over_six), ("row_scaled", row_scaled)):
        if on and rht:
            raise ValueError(f"{name}=True does not support rht=True (TE 2.20 rejects the RHT with it)")
        if on and rounding != "nearest":
            raise ValueError(f"{name}=True needs rounding='nearest' (TE 2.20 rejects stochastic rounding with it)")
    if row_scaled and block != "1d":
        raise ValueError("row_scaled=True needs block='1d' (TE: 'Row-scaled NVFP4 only supports NVFP4 1x16 tile shape')")
    if row_scaled and amax is not None:
        raise ValueError("row_scaled=True computes one amax per row and takes no amax= (TE rejects amax reduction "
                         "with row-scaled mode)")


def uses_kernels(x: torch.Tensor, *, block: Block = "1d", rht: bool = False, rounding: Rounding = "nearest",
                 rht_signs: torch.Tensor | None = WGRAD_SIGNS, four_over_six: bool = False,
                 row_scaled: bool = False, **_ignored) -> bool:
    """Whether :func:`quantize` with these options runs the Triton kernels (else the reference).

    True on a device the kernels run on (CUDA with Triton; CPU only in Triton's interpreter)
    for non-empty float32/bfloat16/float16 inputs, except an RHT on float16 or with signs that
    are not 16 values of ±1, and never with ``four_over_six`` or ``row_scaled`` (see
    :func:`nvfp4lab.kernels.covers_quantize`). Takes (and ignores) the
    other keyword options of :func:`quantize`, so ``uses_kernels(x, **options)`` works.
    """
    mask = kernels.sign_mask(_signs(rht_signs)) if rht else 0
    return kernels.covers_quantize(x, block=block, rounding=rounding, rht=rht, sign_mask=mask,
                                   four_over_six=four_over_six, row_scaled=row_scaled)


def quantize(
    x: torch.Tensor,
    *,
    block: Block = "1d",
    rht: bool = False,
    rounding: Rounding = "nearest",
    generator: "torch.Generator | SRStream | None" = None,
    amax: torch.Tensor | float | None = None,
    rht_signs: torch.Tensor | None = WGRAD_SIGNS,
    check: bool = True,
    four_over_six: bool = False,
    e4m3_max: int = 448,
    err_mode: str = "MAE",
    row_scaled: bool = False,
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
        generator: the SR random source: a ``torch.Generator``, an
            :class:`~nvfp4lab.rounding.SRStream` (state on the device; capturable) or ``None``
            (torch's default generator).
        amax: precomputed per-tensor amax (delayed or fused scaling). Elements
            above it saturate to ±6·block scale. Default: ``max |x|`` (post-RHT if ``rht``).
        rht_signs: the RHT's 16 signs (default TE's fixed Wgrad vector).
        check: raise on NaN and warn on ±Inf, from the amax the quantization computes anyway
            (one host read of one scalar, which on CUDA waits for the amax kernel alone while the
            quantize kernel runs; with ``amax=`` given, the max |x| that the rowwise kernel
            observes as it quantizes (1x16 blocks, no RHT) or else one min/max pass over ``x``,
            read with a tensor ``amax`` in one host read after the quantize kernel is
            launched). ``False`` skips it, so the call never synchronises with the device; it is
            skipped on its own while a CUDA graph is being captured and under ``torch.compile``,
            where a host read is impossible. Unchecked, a NaN input gives a NaN amax, and every
            GEMM output using the tensor is NaN.
        four_over_six: 4over6 (TE ``nvfp4_use_4over6``; arXiv 2512.02010): each block is
            quantized twice, with the map-to-6 scale ``e4m3(RN(RN(bamax/6)·S_enc))`` and the
            map-to-4 scale ``e4m3(RN(that·1.5))`` (block max on FP4 value 4), and keeps the one
            with the lower error; ties keep map-to-6. See :func:`quantize_4over6_blocks`.
            Needs ``rounding="nearest"`` and no RHT. 1x16 and 16x16 blocks.
        e4m3_max: the E4M3 bound in the global scale, 448 or 256 (TE ``nvfp4_e4m3_max``;
            256 only with ``four_over_six``): ``S_enc = 6·e4m3_max / amax``. Block scales are
            still clamped at 448, so 256 leaves room for the 1.5x map-to-4 scale.
        err_mode: ``"MAE"`` (sum of ``|x̂ - x|``) or ``"MSE"`` (sum of squares), the 4over6
            error (TE ``nvfp4_4over6_err_mode``; its default exact mode, not the fast-math one).
        row_scaled: one FP32 amax per row instead of per tensor (TE ``row_scaled_nvfp4``): the
            result's :attr:`NVFP4Tensor.amax` is ``[M]``. 1x16 only, RNE, no RHT, no ``amax=``.

    On CUDA the work goes to the Triton kernels of :mod:`nvfp4lab.kernels` when
    Triton is installed and they cover the options (:func:`uses_kernels`; RNE results
    bit-identical to this reference path; set ``NVFP4LAB_DISABLE_KERNELS=1`` to compare);
    elsewhere the PyTorch code below runs. This function is the one place that decides.

    Returns:
        :class:`NVFP4Tensor`. Shapes whose dimensions are not multiples of 16 are
        zero-padded internally; the logical shape is kept and padding never shows.
        An empty input gives an empty :class:`NVFP4Tensor` with ``amax = 0``.

    Raises:
        TypeError: integer, bool, complex or FP8 dtype.
        ValueError: NaN in ``x`` (it would show as a NaN amax; NVFP4 cannot encode
            it and TE's reference would silently emit code 0), a 0-d input,
            ``block="2d"`` on a 1-D tensor, an unknown ``block`` / ``rounding``,
            ``rht=True`` with ``K % 16 != 0``, a negative, NaN or infinite ``amax``, or
            ``amax=0`` for an input with non-zero values (every element would decode to 0;
            a tensor ``amax`` is read only when ``check``, after the quantization ran: an SR
            generator has then advanced); ``rht_signs`` that are not 16 values of ±1; the 4over6 and
            row-scaled rules of TE 2.20: ``four_over_six`` or ``row_scaled`` that is not a bool,
            with ``rht=True`` or with ``rounding="stochastic"``, ``e4m3_max`` other than 448 or
            256 (256 only with ``four_over_six``), ``err_mode`` other than ``"MAE"``/``"MSE"``,
            ``row_scaled`` with ``block="2d"`` or with ``amax=``.
        TypeError: ``amax`` is neither a number nor a tensor (a tensor of more than one
            element raises ValueError); ``rht`` or ``check`` is not a bool.

    Warns:
        RuntimeWarning: ``x`` holds ±Inf (once per calling line, Python's default filter).
            The numerics are kept as TE's reference computes them: the per-tensor amax is
            ``inf``, so the global encode scale falls back to 1 (TE
            ``compute_global_encode_scaling_factor_FP4``; see :func:`global_encode_scale`)
            and every block is scaled by its E4M3 block scale alone. The block holding the
            Inf saturates to scale 448: the Inf comes back as ±2688 (= 6·448) and every other
            element of that block is quantized on the grid {0, 224, 448, 672, 896, 1344, 1792,
            2688}, so those below 112 in magnitude become 0 (``[1.0, inf, 0]`` -> ``[0, 2688, 0]``);
            blocks whose amax is below 6·2⁻⁶ get subnormal E4M3 scales and lose precision. One
            Inf thus wipes out the small values of its block and removes the per-tensor range
            from the whole tensor. Pass
            ``amax=`` to bound the range, or remove the Inf.

    Exact ``-0.0`` is encoded as code 0 (+0), as TE's reference does (the hardware
    may give code 8). Source: TE
    ``custom_recipes/reference_nvfp4.py``.
    """
    _check_options(x, block, rounding, rht)
    _check_nvfp4_options(block, rht, rounding, four_over_six, e4m3_max, err_mode, row_scaled, amax)
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {check!r}")
    signs = _signs(rht_signs) if rht else None   # only the RHT uses them
    shape = x.shape
    K = shape[-1]
    M = math.prod(shape[:-1])
    device = x.device
    check = check and not _capturing()
    amax_in = None if amax is None else _amax_argument(amax, device)

    def result(data, scale, amax_t, values=None):
        return NVFP4Tensor(
            data=data, scale=scale, amax=amax_t, shape=shape, block=block, dtype=x.dtype,
            rht=rht, rht_signs=signs if rht else None, rounding=rounding, values_bf16=values,
            four_over_six=four_over_six, e4m3_max=e4m3_max, row_scaled=row_scaled,
        )

    if M * K == 0:
        rows_s = -(-M // BLOCK_SIZE) if block == "2d" else M
        return result(
            torch.zeros(M, -(-K // 2), dtype=torch.uint8, device=device),
            torch.zeros(rows_s, -(-K // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=device),
            torch.zeros((M,) if row_scaled else (), dtype=torch.float32, device=device),
        )
    mask = kernels.sign_mask(signs) if rht else 0
    if four_over_six or row_scaled:
        data, scale, amax_t = _quantize_options_reference(x.reshape(M, K), block, four_over_six, e4m3_max,
                                                         err_mode, row_scaled, amax_in)
        if check:
            _check_values(x.reshape(M, K), amax_t.amax() if row_scaled else amax_t, amax_in is not None, rht)
        return result(data, scale, amax_t)
    reads: list = []
    if kernels.covers_quantize(x, block=block, rounding=rounding, rht=rht, sign_mask=mask):
        # the check's read of the amax starts once its kernel is launched: it overlaps the quantize kernel
        on_amax = (lambda a: reads.append(_start_host_read(a))) if check and x.is_cuda else None  # noqa: E731
        # observed: max |x| from the rowwise kernel, where it runs with a given amax (else None)
        data, scale, amax_t, observed = kernels.quantize_rowwise(
            x, block2d=block == "2d", rht=rht, sr=rounding == "stochastic", sign_mask=mask,
            generator=generator, amax=amax_in, on_amax=on_amax, observe=check and amax_in is not None)
    else:
        data, scale, amax_t = _quantize_reference(x.reshape(M, K), block, rht, rounding, generator, amax_in, signs)
        observed = None
    if check:
        _check_values(x.reshape(M, K), amax_t, amax_in is not None, rht, reads[0] if reads else None, observed)
    return result(data, scale, amax_t)


def _quantize_reference(x2: torch.Tensor, block: str, rht: bool, rounding: str, generator,
                        amax: torch.Tensor | None, signs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference: TE's operations in TE's order on ``x2`` [M, K] -> (data, scale, amax)."""
    M, K = x2.shape
    if rht:
        x2 = random_hadamard_transform(x2, signs=signs)
    xf = x2.float().contiguous()
    # Zero-pad to whole blocks (TE reference _pad_tensor); padding has amax 0, code 0.
    Kp = _ceil_to(K, BLOCK_SIZE)
    Mp = _ceil_to(M, BLOCK_SIZE) if block == "2d" else M
    xp = F.pad(xf, (0, Kp - K, 0, Mp - M)) if (Kp, Mp) != (K, M) else xf
    xabs = xp.abs()
    amax_t = xabs.amax() if amax is None else amax
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
    return pack_fp4(codes[:M, : _ceil_to(K, 2)]), scale, amax_t


def quantize_4over6_blocks(xb: torch.Tensor, vec_max: torch.Tensor, amax: torch.Tensor, *, e4m3_max: int = 448,
                           err_mode: str = "MAE", tile_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """4over6 on blocks, TE's operations in TE's order -> (codes ``uint8 [m, nb, 16]``, scales E4M3 ``[m, nb]``).

    Source: TE 2.20 ``custom_recipes/reference_nvfp4.py``,
    ``NVFP4QuantizerRef._quantize_blockwise_reference`` (global scale) and
    ``_quantize_blockwise_4over6_reference`` (candidates, error, choice); CUDA
    ``common/cast/nvfp4/quantize_4over6_nvfp4.cuh``. One FP32 operation per line, RN = round to
    nearest even, ``N = 6 · e4m3_max`` (2688 or 1536)::

        S_enc  = min(RN(N / amax), FLT_MAX); 1.0 where that is 0   # amax inf; amax 0 -> FLT_MAX, as TE's reference
        S_dec  = RN(1 / S_enc)                                      # torch.div(1.0, S_enc)
        base   = RN(RN(bamax / 6) * S_enc)       # NOT the default path's bamax * RN(S_enc * RN(1/6))
        sf4    = e4m3(clamp(RN(base * 1.5), ±448))                 # map-to-4: block max lands on 4
        sf6    = e4m3(clamp(base, ±448))                           # map-to-6: the usual block max on 6
        enc_k  = min(RN(1 / RN(float(sf_k) * S_dec)), FLT_MAX)
        q_k    = e2m1_rne(clamp(RN(x * enc_k), ±6))
        for i in 0..15 (sequentially, err_k starting at +0):        # the error, in the input's domain
            v      = RN(RN(RN(q_k[i] * sf_k) * amax) / N)           # a division by N, not a reciprocal
            d      = RN(v - x_i)
            err_k  = RN(err_k + |d|)          (MAE)   or   RN(err_k + RN(d * d))   (MSE)
        16x16 tiles: the 16 row errors summed as a tree, rows [0:8]+[8:16], [0:4]+[4:8], [0:2]+[2:4],
                     [0]+[1] (TE _sum_4over6_2d_error, the CUDA warp reduction order)
        pick map-to-4  iff  err4 < err6  (strictly: a tie keeps map-to-6)

    Args:
        xb: float32 ``[m, nb, 16]``, the blocks (zero padding contributes 0 to the errors).
        vec_max: float32 ``[m, nb, 1]``, the block amax of each row's block (for 16x16 tiles the tile
            amax repeated on its 16 rows).
        amax: float32 global amax, 0-d, or ``[m, 1, 1]`` per row (row-scaled).
        e4m3_max: 448 or 256.
        err_mode: ``"MAE"`` or ``"MSE"``.
        tile_rows: 1 (1x16 blocks) or 16 (16x16 tiles; ``m`` a multiple of 16).
    """
    dev = xb.device
    m, nb, tl = xb.shape
    fp4_max = _f32(E2M1_MAX, dev)
    e4m3_clamp = _f32(448.0, dev)                                 # block scales are clamped at 448 always
    denom = fp4_max * _f32(float(e4m3_max), dev)                  # 6 * e4m3_max, exact
    flt_max = _f32(FLT_MAX, dev)
    s_enc = torch.minimum(torch.div(denom, amax), flt_max)
    s_enc = torch.where(s_enc == 0.0, torch.ones_like(s_enc), s_enc)
    s_dec = torch.div(1.0, s_enc)
    base = torch.div(vec_max, fp4_max) * s_enc
    sf4 = torch.clamp(base * 1.5, min=-e4m3_clamp, max=e4m3_clamp).to(torch.float8_e4m3fn)
    sf6 = torch.clamp(base, min=-e4m3_clamp, max=e4m3_clamp).to(torch.float8_e4m3fn)
    enc4 = torch.minimum(torch.div(1.0, sf4.float() * s_dec), flt_max)
    enc6 = torch.minimum(torch.div(1.0, sf6.float() * s_dec), flt_max)
    q4 = rne_codes(torch.clamp(xb * enc4, -fp4_max, fp4_max))
    q6 = rne_codes(torch.clamp(xb * enc6, -fp4_max, fp4_max))
    v4_all, v6_all = decode_e2m1(q4), decode_e2m1(q6)
    sf4_f, sf6_f = sf4.float().squeeze(-1), sf6.float().squeeze(-1)   # [m, nb]
    err_amax = amax.squeeze(-1) if amax.dim() == 3 else amax         # row-scaled: [m, 1]
    err4 = torch.zeros_like(vec_max)
    err6 = torch.zeros_like(vec_max)
    for i in range(tl):
        for vals, sf, which in ((v4_all, sf4_f, 4), (v6_all, sf6_f, 6)):
            v = vals[:, :, i] * sf
            v = v * err_amax
            v = v / denom
            d = v - xb[:, :, i]
            e = (d * d) if err_mode == "MSE" else torch.abs(d)
            if which == 4:
                err4 = err4 + e.unsqueeze(-1)
            else:
                err6 = err6 + e.unsqueeze(-1)
    if tile_rows == 1:
        pick4 = err4 < err6
    else:
        pick4 = (_tree_sum_16_rows(err4) < _tree_sum_16_rows(err6)).repeat_interleave(tile_rows, dim=0)
    codes = torch.where(pick4, q4, q6)
    scale = torch.where(pick4, sf4.view(torch.uint8), sf6.view(torch.uint8)).view(torch.float8_e4m3fn).squeeze(-1)
    return codes, scale


def _tree_sum_16_rows(err: torch.Tensor) -> torch.Tensor:
    """[m, nb, 1] row errors -> [m/16, nb, 1] tile errors, TE ``_sum_4over6_2d_error``'s tree order."""
    rows = err.view(err.shape[0] // BLOCK_SIZE, BLOCK_SIZE, err.shape[1])
    rows = rows[:, 0:8, :] + rows[:, 8:16, :]
    rows = rows[:, 0:4, :] + rows[:, 4:8, :]
    rows = rows[:, 0:2, :] + rows[:, 2:4, :]
    return (rows[:, 0, :] + rows[:, 1, :]).unsqueeze(-1)


def _quantize_options_reference(x2: torch.Tensor, block: str, four_over_six: bool, e4m3_max: int, err_mode: str,
                                row_scaled: bool, amax: torch.Tensor | None):
    """The reference for 4over6 and/or row-scaled ``x2`` [M, K] -> (data, scale, amax).

    Source: TE ``NVFP4QuantizerRef._quantize`` (amax: ``max |x|`` per tensor, or per row
    ``torch.max(|x|, dim=1)`` when row-scaled, on the unpadded input) and
    ``_quantize_blockwise_reference`` (zero padding to whole blocks; the default path with a per-row
    ``S_enc`` when only row-scaled, :func:`quantize_4over6_blocks` with 4over6).
    """
    M, K = x2.shape
    xf = x2.float().contiguous()
    Kp = _ceil_to(K, BLOCK_SIZE)
    Mp = _ceil_to(M, BLOCK_SIZE) if block == "2d" else M
    xp = F.pad(xf, (0, Kp - K, 0, Mp - M)) if (Kp, Mp) != (K, M) else xf
    xabs = xp.abs()
    if row_scaled:
        amax_t = xf.abs().amax(dim=1)                                  # [M]
        amax_b = F.pad(amax_t, (0, Mp - M)).view(Mp, 1, 1)
    else:
        amax_t = xabs.amax() if amax is None else amax
        amax_b = amax_t
    nb = Kp // BLOCK_SIZE
    xb = xp.view(Mp, nb, BLOCK_SIZE)
    if block == "1d":
        vec_max = xabs.view(Mp, nb, BLOCK_SIZE).amax(dim=-1, keepdim=True)
    else:
        tile = xabs.view(Mp // BLOCK_SIZE, BLOCK_SIZE, nb, BLOCK_SIZE).amax(dim=(1, 3))
        vec_max = tile.repeat_interleave(BLOCK_SIZE, dim=0).unsqueeze(-1)
    if four_over_six:
        codes, scale = quantize_4over6_blocks(xb, vec_max, amax_b, e4m3_max=e4m3_max, err_mode=err_mode,
                                              tile_rows=BLOCK_SIZE if block == "2d" else 1)
        if block == "2d":  # one scale per tile: the rows of a tile share it
            scale = scale[::BLOCK_SIZE]
    else:  # row-scaled only: the default path with a per-row S_enc
        scale = block_decode_scales(vec_max, amax_b)
        codes = rne_codes(xb * block_encode_scales(scale, amax_b))
        scale = scale.squeeze(-1)
    codes = codes.reshape(Mp, Kp)
    return pack_fp4(codes[:M, : _ceil_to(K, 2)]), scale, amax_t


def pair_uses_kernels(x: torch.Tensor, row: dict, col: dict | None) -> bool:
    """Whether :func:`quantize_rowwise_columnwise` ``(x, row, col)`` runs the Triton kernels alone
    (with ``col=None``: :func:`uses_kernels` of the rowwise options); else :func:`quantize` makes
    each copy (which looks for NaN on the host unless told not to).

    The kernels cover a pair whose copies share ``block`` and ``rounding``, with the RHT on the
    columnwise copy only, no ``amax`` given, no 4over6 or row scaling, and what
    :func:`nvfp4lab.kernels.covers_rowwise_columnwise` asks of ``x`` (``M % 16 == 0`` with the RHT).

    Raises:
        ValueError: invalid ``block`` / ``rounding`` options shared by both copies (as
            :func:`quantize`); copies whose options differ give False, whatever they are.
    """
    if col is None:
        return uses_kernels(x, **row)
    return _pair_kernel_args(x, row, col) is not None


def _pair_kernel_args(x: torch.Tensor, row: dict, col: dict) -> tuple[str, str, bool, int] | None:
    """``(block, rounding, columnwise RHT, sign mask)`` for the pair kernels, or None where they do
    not cover the pair (the rule :func:`pair_uses_kernels` states)."""
    block, rounding = row.get("block", "1d"), row.get("rounding", "nearest")
    col_rht = bool(col.get("rht", False))
    extra = any(opts.get(k) for opts in (row, col) for k in ("four_over_six", "row_scaled"))
    if (row.get("rht", False) or (col.get("block", "1d"), col.get("rounding", "nearest")) != (block, rounding)
            or row.get("amax") is not None or col.get("amax") is not None or x.dim() < 2 or extra):
        return None
    _check_options(x, block, rounding, False)
    mask = kernels.sign_mask(_signs(col.get("rht_signs", WGRAD_SIGNS))) if col_rht else 0
    if not kernels.covers_rowwise_columnwise(x, block=block, rounding=rounding, rht=col_rht, sign_mask=mask,
                                             four_over_six=False, row_scaled=False):
        return None
    return block, rounding, col_rht, mask


def quantize_rowwise_columnwise(
    x: torch.Tensor,
    row: dict,
    col: dict | None = None,
    *,
    generator: "torch.Generator | SRStream | None" = None,
    values: tuple[bool | str, bool | str] = (False, False),
    fallback: bool = True,
    col_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    amax_out: torch.Tensor | None = None,
    gemm_with: tuple[NVFP4Tensor | None, NVFP4Tensor | None] = (None, None),
) -> tuple[NVFP4Tensor, NVFP4Tensor | None] | None:
    """The rowwise and the columnwise NVFP4 copies of ``x`` a training step needs.

    Equivalent to ``(quantize(x, **row), quantize(x2d.t(), **col))`` with
    ``x2d = x.reshape(-1, K)``: the rowwise copy (blocks along ``K``; Fprop/Dgrad operands) and
    the columnwise copy (``x2dᵀ`` quantized along the token axis ``M``; Wgrad operands, with the
    RHT along ``M`` when ``col["rht"]``). With ``col=None`` only the rowwise copy is made
    (``(q, None)``). TE's quantizers produce both usages of one tensor the same way.

    Where the Triton kernels cover the pair (:func:`nvfp4lab.kernels.covers_rowwise_columnwise`:
    the two copies share ``block`` and ``rounding``, only the columnwise copy uses the RHT, no
    ``amax`` given, ``M % 16 == 0`` with the RHT), one amax kernel and one read of ``x`` per copy
    compute both, bit-identical to the two calls for RNE; SR draws independent streams per copy,
    as two calls would. That path does not check for NaN (no host synchronisation): a NaN in
    ``x`` makes both amaxes NaN, and every GEMM output using them NaN.

    Args:
        x: float tensor ``[..., K]`` with at least 2 dimensions.
        row, col: the keyword options of :func:`quantize` for each copy
            (:meth:`nvfp4lab.recipe.NVFP4Recipe.quantize_options` of the two roles).
        generator: SR generator, shared by the two copies.
        values: (rowwise, columnwise): also keep that copy's BF16 block values
            (:attr:`NVFP4Tensor.values_bf16`) where the kernel that runs can write them
            (rowwise 1×16 with ``K % 16 == 0`` or 2D; columnwise ``M % 16 == 0``); the GEMM then
            skips a decode pass. Not part of the format. ``"only"``: that copy's values without
            its codes and scales (its ``data`` and ``scale`` None), where the kernel that runs
            makes them so (1×16 blocks: rowwise with ``K % 16 == 0``, columnwise with
            ``M % 16 == 0`` and no ``col_out``; the same values, fewer instructions and bytes);
            elsewhere ``"only"`` is ``True``. For an operand a GEMM uses at once (the layer's
            Fprop X, and dY for Dgrad and Wgrad).
        fallback: where the kernels do not cover the pair, make it with :func:`quantize`
            (default) or return ``None`` (for a caller with its own fallback).
        col_out: ``(data, scale, amax)`` tensors for the columnwise copy (``uint8 [K, ceil(M/2)]``,
            ``float8_e4m3fn`` ``[K or ceil(K/16), ceil(M/16)]``, ``float32 []``; the first two
            contiguous and 16-byte aligned), or None for new ones. The kernels write the codes and
            scales there directly (the amax, computed in a buffer of its own, is copied); the
            reference path copies all three. The columnwise copy returned holds these tensors.
            With 2D blocks a fourth tensor may follow: ``bfloat16 [K, M]``, the transpose of a
            contiguous, 16-byte aligned ``[M, K]``, for the block values of the columnwise copy
            (with 2D blocks the transpose of the rowwise copy's): the kernels write them there
            (with ``values[0]``), else they are decoded into it; both copies' ``values_bf16``
            are then views of it.
        amax_out: a zeroed, contiguous, 16-byte aligned ``float32 [2]`` tensor for the kernels'
            amax pass to accumulate into (``[0]`` rowwise, ``[1]`` columnwise amax), or None:
            the copies' ``amax`` are then views of it (a ``col_out`` amax that is already the
            right view is not copied into). Used only where the kernels run
            (:func:`nvfp4lab.kernels.quantize_rowwise_columnwise`).
        gemm_with: (rowwise, columnwise): the quantized operand (an :class:`NVFP4Tensor` made
            before this call) that copy will be multiplied with by :func:`nvfp4_matmul`, or None.
            Where the kernels make the pair, they also compute that GEMM's per-tensor factor (alpha) from
            the two amaxes (:attr:`NVFP4Tensor.gemm_coef`; the GEMM then launches no kernel for
            it): the same alpha, the same product.

    Raises:
        What :func:`quantize` raises, for either copy.
        ValueError: ``col_out`` without ``col``, or not as described; ``values`` not a pair of
            False, True or ``"only"``; ``gemm_with`` not a pair of None or NVFP4Tensors with a 0-d
            amax on ``x``'s device.
    """
    if not (isinstance(values, (tuple, list)) and len(values) == 2
            and all(isinstance(v, str) and v == "only" or not isinstance(v, str) and v in (False, True)
                    for v in values)):
        raise ValueError(f"values must be a pair of False, True or 'only', got {values!r}")
    if not (isinstance(gemm_with, (tuple, list)) and len(gemm_with) == 2):
        raise ValueError(f"gemm_with must be a pair (rowwise partner, columnwise partner), got {gemm_with!r}")
    for name, q in zip(("rowwise", "columnwise"), gemm_with):
        if q is not None and not (isinstance(q, NVFP4Tensor) and q.amax.shape == () and q.amax.device == x.device):
            raise ValueError(f"gemm_with's {name} partner must be an NVFP4Tensor with a 0-d amax on x's device")
    if col is None:
        if col_out is not None:
            raise ValueError("col_out is given but col is None: there is no columnwise copy to write")
        if fallback or uses_kernels(x, **row):
            return quantize(x, generator=generator, **row), None
        return None
    if col_out is not None and not (isinstance(col_out, (tuple, list)) and len(col_out) in (3, 4)
                                    and isinstance(col_out[2], torch.Tensor) and col_out[2].shape == ()
                                    and col_out[2].dtype == torch.float32 and col_out[2].device == x.device):
        raise ValueError("col_out must be (data, scale, amax) with amax a 0-d float32 tensor on x's device, "
                         "and with 2D blocks optionally the columnwise values")
    values_t = col_out[3] if col_out is not None and len(col_out) == 4 else None
    if values_t is not None and (row.get("block", "1d") != "2d" or not isinstance(values_t, torch.Tensor)
                                 or values_t.dim() != 2 or not values_t.t().is_contiguous()):
        raise ValueError("col_out's values (its fourth tensor) need 2D blocks and must be the transpose of a "
                         "contiguous [M, K] tensor")
    args = _pair_kernel_args(x, row, col)
    if args is None:
        if not fallback:
            return None
        x2d = x.reshape(-1, x.shape[-1])
        q_row, q_col = quantize(x, generator=generator, **row), quantize(x2d.t(), generator=generator, **col)
        if col_out is not None:
            kernels.check_col_out(col_out[:2], x2d, q_col.block == "2d")
            q_col = dataclasses.replace(q_col, data=col_out[0].copy_(q_col.data),
                                        scale=col_out[1].view(torch.uint8).copy_(q_col.scale.view(torch.uint8))
                                        .view(torch.float8_e4m3fn),
                                        amax=col_out[2].copy_(q_col.amax))
        if values_t is not None:
            values_t.copy_(q_col.block_values(torch.bfloat16))
            q_row = dataclasses.replace(q_row, values_bf16=values_t.t())
            q_col = dataclasses.replace(q_col, values_bf16=values_t)
        return q_row, q_col
    block, rounding, col_rht, mask = args
    coefs = [(q.amax, i == 1, torch.empty(2, dtype=torch.float32, device=x.device))
             for i, q in enumerate(gemm_with) if q is not None]
    d, s, am, dt, st, amt, v, vt = kernels.quantize_rowwise_columnwise(
        x, block2d=block == "2d", rht=col_rht, sr=rounding == "stochastic", sign_mask=mask,
        generator=generator, values=tuple(values),
        col_out=None if col_out is None else col_out[:2], values_out=None if values_t is None else values_t.t(),
        amax_out=amax_out, coefs=coefs)
    gemm_coef = {int(c): (amax, out) for amax, c, out in coefs}
    if col_out is not None:
        st = col_out[1].view(torch.float8_e4m3fn)
        amt = col_out[2] if col_out[2].data_ptr() == amt.data_ptr() else col_out[2].copy_(amt)
    M, K = math.prod(x.shape[:-1]), x.shape[-1]
    if values_t is not None:
        if v is None:   # the kernel that ran wrote no values: decode them into the given tensor
            values_t.t().copy_(kernels.block_values(d, s, M, K, block2d=True))
        v, vt = values_t.t(), values_t
    q_row = NVFP4Tensor(data=d, scale=s, amax=am, shape=x.shape, block=block, dtype=x.dtype,
                        rounding=rounding, values_bf16=v, gemm_coef=gemm_coef.get(0))
    q_col = NVFP4Tensor(data=dt, scale=st, amax=amt, shape=torch.Size([K, M]), block=block, dtype=x.dtype,
                        rht=col_rht, rht_signs=_signs(col.get("rht_signs", WGRAD_SIGNS)) if col_rht else None,
                        rounding=rounding, values_bf16=vt, gemm_coef=gemm_coef.get(1))
    return q_row, q_col


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
                 bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact emulation of an NVFP4 GEMM ``a @ bᵀ (+ bias)``: ``[M, K] × [N, K] -> [M, N]``.

    Both operands are quantized along the shared contraction dimension ``K``. The
    product of the ``code × block scale`` operands (:meth:`NVFP4Tensor.block_values`,
    exact) is accumulated in FP32, then multiplied in FP32 by
    ``alpha = RN(RN(amax_a · amax_b) / (6·6·448·448))``, the factor of TE's reference
    ``qgemm`` (a division; TE's native ``common/recipe/nvfp4.cu`` multiplies by
    ``RN(1/(6·6·448·448))`` instead, which can differ by one ulp); ``bias`` (``[N]``, any float
    dtype) is then added in FP32 and the sum rounded once to ``out_dtype``. Up to FP32
    accumulation order this is what an NVFP4 tensor core computes.

    ``out``: a contiguous ``[M, N]`` tensor of ``out_dtype`` to write the result into (the
    product is the same), or None for a new tensor.

    Raises:
        ValueError: ``K`` differs, or one operand is RHT-rotated and the other is
            not (or with other signs): the rotation would not cancel; ``bias`` is not
            ``[N]``; ``out`` is not a contiguous ``[M, N]`` tensor of ``out_dtype``.
        TypeError: an operand is not an :class:`NVFP4Tensor` (quantize it first), or
            ``out_dtype`` is not float16, bfloat16, float32 or float64.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, NVFP4Tensor):
            raise TypeError(f"nvfp4_matmul operand {name} must be an NVFP4Tensor (quantize it first), "
                            f"got {type(t).__name__}")
    check_float_dtype(out_dtype, "nvfp4_matmul out_dtype")
    _check_bias(bias, b.rows)
    if out is not None and (out.shape != (a.rows, b.rows) or out.dtype != out_dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{a.rows}, {b.rows}] tensor of {out_dtype}, got {out.dtype} "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    if a.cols != b.cols:
        raise ValueError(f"contraction dimensions differ: a has K={a.cols}, b has K={b.cols}")
    if a.rht != b.rht or (
        a.rht and a.rht_signs is not b.rht_signs
        and not torch.equal(torch.as_tensor(a.rht_signs), torch.as_tensor(b.rht_signs))
    ):
        raise ValueError("both operands must use the same RHT (or none) for it to cancel in the GEMM")
    plain = not (a.row_scaled or b.row_scaled) and a.e4m3_max == b.e4m3_max == 448  # what gemm covers
    if not plain:
        # TE reference qgemm: alpha = (amax_a * amax_b) / (6·6·e4m3_max_a·e4m3_max_b); a row-scaled
        # operand contributes one amax per output row (a) or column (b).
        acc = a.block_values(torch.float32) @ b.block_values(torch.float32).T
        amax_a = a.amax.reshape(-1, 1) if a.row_scaled else a.amax
        amax_b = b.amax.reshape(1, -1) if b.row_scaled else b.amax
        factor = E2M1_MAX * E2M1_MAX * float(a.e4m3_max) * float(b.e4m3_max)
        return _into(out, _gemm_epilogue(acc, amax_a, amax_b, out_dtype, bias, factor))
    if a.rows * a.cols * b.rows and kernels.covers_gemm(a.device, b.device, out_dtype, bias):
        # BF16 block values (exact) and a cuBLAS BF16 GEMM with FP32 accumulation, then alpha, bias, cast.
        return kernels.gemm(a.block_values(torch.bfloat16), b.block_values(torch.bfloat16), a.amax, b.amax,
                            out_dtype, bias, out=out, coef=_gemm_coef(a, b))
    acc = a.block_values(torch.float32) @ b.block_values(torch.float32).T
    return _into(out, _gemm_epilogue(acc, a.amax, b.amax, out_dtype, bias))


def _gemm_coef(a: NVFP4Tensor, b: NVFP4Tensor) -> torch.Tensor | None:
    """The (alpha, beta) of the GEMM of ``a`` and ``b`` that the kernels computed with one of them
    (:attr:`NVFP4Tensor.gemm_coef` naming the other's amax), or None."""
    for t, other in ((a, b), (b, a)):
        if t.gemm_coef is not None and t.gemm_coef[0] is other.amax:
            return t.gemm_coef[1]
    return None


def _into(out: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """``t``, or ``t`` copied into ``out`` when one is given (a path that computed a new tensor)."""
    if out is None or out is t:
        return t
    return out.copy_(t)


def _gemm_epilogue(acc: torch.Tensor, amax_a: torch.Tensor, amax_b: torch.Tensor, out_dtype: torch.dtype,
                   bias: torch.Tensor | None, factor: float = GEMM_ALPHA_DENOMINATOR) -> torch.Tensor:
    """The tail of an emulated NVFP4 GEMM, in FP32 and in this order: ``RN(acc · alpha)`` with
    ``alpha = RN(RN(amax_a · amax_b) / (6²·448²))`` (a tensor division, IEEE), ``+ bias``, one
    rounding to ``out_dtype``. ``acc``: the FP32 product of the block values [M, N]."""
    alpha = (amax_a.float() * amax_b.float()) / _f32(factor, acc.device)
    y = acc * alpha
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)
