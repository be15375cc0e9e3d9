"""The number formats of NVFP4: E2M1 elements and E4M3 block scales.

An NVFP4 element is a 4-bit **E2M1** float: bit 3 is the sign, bits 2-1 the
exponent (bias 1) and bit 0 the mantissa. Its eight magnitudes are
``0, 0.5, 1, 1.5, 2, 3, 4, 6``; there is no Inf and no NaN. Two elements share
a byte. Every 16 elements share one **E4M3** (FP8, ``torch.float8_e4m3fn``)
block scale, and the whole tensor shares one FP32 per-tensor (global) scale;
those live in :mod:`nvfp4lab.quantize`.

Every rule here follows Transformer Engine 2.20's pure-PyTorch reference,
``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``
(``cast_to_fp4x2`` / ``cast_from_fp4x2``).
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "E2M1_MAX",
    "E4M3_MAX",
    "E5M2_MAX",
    "FLT_MAX",
    "GLOBAL_SCALE_NUMERATOR",
    "GEMM_ALPHA_DENOMINATOR",
    "RCP_E2M1_MAX",
    "RCP_GLOBAL_SCALE_NUMERATOR",
    "E2M1_SIGN_BIT",
    "check_float_tensor",
    "check_no_nan",
    "rne_codes",
    "encode_e2m1",
    "decode_e2m1",
    "pack_fp4",
    "unpack_fp4",
    "to_e4m3",
    "FP8_BLOCK_LEN",
    "MX_BLOCK_SIZE",
    "E8M0_BIAS",
    "E8M0_NAN",
    "E8M0_MIN_EXP",
    "E8M0_MAX_EXP",
    "E2M1_EMAX",
    "E4M3_EMAX",
    "E5M2_EMAX",
    "RCP_E4M3_MAX",
    "RCP_E5M2_MAX",
    "e8m0_round_up",
    "e8m0_from_exponent",
    "e8m0_to_float",
    "e8m0_inverse",
]

#: The 8 non-negative E2M1 magnitudes, indexed by the 3-bit code (exponent, mantissa).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
#: Largest E2M1 magnitude (code 7).
E2M1_MAX = 6.0
#: Largest finite FP8 E4M3 (``float8_e4m3fn``) magnitude.
E4M3_MAX = 448.0
#: Largest finite FP8 E5M2 magnitude.
E5M2_MAX = 57344.0
#: Largest finite float32, used by TE to cap reciprocals of zero.
FLT_MAX = float(torch.finfo(torch.float32).max)
#: Bit 3 of an E2M1 code is its sign.
E2M1_SIGN_BIT = 8
#: NVFP4's per-tensor encode scale is ``GLOBAL_SCALE_NUMERATOR / amax`` = 448 · 6 / amax = 2688 / amax
#: (exact in FP32; TE ``core_nvfp4.cuh`` ``compute_global_encode_scaling_factor_FP4``; paper appendix B.1).
GLOBAL_SCALE_NUMERATOR = E4M3_MAX * E2M1_MAX
#: An NVFP4 GEMM's output factor is ``amax_a · amax_b / GEMM_ALPHA_DENOMINATOR`` = ... / (6² · 448²)
#: = 7225344 (exact in FP32; TE ``common/recipe/nvfp4.cu``, reference ``qgemm``).
GEMM_ALPHA_DENOMINATOR = E2M1_MAX * E2M1_MAX * E4M3_MAX * E4M3_MAX
#: RN_fp32(1/6) = 0x3E2AAAAB, the factor the block-scale computation multiplies by (kernels take it as an
#: fp32 argument).
RCP_E2M1_MAX = float(torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32))
#: RN_fp32(1/2688), the decode factor of :meth:`nvfp4lab.NVFP4Tensor.dequantize` (TE ``dequantize_nvfp4.cuh``).
RCP_GLOBAL_SCALE_NUMERATOR = float(torch.tensor(1.0 / GLOBAL_SCALE_NUMERATOR, dtype=torch.float32))

#: Block length of TE's ``Float8BlockScaling``: 1x128 vectors and 128x128 tiles
#: (``Float8BlockQuantizer.block_len``, ``transformer_engine/pytorch/tensor/float8_blockwise_tensor.py``).
FP8_BLOCK_LEN = 128
#: Elements per MX block (OCP Microscaling Formats (MX) v1.0, section 5: k = 32; TE ``MXFP8BlockScaling``).
MX_BLOCK_SIZE = 32
#: E8M0 (the MX block scale) is an unsigned 8-bit exponent: code ``e`` means ``2**(e - 127)``, code 255 is NaN
#: (OCP MX v1.0, section 5.4.1).
E8M0_BIAS = 127
E8M0_NAN = 255
#: Smallest and largest unbiased exponents an E8M0 scale holds (codes 0 and 254).
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
#: Exponent of the largest normal of each element format, ``emax_elem`` of OCP MX v1.0 section 6.3
#: (E2M1: 6 = 1.5 * 2**2; E4M3: 448 = 1.75 * 2**8; E5M2: 57344 = 1.75 * 2**15).
E2M1_EMAX = 2
E4M3_EMAX = 8
E5M2_EMAX = 15
#: ``RN_fp32(1/448)`` and ``RN_fp32(1/57344)``: TE's ``Quantized_Limits<OType>::max_norm_rcp``
#: (``transformer_engine/common/utils.cuh``), the factor MXFP8 multiplies the block amax by.
RCP_E4M3_MAX = float(torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32))
RCP_E5M2_MAX = float(torch.tensor(1.0 / E5M2_MAX, dtype=torch.float32))

# All 16 code points, code -> value. Code 8 is -0.0.
_E2M1_TABLE = torch.cat([E2M1_VALUES, -E2M1_VALUES])

# Round-to-nearest-even decision points on the magnitude axis. A magnitude goes
# *up* past a threshold when it is strictly greater (``>``) if the code below the
# threshold is even, or greater-or-equal (``>=``) if the code below is odd: ties
# go to the code whose mantissa bit is 0 (TE reference ``cast_to_fp4x2``).
#   threshold: 0.25 0.75 1.25 1.75 2.5  3.5  5.0
#   tie goes:   0    1    1    2    2    4    4      (value)
_STRICT_THRESHOLDS = (0.25, 1.25, 2.5, 5.0)  # tie rounds down
_INCLUSIVE_THRESHOLDS = (0.75, 1.75, 3.5)  # tie rounds up

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float_tensor(x: torch.Tensor, what: str = "input") -> None:
    """Raise a clear error unless ``x`` is a float16/bfloat16/float32/float64 tensor.

    Raises:
        TypeError: ``x`` is not a tensor, or its dtype is integer, bool,
            complex or an FP8 type (the message names the dtype).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{what} has dtype {x.dtype}; NVFP4 quantizes floating-point tensors "
            f"(one of {', '.join(str(d) for d in _FLOAT_DTYPES)})"
        )


