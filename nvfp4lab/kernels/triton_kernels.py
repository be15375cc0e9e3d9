"""Triton kernels for NVFP4 quantization, bit-exact with :func:`nvfp4lab.quantize.quantize`.

Imported lazily by :mod:`nvfp4lab.kernels` (this module needs Triton). With
``TRITON_INTERPRET=1`` set *before* the import, Triton's interpreter runs the same kernels
on CPU tensors, which is how the CPU tests check bit-exactness.

Every floating-point step is one IEEE float32 operation in the order of TE 2.20 (reference_nvfp4.py::_quantize_blockwise_reference, common/cast/nvfp4/core_nvfp4.cuh)
(``nvfp4lab.quantize``). Rounding that Triton would do through a conversion is done here
with integer bit arithmetic instead, so that the GPU and the interpreter agree bit for bit
(the interpreter's float conversions truncate or round half-up, e.g. fp32->bf16 and
fp32->fp8):

* E4M3 block scales: RNE by integer rounding of the float32 bits (normal range) and by
  the ``(s + 2^14) - 2^14`` trick (subnormal range, quantum 2^-9); the input is clamped
  to ``[0, 448]`` first, so no saturation logic is needed. ``float(sf)`` is the rounded
  float32 value itself.
* BF16 rounding of RHT outputs: the hardware ``cvt.rn.bf16x2.f32`` on the GPU and
  ``(bits + 0x7FFF + lsb) & 0xFFFF0000`` in the interpreter (:data:`HW_CVT`).
* E2M1 codes: the minimum of three candidates, each one exact float32 operation
  (:func:`_e2m1_rne_fast`, :func:`_e2m1_sr_fast`): float32 arithmetic, not the half-rate integer
  pipe, does most of the work. A copy that holds only its BF16 values rounds each magnitude on
  the E2M1 grid with one magic number per binade instead (:func:`_grid_values_bits`).
* Reciprocals and the global scale use ``tl.math.div_rn`` (IEEE division); Triton's ``/``
  on float32 lowers to the approximate ``div.full.f32``.
* Kernels are launched with ``enable_fp_fusion=False`` so no multiply-add is contracted
  into an FMA; the few fused multiply-adds are explicit ``tl.fma`` whose product is exact (a
  power of two), so the interpreter's multiply-then-add gives the same bits.

The random Hadamard transform is a 16-point fast Walsh-Hadamard butterfly (4 stages of
add/sub, via reshape/split/join/permute), not a matmul. With ``RHT_F64`` (the default for
every input dtype) the butterfly runs in float64, where the 16-term sum is exact for
bf16 blocks spanning less than 2^41 and fp32 blocks spanning less than 2^25 (the bounds of
``nvfp4lab.hadamard``), then rounds once to float32 and (for bf16 inputs) once more to bf16:
what ``nvfp4lab.hadamard`` does (float64 sum, rounded to float32, then to the input dtype),
bit for bit wherever the sum is exact. The 16-slice amax pass needs only the largest output:
it runs the butterfly in float32 and keeps that result where a margin argument certifies it equal
to the float64 one (:func:`_certain_bf16_max`; BF16 inputs), re-reading the tile for a float64
butterfly only where it cannot (about one tile in a hundred). With ``RHT_F64=False`` it runs in float32:
bit-identical for bf16 inputs except in blocks of extreme dynamic range (1 element in
16.7M for 4096^2 randn, the class of difference TE's own FP32 accumulation has) and not
bit-identical for fp32 inputs (about half the elements differ by an ulp).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)  # largest finite float32
#: Compiled for the GPU (not Triton's interpreter): float32 -> BF16 rounding may use the hardware
#: conversion (``cvt.rn.bf16x2.f32``, two values per instruction), which rounds to nearest even
#: exactly; the interpreter's conversions do not, so there the integer rounding runs instead.
HW_CVT = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))
#: Philox4x32 rounds for stochastic rounding (Random123's Philox4x32-7 passes BigCrush; 10 is
#: the conventional safety margin and Triton's default).
PHILOX_ROUNDS = tl.constexpr(7)


# ----------------------------------------------------------------------------- numerics helpers
@triton.jit
def _div_rn(num, den):
    """IEEE float32 ``num / den`` (num a python float, den a tensor)."""
    return tl.math.div_rn(tl.full(den.shape, num, tl.float32), den)


@triton.jit
def _global_scales(amax, inv6):
    """(S_enc, S_dec, mult) from the per-tensor amax (0-d fp32): TE core_nvfp4.cuh compute_global_encode_scaling_factor_FP4."""
    a = tl.full((1,), 0.0, tl.float32) + amax
    s_enc = tl.minimum(_div_rn(2688.0, a), FLT_MAX)
    s_enc = tl.where((a == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_dec = _div_rn(1.0, s_enc)
    mult = s_enc * inv6
    return tl.max(s_enc, axis=0), tl.max(s_dec, axis=0), tl.max(mult, axis=0)


@triton.jit
def _abs_bits(v):
    """``|v|`` as int32 bits (sign cleared). For non-negative floats the integer order is the
    float order, and every NaN's bits exceed +inf's, so an integer max of these is a
    NaN-propagating amax (``tl.maximum`` on floats would drop NaN)."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _max_nan(a, b):
    """``max(a, b)`` that propagates NaN (PTX ``max.NaN.f32``, one FMNMX); a reduction's combine."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax_bits(v):
    """NaN-propagating ``max |v|`` of a 2-D tile as int32 bits (see :func:`_abs_bits`)."""
    return tl.max(tl.max(_abs_bits(v), axis=1), axis=0)


@triton.jit
def _rounded_max(bits, ROUND_BF16: tl.constexpr):
    """An amax (|v| as int32 bits, NaN-propagating) of float32 RHT outputs -> the amax of those
    outputs rounded to BF16. RNE is monotone and odd, so max|RN(v)| = RN(max|v|): the amax passes
    round one value per tile instead of every element (NaN stays NaN, overflow gives inf)."""
    if ROUND_BF16:
        bits = _round_bf16(bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    return bits


@triton.jit
def _certain_bf16_max(bits):
    """A post-RHT amax from an FP32 butterfly, certified: ``(amax bits, ok)``.

    ``bits``: the int32 bits of a tile's max |y| over FP32-butterfly RHT outputs of BF16 inputs
    (``_rht16(..., F64=False)``, scaled by 1/4). The exact pass wants RN_bf16(RN_fp32(Y)), Y the
    exact max (:func:`_rounded_max` of the FP64 butterfly). An FP32 butterfly of depth 4 errs by
    at most γ₄·Σ|x| ≤ 2⁻²²·16·max|x| per unscaled output, and the unscaled Hadamard keeps the
    norm times 4, so Y ≥ max|x|/4 and the tile max is within 2⁻¹⁸·Y of Y (Higham, *Accuracy and
    Stability of Numerical Algorithms*, §4.2, pairwise summation). RN_bf16∘RN_fp32 is monotone:
    where it maps ``max·(1 - 2⁻¹⁶)`` and ``max·(1 + 2⁻¹⁶)`` (each within 2⁻²⁴ of exact) to the
    same BF16 value, that value is the exact pass's, and ``ok`` is True. Not ok (the caller runs
    the FP64 butterfly): the max lies within ~2⁻¹⁶ of a BF16 rounding boundary (0.6-1.1% of the
    tiles of 4096² Gaussian, log-normal-row and Student-t inputs), is below 2⁻¹⁰⁰ (FP32 scaling may have underflowed) or is Inf/NaN (an Inf or NaN input,
    or an FP32 overflow the FP64 sum would not have)."""
    j = tl.arange(0, 2)
    v = tl.full((2,), 0.0, tl.float32) + bits.to(tl.float32, bitcast=True)
    r = _round_bf16(v * tl.where(j == 0, 0.9999847412109375, 1.0000152587890625)).to(tl.int32, bitcast=True)
    lo = tl.min(r, axis=0)
    hi = tl.max(r, axis=0)
    return hi, (lo == hi) & (bits >= 0x0D800000) & (bits < 0x7F800000)


@triton.jit
def _e4m3_rne(s):
    """``s`` float32 in [0, 448] -> (RNE E4M3 value as float32, its E4M3 bit pattern as int32)."""
    bits = s.to(tl.int32, bitcast=True)
    rn = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # clear the low 20 bits (0xFFF00000)
    vn = rn.to(tl.float32, bitcast=True)
    vs = (s + 16384.0) - 16384.0  # subnormal E4M3: RNE to a multiple of 2^-9
    v = tl.where(s < 0.015625, vs, vn)
    vb = v.to(tl.int32, bitcast=True)
    code_n = (((vb >> 23) - 120) << 3) | ((vb >> 20) & 7)
    code_s = (v * 512.0).to(tl.int32)
    code = tl.where(v < 0.015625, code_s, code_n)
    return v, code


@triton.jit
def _e4m3_decode(code):
    """E4M3 (fn) bit patterns 0..0x7E (int32, non-negative scales) -> float32 values."""
    e = (code >> 3) & 15
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _round_bf16(v):
    """Round float32 to the nearest BF16 value (ties to even), returned as float32.

    On the GPU (:data:`HW_CVT`) the hardware conversion (NaN stays a NaN); in the interpreter the
    integer rounding ``(bits + 0x7FFF + lsb) & 0xFFFF0000``, where NaN gives torch's BF16 NaN
    (0x7FC0): the integer rounding would carry a NaN with an all-ones significand (0x7FFFFFFF,
    the GPU's canonical NaN) into the sign bit (-0.0)."""
    if HW_CVT:  # two values per cvt.rn.bf16x2.f32, widened back by a shift and a mask
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; and.b32 $1, t, 0xFFFF0000; }",
            "=r,=r,r,r", [v], dtype=tl.int32, is_pure=True, pack=2).to(tl.float32, bitcast=True)
    b = v.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    r = tl.where(v != v, 0x7FC00000, r)
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _rht16(x, R: tl.constexpr, C: tl.constexpr, SIGN_MASK: tl.constexpr, F64: tl.constexpr,
           ROUND_BF16: tl.constexpr):
    """RHT of each 16-chunk of the last axis of ``x`` [R, C]: ``y = ((x ⊙ s) @ H16) / 4``.

    A 4-stage butterfly (natural/Sylvester order), exact in float64 for bf16 and most fp32
    inputs, rounded once to float32, then to bf16 when ``ROUND_BF16``.
    """
    j = tl.arange(0, C) % 16
    sgn = tl.where(((SIGN_MASK >> j) & 1) != 0, -1.0, 1.0)
    if F64:
        v = x.to(tl.float64) * sgn.to(tl.float64)[None, :]
    else:
        v = x * sgn[None, :]
    v = tl.reshape(v, (R * C // 16, 2, 2, 2, 2))
    for _ in tl.static_range(4):
        a, b = tl.split(v)
        v = tl.permute(tl.join(a + b, a - b), (0, 4, 1, 2, 3))
    v = tl.reshape(v, (R, C))
    if F64:
        v = (v * 0.25).to(tl.float32)
    else:
        v = v * 0.25
    if ROUND_BF16:
        v = _round_bf16(v)
    return v


@triton.jit
def _clamp6(y):
    """``y`` clamped to [-6, 6] (the E2M1 range; TE clamps the scaled values before rounding)."""
    return tl.minimum(tl.maximum(y, -6.0), 6.0)


@triton.jit
def _e2m1_rne(y):
    """E2M1 codes (int32) of ``y`` already clamped to [-6, 6]: TE ``cast_to_fp4x2`` thresholds."""
    m = tl.abs(y)
    c = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
         + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
         + (m > 5.0).to(tl.int32))
    return c | ((y < 0.0).to(tl.int32) << 3)


@triton.jit
def _sign_bit3(y):
    """The E2M1 sign bit (8) where ``y < 0``, else 0 (int32): ``y + 0.0`` turns -0.0 into +0.0 and
    keeps every other value, so -0.0 gets no sign (TE's reference) and a negative value that
    rounds to zero keeps it."""
    return (((y + 0.0).to(tl.uint32, bitcast=True) >> 31) << 3).to(tl.int32)


@triton.jit
def _e2m1_rne_fast(y):
    """E2M1 codes (int32) of the scaled values ``y`` (not clamped; |y| > 6 saturates to 6): the
    codes of :func:`_e2m1_rne` (TE's thresholds) from floating-point operations.

    Within each binade of the E2M1 grid the code is a linear function of the value, and a code
    is even exactly where the value's mantissa bit is, so with m = min(|y|, 6) the magnitude code
    is RNE-to-integer of the piecewise-linear, concave T(m) = min(2m, m + 2, m/2 + 4). RNE is
    monotone, so it is the minimum of the three candidates RNE(2m), 2 + RNE(m), 4 + RNE(m/2),
    each one exact operation: adding the magic 2^23 (whose float32 ulp is 1) rounds to an
    integer, ``fma(m, 2, 2^23)`` etc., and the product is exact (a power of two), so Triton's
    interpreter (multiply, then add) gives the same bits. The minimum's float32 bits are
    0x4B000000 + code. (Checked against the thresholds on every float32 in [0, 6].)

    The sign is that of ``y < 0``, as TE's reference (:func:`_sign_bit3`). Mostly floating-point
    operations: the integer pipe, which issues at half the float32 rate on Hopper, was what
    bounded the kernels. NaN gives an unspecified code.
    """
    return (_e2m1_rne_grid(y).to(tl.int32, bitcast=True) - 0x4B000000) | _sign_bit3(y)


@triton.jit
def _e2m1_rne_grid(y):
    """The magnitude code of :func:`_e2m1_rne_fast` as the float32 ``2^23 + code`` (exact)."""
    m = tl.minimum(tl.abs(y), 6.0)
    return tl.minimum(tl.minimum(tl.fma(m, 2.0, 8388608.0), m + 8388610.0), tl.fma(m, 0.5, 8388612.0))


@triton.jit
def _e2m1_sr_fast(y, u):
    """Stochastic E2M1 codes of the scaled values ``y`` (not clamped; |y| > 6 saturates to 6), with
    ``u`` the offset uniform of :func:`_sr_offset` (same shape).

    In the code domain of :func:`_e2m1_rne_fast`, where the code is linear in the value within a
    binade, stochastic rounding is ``floor(T(m) + v)`` with v uniform in [0, 1): it rounds up
    with probability frac(T) = (m - lo) / step. floor is monotone, so it is again the minimum of
    the three candidates' floors, and ``floor(t + v) = RNE(t + u)`` with ``u = v - 1/2 + 2^-16``
    (the 2^-16 keeps ties, where RNE would pick the even neighbour, off the draws' grid). Each
    candidate is one fma (``t + u``) and one magic add (RNE to an integer). A grid value never
    rounds away (``|u| < 1/2``). The sign is that of ``y < 0`` (:func:`_sign_bit3`).
    The two roundings of a candidate move the decision by at most 2^-21 of a step.
    """
    return (_e2m1_sr_grid(y, u).to(tl.int32, bitcast=True) - 0x4B400000) | _sign_bit3(y)


@triton.jit
def _e2m1_sr_grid(y, u):
    """The magnitude code of :func:`_e2m1_sr_fast` as the float32 ``1.5·2^23 + code`` (exact)."""
    m = tl.minimum(tl.abs(y), 6.0)
    # magic 1.5 * 2^23: t + u reaches -1/2, and the float32 ulp is 1 only from 2^23 on
    u1 = tl.fma(m, 2.0, u) + 12582912.0
    u2 = (m + u) + 12582914.0
    u3 = tl.fma(m, 0.5, u) + 12582916.0
    return tl.minimum(tl.minimum(u1, u2), u3)


@triton.jit
def _sr_offset(byte):
    """A random byte ``k`` (uint32, 0..255) -> the offset uniform ``u = (k + 1/2) / 256 - 1/2 +
    2^-16`` of :func:`_e2m1_sr_fast` (exact float32).

    The byte goes into bits 8..15 of the float32 ``1 + (k + 1/2)·2^-15 + 2^-23``
    (bits 0x3F800081), and one exact fma makes ``f·128 - 128.5``. 8 random bits per element, as
    Blackwell's ``cvt.rs.satfinite.e2m1x4.f32`` (TE): each rounding probability is within
    2^-9 + 2^-16 of (m - lo) / step, and its average over values is unbiased.
    """
    f = ((byte << 8) | 0x3F800081).to(tl.float32, bitcast=True)
    return tl.fma(f, 128.0, -128.5)


@triton.jit
def _sr_byte_offsets(word, b):
    """The offset uniforms (:func:`_sr_offset`) of byte ``b`` of random int32 words: ``b`` a
    constant 0..3 or an int32 tensor of them broadcastable to ``word``.

    On the GPU (:data:`HW_CVT`) one byte permute builds the float32 bits 0x3F80kk81 of
    :func:`_sr_offset` from the word and the constant 0x3F800081 (``prmt.b32`` with the selector
    0x7604 + 16·b: byte 0 = 0x81, byte 1 = byte b of the word, bytes 2-3 = 0x80, 0x3F), in place
    of a shift and two masks; the same bits as the interpreter's shifts."""
    if HW_CVT:
        sel = tl.full(word.shape, 0x7604, tl.int32) + b * 16
        k = tl.full(word.shape, 0x3F800081, tl.int32)
        f = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [word, k, sel],
                                      dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
        return tl.fma(f, 128.0, -128.5)
    return _sr_offset((word.to(tl.uint32, bitcast=True) >> (8 * b)) & 0xFF)


@triton.jit
def _sr_words(seed, counter):
    """The four random int32 words of one 16-element block: Philox4x32 (PHILOX_ROUNDS) at
    ``counter`` (a tensor; one counter per block), keyed by ``seed``."""
    return tl.randint4x(seed, counter, PHILOX_ROUNDS)


@triton.jit
def _sr_block_uniforms(seed, counter):
    """Offset uniforms for whole 16-element blocks in element order: ``counter`` [R, NB] ->
    [R, NB * 16]. Element i of a block takes byte (i % 8) // 2 of word (i // 8)·2 + i % 2 of the
    block's draw (:func:`_sr_words`): the mapping under which the rowwise kernel's four
    [even, odd] x [first, second half] quarters of a block each take one whole word."""
    r0, r1, r2, r3 = _sr_words(seed, counter)
    w = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [R, NB, p, h] = word 2h + p
    R: tl.constexpr = counter.shape[0]
    NB: tl.constexpr = counter.shape[1]
    w = tl.broadcast_to(w[:, :, :, :, None], (R, NB, 2, 2, 4))
    u = _sr_byte_offsets(w, tl.arange(0, 4)[None, None, None, None, :])  # [R, NB, p, h, b]
    return tl.reshape(tl.permute(u, (0, 1, 3, 4, 2)), (R, NB * 16))  # element h*8 + b*2 + p


@triton.jit
def _sr_word_offsets(word):
    """Offset uniforms of the four bytes of each random word: [R, NB] -> [R, NB, 4] (byte b of
    the word in lane b; as :func:`_sr_offset`)."""
    R: tl.constexpr = word.shape[0]
    NB: tl.constexpr = word.shape[1]
    return _sr_byte_offsets(tl.broadcast_to(word[:, :, None], (R, NB, 4)), tl.arange(0, 4)[None, None, :])


@triton.jit
def _pack(codes, R: tl.constexpr, C: tl.constexpr):
    """int32 codes [R, C] -> uint8 bytes [R, C/2], even element in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _encode_1d(v, s_dec, mult, u, R: tl.constexpr, C: tl.constexpr, SR: tl.constexpr,
               E2M1_BITS: tl.constexpr = True):
    """1x16 blocks along the last axis of ``v`` [R, C]: (codes int32 [R, C], scale bytes int32 [R, C/16])."""
    v3 = tl.reshape(v, (R, C // 16, 16))
    bamax = tl.max(tl.abs(v3), axis=2)
    sf = tl.minimum(tl.minimum(bamax * mult, FLT_MAX), 448.0)
    sfv, sfc = _e4m3_rne(sf)
    enc = tl.minimum(_div_rn(1.0, sfv * s_dec), FLT_MAX)
    y = v3 * enc[:, :, None]
    if SR:
        codes = _e2m1_sr_fast(y, tl.reshape(u, (R, C // 16, 16)))
    elif E2M1_BITS:
        codes = _e2m1_rne_fast(y)
    else:
        codes = _e2m1_rne(_clamp6(y))
    return tl.reshape(codes, (R, C)), sfc


@triton.jit
def _encode_2d(v, s_dec, mult, u, R: tl.constexpr, C: tl.constexpr, SR: tl.constexpr,
               E2M1_BITS: tl.constexpr = True):
    """16x16 tiles of ``v`` [R, C]: (codes int32 [R, C], scale bytes int32 [R/16, C/16])."""
    v4 = tl.reshape(v, (R // 16, 16, C // 16, 16))
    bamax = tl.max(tl.max(tl.abs(v4), axis=3), axis=1)
    sf = tl.minimum(tl.minimum(bamax * mult, FLT_MAX), 448.0)
    sfv, sfc = _e4m3_rne(sf)
    enc = tl.minimum(_div_rn(1.0, sfv * s_dec), FLT_MAX)
    y = v4 * enc[:, None, :, None]
    if SR:
        codes = _e2m1_sr_fast(y, tl.reshape(u, (R // 16, 16, C // 16, 16)))
    elif E2M1_BITS:
        codes = _e2m1_rne_fast(y)
    else:
        codes = _e2m1_rne(_clamp6(y))
    return tl.reshape(codes, (R, C)), sfc


@triton.jit
def _tile_index(M, K, BM: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr):
    pid = tl.program_id(0)
    n_k = tl.cdiv(K, BK)
    if REVERSE:
        pid = tl.cdiv(M, BM) * n_k - 1 - pid
    return pid // n_k, pid % n_k


@triton.jit
def _load_tile(x_ptr, M, K, sxm, sxk, pm, pk, BM: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
               I64: tl.constexpr):
    rows = pm * BM + tl.arange(0, BM)
    cols = pk * BK + tl.arange(0, BK)
    if I64:
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    ptrs = x_ptr + rows[:, None] * sxm + cols[None, :] * sxk
    if EVEN:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0)
    return x.to(tl.float32), rows, cols


@triton.jit
def _store(ptrs, val, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, val)
    else:
        tl.store(ptrs, val, mask=mask)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def amax_kernel(x_ptr, amax_ptr, M, K, sxm, sxk,
                ROW: tl.constexpr, ROW_RHT: tl.constexpr, COL_RHT: tl.constexpr,
                SIGN_MASK: tl.constexpr, RHT_F64: tl.constexpr, ROUND_BF16: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr):
    """Global amax pass: atomic max of |x| (or |RHT_K(x)|) into amax[0] when ROW, and of
    |RHT_M(x)| (the columnwise copy's post-RHT values) into amax[1] when COL_RHT.

    ``amax_ptr`` is the float32 amax buffer viewed as int32: the max is taken on the bits of
    |x| (:func:`_amax_bits`), so a NaN anywhere gives a NaN amax (which then turns every GEMM
    output that uses this operand into NaN, through the per-tensor factor) without a host sync."""
    pm, pk = _tile_index(M, K, BM, BK, False)
    x, rows, cols = _load_tile(x_ptr, M, K, sxm, sxk, pm, pk, BM, BK, EVEN, I64)
    if ROW:
        if ROW_RHT:
            tl.atomic_max(amax_ptr, _rounded_max(_amax_bits(_rht16(x, BM, BK, SIGN_MASK, RHT_F64, False)), ROUND_BF16))
        else:
            tl.atomic_max(amax_ptr, _amax_bits(x))
    if COL_RHT:
        vt = _rht16(tl.trans(x), BK, BM, SIGN_MASK, RHT_F64, False)
        tl.atomic_max(amax_ptr + 1, _rounded_max(_amax_bits(vt), ROUND_BF16))


@triton.jit
def quantize_kernel(x_ptr, M, K, sxm, sxk, amax_ptr, amaxt_ptr, seed_ptr,
                    d_ptr, s_ptr, dt_ptr, st_ptr,
                    d_rs, s_rs, dt_rs, st_rs, inv6,
                    ROW: tl.constexpr, COL: tl.constexpr, ROW_RHT: tl.constexpr, COL_RHT: tl.constexpr,
                    BLOCK2D: tl.constexpr, SR: tl.constexpr, SIGN_MASK: tl.constexpr,
                    RHT_F64: tl.constexpr, ROUND_BF16: tl.constexpr,
                    BM: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr, E2M1_BITS: tl.constexpr,
                    EVEN: tl.constexpr, I64: tl.constexpr):
    """Quantize one [BM, BK] tile of x [M, K] (strides sxm, sxk), read once.

    ROW: x along K -> data d [M, ceil(K/2)] (row stride d_rs), scales s [M or ceil(M/16),
    ceil(K/16)] (row stride s_rs), global amax at amax_ptr.
    COL: xᵀ along M -> data dt [K, ceil(M/2)], scales st [K or ceil(K/16), ceil(M/16)],
    amax at amaxt_ptr; with COL_RHT the RHT runs along M. With BLOCK2D the columnwise output is
    the transpose of the rowwise one (same tiles, same amax), as ``quantize(x.t(), block="2d")``.
    SR random streams: seed[0] for the rowwise output, seed[1] for the columnwise one; one
    Philox draw per 1x16 block of the output, at counter (output row) * (blocks per row) + block
    (:func:`_sr_block_uniforms`).
    """
    pm, pk = _tile_index(M, K, BM, BK, REVERSE)
    x, rows, cols = _load_tile(x_ptr, M, K, sxm, sxk, pm, pk, BM, BK, EVEN, I64)
    Mh = (M + 1) // 2
    Kh = (K + 1) // 2
    M16 = (M + 15) // 16
    K16 = (K + 15) // 16
    if ROW or BLOCK2D:
        s_enc, s_dec, mult = _global_scales(tl.load(amax_ptr), inv6)
        v = x
        if ROW_RHT:
            v = _rht16(x, BM, BK, SIGN_MASK, RHT_F64, ROUND_BF16)
        u = 0.0
        if SR:
            seed = tl.load(seed_ptr)
            u = _sr_block_uniforms(seed, rows[:, None] * K16 + (pk * (BK // 16) + tl.arange(0, BK // 16))[None, :])
        if BLOCK2D:
            codes, sfc = _encode_2d(v, s_dec, mult, u, BM, BK, SR, E2M1_BITS)
        else:
            codes, sfc = _encode_1d(v, s_dec, mult, u, BM, BK, SR, E2M1_BITS)
        if ROW:
            hcols = pk * (BK // 2) + tl.arange(0, BK // 2)
            _store(d_ptr + rows[:, None] * d_rs + hcols[None, :], _pack(codes, BM, BK),
                   (rows[:, None] < M) & (hcols[None, :] < Kh), EVEN)
            scols = pk * (BK // 16) + tl.arange(0, BK // 16)
            if BLOCK2D:
                srows = pm * (BM // 16) + tl.arange(0, BM // 16)
                _store(s_ptr + srows[:, None] * s_rs + scols[None, :], sfc.to(tl.uint8),
                   (srows[:, None] < M16) & (scols[None, :] < K16), EVEN)
            else:
                _store(s_ptr + rows[:, None] * s_rs + scols[None, :], sfc.to(tl.uint8),
                   (rows[:, None] < M) & (scols[None, :] < K16), EVEN)
        if COL and BLOCK2D:
            hrows = pm * (BM // 2) + tl.arange(0, BM // 2)
            _store(dt_ptr + cols[:, None] * dt_rs + hrows[None, :], _pack(tl.trans(codes), BK, BM),
                   (cols[:, None] < K) & (hrows[None, :] < Mh), EVEN)
            srows = pm * (BM // 16) + tl.arange(0, BM // 16)
            scols = pk * (BK // 16) + tl.arange(0, BK // 16)
            _store(st_ptr + scols[:, None] * st_rs + srows[None, :], tl.trans(sfc).to(tl.uint8),
                   (scols[:, None] < K16) & (srows[None, :] < M16), EVEN)
    if COL and not BLOCK2D:
        s_enc_t, s_dec_t, mult_t = _global_scales(tl.load(amaxt_ptr), inv6)
        vt = tl.trans(x)
        if COL_RHT:
            vt = _rht16(vt, BK, BM, SIGN_MASK, RHT_F64, ROUND_BF16)
        ut = 0.0
        if SR:
            seed_t = tl.load(seed_ptr + 1)
            ut = _sr_block_uniforms(seed_t, cols[:, None] * M16 + (pm * (BM // 16) + tl.arange(0, BM // 16))[None, :])
        codes_t, sfc_t = _encode_1d(vt, s_dec_t, mult_t, ut, BK, BM, SR, E2M1_BITS)
        hrows = pm * (BM // 2) + tl.arange(0, BM // 2)
        _store(dt_ptr + cols[:, None] * dt_rs + hrows[None, :], _pack(codes_t, BK, BM),
                   (cols[:, None] < K) & (hrows[None, :] < Mh), EVEN)
        srows = pm * (BM // 16) + tl.arange(0, BM // 16)
        _store(st_ptr + cols[:, None] * st_rs + srows[None, :], sfc_t.to(tl.uint8),
                   (cols[:, None] < K) & (srows[None, :] < M16), EVEN)


@triton.jit
def dequantize_kernel(d_ptr, s_ptr, amax_ptr, out_ptr, M, K, d_rs, s_rs, o_rs, inv2688,
                      BLOCK2D: tl.constexpr, GLOBAL: tl.constexpr, UNDO_RHT: tl.constexpr,
                      SIGN_MASK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Decode packed E2M1 codes with their E4M3 block scales to BF16 [M, K].

    GLOBAL=False: ``code × sf`` (exact in BF16; ``NVFP4Tensor.block_values``).
    GLOBAL=True: ``RN(code · RN(RN(sf · amax) · RN(1/2688)))`` in fp32 (``sf`` alone when amax
    is not finite), then with UNDO_RHT the inverse RHT (float64 butterfly, rounded to fp32),
    then RNE to BF16: ``NVFP4Tensor.dequantize(torch.bfloat16)``.
    """
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    hcols = pk * (BK // 2) + tl.arange(0, BK // 2)
    b = tl.load(d_ptr + rows[:, None] * d_rs + hcols[None, :],
                mask=(rows[:, None] < M) & (hcols[None, :] < (K + 1) // 2), other=0).to(tl.int32)
    c = tl.reshape(tl.join(b & 15, b >> 4), (BM, BK))
    m = c & 7
    mag = tl.where(m < 4, m.to(tl.float32) * 0.5,
                   tl.where(m < 6, (m - 2).to(tl.float32), 4.0 + (m - 6).to(tl.float32) * 2.0))
    val = tl.where((c & 8) != 0, -mag, mag)
    scols = pk * (BK // 16) + tl.arange(0, BK // 16)
    if BLOCK2D:
        srows = rows // 16
    else:
        srows = rows
    sb = tl.load(s_ptr + srows[:, None] * s_rs + scols[None, :],
                 mask=(rows[:, None] < M) & (scols[None, :] < (K + 15) // 16), other=0)
    sf = _e4m3_decode(sb.to(tl.int32))
    if GLOBAL:
        amax = tl.load(amax_ptr)
        amax_b = tl.full(sf.shape, 0.0, tl.float32) + amax
        finite = tl.abs(amax_b) <= FLT_MAX
        sf = tl.where(finite, (sf * amax_b) * inv2688, sf)
    out = tl.reshape(tl.reshape(val, (BM, BK // 16, 16)) * sf[:, :, None], (BM, BK))
    if UNDO_RHT:
        # inverse: u @ Rᵀ = ((u @ H16) ⊙ s) / 4 (H symmetric); exact in float64, one rounding
        j = tl.arange(0, BK) % 16
        sgn = tl.where(((SIGN_MASK >> j) & 1) != 0, -1.0, 1.0).to(tl.float64)
        w = tl.reshape(out.to(tl.float64), (BM * BK // 16, 2, 2, 2, 2))
        for _ in tl.static_range(4):
            a, bb = tl.split(w)
            w = tl.permute(tl.join(a + bb, a - bb), (0, 4, 1, 2, 3))
        out = ((tl.reshape(w, (BM, BK)) * sgn[None, :]) * 0.25).to(tl.float32)
    out = _round_bf16(out)
    cols = pk * BK + tl.arange(0, BK)
    tl.store(out_ptr + rows[:, None] * o_rs + cols[None, :],
             (out.to(tl.uint32, bitcast=True) >> 16).to(tl.int16),
             mask=(rows[:, None] < M) & (cols[None, :] < K))


# ----------------------------------------------------------------------------- 16-slice kernel
@triton.jit
def _load_slice_tile(x_ptr, M, K, sxm, sxk, G: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr,
                     EVEN: tl.constexpr, I64: tl.constexpr):
    """This program's tile of 16·G rows × BK columns of x [M, K] as 16 row slices
    ``xs[i] = x[16g + i, k]`` (float32, a tuple of 16 [G, BK] tensors), with the slices' first
    rows ``g`` [G], the columns [BK] and the tile index (pm, pk)."""
    pm, pk = _tile_index(M, K, 16 * G, BK, REVERSE)
    xs, g, cols = _slice_tile_at(x_ptr, M, K, sxm, sxk, pm, pk, G, BK, EVEN, I64)
    return xs, g, cols, pm, pk


@triton.jit
def _slice_tile_at(x_ptr, M, K, sxm, sxk, pm, pk, G: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
                   I64: tl.constexpr, inside=None):
    """Tile (pm, pk) of 16·G rows × BK columns of x [M, K] as 16 row slices (:func:`_load_slices`,
    ``inside`` passed on), with the slices' first rows ``g`` [G] and the columns [BK]."""
    g = pm * (16 * G) + tl.arange(0, G) * 16
    cols = pk * BK + tl.arange(0, BK)
    if I64:
        g = g.to(tl.int64)
        cols = cols.to(tl.int64)
    return _load_slices(x_ptr, M, K, sxm, sxk, g, cols, EVEN, inside), g, cols


@triton.jit
def _load_slices(x_ptr, M, K, sxm, sxk, g, cols, EVEN: tl.constexpr, inside=None):
    """The 16 row slices ``x[g + i, cols]`` (a tuple of 16 float32 [G, C] tensors) of x [M, K]
    (M % 16 == 0), for the slices' first rows ``g`` [G] and the columns ``cols`` [C]; zero where
    out of bounds unless EVEN, and everywhere (no memory read) where a given boolean ``inside``
    is false."""
    base = x_ptr + g[:, None] * sxm + cols[None, :] * sxk
    if EVEN and inside is None:
        xs = [tl.load(base + i * sxm).to(tl.float32)
              for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    else:
        if EVEN:
            lmask = tl.broadcast_to(inside, (g.shape[0], cols.shape[0]))
        else:
            lmask = (g[:, None] < M) & (cols[None, :] < K)
            if inside is not None:
                lmask = lmask & inside
        xs = [tl.load(base + i * sxm, mask=lmask, other=0.0).to(tl.float32)
              for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    return tl.tuple(xs)


@triton.jit
def _rht16_slices(xs, SIGN_MASK: tl.constexpr, F64: tl.constexpr, ROUND_BF16: tl.constexpr,
                  SCALE: tl.constexpr = True, STAGES: tl.constexpr = 4):
    """The RHT of columnwise blocks held as 16 slices (tuple of 16 [G, BK], slice i = element i of
    every block): the 4-stage butterfly of :func:`_rht16` as element-wise add/sub between slices,
    with the same numerics (exact in float64, one rounding to float32, then to bf16). Not SCALE
    (FP32 only, no rounding to bf16): the butterfly's sums without the final 1/4, for an amax
    that scales its one maximum instead (see :func:`_slices_amax_bits`).

    The signs are not applied to the inputs: each value carries a compile-time sign, and a stage
    adds or subtracts the magnitudes so that both of its outputs carry the sign of its first
    input. Before stage s the sign of value i is that of input (i >> s) << s, so every output
    carries the sign of input 0, applied with the final 1/4 (-1/4). Each intermediate is then
    exactly ± the signed butterfly's (RN(-v) = -RN(v)), with no negation instruction: in float64
    the inputs convert straight from BF16 (F2F.F64.BF16), where a negated input took an FP32
    negation and conversion. Only a zero's sign may differ (x - x = +0), which the consumers
    never see: they take |y| or add +0.0 (:func:`_scaled`, :func:`_sign_bit3`).

    ``STAGES=3`` (FP32, not SCALE, for :func:`_rht16_slices_amax_bits`): the first three stages
    alone, their outputs unscaled and unsigned."""
    if F64:
        ys = [xs[i].to(tl.float64) for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    else:
        ys = [xs[i] for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    for s in tl.static_range(STAGES):
        # Stage s pairs a = ys[p] and b = ys[p + 2^s], p = i with bit s cleared. Before it, value i
        # carries the sign of input (i >> s) << s: a that of input p0 = p with its low s bits
        # cleared, b that of input p0 + 2^s. The pair's sum goes to p and its difference to p + 2^s
        # where the two signs agree, and the other way round where they differ.
        ys = [(ys[i - (i & (1 << s))] + ys[i - (i & (1 << s)) + (1 << s)]
               if ((i & (1 << s)) == 0) == (((SIGN_MASK >> ((i >> (s + 1)) << (s + 1))) & 1)
                                            == ((SIGN_MASK >> (((i >> (s + 1)) << (s + 1)) + (1 << s))) & 1))
               else ys[i - (i & (1 << s))] - ys[i - (i & (1 << s)) + (1 << s)])
              for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    q: tl.constexpr = -0.25 if (SIGN_MASK & 1) != 0 else 0.25
    if F64:
        ys = [(ys[i] * q).to(tl.float32) for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    elif SCALE:
        ys = [ys[i] * q for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    elif (SIGN_MASK & 1) != 0:
        ys = [-ys[i] for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    if ROUND_BF16:
        ys = [_round_bf16(ys[i]) for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    return tl.tuple(ys)


@triton.jit
def _slices_amax_bits(ys, SCALE: tl.constexpr = 1.0):
    """NaN-propagating max |y| over slices (a tuple of [G, BK] float32 tensors, 16 or any number), times SCALE,
    as int32 bits.

    Each thread keeps a float max that propagates NaN (PTX ``max.NaN.f32``: one FMNMX with the
    |y| folded in, where the int32 max of :func:`_abs_bits` takes two ALU instructions); the
    threads' maxima are then combined as int32 bits (:func:`_abs_bits`' order; any NaN's bits
    exceed +inf's). SCALE (a power of two) multiplies the one maximum: ``RN(SCALE·t)`` is
    monotone in t, so ``max RN(SCALE·|y|) = RN(SCALE·max |y|)`` bit for bit, NaN and Inf
    included: the FP32 amax pass leaves the RHT's 1/4 out of its butterfly and scales here."""
    m = tl.abs(ys[0])
    for i in tl.static_range(1, len(ys)):
        m = _max_nan(m, tl.abs(ys[i]))
    if SCALE != 1.0:
        m = m * SCALE
    return tl.max(tl.max(m.to(tl.int32, bitcast=True), axis=1), axis=0)


@triton.jit
def _rht16_slices_amax_bits(xs, SIGN_MASK: tl.constexpr):
    """The FP32-butterfly post-RHT max of 16 slices (as :func:`_slices_amax_bits` of
    ``_rht16_slices(xs, SIGN_MASK, False, False, False)`` times 1/4) without the last stage's
    outputs: that stage turns each pair (a, b), slices p and p + 8, into ±RN(a + b) and ±RN(a - b),
    and max(|a + b|, |a - b|) = |a| + |b| with RN monotone, so the pair's larger magnitude is
    RN(|a| + |b|): one addition (its |·| operand modifiers free) where the stage's two and the max's
    two took four instructions, two of them on the half-rate ALU pipe. The same bits wherever the
    three-stage values are finite; where a and b are infinities the stage gives a NaN (∞ - ∞) and
    this an inf. Only for :func:`amax_slices_kernel`'s certified path, which takes any non-finite
    maximum to the FP64 butterfly (:func:`_certain_bf16_max`)."""
    ys = _rht16_slices(xs, SIGN_MASK, False, False, False, 3)
    return _slices_amax_bits(tl.tuple([tl.abs(ys[i]) + tl.abs(ys[i + 8]) for i in (0, 1, 2, 3, 4, 5, 6, 7)]), 0.25)


@triton.jit
def _col_sr_offsets(seed_ptr, cols, gi, M16):
    """The SR offset uniforms of the 16 slices of a tile's columnwise blocks (:func:`_sr_byte_offsets`):
    one Philox draw per block, keyed by the columnwise copy's seed (``seed_ptr[1]``), counter
    ``k * M/16 + block``; slice i takes byte (i % 8) // 2 of word (i // 8)·2 + i % 2."""
    seed_t = tl.load(seed_ptr + 1)
    r = _sr_words(seed_t, cols[None, :] * M16 + gi[:, None])  # one draw per columnwise block
    return [_sr_byte_offsets(r[(i // 8) * 2 + i % 2], (i % 8) // 2)
            for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]


@triton.jit
def _slices_code_words(gs, ys, MAGIC: tl.constexpr):
    """The two int32 words of packed E2M1 codes of columnwise blocks held as 16 slices: ``gs[i]``
    the grid floats (``MAGIC + magnitude code``) and ``ys[i]`` the scaled values (from
    :func:`_scaled`) of element i of every block -> (elements 0-7, elements 8-15), element e in
    bits 4(e % 8)..4(e % 8)+3, packed as :func:`_code_word` packs them (:func:`_code_term`)."""
    w0 = _code_word_start(ys[0], MAGIC)
    w1 = _code_word_start(ys[0], MAGIC)
    for i in tl.static_range(8):
        w0 = _code_term(gs[i], ys[i], 1 << (4 * i), w0)
        w1 = _code_term(gs[8 + i], ys[8 + i], 1 << (4 * i), w1)
    return w0.to(tl.int32, bitcast=True), w1.to(tl.int32, bitcast=True)


@triton.jit
def _store_slices_transposed(vt_ptr, vt_rs, vs, cols, pm, M, K, G: tl.constexpr, BK: tl.constexpr,
                             EVEN: tl.constexpr):
    """Store 16 slices ``vs[i]`` [G, BK] (element (g, k) of slice i belongs to row 16g + i of tile
    pm, column ``cols[k]``) transposed, into ``vt`` [K, M] (row stride ``vt_rs``): row k of ``vt``
    gets the tile's G blocks' 16 values side by side (16·G contiguous elements), one coalesced row
    segment instead of one 32-byte piece per thread and row."""
    # one [G, BK, 16] tensor: element (g, k, i) = vs[i][g, k], the value of xᵀ[k, 16g + i]
    p = [tl.join(vs[2 * j], vs[2 * j + 1]) for j in (0, 1, 2, 3, 4, 5, 6, 7)]
    q = [tl.join(p[2 * j], p[2 * j + 1]) for j in (0, 1, 2, 3)]
    r = [tl.join(q[2 * j], q[2 * j + 1]) for j in (0, 1)]
    vrow = tl.reshape(tl.permute(tl.join(r[0], r[1]), (1, 0, 5, 4, 3, 2)), (BK, 16 * G))
    vcol = pm * (16 * G) + tl.arange(0, 16 * G)
    _store(vt_ptr + cols[:, None] * vt_rs + vcol[None, :], vrow, (cols[:, None] < K) & (vcol[None, :] < M), EVEN)


@triton.jit
def quantize_slices_kernel(x_ptr, M, K, sxm, sxk, amax_ptr, amaxt_ptr, seed_ptr,
                           d_ptr, s_ptr, dt32_ptr, st_ptr, v_ptr, vt_ptr,
                           d_rs, s_rs, dt32_rs, st_rs, v_rs, vt_rs, inv6,
                           p0_ptr, o0_ptr, c0_ptr, p1_ptr, o1_ptr, c1_ptr, gemm_factor,
                           VALUES_ROW: tl.constexpr, VALUES_COL: tl.constexpr,
                           ROW: tl.constexpr, COL: tl.constexpr, COL_RHT: tl.constexpr,
                           BLOCK2D: tl.constexpr, SR: tl.constexpr, SIGN_MASK: tl.constexpr,
                           RHT_F64: tl.constexpr, ROUND_BF16: tl.constexpr,
                           G: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr, E2M1_BITS: tl.constexpr,
                           EVEN: tl.constexpr, I64: tl.constexpr, COL_CODES: tl.constexpr = True,
                           N_COEF: tl.constexpr = 0):
    """Rowwise and/or columnwise quantization of x [M, K] (M % 16 == 0) from one read.

    The tile (16·G rows × BK columns) is loaded as 16 slices ``xs[i] = x[16g + i, k]`` of shape
    [G, BK], so every columnwise block (16 consecutive rows of one column) is the 16 slices at
    one (g, k): the columnwise block amax, the RHT butterfly and the nibble packing along M are
    element-wise operations between slices (no transpose or shuffle), and the 16 codes of a
    columnwise block pack into two int32 words stored to ``dt`` viewed as int32 [K, M/8].
    Rowwise blocks are encoded per slice along K. Same numerics as :func:`quantize_kernel`.
    VALUES_ROW (2D only) / VALUES_COL also write the BF16 block values of the rowwise copy to
    ``v`` [M, K] and of the columnwise copy to ``vt`` [K, M] (int16 bits). The columnwise outputs
    are stored row by row: row k of ``dt``, ``st`` and ``vt`` gets the tile's G blocks side by side
    (2·G words, G scales, 16·G values) in one row segment, rather than one piece per thread and
    row (5% faster on an H200 at 8192², commit 908a420). With VALUES_COL and not COL_CODES (1x16
    blocks) the columnwise copy is its values alone, made as the rowwise kernel's CODES=False
    makes them (:func:`_grid_values_bits`): no codes, no scales.

    With N_COEF (1 or 2) program 0 also writes the per-tensor factors of the GEMMs that the copies
    it makes enter, whose amaxes are final before it starts: ``c_i = (alpha, 0)`` with alpha of
    the amaxes at ``p_i_ptr`` (the other operand's) and ``o_i_ptr`` (this copy's)
    (:func:`_store_gemm_coef`, without a launch of its own).
    """
    if N_COEF > 0:
        if tl.program_id(0) == 0:
            _store_gemm_coef(p0_ptr, o0_ptr, c0_ptr, gemm_factor)
            if N_COEF > 1:
                _store_gemm_coef(p1_ptr, o1_ptr, c1_ptr, gemm_factor)
    BM: tl.constexpr = 16 * G
    xs, g, cols, pm, pk = _load_slice_tile(x_ptr, M, K, sxm, sxk, G, BK, REVERSE, EVEN, I64)
    K16 = (K + 15) // 16
    M16 = M // 16
    gi = pm * G + tl.arange(0, G)  # columnwise block index along M
    # ---------------- rowwise (and 2D) ----------------
    if ROW or BLOCK2D:
        s_enc, s_dec, mult = _global_scales(tl.load(amax_ptr), inv6)
        if SR:
            seed = tl.load(seed_ptr)
        scols = pk * (BK // 16) + tl.arange(0, BK // 16)
        hcols = pk * (BK // 2) + tl.arange(0, BK // 2)
        if BLOCK2D:
            tm = tl.max(tl.reshape(tl.abs(xs[0]), (G, BK // 16, 16)), axis=2)
            for i in tl.static_range(1, 16):
                tm = tl.maximum(tm, tl.max(tl.reshape(tl.abs(xs[i]), (G, BK // 16, 16)), axis=2))
            sf = tl.minimum(tl.minimum(tm * mult, FLT_MAX), 448.0)
            sfv, sfc = _e4m3_rne(sf)
            enc = tl.minimum(_div_rn(1.0, sfv * s_dec), FLT_MAX)
            if ROW:
                _store(s_ptr + gi[:, None] * s_rs + scols[None, :], sfc.to(tl.uint8),
                       (gi[:, None] < M16) & (scols[None, :] < K16), EVEN)
            if COL:  # transposed: row k/16 of the columnwise scales holds the G tiles side by side
                _store(st_ptr + scols[:, None] * st_rs + gi[None, :], tl.trans(sfc).to(tl.uint8),
                       (gi[None, :] < M16) & (scols[:, None] < K16), EVEN)
            rcodes = [tl.reshape(_e2m1_rne_fast(tl.reshape(xs[i], (G, BK // 16, 16)) * enc[:, :, None]), (G, BK))
                for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
            if ROW:
                for i in tl.static_range(16):
                    _store(d_ptr + (g + i)[:, None] * d_rs + hcols[None, :], _pack(rcodes[i], G, BK),
                           ((g + i)[:, None] < M) & (hcols[None, :] < (K + 1) // 2), EVEN)
            if VALUES_ROW or VALUES_COL:
                sfv_b = tl.reshape(tl.broadcast_to(sfv[:, :, None], (G, BK // 16, 16)), (G, BK))
                rvals = [_values_bits(rcodes[i], sfv_b) for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
                if VALUES_ROW:
                    for i in tl.static_range(16):
                        _store(v_ptr + (g + i)[:, None] * v_rs + cols[None, :], rvals[i],
                               ((g + i)[:, None] < M) & (cols[None, :] < K), EVEN)
        else:
            for i in tl.static_range(16):
                u = 0.0
                if SR:
                    u = _sr_block_uniforms(seed, (g + i)[:, None] * K16 + (pk * (BK // 16) + tl.arange(0, BK // 16))[None, :])
                codes, sfc = _encode_1d(xs[i], s_dec, mult, u, G, BK, SR, E2M1_BITS)
                _store(d_ptr + (g + i)[:, None] * d_rs + hcols[None, :], _pack(codes, G, BK),
                       ((g + i)[:, None] < M) & (hcols[None, :] < (K + 1) // 2), EVEN)
                _store(s_ptr + (g + i)[:, None] * s_rs + scols[None, :], sfc.to(tl.uint8),
                       ((g + i)[:, None] < M) & (scols[None, :] < K16), EVEN)
    # ---------------- columnwise ----------------
    if COL and BLOCK2D:
        ccodes = rcodes
    if COL and not BLOCK2D:
        s_enc_t, s_dec_t, mult_t = _global_scales(tl.load(amaxt_ptr), inv6)
        ys = xs
        if COL_RHT:
            ys = _rht16_slices(xs, SIGN_MASK, RHT_F64, ROUND_BF16)
        bm = tl.abs(ys[0])
        for i in tl.static_range(1, 16):
            bm = tl.maximum(bm, tl.abs(ys[i]))
        sf = tl.minimum(tl.minimum(bm * mult_t, FLT_MAX), 448.0)
        sfv, sfc = _e4m3_rne(sf)
        enc = tl.minimum(_div_rn(1.0, sfv * s_dec_t), FLT_MAX)
        if COL_CODES or not VALUES_COL:
            _store(st_ptr + cols[:, None] * st_rs + gi[None, :], tl.trans(sfc).to(tl.uint8),
                   (cols[:, None] < K) & (gi[None, :] < M16), EVEN)
            if not VALUES_COL:   # the codes alone: packed straight from the grid floats
                zs = [_scaled(ys[i], enc) for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
                if SR:
                    us = _col_sr_offsets(seed_ptr, cols, gi, M16)
                    w0, w1 = _slices_code_words([_e2m1_sr_grid(zs[i], us[i]) for i in
                                                 (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)], zs, 0x4B400000)
                else:
                    w0, w1 = _slices_code_words([_e2m1_rne_grid(zs[i]) for i in
                                                 (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)], zs, 0x4B000000)
            elif SR:   # drawn after the scales' store (before it, ptxas gives the kernel 128 registers, not 96)
                us = _col_sr_offsets(seed_ptr, cols, gi, M16)
                ccodes = [_e2m1_sr_fast(ys[i] * enc, us[i])
                          for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
            else:
                ccodes = [_e2m1_rne_fast(ys[i] * enc)
                          for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
            if VALUES_COL:
                cvals = [_values_bits(ccodes[i], sfv) for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
        elif SR:   # the values alone (as quantize_rows_kernel's CODES=False), as int16 bits
            us = _col_sr_offsets(seed_ptr, cols, gi, M16)
            cvals = [(_grid_values_bits(_scaled(ys[i], enc), us[i], sfv, True) >> 16).to(tl.int16)
                     for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
        else:
            cvals = [(_grid_values_bits(_scaled(ys[i], enc), 0.0, sfv, False) >> 16).to(tl.int16)
                     for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    if COL and VALUES_COL:
        if BLOCK2D:
            cvals = rvals
        _store_slices_transposed(vt_ptr, vt_rs, cvals, cols, pm, M, K, G, BK, EVEN)
    if COL and (COL_CODES or BLOCK2D or not VALUES_COL):
        if BLOCK2D or VALUES_COL:   # (else packed above, from the grid floats)
            w0 = ccodes[0]
            w1 = ccodes[8]
            for i in tl.static_range(1, 8):
                w0 = w0 | (ccodes[i] << (4 * i))
                w1 = w1 | (ccodes[8 + i] << (4 * i))
        # row k of the packed codes: the G blocks' two words each side by side (2·G contiguous
        # int32), stored as one coalesced row segment (the tile's layout has k across threads)
        wrow = tl.reshape(tl.permute(tl.join(w0, w1), (1, 0, 2)), (BK, 2 * G))
        wcol = pm * (2 * G) + tl.arange(0, 2 * G)
        _store(dt32_ptr + cols[:, None] * dt32_rs + wcol[None, :], wrow,
               (cols[:, None] < K) & (wcol[None, :] < 2 * M16), EVEN)


@triton.jit
def _slices_rht_amax_f64(x_ptr, M, K, sxm, sxk, pm, pk, G: tl.constexpr, BK: tl.constexpr, FB: tl.constexpr,
                         SIGN_MASK: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr):
    """The FP64-butterfly post-RHT max (int32 bits, not rounded) of the tile (pm, pk) of
    :func:`_load_slice_tile`, re-read from memory FB columns at a time in a loop: the rare
    fallback of :func:`amax_slices_kernel`, kept narrow. Recomputing the whole tile in place
    instead made the pass 15-110% slower than an uncertified FP32 pass at the same tiles (H200,
    8192², depending on the tile), even though the fallback seldom runs; re-read in steps, 1-12%."""
    g = pm * (16 * G) + tl.arange(0, G) * 16
    if I64:
        g = g.to(tl.int64)
    m = tl.zeros((G, FB), tl.int32)
    # up to min(K, BK), a bound known only at run time (columns past K are masked all the same):
    # over the constant BK the compiler unrolls this rare loop, and the pass took 74 registers, not
    # 48 (a while loop: Triton's interpreter cannot take a tensor as range()'s bound)
    c = 0
    while c < tl.minimum(K, BK):
        cols = pk * BK + c + tl.arange(0, FB)
        if I64:
            cols = cols.to(tl.int64)
        ys = _rht16_slices(_load_slices(x_ptr, M, K, sxm, sxk, g, cols, EVEN), SIGN_MASK, True, False)
        for i in tl.static_range(16):
            m = tl.maximum(m, _abs_bits(ys[i]))
        c += FB
    return tl.max(tl.max(m, axis=1), axis=0)


@triton.jit
def _slices_at(x_ptr, M, K, sxm, sxk, t, n_k, G: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
               I64: tl.constexpr):
    """The 16 row slices of tile ``t`` (row-major over tiles of 16·G rows × BK columns, ``n_k`` per
    row of tiles) of x [M, K], as :func:`_load_slices`; all zero (no memory read) where
    ``t`` is past the last tile."""
    return _slice_tile_at(x_ptr, M, K, sxm, sxk, t // n_k, t % n_k, G, BK, EVEN, I64,
                          t < tl.cdiv(M, 16 * G) * n_k)[0]


@triton.jit
def _amax_slices_tile(x_ptr, M, K, sxm, sxk, xs, t, n_k, ROW: tl.constexpr, COL_RHT: tl.constexpr,
                      SIGN_MASK: tl.constexpr, RHT_F64: tl.constexpr, ROUND_BF16: tl.constexpr, G: tl.constexpr,
                      BK: tl.constexpr, FB: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr):
    """(rowwise max |x|, columnwise post-RHT max) of tile ``t`` of :func:`amax_slices_kernel`,
    whose slices ``xs`` are loaded, as int32 bits (0 for a copy not asked for)."""
    row_bits = tl.full([], 0, tl.int32)
    col_bits = tl.full([], 0, tl.int32)
    if ROW:
        row_bits = _slices_amax_bits(xs)
    if COL_RHT:
        if RHT_F64 and not ROUND_BF16:   # FP32/FP16 input: the FP64 butterfly
            col_bits = _slices_amax_bits(_rht16_slices(xs, SIGN_MASK, True, False))
        elif RHT_F64:   # the FP32 butterfly, certified; its 1/4 applied to the one maximum
            col_bits, ok = _certain_bf16_max(_rht16_slices_amax_bits(xs, SIGN_MASK))
            if not ok:
                col_bits = _rounded_max(_slices_rht_amax_f64(x_ptr, M, K, sxm, sxk, t // n_k, t % n_k, G, BK, FB,
                                                             SIGN_MASK, EVEN, I64), True)
        else:   # the FP32 butterfly, its 1/4 applied to the one maximum (_slices_amax_bits)
            col_bits = _rounded_max(_slices_amax_bits(_rht16_slices(xs, SIGN_MASK, False, False, False), 0.25),
                                    ROUND_BF16)
    return row_bits, col_bits


@triton.jit
def amax_slices_kernel(x_ptr, amax_ptr, M, K, sxm, sxk,
                       ROW: tl.constexpr, COL_RHT: tl.constexpr, SIGN_MASK: tl.constexpr,
                       RHT_F64: tl.constexpr, ROUND_BF16: tl.constexpr,
                       G: tl.constexpr, BK: tl.constexpr, FB: tl.constexpr, EVEN: tl.constexpr,
                       I64: tl.constexpr, STRIDED: tl.constexpr = False):
    """amax pass for the 16-slice layout (M % 16 == 0): max|x| into amax[0] when ROW and the
    columnwise post-RHT max into amax[1] when COL_RHT, the butterfly as in quantize_slices_kernel.
    NaN-propagating integer max on int32 ``amax_ptr``, as :func:`amax_kernel`.

    One program per tile (16·G rows × BK columns), or with STRIDED fewer: each takes the tiles
    ``pid, pid + P, pid + 2P, ...`` (P the grid's size) and loads the next one's slices before
    working on the current one's, so that its reads are in flight during the arithmetic, keeping
    its running maxima for one atomic per amax at the end (H200, alone, three programs per SM:
    14-19% faster at 16384 × 2304, 16384 × 3072 and 8192² than one program per tile; the loop's
    registers, 128-136 a thread instead of 80, made one program per tile a third slower at
    8192 × 768, so that grid runs without the loop). The tiles in the grid's last round are the highest, as with one program per
    tile, so the quantize kernels that read in reverse order after it (``REVERSE``) still find the
    end of x in the L2.

    With RHT_F64 and BF16 input (ROUND_BF16) the post-RHT max comes from an FP32 butterfly where
    :func:`_certain_bf16_max` certifies that it equals the FP64 one's, tile by tile, and otherwise
    (about one tile in a hundred on Gaussian data) from :func:`_slices_rht_amax_f64`, FB columns
    at a time: the same bits as the FP64 butterfly everywhere."""
    pid = tl.program_id(0)
    n_k = tl.cdiv(K, BK)
    xs = _slices_at(x_ptr, M, K, sxm, sxk, pid, n_k, G, BK, EVEN, I64)
    if STRIDED:
        P = tl.num_programs(0)
        n_tiles = tl.cdiv(M, 16 * G) * n_k
        row_bits = tl.full([], 0, tl.int32)
        col_bits = tl.full([], 0, tl.int32)
        t = pid
        while t < n_tiles:   # (a while loop: Triton's interpreter cannot take a tensor as range()'s bound)
            xs_next = _slices_at(x_ptr, M, K, sxm, sxk, t + P, n_k, G, BK, EVEN, I64)
            r, c = _amax_slices_tile(x_ptr, M, K, sxm, sxk, xs, t, n_k, ROW, COL_RHT, SIGN_MASK, RHT_F64, ROUND_BF16,
                                     G, BK, FB, EVEN, I64)
            row_bits = tl.maximum(row_bits, r)
            col_bits = tl.maximum(col_bits, c)
            t += P
            xs = xs_next
    else:
        row_bits, col_bits = _amax_slices_tile(x_ptr, M, K, sxm, sxk, xs, pid, n_k, ROW, COL_RHT, SIGN_MASK, RHT_F64,
                                               ROUND_BF16, G, BK, FB, EVEN, I64)
    if ROW:
        tl.atomic_max(amax_ptr, row_bits)
    if COL_RHT:
        tl.atomic_max(amax_ptr + 1, col_bits)


# ----------------------------------------------------------------------------- GEMM epilogue
@triton.jit
def _gemm_alpha(amax_a_ptr, amax_b_ptr, gemm_factor):
    """The per-tensor factor of an emulated NVFP4 GEMM, ``RN(RN(amax_a · amax_b) / 6²·448²)`` (IEEE division)."""
    ab = tl.load(amax_a_ptr).to(tl.float32) * tl.load(amax_b_ptr).to(tl.float32)
    return tl.math.div_rn(ab, gemm_factor)


@triton.jit
def _store_gemm_coef(amax_a_ptr, amax_b_ptr, out_ptr, gemm_factor):
    """``out[0] = alpha`` (:func:`_gemm_alpha`) and ``out[1] = 0``: the (alpha, beta) device scalars
    of the cuBLAS GEMM that applies alpha in its epilogue (:mod:`nvfp4lab.kernels.cublas`)."""
    tl.store(out_ptr, _gemm_alpha(amax_a_ptr, amax_b_ptr, gemm_factor))
    tl.store(out_ptr + 1, 0.0)


@triton.jit
def gemm_alpha_kernel(amax_a_ptr, amax_b_ptr, out_ptr, gemm_factor):
    """:func:`_store_gemm_coef` in a launch of its own (one program)."""
    _store_gemm_coef(amax_a_ptr, amax_b_ptr, out_ptr, gemm_factor)


@triton.jit
def gemm_epilogue_kernel(acc_ptr, amax_a_ptr, amax_b_ptr, bias_ptr, out_ptr, M, N, acc_rs, out_rs,
                         gemm_factor, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr):
    """The per-tensor factor, bias and output cast of an emulated NVFP4 GEMM, in one pass.

    ``out = cast(RN(RN(acc · alpha) + bias))`` with ``alpha = RN(RN(amax_a · amax_b) / 6²·448²)``
    (IEEE division), the FP32 operations of :func:`nvfp4lab.quantize.nvfp4_matmul` in its order;
    ``cast`` is RNE to BF16 (``OUT_BF16``, stored as int16 bits) or none (FP32). ``acc`` [M, N]
    FP32 is the accumulated product of the block values (cuBLAS).
    """
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    cols = pn * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    acc = tl.load(acc_ptr + rows[:, None] * acc_rs + cols[None, :], mask=mask, other=0.0)
    t = acc * _gemm_alpha(amax_a_ptr, amax_b_ptr, gemm_factor)
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        t = t + b[None, :]
    optrs = out_ptr + rows[:, None] * out_rs + cols[None, :]
    if OUT_BF16:
        tl.store(optrs, (_round_bf16(t).to(tl.uint32, bitcast=True) >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(optrs, t, mask=mask)


# ----------------------------------------------------------------------------- one block per thread
@triton.jit
def _e2m1_decode_bits(c):
    """E2M1 codes (int32 0..15) -> their values as float32 bits. Magnitude m = c & 7: m >= 2 is
    2^(m//2 - 1)·(1 + (m & 1)/2), whose bits are exactly (m + 252) << 22; m = 1 is 0.5 and m = 0 is
    0 (m · 0x3F000000); the sign is bit 3 moved to bit 31."""
    m = c & 7
    mag = tl.where(m < 2, m * 0x3F000000, (m + 252) << 22)
    return mag | ((c & 8) << 28)


@triton.jit
def _values_bits(codes, sfv):
    """E2M1 codes and their (broadcast) E4M3 scale values, same shape -> BF16 block values as
    int16 bits (``code × scale`` is exact in BF16, so the top 16 bits of the FP32 product)."""
    v = _e2m1_decode_bits(codes).to(tl.float32, bitcast=True) * sfv
    return (v.to(tl.uint32, bitcast=True) >> 16).to(tl.int16)


@triton.jit
def _grid_values_bits(y, u, sfv, SR: tl.constexpr):
    """The BF16 block values ``code × scale`` of the scaled values ``y`` (from :func:`_scaled`,
    never -0.0) as float32 bits (uint32; exact in BF16), RNE or SR (``u``: the offsets of
    :func:`_e2m1_sr_fast`, not read for RNE), ``sfv`` the E4M3 scale (broadcast); without codes.

    Rounded on the E2M1 grid itself: with m = min(|y|, 6), the grid's step at m is q = 1/2 below
    2, 1 in [2, 4) and 2 from 4 on, i.e. max(1/2, p/2) with p = 2^floor(log2 m) (m's exponent
    bits), and both RNE and SR round m to a multiple of q within its binade (the codes' T(m) of
    :func:`_e2m1_rne_fast` is m/q plus a constant there). Adding the magic ``2^23·q`` (float32
    ulp q) and taking it off again rounds to that multiple: RNE ``(m + 2^23·q) - 2^23·q``; SR
    ``(RN(m + q·u) + 1.5·2^23·q) - 1.5·2^23·q``, q·u exact, which is q times the code-domain
    candidate RN(RN(m/q + u) + 1.5·2^23) of :func:`_e2m1_sr_grid`. The rounded magnitude times the
    scale is exact (at most 2 + 4 significant bits), then the sign bit of ``y`` is or-ed in. The
    same bits as decoding :func:`_e2m1_rne_fast` / :func:`_e2m1_sr_fast`'s codes (checked on every
    float32 m in [0, 6] for RNE; on 5M values, boundaries included, for each of SR's 256 offsets),
    in about 9 operations per element where the codes' minimum of three candidates and their
    decode take 14 (RNE)."""
    m = tl.minimum(tl.abs(y), 6.0)
    p = (m.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)   # 0 below 2^-126
    if SR:
        q = tl.maximum(p * 0.5, 0.5)
        c = q * 12582912.0
        v = (tl.fma(u, q, m) + c) - c
    else:
        c = tl.maximum(p * 4194304.0, 4194304.0)
        v = (m + c) - c
    return (v * sfv).to(tl.uint32, bitcast=True) | (y.to(tl.uint32, bitcast=True) & 0x80000000)


@triton.jit
def _scaled(a, enc):
    """``a × enc`` rounded to float32 (TE's scaled value y), then plus +0.0, which turns -0.0 into
    +0.0 and keeps every other value: the sign bit of the result is that of ``y < 0``, as in TE's
    reference and :func:`_sign_bit3` (``enc`` > 0). Two instructions, not ``fma(a, enc, +0.0)``:
    where a negative product underflows to zero (a block spanning more than 2^150), the fused
    operation rounds the exact, non-zero sum and so returns -0.0 (IEEE 754: a result rounded to
    zero keeps the exact result's sign), where y is -0.0 and y + 0.0 is +0.0; on an H200 that
    gave SR code 8 (and BF16 value -0.0) where the reference gives code 0 (and +0.0)."""
    return a * enc + 0.0


@triton.jit
def _pair_words(ve, vo):
    """float32 bits of BF16 values of even/odd element pairs -> the int32 words of the BF16 tensor."""
    return ((ve >> 16) | (vo & 0xFFFF0000)).to(tl.int32, bitcast=True)


@triton.jit
def _rows_values_words(c_even, c_odd, sfv):
    """BF16 block values ``code × scale`` of even/odd element pairs, packed as the int32 words of
    the BF16 tensor (even element in the low half)."""
    ve = (_e2m1_decode_bits(c_even).to(tl.float32, bitcast=True) * sfv).to(tl.uint32, bitcast=True)
    vo = (_e2m1_decode_bits(c_odd).to(tl.float32, bitcast=True) * sfv).to(tl.uint32, bitcast=True)
    return _pair_words(ve, vo)


@triton.jit
def _mad_u32(a, b, c):
    """``a·b + c`` on uint32 (wrapping): one ``mad.lo.u32`` (IMAD) on the GPU, where LLVM would turn a
    power-of-two ``b`` into a shift and an add on the integer pipe."""
    if HW_CVT:
        return tl.inline_asm_elementwise("mad.lo.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    return a * b + c


@triton.jit
def _code_word_start(like, MAGIC: tl.constexpr):
    """The start of a packed code word (uint32, shaped as ``like``): minus the share of eight
    grid floats' magic, ``-MAGIC_bits · (1 + 16 + ... + 16^7) mod 2^32`` (see :func:`_code_term`)."""
    corr: tl.constexpr = (-MAGIC * 0x11111111) % (1 << 32)
    return tl.full(like.shape, corr, tl.uint32)


@triton.jit
def _code_term(g, y, w, acc):
    """``acc`` plus one element's share of a packed E2M1 code word (uint32, wrapping mod 2^32):
    its grid float's bits times the weight ``w`` = 16^e (e its nibble; ``g`` = MAGIC + magnitude
    code, from :func:`_e2m1_rne_grid` or :func:`_e2m1_sr_grid`) and the sign bit of its scaled
    value ``y`` (from :func:`_scaled`, never -0.0: :func:`_sign_bit3`'s sign) times 8w. Eight
    such terms on :func:`_code_word_start` leave the eight codes in their nibbles: integer
    multiply-adds, one IMAD each on the GPU (:func:`_mad_u32`), where the codes' shifts and ors
    take the integer pipe."""
    return _mad_u32(g.to(tl.uint32, bitcast=True), w, _mad_u32(y.to(tl.uint32, bitcast=True) >> 31, w << 3, acc))


@triton.jit
def _code_word(ge, go, ye, yo, MAGIC: tl.constexpr):
    """Eight E2M1 codes packed in one int32 word, element e in bits 4e..4e+3, from their grid floats
    and scaled values: ``ge``, ``go`` [R, NB, 4] the float32 ``MAGIC + magnitude code`` of elements
    2j and 2j+1 in lane j (:func:`_e2m1_rne_grid`: MAGIC 2^23; :func:`_e2m1_sr_grid`: 1.5·2^23),
    ``ye``, ``yo`` their scaled values. The word :func:`_e2m1_rne_fast` / :func:`_e2m1_sr_fast`'s
    codes pack into: each lane adds its two elements' terms (:func:`_code_term`, weights 16^(2j)
    and 16^(2j+1)), lane 0 also the word's start (:func:`_code_word_start`), and the lanes sum."""
    j = tl.arange(0, 4)[None, None, :]
    we = tl.full(j.shape, 1, tl.uint32) << (8 * j).to(tl.uint32)
    start = tl.where(j == 0, _code_word_start(j, MAGIC), 0).to(tl.uint32)
    t = _code_term(ge, ye, we, _code_term(go, yo, we << 4, start))
    return tl.sum(t, axis=2).to(tl.int32, bitcast=True)


@triton.jit
def quantize_rows_kernel(x_ptr, M, K, sxm, amax_ptr, seed_ptr, d32_ptr, s_ptr, v32_ptr, obs_ptr, d32_rs, s_rs, v32_rs,
                         inv6,
                         SR: tl.constexpr, VALUES: tl.constexpr, WORDS: tl.constexpr, BM: tl.constexpr,
                         NB: tl.constexpr, REVERSE: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr,
                         CODES: tl.constexpr = True, OBSERVE: tl.constexpr = False):
    """Rowwise 1x16 quantization of x [M, K] (K % 16 == 0, unit column stride), one block per thread.

    Each program takes BM rows x NB blocks (grid: row tiles x block tiles); a thread holds the
    16 elements of its block as four [BM, NB, 4] tensors: the even and odd elements of each
    8-element half. With ``WORDS`` (BF16 input, ``x`` and ``sxm`` 4-byte aligned) they are loaded
    as the int32 words of the BF16 pairs and unpacked by a shift and a mask; otherwise loaded as
    floats and split. The block amax, the E4M3 scale and its reciprocal are computed once per
    block with no shuffle; the 16 codes pack into two int32 words stored as one 8-byte vector to
    ``d32`` (the packed codes viewed as int32 [M, K/8]). Same numerics as :func:`quantize_kernel`
    (ROW, no RHT); SR uses the same Philox counters (row * K16 + block) and byte mapping
    (:func:`_sr_block_uniforms`), so it draws the same stream. With VALUES it also writes the BF16 block values ``code × scale`` (exact)
    to ``v32`` (the BF16 [M, K] output viewed as int32 [M, K/2]), the operand the emulated GEMM
    multiplies, saving a separate decode pass. With VALUES and not CODES it writes those values
    alone, neither codes nor scales, and makes them without the integer codes: each magnitude is
    rounded on the E2M1 grid in the float domain (:func:`_grid_values_bits`; the same bits).
    With OBSERVE (a given amax, checked by the caller) the block amaxes propagate NaN and the
    program's largest goes to ``obs_ptr`` (int32 bits, atomic max, as :func:`amax_kernel`, made only
    where it exceeds what the slot holds): the input's max |x|, which tells the caller's check about
    NaN and ±Inf without another pass. The codes and scales are those of the default wherever no NaN
    is present.
    """
    K16 = K // 16
    pm = tl.program_id(0)
    pb = tl.program_id(1)
    if REVERSE:
        pm = tl.num_programs(0) - 1 - pm
        pb = tl.num_programs(1) - 1 - pb
    rows = pm * BM + tl.arange(0, BM)
    blks = pb * NB + tl.arange(0, NB)
    if I64:
        rows = rows.to(tl.int64)
        blks = blks.to(tl.int64)
    e4 = tl.arange(0, 4)
    m3 = (rows[:, None, None] < M) & (blks[None, :, None] < K16)
    if WORDS:
        wptr = x_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None, None] * (sxm // 2) + (blks * 8)[None, :, None] \
            + e4[None, None, :]
        if EVEN:
            w0 = tl.load(wptr)
            w1 = tl.load(wptr + 4)
        else:
            w0 = tl.load(wptr, mask=m3, other=0)
            w1 = tl.load(wptr + 4, mask=m3, other=0)
        a0 = (w0 << 16).to(tl.float32, bitcast=True)
        a1 = (w0 & -65536).to(tl.float32, bitcast=True)
        a2 = (w1 << 16).to(tl.float32, bitcast=True)
        a3 = (w1 & -65536).to(tl.float32, bitcast=True)
    else:
        e8 = tl.arange(0, 8)
        ptrs = x_ptr + rows[:, None, None] * sxm + (blks * 16)[None, :, None] + e8[None, None, :]
        if EVEN:
            lo = tl.load(ptrs).to(tl.float32)
            hi = tl.load(ptrs + 8).to(tl.float32)
        else:
            lo = tl.load(ptrs, mask=m3, other=0.0).to(tl.float32)
            hi = tl.load(ptrs + 8, mask=m3, other=0.0).to(tl.float32)
        a0, a1 = tl.split(tl.reshape(lo, (BM, NB, 4, 2)))
        a2, a3 = tl.split(tl.reshape(hi, (BM, NB, 4, 2)))
    s_enc, s_dec, mult = _global_scales(tl.load(amax_ptr), inv6)
    if OBSERVE:
        m = _max_nan(_max_nan(tl.abs(a0), tl.abs(a1)), _max_nan(tl.abs(a2), tl.abs(a3)))
        bamax = tl.reduce(m, 2, _max_nan)
        pmax = tl.max(tl.max(bamax.to(tl.int32, bitcast=True), axis=1), axis=0)
        # the slot only grows: a program whose max it already holds skips the atomic (the
        # programs' atomics on one address serialise; most find the slot at its final value)
        if pmax > tl.load(obs_ptr, volatile=True):
            tl.atomic_max(obs_ptr, pmax)
    else:
        bamax = tl.maximum(tl.maximum(tl.max(tl.abs(a0), axis=2), tl.max(tl.abs(a1), axis=2)),
                           tl.maximum(tl.max(tl.abs(a2), axis=2), tl.max(tl.abs(a3), axis=2)))
    sf = tl.minimum(tl.minimum(bamax * mult, FLT_MAX), 448.0)
    sfv, sfc = _e4m3_rne(sf)
    enc = tl.minimum(_div_rn(1.0, sfv * s_dec), FLT_MAX)[:, :, None]
    if SR:   # one draw per block: the offsets of its four words' bytes, one word per quarter
        seed = tl.load(seed_ptr)
        r0, r1, r2, r3 = _sr_words(seed, rows[:, None] * K16 + blks[None, :])
        u0 = _sr_word_offsets(r0)
        u1 = _sr_word_offsets(r1)
        u2 = _sr_word_offsets(r2)
        u3 = _sr_word_offsets(r3)
    else:   # (not read by RNE)
        u0 = 0.0
        u1 = 0.0
        u2 = 0.0
        u3 = 0.0
    sfb = sfv[:, :, None]
    vptrs = v32_ptr + rows[:, None, None] * v32_rs + (blks * 8)[None, :, None] + e4[None, None, :]   # BF16 values
    if not CODES:   # the BF16 values alone, from the codes in the float domain
        _store(vptrs, _pair_words(_grid_values_bits(_scaled(a0, enc), u0, sfb, SR),
                                  _grid_values_bits(_scaled(a1, enc), u1, sfb, SR)), m3, EVEN)
        _store(vptrs + 4, _pair_words(_grid_values_bits(_scaled(a2, enc), u2, sfb, SR),
                                      _grid_values_bits(_scaled(a3, enc), u3, sfb, SR)), m3, EVEN)
        return
    if SR and not VALUES:
        # SR codes alone: packed from the grid floats (_code_word; on an H200 at 8192², 2% faster). The
        # RNE codes keep the shift-and-or packing: there the packing by multiply-adds, 8% fewer
        # instructions, made the kernel after an amax pass 6% slower at its tile (commit 4dab021)
        y0 = _scaled(a0, enc)
        y1 = _scaled(a1, enc)
        y2 = _scaled(a2, enc)
        y3 = _scaled(a3, enc)
        words = tl.join(_code_word(_e2m1_sr_grid(y0, u0), _e2m1_sr_grid(y1, u1), y0, y1, 0x4B400000),
                        _code_word(_e2m1_sr_grid(y2, u2), _e2m1_sr_grid(y3, u3), y2, y3, 0x4B400000))
    else:
        if SR:
            c0 = _e2m1_sr_fast(a0 * enc, u0)
            c1 = _e2m1_sr_fast(a1 * enc, u1)
            c2 = _e2m1_sr_fast(a2 * enc, u2)
            c3 = _e2m1_sr_fast(a3 * enc, u3)
        else:
            # what the sign costs, at most (H200, 8192^2, graph replays): with the sign bits left out
            # (wrong codes) the kernel took 49.2 us against 52.4-52.7 with the amax given, and
            # quantize(x) 92.7 against 94.5; with the clamp to 6 left out, 51.9-52.3 and 97.6-97.9
            c0 = _e2m1_rne_fast(a0 * enc)
            c1 = _e2m1_rne_fast(a1 * enc)
            c2 = _e2m1_rne_fast(a2 * enc)
            c3 = _e2m1_rne_fast(a3 * enc)
        if VALUES:
            _store(vptrs, _rows_values_words(c0, c1, sfb), m3, EVEN)
            _store(vptrs + 4, _rows_values_words(c2, c3, sfb), m3, EVEN)
        sh = (e4 * 8)[None, None, :]
        words = tl.join(tl.sum((c0 << sh) | (c1 << (sh + 4)), axis=2),
                        tl.sum((c2 << sh) | (c3 << (sh + 4)), axis=2))  # [BM, NB, 2]: the block's 8 bytes
    wptrs = d32_ptr + rows[:, None, None] * d32_rs + (blks * 2)[None, :, None] + tl.arange(0, 2)[None, None, :]
    _store(wptrs, words, m3, EVEN)
    _store(s_ptr + rows[:, None] * s_rs + blks[None, :], sfc.to(tl.uint8),
           (rows[:, None] < M) & (blks[None, :] < K16), EVEN)


@triton.jit
def block_values_rows_kernel(d32_ptr, s_ptr, out_ptr, M, K, d32_rs, s_rs, o_rs,
                             BLOCK2D: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """``code × E4M3 block scale`` as BF16 [M, K] (K % 16 == 0), one block per thread: the block's
    two int32 words and its scale byte in, 16 exact BF16 values (two 16-byte vectors) out.
    Same values as :func:`dequantize_kernel` with GLOBAL=False."""
    K16 = K // 16
    pm = tl.program_id(0)
    pb = tl.program_id(1)
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    blks = pb * NB + tl.arange(0, NB)
    m2 = (rows[:, None] < M) & (blks[None, :] < K16)
    wbase = d32_ptr + rows[:, None] * d32_rs + (blks * 2)[None, :]
    w_lo = tl.load(wbase, mask=m2, other=0)
    w_hi = tl.load(wbase + 1, mask=m2, other=0)
    if BLOCK2D:
        srows = rows // 16
    else:
        srows = rows
    sf = _e4m3_decode(tl.load(s_ptr + srows[:, None] * s_rs + blks[None, :], mask=m2, other=0).to(tl.int32))
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    obase = out_ptr + rows[:, None, None] * o_rs + (blks * 16)[None, :, None] + tl.arange(0, 8)[None, None, :]
    m3 = (rows[:, None, None] < M) & (blks[None, :, None] < K16)
    for half in tl.static_range(2):
        w = w_lo if half == 0 else w_hi
        c = (w[:, :, None] >> shifts) & 15
        v = _e2m1_decode_bits(c).to(tl.float32, bitcast=True) * sf[:, :, None]  # exact: 2 x 4 significant bits
        tl.store(obase + half * 8, (v.to(tl.uint32, bitcast=True) >> 16).to(tl.int16), mask=m3)
