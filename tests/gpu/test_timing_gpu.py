"""nvfp4lab.timing on the GPU: CUDA events and graph replay measure the GPU's work."""

import pytest
import torch

from nvfp4lab.timing import bench_ms, graph_ms, median_ms

pytestmark = pytest.mark.gpu


def test_cuda_timers_agree_on_a_big_matmul():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    events = median_ms(lambda: a @ a, "cuda", iters=10, warmup=3)
    bench = bench_ms(lambda: a @ a, "cuda", rep_ms=100)
    graph = graph_ms(lambda: a @ a, rep_ms=100)
    # the same GEMM (~0.2 ms on an H100/H200) measured three ways: within a factor of two
    assert 0.5 < events / bench < 2.0 and 0.5 < graph / bench < 2.0


def test_read_flush_times_the_work_and_spares_a_read_the_write_back():
    """``l2_flush="read"``: a GEMM measures as with do_bench's zeroing flush (compute-bound: the
    flush's write-back hardly shows), and a read of 128 MiB, the first kernel after each flush, is
    never slower after a reading flush than after a zeroing one (whose dirty lines it writes back)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    assert 0.8 < bench_ms(lambda: a @ a, "cuda", l2_flush="read") / bench_ms(lambda: a @ a, "cuda") < 1.25
    x = torch.randn(32 * 1024 * 1024, device="cuda")
    read, zero = bench_ms(lambda: x.amax(), "cuda", l2_flush="read"), bench_ms(lambda: x.amax(), "cuda")
    assert 0.0 < read < 1.05 * zero, (read, zero)
