"""nvfp4lab.timing on the CPU (the CUDA paths run in tests/gpu)."""

import time

import pytest

from nvfp4lab.timing import bench_ms, capture, median_ms, per_call_ms


def test_per_call_counts_calls_and_measures_sleep():
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.002)

    times = per_call_ms(work, "cpu", iters=5, warmup=2)
    assert len(calls) == 7 and len(times) == 5
    assert all(t >= 2.0 for t in times)                   # a 2 ms sleep never takes less
    assert median_ms(work, "cpu", iters=3) >= 2.0 and bench_ms(work, "cpu", repeat=3) >= 2.0


def test_before_runs_untimed_before_each_timed_call():
    order = []
    times = per_call_ms(lambda: order.append("fn"), "cpu", iters=3, warmup=1,
                        before=lambda: (order.append("before"), time.sleep(0.005)))
    assert order == ["fn"] + ["before", "fn"] * 3
    assert all(t < 5.0 for t in times)                    # the 5 ms sleep of ``before`` is not timed


def test_bench_rejects_an_unknown_l2_flush():
    with pytest.raises(ValueError, match="l2_flush"):
        bench_ms(lambda: None, "cpu", l2_flush="clean")


def test_per_call_rejects_bad_counts():
    with pytest.raises(ValueError, match="iters >= 1"):
        per_call_ms(lambda: None, "cpu", iters=0)


def test_capture_without_freeing_the_cache_needs_its_stream():
    """``free_cache=False`` captures on the stream it is given; without one it refuses before
    touching the device (and before calling ``fn``)."""
    calls = []
    with pytest.raises(ValueError, match="needs the stream"):
        capture(lambda: calls.append(1), free_cache=False)
    assert not calls