def check_float_dtype(dtype: torch.dtype, what: str = "dtype") -> None:
    """Raise ``TypeError`` unless ``dtype`` is float16, bfloat16, float32 or float64: the dtypes a
    decoded NVFP4 value or a GEMM result is returned in (an integer or FP8 dtype would silently
    truncate or round it again)."""
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} must be one of {', '.join(str(d) for d in _FLOAT_DTYPES)}, got {dtype}")


def check_no_nan(x: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` if ``x`` holds a NaN (NVFP4 cannot encode it).

    Source of the rule: TE's reference would silently emit code 0 (``reference_nvfp4.py``,
    ``cast_to_fp4x2``). One reduction and one host synchronisation.
    """
    if torch.isnan(x).any():
        raise ValueError(
            f"{what} contains NaN; NVFP4 has no NaN encoding and TE's reference would "
            "silently turn it into code 0 (TE reference_nvfp4.py::cast_to_fp4x2)"
        )


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes, round to nearest, ties to even code.

    Args:
        x: float tensor of any shape, in E2M1 units (i.e. already multiplied by the
            block's encode scale). Values beyond ±6 (including ±Inf) saturate to
            ±6, as TE's reference clamp and the hardware ``cvt.rn.satfinite`` do.

    Returns:
        ``uint8`` tensor of ``x``'s shape holding one code 0..15 per element
        (bit 3 = sign). Ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to
        0, 1, 1, 2, 2, 4, 4. Values in ``[-0.25, 0)`` give code 8 (−0); an exact
        ``-0.0`` gives code 0, as in TE's reference (``-0.0 >= 0.0`` is true).
        The hardware probably gives 8 for −0.0 (unconfirmed); we follow the
        reference because it is the bit-exactness oracle.

    Raises:
        TypeError: non-float dtype.
        ValueError: NaN in ``x`` (E2M1 has no NaN; the reference would give code 0).

    Source: TE ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py::cast_to_fp4x2``.
    """
    check_float_tensor(x)
    check_no_nan(x, "encode_e2m1 input")
    return rne_codes(x.float())


def rne_codes(y: torch.Tensor) -> torch.Tensor:
    """RNE E2M1 codes (uint8, 0..15, same shape) of a float32 tensor known to hold no NaN.

    :func:`encode_e2m1` without its checks, for callers that already validated (the hot path
    of :func:`nvfp4lab.quantize`). Values beyond ±6 saturate; ``-0.0`` gives code 0.

    The magnitude code is the number of decision thresholds the clamped magnitude has
    passed: ``>`` for thresholds whose tie rounds down, ``>=`` for those whose tie rounds
    up. (Seven byte-wide comparisons measured 3x faster on CPU than one ``bucketize``.)
    """
    y = y.clamp(-E2M1_MAX, E2M1_MAX)
    mag = y.abs()
    code = (mag > _STRICT_THRESHOLDS[0]).to(torch.uint8)
    for t in _STRICT_THRESHOLDS[1:]:
        code += mag > t
    for t in _INCLUSIVE_THRESHOLDS:
        code += mag >= t
    return code | ((y < 0).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Map E2M1 codes (``uint8`` 0..15, one per element) to their float32 values.

    Raises:
        TypeError: ``codes`` is not ``uint8``.
        ValueError: a code is above 15 (you may have passed packed bytes: use
            :func:`unpack_fp4` first).
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"E2M1 codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes))}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("E2M1 codes must be 0..15; got a larger value (packed bytes? use unpack_fp4 first)")
    return _E2M1_TABLE.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte along the last dimension.

    Args:
        codes: ``uint8`` ``[..., K]`` with values 0..15 and ``K`` even.

    Returns:
        ``uint8`` ``[..., K/2]``; element ``2i`` goes in the **low** nibble and
        element ``2i+1`` in the high nibble (TE ``cast_to_fp4x2``:
        ``result[:, ::2] + result[:, 1::2] * 16``; PTX ``cvt...e2m1x2``).

    Raises:
        TypeError: not ``uint8``. ValueError: ``K`` odd, a 0-d tensor, or codes > 15.
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"pack_fp4 needs uint8 codes, got {getattr(codes, 'dtype', type(codes))}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(
            f"pack_fp4 needs an even last dimension (two codes per byte); got shape {tuple(codes.shape)}. "
            "Pad with code 0 first."
        )
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("pack_fp4: codes must be 0..15")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``uint8 [..., K/2]`` -> ``uint8 [..., K]`` codes, low nibble first.

    Raises:
        TypeError: not ``uint8``. ValueError: a 0-d tensor.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4 needs uint8 bytes, got {getattr(packed, 'dtype', type(packed))}")
    if packed.dim() == 0:
        raise ValueError("unpack_fp4 needs at least one dimension")
    out = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to FP8 E4M3 (``torch.float8_e4m3fn``), RNE, saturating at ±448.

    ``float8_e4m3fn`` has no Inf, so values are clamped to ±448 first (TE
    reference ``clamp(..., -448, 448).to(torch.float8_e4m3fn)``; the kernels use
    ``cvt.rn.satfinite``). Subnormal results (down to 2^-9) and zero are kept:
    NVFP4 block scales have **no floor** (torchao floors at 2^-6, TE does not). NaN stays NaN
    (E4M3's NaN code 0x7F, with its sign), as the reference's clamp-then-cast gives: a NaN amax
    makes a NaN scale, which turns the GEMM outputs that use it into NaN.

    Raises:
        TypeError: non-float dtype.
    """
    check_float_tensor(x)
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_round_up(x: torch.Tensor) -> torch.Tensor:
    """E8M0 code of a non-negative float32, rounded **up** to a power of two and saturated.

    TE's ``ptx::float_to_e8m0`` (``transformer_engine/common/util/ptx_arch_spec.cuh``; on Blackwell
    the PTX ``cvt.rp.satfinite.ue8m0x2.f32``), which MXFP8 applies to ``amax * RN(1/fp8_max)``:

    * the code is the fp32 biased exponent, plus one when any mantissa bit is set (an exact
      power of two keeps its exponent; anything just above goes one up);
    * NaN gives 255; +Inf and values at or above ``2**127`` (biased exponent 254) give 254, the
      largest finite code (satfinite);
    * 0 gives code 0 (``2**-127``); an fp32 subnormal gives 0 if it is at most ``2**-127`` (mantissa
      ``<= 0x400000``) and 1 (``2**-126``) otherwise.

    Args:
        x: float32 tensor of any shape, ``>= 0`` (an amax-derived value; the sign bit is ignored).

    Returns:
        ``uint8`` tensor of the same shape.

    Raises:
        TypeError: ``x`` is not float32.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"e8m0_round_up needs a float32 tensor, got {getattr(x, 'dtype', type(x))}")
    bits = x.abs().contiguous().view(torch.int32)
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    bump = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = exponent + bump.to(torch.int32)
    code = torch.where(torch.isinf(x), torch.full_like(code, 254), code)
    code = torch.where(torch.isnan(x), torch.full_like(code, E8M0_NAN), code)
    return code.to(torch.uint8)


def e8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """E8M0 code of ``2**exponent`` for an integer tensor, clamped to ``[-127, 127]`` (codes 0..254).

    Raises:
        TypeError: ``exponent`` is not an integer tensor.
    """
    if not isinstance(exponent, torch.Tensor) or exponent.is_floating_point() or exponent.dtype == torch.bool:
        raise TypeError(f"e8m0_from_exponent needs an integer tensor, got {getattr(exponent, 'dtype', type(exponent))}")
    return (exponent.to(torch.int32).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP) + E8M0_BIAS).to(torch.uint8)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 codes (``uint8``) to float32 ``2**(code - 127)``; code 255 is NaN.

    Code 0 is ``2**-127``, an fp32 subnormal (exact). Source: OCP MX v1.0 section 5.4.1.

    Raises:
        TypeError: ``codes`` is not ``uint8``.
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"E8M0 codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes))}")
    value = torch.ldexp(torch.ones(codes.shape, dtype=torch.float32, device=codes.device),
                        codes.to(torch.int32) - E8M0_BIAS)
    return torch.where(codes == E8M0_NAN, torch.full_like(value, float("nan")), value)


def e8m0_inverse(codes: torch.Tensor) -> torch.Tensor:
    """The float32 factor ``2**(127 - code)`` an MX quantizer multiplies elements by; 255 gives NaN.

    TE's ``ptx::exp2f_rcp<float>`` (``transformer_engine/common/util/ptx.cuh``): exact for every
    code, including code 254 whose inverse ``2**-127`` is subnormal.

    Raises:
        TypeError: ``codes`` is not ``uint8``.
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"E8M0 codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes))}")
    value = torch.ldexp(torch.ones(codes.shape, dtype=torch.float32, device=codes.device),
                        E8M0_BIAS - codes.to(torch.int32))
    return torch.where(codes == E8M0_NAN, torch.full_like(value, float("nan")), value)
