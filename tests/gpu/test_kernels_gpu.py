"""nvfp4lab.kernels on CUDA: bit-exact with the pure-PyTorch quantizer at training sizes.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_kernels_gpu.py`` (no TRITON_INTERPRET).
The reference is :func:`nvfp4lab.quantize.quantize` on the same CUDA tensor with the fast path
switched off (:func:`nvfp4lab.kernels.disabled`), which ``tests/gpu/test_quantize_gpu.py``
checks against the CPU path and TE's reference. Comparisons are exact: packed bytes, scale
bytes, amax bits. SR is checked statistically, as TE's test_nvfp4_sr_quantize.py does.
"""

import functools
import pytest
import torch

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")

from nvfp4lab import kernels  # noqa: E402
from nvfp4lab.linear import NVFP4GemmQuantizer  # noqa: E402
from nvfp4lab.testing import assert_nvfp4_equal, rht_rounding_boundary_block
from nvfp4lab.formats import E2M1_VALUES, decode_e2m1  # noqa: E402
from nvfp4lab.rounding import SRStream  # noqa: E402
from nvfp4lab.hadamard import WGRAD_SIGNS, random_hadamard_transform  # noqa: E402
from nvfp4lab.quantize import (  # noqa: E402
    block_encode_scales, nvfp4_matmul, quantize, quantize_rowwise_columnwise, uses_kernels)

if not torch.cuda.is_available():  # conftest skips gpu tests too; keep module import cheap
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if kernels.interpreter_mode():
    pytest.skip("TRITON_INTERPRET=1 is set: these tests are for the compiled kernels", allow_module_level=True)

DEV = "cuda"
# TE's tests/pytorch/nvfp4/test_nvfp4_quantize_exact.py shapes plus odd and 3-D ones.
TE_SHAPES = [(128, 128), (256, 256), (256, 1024), (1024, 256), (256, 272), (304, 304), (320, 256),
             (2048, 2048), (1024, 2048), (2048, 1024), (8192, 8192)]
ODD_SHAPES = [(17, 33), (1000, 40), (4, 300, 64), (3, 40, 48)]
CONFIGS = [("1d", False), ("2d", False), ("1d", True)]


def _x(shape, dtype, seed=0, scale=1.0):
    g = torch.Generator(DEV).manual_seed(seed)
    return (torch.randn(shape, device=DEV, generator=g) * scale).to(dtype)


def _ref(x, **kw):
    with kernels.disabled():
        return quantize(x, **kw)


def fast(x, **kw):
    """``quantize(x, **kw)`` through the kernels (asserting that they cover these options)."""
    assert uses_kernels(x, **kw), kw
    return quantize(x, **kw)


def pair(x, *, block="1d", rht=False, rounding="nearest", generator=None, values=(False, False)):
    """Both copies through the fused kernels (None where they decline)."""
    return quantize_rowwise_columnwise(x, dict(block=block, rounding=rounding),
                                       dict(block=block, rht=rht, rounding=rounding),
                                       generator=generator, values=values, fallback=False)


_same = functools.partial(assert_nvfp4_equal, check_dtype=False)

@pytest.mark.parametrize("shape", TE_SHAPES + ODD_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block,rht", CONFIGS, ids=["1d", "2d", "1d-rht"])
def test_quantize_fast_bit_exact(shape, dtype, block, rht):
    x = _x(shape, dtype, scale=3.0)
    if rht and shape[-1] % 16:
        assert not uses_kernels(x, rht=True)
        return
    _same(fast(x, block=block, rht=rht), _ref(x, block=block, rht=rht))


@pytest.mark.parametrize("shape", TE_SHAPES + [(17, 33), (1000, 48)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block,rht", CONFIGS, ids=["1d", "2d", "1d-rht"])
def test_columnwise_and_fused_bit_exact(shape, dtype, block, rht):
    x = _x(shape, dtype, seed=1)
    if rht and shape[0] % 16:
        assert pair(x, rht=True) is None
        return
    ref_col = _ref(x.t(), block=block, rht=rht)
    _same(fast(x.t(), block=block, rht=rht), ref_col)  # transposed view
    row, col = pair(x, block=block, rht=rht)
    _same(row, _ref(x, block=block))
    _same(col, ref_col)


def test_non_contiguous_and_special_values():
    x = _x((512, 768), torch.bfloat16, seed=2)
    for v in (x[:, ::2], x[::3], x.view(4, 128, 768).permute(1, 0, 2), x.t()[:, :496]):
        for block, rht in CONFIGS:
            if rht and v.shape[-1] % 16:
                continue
            _same(fast(v, block=block, rht=rht), _ref(v, block=block, rht=rht))
    y = _x((256, 256), torch.float32, seed=3)
    y[0, :16] = 0.0
    y[1, :16] = 1e-30  # underflowed block scale next to larger blocks: codes ±6, scale 0
    y[2, 0] = float("inf")
    y[3, 0] = -0.0
    y[4, :] = torch.finfo(torch.float32).tiny / 4  # denormals
    for block, rht in CONFIGS:
        _same(fast(y, block=block, rht=rht), _ref(y, block=block, rht=rht))
    z = torch.zeros(128, 128, device=DEV, dtype=torch.bfloat16)
    _same(fast(z), _ref(z))
    m = torch.full((128, 128), torch.finfo(torch.bfloat16).max, device=DEV, dtype=torch.bfloat16)
    _same(fast(m), _ref(m))
    for amax in (0.5, torch.tensor(1e-38, device=DEV)):
        _same(fast(y, amax=amax), _ref(y, amax=amax))


def test_rht_is_exact_where_an_fp32_butterfly_is_not():
    """The kernels' columnwise RHT (FP64 butterfly; the amax pass's FP32 one where it certifies its
    result, which these blocks never let it) gives the reference's amax on blocks at a BF16
    rounding boundary, where an FP32 butterfly (``rht_f64=False``) is wrong in most draws, and
    the reference's amax and codes on BF16 subnormal inputs (maxima below 2^-100: the fallback)."""
    g = torch.Generator().manual_seed(1)

    def amax(x):
        return pair(x, rht=True)[1].amax.view(torch.int32)

    def ref_amax(x):
        with kernels.disabled():
            return quantize_rowwise_columnwise(x, dict(block="1d"), dict(block="1d", rht=True))[1].amax.view(torch.int32)

    wrong_fp32 = 0
    for _ in range(100):
        x = rht_rounding_boundary_block(g, columns=64, device=DEV)
        want = ref_amax(x)
        assert torch.equal(amax(x), want)
        with kernels.use_options(rht_f64=False):
            wrong_fp32 += not torch.equal(amax(x), want)
    assert wrong_fp32 >= 20
    sub = (torch.randn(4096, 512, device=DEV, generator=torch.Generator(DEV).manual_seed(2)) * 1e-39).to(torch.bfloat16)
    assert torch.equal(amax(sub), ref_amax(sub))
    _same(pair(sub, rht=True)[1], _ref(sub.t(), rht=True))


def test_launch_cache_launches_the_kernel_triton_would():
    """``kernels._launch`` keeps Triton's compiled kernel per launch signature, and
    ``kernels._quantize_rows`` a launch plan per call signature: calls that change what Triton
    specialises on (a 16-byte-aligned or unaligned pointer, M == 1, K not a multiple of 16, a
    transposed view) give a new entry, and every call (the first, which plans, and a repeat, which
    launches from the plan) equals Triton's own launch (``launch_cache=False``) and the reference,
    bit for bit: RNE and SR (a ``torch.Generator``, an ``SRStream``), amax computed or given, pairs.
    Repeating a call adds no entry."""
    base = _x((300 * 64 + 64,), torch.bfloat16, seed=5, scale=2.0)
    views = [base[:256 * 64].view(256, 64),                 # aligned
             base[1:1 + 256 * 64].view(256, 64),            # 2-byte offset: unaligned pointer
             base[8:8 + 272 * 48].view(272, 48),            # 16-byte aligned again, K = 48
             base[:64].view(1, 64),                         # M == 1
             base[:300 * 40].view(300, 40),                 # K % 16 != 0
             base[:256 * 64].view(256, 64).t()]             # strides (1, 64)
    calls = [lambda v: quantize(v), lambda v: quantize(v, block="2d"),
             lambda v: quantize(v, rounding="stochastic", generator=torch.Generator(DEV).manual_seed(7)),
             lambda v: quantize(v, rounding="stochastic", generator=SRStream(7, DEV)),
             lambda v: quantize(v, amax=torch.tensor(3.0, device=DEV), check=False),
             lambda v: quantize(v, rht=True) if v.shape[-1] % 16 == 0 else None,
             lambda v: pair(v, rht=True, values=(True, True)) if v.shape[0] % 16 == 0 else None]
    for v in views:
        for call in calls:
            with kernels.use_options(launch_cache=False):
                own = call(v)
            cached = call(v)
            entries = len(kernels._LAUNCHES)
            again = call(v)
            assert len(kernels._LAUNCHES) == entries, "a repeated call made a new launch entry"
            if own is None:
                assert cached is None
                continue
            for a, b, c in zip(*(r if isinstance(r, tuple) else (r,) for r in (own, cached, again))):
                _same(b, a)
                _same(c, a)
                if a.values_bf16 is not None:
                    assert torch.equal(b.values_bf16, a.values_bf16) and torch.equal(c.values_bf16, a.values_bf16)
        _same(quantize(v), _ref(v))
    assert kernels._LAUNCHES, "the launch cache was not used"
    assert kernels._ROWS_PLANS, "no launch plan was made"


def test_launch_plans_honour_triton_launch_hooks():
    """With a Triton launch hook installed (as a profiler does), every launch reaches it, planned
    calls too, and gives the same bits."""
    from triton import knobs

    x = _x((512, 256), torch.bfloat16, seed=3)
    before = fast(x)
    fast(x)   # planned by now
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        q = fast(x)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert seen == ["amax_kernel", "quantize_rows_kernel"], seen
    _same(q, before)


def test_amax_buffer_slots_are_fresh_zeros_and_captures_get_their_own():
    """``kernels._amax_buffer``: on the default stream, distinct 16-byte-aligned zeroed slots of one
    pool, a new pool when one is used up; on another stream (a capture's) a ``torch.zeros`` of its
    own, so that a captured quantize replays from zero every time."""
    kernels._AMAX_POOLS.clear()   # a pool of its own, from the first slot
    with torch.cuda.stream(torch.cuda.default_stream()):   # whatever stream earlier tests left current
        bufs = [kernels._amax_buffer(torch.device(DEV)) for _ in range(kernels._AMAX_POOL_FLOATS // 4 + 3)]
    ptrs = {b.data_ptr() for b in bufs}
    assert len(ptrs) == len(bufs) and all(p % 16 == 0 for p in ptrs)
    assert all(torch.equal(b, torch.zeros(2, device=DEV)) for b in bufs)
    assert bufs[0].untyped_storage().data_ptr() == bufs[1].untyped_storage().data_ptr()   # one pool
    assert bufs[0].untyped_storage().data_ptr() != bufs[-1].untyped_storage().data_ptr()  # then the next
    with torch.cuda.stream(torch.cuda.Stream()):
        own = kernels._amax_buffer(torch.device(DEV))
        assert own.untyped_storage().nbytes() == 8 and torch.equal(own, torch.zeros(2, device=DEV))
    x = _x((256, 256), torch.bfloat16, seed=4)
    with torch.cuda.stream(torch.cuda.default_stream()):
        eager = fast(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fast(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = quantize(x, check=False)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        _same(q, eager)


@pytest.mark.parametrize("block,rht", CONFIGS, ids=["1d", "2d", "1d-rht"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_bit_exact(block, rht, dtype):
    x = _x((4096, 4096), dtype, seed=4)
    q = _ref(x, block=block, rht=rht)
    with kernels.disabled():
        ref_deq = q.dequantize(torch.bfloat16)
        ref_bv = q.block_values(torch.bfloat16)
    assert torch.equal(q.dequantize(torch.bfloat16), ref_deq)
    assert torch.equal(q.block_values(torch.bfloat16), ref_bv)


def test_matmul_fast_matches_reference():
    a = fast(_x((2048, 4096), torch.bfloat16, seed=5))
    b = fast(_x((1024, 4096), torch.bfloat16, seed=6), block="2d")
    with kernels.disabled():
        ref = nvfp4_matmul(a, b)  # fp32 GEMM of the exact block values
    out = nvfp4_matmul(a, b)
    assert out.dtype == torch.float32
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, rel  # FP32 accumulation order only


def test_gemm_quantizer_in_nvfp4linear():
    linear = pytest.importorskip("nvfp4lab.linear")
    from nvfp4lab.recipe import NVFP4Recipe

    recipe = NVFP4Recipe(disable_stochastic_rounding=True)
    torch.manual_seed(0)
    ref = linear.NVFP4Linear(512, 384, device=DEV, recipe=recipe)
    fast = linear.NVFP4Linear.from_linear(ref, recipe=recipe, quantizer=NVFP4GemmQuantizer())
    x = _x((4, 256, 512), torch.float32, seed=7).requires_grad_()
    with kernels.disabled():
        y_ref = ref(x)
        y_ref.square().sum().backward()
    g_ref = (x.grad.clone(), ref.weight.grad.clone())
    x.grad = None
    ref.weight.grad = None
    if ref.bias is not None:
        ref.bias.grad = None
    y = fast(x)
    y.square().sum().backward()
    for a, b in ((y, y_ref), (x.grad, g_ref[0]), (fast.weight.grad, g_ref[1])):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    # the full recipe (SR gradients) runs and is finite
    full = linear.NVFP4Linear.from_linear(ref, quantizer=NVFP4GemmQuantizer())
    full(x.bfloat16()).float().sum().backward()
    assert torch.isfinite(full.weight.grad).all()


@pytest.mark.parametrize("shape", [(256, 1024), (2048, 2048), (8192, 4096), (304, 304)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", [dict(), dict(rht=True), dict(block="2d"), dict(rht=True, rounding="stochastic")],
                         ids=["1d", "1d-rht", "2d", "1d-rht-sr"])
def test_block_values_written_with_the_codes(shape, dtype, kw):
    x = _x(shape, dtype, seed=12)
    row, col = pair(x, values=(True, True), **kw)
    for q in (row, col):
        assert q.values_bf16 is not None
        with kernels.disabled():
            assert torch.equal(q.values_bf16, q.block_values(torch.bfloat16))


@pytest.mark.parametrize("shape", [(304, 304), (2048, 2048), (8192, 4096), (8192, 768), (1000, 48)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_values_only_copies_on_gpu(shape, dtype, rounding):
    """The compiled values-only kernels (rowwise ``CODES=False``, columnwise ``COL_CODES=False``:
    the code kept as a float, no integer codes) write the same BF16 bits as the kernels that write
    the codes too, for the same generator state, with -0.0, zero blocks and TE's thresholds in the
    input (the columnwise copy with the RHT where M % 16 == 0)."""
    x = _x(shape, dtype, seed=31, scale=3.0)
    x[::7, ::5] = -0.0
    x[1, :16] = 0.0
    x[2, 16:32] = -0.0
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], device=DEV)
    x[3, :16] = torch.cat([t, -t]).to(dtype)
    x[4, :] *= 1e-30
    rht = shape[0] % 16 == 0
    g1, g2 = SRStream(9, DEV), SRStream(9, DEV)
    row, col = pair(x, rht=rht, rounding=rounding, generator=g1, values=(True, True))
    row_v, col_v = pair(x, rht=rht, rounding=rounding, generator=g2, values=("only", "only"))
    if not rht:   # M % 16 != 0: the tile kernel makes the columnwise copy, codes and no values
        assert col_v.data is not None and col_v.values_bf16 is None and col.values_bf16 is None
        _same(col_v, col)
    for q, q_v in ((row, row_v), (col, col_v)) if rht else ((row, row_v),):
        assert q_v.data is None
        assert torch.equal(q_v.values_bf16.view(torch.int16), q.values_bf16.view(torch.int16))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_scaled_values_that_underflow_to_zero_get_the_reference_sign(rounding):
    """A block spanning more than 2^150: its small negative elements, scaled, underflow to -0.0
    in float32, which TE's reference (y < 0 is false) encodes as code 0 and decodes to +0.0. The
    kernels give the reference's bytes and BF16 bits with RNE and SR, codes and values-only, rowwise
    and columnwise after the RHT (whose outputs are built here to cancel down to ±t/4). Before the
    fix the SR codes and the values-only copies took the sign of a fused multiply-add (code 8, -0.0)."""
    A, t = 2.0 ** 100, 2.0 ** -120
    x = torch.zeros(64, 64, device=DEV)
    x[:16, 0] = A
    x[:16, 1:16] = -t                       # rowwise blocks: A and fifteen -t
    signs = WGRAD_SIGNS.to(DEV)
    x[16, 16:32] = A * signs[0]             # columnwise blocks (rows 16-31): after the sign flips and
    x[17, 16:32] = A * signs[1]             # H16, A + A·H[1, j] cancels in every odd output j,
    x[31, 16:32] = -t * signs[15]           # leaving ±t/4
    x = x.to(torch.bfloat16)
    y = random_hadamard_transform(x[16:32].t().float().contiguous())
    assert bool(((y < 0) & (y > -t)).any())   # tiny negative post-RHT values are there
    q, qr = fast(x, rounding=rounding, generator=SRStream(4, DEV)), _ref(x, rounding=rounding, generator=SRStream(4, DEV))
    assert_nvfp4_equal(q, qr)
    assert int(qr.data[0, 0]) == 0x07           # +6, then code 0 (not 8) for the underflowed -t
    with kernels.disabled():
        ref = quantize_rowwise_columnwise(x, dict(rounding=rounding), dict(rht=True, rounding=rounding),
                                          generator=SRStream(5, DEV))
    ref_values = [r.block_values(torch.bfloat16).view(torch.int16) for r in ref]
    for values in ((False, False), (True, True), ("only", "only")):
        got = pair(x, rht=True, rounding=rounding, generator=SRStream(5, DEV), values=values)
        for g, r, rv in zip(got, ref, ref_values):
            if values[0] != "only":
                assert_nvfp4_equal(g, r)
            if values[0]:
                assert torch.equal(g.values_bf16.view(torch.int16), rv), values


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemm_epilogue_bit_exact(out_dtype):
    """alpha, bias and the cast in one kernel == the reference's FP32 torch ops on the same acc."""
    a = fast(_x((1024, 512), torch.bfloat16, seed=8))
    b = fast(_x((768, 512), torch.float32, seed=9), block="2d")
    va, vb = a.block_values(torch.bfloat16), b.block_values(torch.bfloat16)
    acc = torch.mm(va, vb.t(), out_dtype=torch.float32)  # the GEMM kernels.gemm runs (deterministic)
    bias = _x((768,), torch.bfloat16, seed=10)
    alpha = (a.amax.float() * b.amax.float()) / torch.full((), 7225344.0, device=DEV)
    ref = (acc * alpha + bias.float()).to(out_dtype)
    assert torch.equal(kernels.gemm(va, vb, a.amax, b.amax, out_dtype, bias), ref)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["rowmajor", "a_view", "b_view"])
def test_cublas_device_alpha_epilogue_bit_exact(out_dtype, layout):
    """cuBLAS with alpha read from device memory gives RN_out(RN32(alpha · acc)): small-integer
    operands make the FP32 accumulation exact in any order, so the result must equal the
    reference's torch ops bit for bit. The output buffer is recycled from a NaN-filled block,
    so reading C (beta = 0) would show as NaN."""
    from nvfp4lab.kernels import cublas

    if not cublas.available():
        pytest.skip("cuBLAS symbols not found")
    g = torch.Generator(DEV).manual_seed(21)
    M, N, K = 384, 256, 512
    a = torch.randint(-6, 7, (M, K), device=DEV, generator=g).to(torch.bfloat16)
    b = torch.randint(-6, 7, (N, K), device=DEV, generator=g).to(torch.bfloat16)
    if layout == "a_view":
        a = a.t().contiguous().t()
    if layout == "b_view":
        b = b.t().contiguous().t()
    alpha = torch.tensor([0.1234567, 0.0], device=DEV)
    ref = ((a.float() @ b.float().t()) * alpha[0]).to(out_dtype)
    del ref  # recompute after recycling a NaN block into the allocator
    junk = torch.full((M, N), float("nan"), dtype=out_dtype, device=DEV)
    del junk
    out = cublas.gemm_device_alpha(a, b, alpha, out_dtype)
    ref = ((a.float() @ b.float().t()) * alpha[0]).to(out_dtype)
    assert out is not None and out.dtype == out_dtype and out.shape == (M, N)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="alpha_zero"):
        cublas.gemm_device_alpha(a, b, alpha[:1], out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matmul_fast_cublas_alpha_equals_epilogue_path(out_dtype):
    """nvfp4_matmul_fast with alpha in cuBLAS's epilogue == the FP32-output + epilogue-kernel path
    (up to FP32 accumulation order), and a NaN amax still makes every output NaN."""
    a = fast(_x((2048, 1024), torch.bfloat16, seed=22))
    b = fast(_x((768, 1024), torch.bfloat16, seed=23), block="2d")
    out = nvfp4_matmul(a, b, out_dtype=out_dtype)
    with kernels.use_options(cublas_alpha=False):
        ref = nvfp4_matmul(a, b, out_dtype=out_dtype)
    assert out.dtype == ref.dtype == out_dtype
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < (1e-5 if out_dtype == torch.float32 else 4e-3), rel
    a.amax.fill_(float("nan"))
    assert torch.isnan(nvfp4_matmul(a, b, out_dtype=out_dtype)).all()


def test_gemm_factor_from_the_quantize_kernels_gives_the_same_products():
    """The layer's three GEMMs with their per-tensor factors written by the quantize kernels
    (``gemm_with``: W's kernel for Fprop, dY's for Dgrad and Wgrad) give the bits of the same
    GEMMs computing the factors in a launch of their own (``gemm_coef`` dropped)."""
    import dataclasses

    from nvfp4lab.recipe import NVFP4Recipe

    r = NVFP4Recipe()
    opts = r.quantize_options
    x = _x((2048, 768), torch.bfloat16, seed=31)
    w = _x((2304, 768), torch.bfloat16, seed=32)
    dy = _x((2048, 2304), torch.bfloat16, seed=33, scale=1e-3)
    qx, qxt = quantize_rowwise_columnwise(x, opts("input_rowwise"), opts("input_columnwise"), values=("only", False))
    qw, qwt = quantize_rowwise_columnwise(w, opts("weight"), opts("weight_columnwise"), values=(True, False),
                                          gemm_with=(qx, None))
    qdy, qdyt = quantize_rowwise_columnwise(dy, opts("grad_output_rowwise"), opts("grad_output_columnwise"),
                                            generator=SRStream(3, device=DEV), values=("only", "only"),
                                            gemm_with=(qwt, qxt))
    for a, b, folded in ((qx, qw, qw), (qdy, qwt, qdy), (qdyt, qxt, qdyt)):
        assert folded.gemm_coef is not None
        plain = dataclasses.replace(folded, gemm_coef=None)
        unfolded = (plain, b) if folded is a else (a, plain)
        assert torch.equal(nvfp4_matmul(a, b, out_dtype=torch.bfloat16),
                           nvfp4_matmul(*unfolded, out_dtype=torch.bfloat16))


def test_default_nvfp4linear_takes_the_fused_path(fused_pair_calls):
    """On CUDA the default quantizer quantizes X, W and dY once each for both copies and
    agrees with the operand-by-operand reference (FP32 accumulation order only); a NaN in X
    gives NaN Y and dW with no host-side scan."""
    linear = pytest.importorskip("nvfp4lab.linear")
    from nvfp4lab.recipe import NVFP4Recipe

    recipe = NVFP4Recipe(disable_stochastic_rounding=True)
    torch.manual_seed(0)
    layer = linear.NVFP4Linear(512, 384, device=DEV, recipe=recipe)
    x = _x((4, 256, 512), torch.bfloat16, seed=11).requires_grad_()
    with kernels.disabled():
        y_ref = layer(x)
        y_ref.float().square().sum().backward()
    g_ref = (x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    x.grad = layer.weight.grad = layer.bias.grad = None
    calls = fused_pair_calls
    y = layer(x)
    y.float().square().sum().backward()
    assert sum(calls) == 3
    for a, b in ((y, y_ref), (x.grad, g_ref[0]), (layer.weight.grad, g_ref[1]), (layer.bias.grad, g_ref[2])):
        assert a.dtype == b.dtype
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2 if a.dtype == torch.bfloat16 \
            else ((a - b).norm() / b.norm()).item() < 1e-5
    xn = x.detach().clone()
    xn[0, 0, 0] = float("nan")
    xn.requires_grad_()
    layer.weight.grad = None
    yn = layer(xn)
    yn.float().sum().backward()
    assert torch.isnan(yn).all() and torch.isnan(layer.weight.grad).all()


# ----------------------------------------------------------------------------- SR statistics
def _bracket(y):
    a = y.clamp(-6, 6).abs()
    grid = E2M1_VALUES.to(y.device)
    lo_i = torch.searchsorted(grid, a.contiguous(), right=True) - 1
    return a, grid[lo_i], grid[(lo_i + 1).clamp(max=7)]


def test_sr_adjacency_and_mean_beats_rn_8192():
    """TE's test: every SR code brackets x/scale; the mean of 50 draws beats RN; draws differ."""
    x = _x((8192, 8192), torch.bfloat16, seed=8)
    for make in (lambda **k: fast(x, **k),
                 lambda **k: pair(x, rht=True, **k)[1]):
        rn = make()
        target = rn.dequantize(torch.float32, undo_rht=False)
        src = x.float() if not rn.rht else random_hadamard_transform(x.t().contiguous()).float()
        y = src.view(rn.rows, -1, 16) * block_encode_scales(rn.scale, rn.amax)[:, :, None]
        a, lo, hi = _bracket(y.view(rn.rows, rn.cols))
        acc = torch.zeros(rn.rows, rn.cols, device=DEV)
        prev = None
        n = 50
        for i in range(n):
            q = make(rounding="stochastic", generator=torch.Generator(DEV).manual_seed(100 + i))
            assert torch.equal(q.scale.view(torch.uint8), rn.scale.view(torch.uint8))
            mag = decode_e2m1(q.codes()).abs()
            assert bool(((mag == lo) | (mag == hi)).all())
            acc += q.dequantize(torch.float32, undo_rht=False).view(rn.rows, rn.cols)
            if prev is not None:
                assert not torch.equal(prev, q.data)
            prev = q.data
        src2 = src.view(rn.rows, rn.cols)
        rmse_sr = ((acc / n) - src2).pow(2).mean().sqrt()
        rmse_rn = (target.view(rn.rows, rn.cols) - src2).pow(2).mean().sqrt()
        assert rmse_sr < rmse_rn, (rmse_sr.item(), rmse_rn.item())


def test_sr_unbiased_chi_square():
    """Per-element up-counts over 256 draws ~ Binomial(256, p): chi-square within 6 sigma."""
    n = 256
    x = _x((64, 1024), torch.bfloat16, seed=9)
    xr = x.repeat(n, 1)
    q = fast(xr, rounding="stochastic", generator=torch.Generator(DEV).manual_seed(1))
    y = x.float().view(64, 64, 16) * block_encode_scales(q.scale[:64], q.amax)[:, :, None]
    a, lo, hi = _bracket(y.view(64, 1024))
    mag = decode_e2m1(q.codes()).abs().view(n, 64, 1024)
    assert bool(((mag == lo) | (mag == hi)).all())
    p = torch.where(hi > lo, (a - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi)), torch.zeros_like(a))
    ups = (mag == hi).double().sum(0)
    live = (p > 0) & (p < 1)
    var = n * p.double() * (1 - p.double())
    chi2 = (((ups - n * p.double()) ** 2)[live] / var[live]).sum().item()
    d = int(live.sum())
    assert abs(chi2 - d) < 6 * (2 * d) ** 0.5, (chi2, d)
    z = ((ups - n * p.double())[live].sum() / var[live].sum().sqrt()).item()
    assert abs(z) < 5, z


# ----------------------------------------------------------------------------- numerics helpers on GPU
import triton.language as tl  # noqa: E402

from nvfp4lab.kernels import triton_kernels as tk  # noqa: E402


@triton.jit
def _e4m3_probe(s_ptr, v_ptr, c_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v, c = tk._e4m3_rne(tl.load(s_ptr + i))
    tl.store(v_ptr + i, v)
    tl.store(c_ptr + i, c)


@triton.jit
def _bf16_probe(x_ptr, o_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + i, tk._round_bf16(tl.load(x_ptr + i)))


def test_e4m3_and_bf16_rounding_on_gpu():
    """The integer roundings compile to the same bits on the GPU as torch's casts."""
    g = torch.Generator(DEV).manual_seed(10)
    s = torch.rand(1 << 22, device=DEV, generator=g) * 448
    s[: 1 << 20] = torch.exp2(-torch.rand(1 << 20, device=DEV, generator=g) * 40) * 448
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(DEV)
    s[:126] = (grid[1:] + grid[:-1]) / 2  # exact midpoints (ties)
    v = torch.empty_like(s)
    c = torch.empty_like(s, dtype=torch.int32)
    _e4m3_probe[(s.numel() // 1024,)](s, v, c, BLOCK=1024, enable_fp_fusion=False)
    ref = s.to(torch.float8_e4m3fn)
    assert torch.equal(v, ref.float()) and torch.equal(c, ref.view(torch.uint8).int())
    e = torch.randint(-100, 100, (1 << 22,), device=DEV, generator=g).float()
    b = torch.randn(1 << 22, device=DEV, generator=g) * torch.exp2(e)
    out = torch.empty_like(b)
    _bf16_probe[(b.numel() // 1024,)](b, out, BLOCK=1024)
    assert torch.equal(out, b.to(torch.bfloat16).float())


@triton.jit
def _sr_offsets_probe(w_ptr, u_ptr, ul_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    w = tl.load(w_ptr + i)
    for b in tl.static_range(4):  # a constant byte index
        tl.store(u_ptr + b * N + i, tk._sr_byte_offsets(w, b))
    lanes = tk._sr_word_offsets(w[None, :])  # [1, N, 4]: byte b in lane b
    tl.store(ul_ptr + tl.arange(0, 4)[None, None, :] * N + i[None, :, None], lanes)


def test_sr_byte_offsets_on_gpu():
    """The GPU's byte permute (prmt) gives every byte's offset uniform (k + 1/2)/256 - 1/2 + 2^-16
    exactly, for a constant byte index and for the per-lane index the rowwise kernel uses: the
    same bits as the interpreter's shifts, which tests/test_kernels.py checks."""
    k = torch.arange(256, device=DEV, dtype=torch.int32)
    w = k | ((k + 85) % 256 << 8) | ((k + 170) % 256 << 16) | (((255 - k) << 24).to(torch.int32))
    u = torch.empty(4, 256, device=DEV)
    ul = torch.empty(4, 256, device=DEV)
    _sr_offsets_probe[(1,)](w, u, ul, N=256)
    wb = w.view(torch.uint8).view(256, 4).t().double()  # byte b of each word (little endian)
    want = ((wb + 0.5) / 256 - 0.5 + 2**-16).float()
    assert torch.equal(u, want) and torch.equal(ul, want)


def test_rht_fp32_butterfly_mismatch_rate():
    """rht_f64=False (FP32 butterfly) on bf16: report how many codes differ at 8192² (expected ~a few)."""
    x = _x((8192, 8192), torch.bfloat16, seed=11)
    ref = _ref(x.t(), rht=True)
    with kernels.use_options(rht_f64=False):
        q = fast(x.t(), rht=True)
    differ = (q.codes() != ref.codes()).sum().item()
    print(f"FP32 butterfly: {differ} of {x.numel()} codes differ from the exact RHT")
    assert differ <= 1e-5 * x.numel()


@pytest.mark.parametrize("kw", [{}, {"block": "2d"}, {"rht": True}, {"rounding": "stochastic"}],
                         ids=["1d", "2d", "rht", "sr"])
def test_the_check_reads_the_amax_early_and_still_raises_on_nan(kw):
    """``quantize(x)`` on CUDA starts its host read of the amax once the amax kernel is launched
    (it then overlaps the quantize kernel): a NaN still raises and an Inf still warns, on a call
    that plans its launches and on one that replays the plan, and a clean input gives the bits of
    ``check=False``."""
    x = _x((512, 256), torch.bfloat16, seed=9)
    gen = (lambda: {"generator": torch.Generator(DEV).manual_seed(1)}) if kw.get("rounding") else dict  # noqa: E731
    for _ in range(2):
        _same(quantize(x, **kw, **gen()), quantize(x, check=False, **kw, **gen()))
    xn, xi = x.clone(), x.clone()
    xn[3, 5] = float("nan")
    xi[7, 1] = float("inf")
    for _ in range(2):
        with pytest.raises(ValueError, match="NaN"):
            quantize(xn, **kw, **gen())
        with pytest.warns(RuntimeWarning, match="Inf"):
            quantize(xi, **kw, **gen())


def test_the_checks_host_read_waits_for_the_amax_alone():
    """``quantize``'s host read of the amax (``_start_host_read``) waits for the work launched
    before it was started, not for what the current stream runs after it (the quantize kernel),
    even when that work is launched before the read is asked for."""
    from nvfp4lab.quantize import _start_host_read
    t = torch.full((), 3.5, device=DEV)
    t.mul_(2.0)                            # the value the read must see: launched before the mark
    read = _start_host_read(t)
    torch.cuda._sleep(2_000_000_000)       # about a second of GPU time on the current stream
    after = torch.cuda.Event()
    after.record()
    assert read() == 7.0
    assert not after.query()               # the read returned while the sleep still ran
    torch.cuda.synchronize()


@pytest.mark.parametrize("kw", [{}, {"block": "2d"}, {"rht": True}, {"rounding": "stochastic"}],
                         ids=["1d", "2d", "rht", "sr"])
def test_the_check_of_a_given_amax_reads_once_and_still_raises_on_nan(kw):
    """``quantize(x, amax=a)`` on CUDA: where the rowwise kernel runs (1x16, no RHT) it observes
    max |x| itself (``observe``), elsewhere an aminmax pass does; either way a clean input gives
    the bits of ``check=False`` on the planning and the replaying call, a NaN in x raises, an Inf
    warns, and a NaN or negative given amax raises."""
    x = _x((512, 256), torch.bfloat16, seed=10)
    a = x.float().abs().amax() if not kw.get("rht") else quantize(x, rht=True).amax
    gen = (lambda: {"generator": torch.Generator(DEV).manual_seed(1)}) if kw.get("rounding") else dict  # noqa: E731
    for _ in range(2):
        _same(quantize(x, amax=a, **kw, **gen()), quantize(x, amax=a, check=False, **kw, **gen()))
    out = kernels.quantize_rowwise(x, amax=a, observe=True, block2d=kw.get("block") == "2d", rht=bool(kw.get("rht")),
                                   sr=bool(kw.get("rounding")), generator=gen().get("generator"))
    assert len(out) == 4
    if not kw.get("rht") and kw.get("block") != "2d":
        assert out[3] == x.float().abs().max()
    else:
        assert out[3] is None
    xn, xi = x.clone(), x.clone()
    xn[3, 5] = float("nan")
    xi[7, 1] = -float("inf")
    for _ in range(2):
        with pytest.raises(ValueError, match="NaN"):
            quantize(xn, amax=a, **kw, **gen())
        with pytest.warns(RuntimeWarning, match="Inf"):
            quantize(xi, amax=a, **kw, **gen())
        with pytest.raises(ValueError, match="amax must be a finite, non-negative number"):
            quantize(x, amax=torch.tensor(-1.0, device=DEV), **kw, **gen())
