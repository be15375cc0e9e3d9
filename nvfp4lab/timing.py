"""Timing a callable on the CPU or a CUDA GPU: the one timer of the benchmarks, the GPU report and the book.

Three ways, for three questions:

* :func:`per_call_ms` / :func:`median_ms`: each call timed on its own (CUDA events around it on a
  GPU, ``time.perf_counter`` on the CPU) after warm-up calls. What a user calling the function
  from Python gets, launch overhead included.
* :func:`bench_ms`: the median of many back-to-back calls with the L2 cache flushed in between
  (``triton.testing.do_bench`` on a GPU; the per-call median on the CPU). A kernel's own time.
  ``l2_flush="read"`` flushes by reading instead of zeroing (see there).
* :func:`graph_ms`: the callable captured once in a CUDA graph and the replay timed with
  :func:`bench_ms`: the GPU time of its kernels without Python or launch overhead.

All return milliseconds. On a GPU they synchronize, so none of them can run inside a capture.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["per_call_ms", "median_ms", "bench_ms", "graph_ms", "capture", "side_stream"]


def per_call_ms(fn: Callable[[], Any], device: torch.device | str, *, iters: int, warmup: int = 1,
                before: Callable[[], Any] | None = None) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn``, after ``warmup`` untimed calls.

    Args:
        fn: the work, called with no arguments.
        device: where it runs: CUDA events around each call on ``"cuda"`` (the call's GPU time
            as the stream sees it, including any gaps while Python launches kernels), wall clock on
            ``"cpu"``.
        iters: timed calls (>= 1).
        warmup: untimed calls first (compilation, autotuning, allocator warm-up).
        before: untimed work run before each timed call (e.g. an L2 flush), or None.

    Raises:
        ValueError: ``iters < 1`` or ``warmup < 0``.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"per_call_ms needs iters >= 1 and warmup >= 0, got {iters} and {warmup}")
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def median_ms(fn: Callable[[], Any], device: torch.device | str, *, iters: int, warmup: int = 1) -> float:
    """The median of :func:`per_call_ms` (same arguments and errors)."""
    return statistics.median(per_call_ms(fn, device, iters=iters, warmup=warmup))


def bench_ms(fn: Callable[[], Any], device: torch.device | str, *, repeat: int = 5, rep_ms: int = 200,
             l2_flush: str = "zero") -> float:
    """Median milliseconds of ``fn`` run back to back: a kernel's own time.

    On CUDA: ``triton.testing.do_bench`` (``rep_ms`` milliseconds of repeats after a warm-up of an
    eighth of that, at least 25 ms; the L2 cache flushed between repeats; median). Its flush zeroes
    a 256 MiB buffer (Triton 3.6 ``CudaDriver.clear_cache``), which leaves the L2 full of dirty
    lines: the first kernel after it also pays their write-back to memory. ``l2_flush="read"``
    flushes by reading a 256 MiB buffer instead (clean lines, nothing to write back) and times
    ``10 * repeat`` calls, each between CUDA events after its own flush. On the CPU:
    :func:`median_ms` with ``repeat`` timed calls after one warm-up call (``l2_flush`` unused).

    Raises:
        ValueError: ``l2_flush`` is not ``"zero"`` or ``"read"``.
    """
    if l2_flush not in ("zero", "read"):
        raise ValueError(f"l2_flush must be 'zero' (do_bench's) or 'read', got {l2_flush!r}")
    if torch.device(device).type == "cuda":
        if l2_flush == "read":
            return _after_read_flush_ms(fn, device, 10 * repeat)
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=max(25, rep_ms // 8), rep=rep_ms, return_mode="median"))
    return median_ms(fn, device, iters=repeat, warmup=1)


#: Per CUDA device, the 256 MiB buffer :func:`bench_ms` reads to flush the L2 (``l2_flush="read"``).
_READ_FLUSH: dict[int, torch.Tensor] = {}


def _after_read_flush_ms(fn: Callable[[], Any], device: torch.device | str, iters: int) -> float:
    """:func:`bench_ms` with ``l2_flush="read"`` on CUDA: the median of ``iters`` calls, each timed
    by CUDA events right after a read of the whole flush buffer (``amax``: one pass, a 4-byte result)."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    flush = _READ_FLUSH.get(index)
    if flush is None:
        flush = _READ_FLUSH[index] = torch.ones(256 * 1024 * 1024 // 4, dtype=torch.int32, device=f"cuda:{index}")
    return statistics.median(per_call_ms(fn, device, iters=iters, warmup=1, before=flush.amax))


#: The side stream of each device for warm-ups (:func:`side_stream`).
_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device | str | int | None = None) -> "torch.cuda.Stream":
    """A side stream of a CUDA ``device`` (default: the current one), the same one on every call.

    For warm-ups before a CUDA-graph capture (:func:`capture`, ``nvfp4lab train --cuda-graph``):
    PyTorch keeps a cuBLAS workspace (32 MiB on Hopper) for every stream cuBLAS ran on, for the
    life of the process, so a new stream per warm-up kept one per warm-up.
    """
    index = device if isinstance(device, int) else None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


def capture(fn: Callable[[], Any], *, warmup: int = 3, generators: Sequence[torch.Generator] = (),
            pool: Any = None, stream: "torch.cuda.Stream | None" = None,
            capture_error_mode: str = "global", free_cache: bool = True) -> tuple["torch.cuda.CUDAGraph", Any]:
    """``fn`` warmed up ``warmup`` times on a side stream, then captured once in a CUDA graph.

    ``pool``, ``stream`` and ``capture_error_mode`` are passed to ``torch.cuda.graph`` (a memory
    pool shared with other graphs; the stream to capture on; ``"thread_local"`` lets other
    threads use CUDA during the capture). The warm-up runs on ``stream`` when one is given, else on
    the current device's :func:`side_stream`. ``free_cache=False`` captures through
    ``CUDAGraph.capture_begin`` / ``capture_end`` on ``stream`` (required then) instead, without the
    ``torch.cuda.empty_cache()`` that ``torch.cuda.graph`` runs first: that call hands every cached
    block back to the driver, so the tensors the caller allocates next get other addresses than
    the step before (what :mod:`nvfp4lab.cuda_graphs` captures between a caller's steps must not do).

    Returns:
        ``(graph, outputs)``: ``graph.replay()`` reruns the captured work, writing into the
        ``outputs`` the captured call returned (static tensors).

    Raises:
        ValueError: ``free_cache=False`` without a ``stream``.
        What the capture raises (e.g. a host synchronization inside ``fn``).
    """
    if not free_cache and stream is None:
        raise ValueError("capture(free_cache=False) needs the stream to capture on")
    side = stream if stream is not None else side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    for gen in generators:
        graph.register_generator_state(gen)
    if free_cache:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            out = fn()
        return graph, out
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        try:
            out = fn()
        finally:
            graph.capture_end()
    return graph, out


def graph_ms(fn: Callable[[], Any], *, rep_ms: int = 200, generators: Sequence[torch.Generator] = (),
             warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` captured once in a CUDA graph and replayed (:func:`bench_ms`).

    ``fn`` first runs ``warmup`` times on a side stream (Triton compiles, cuBLAS picks algorithms),
    then once under ``torch.cuda.graph``. ``generators``: custom CUDA generators ``fn`` draws from,
    registered with the graph so that every replay draws fresh numbers.

    Raises:
        What the capture raises (e.g. a host synchronization inside ``fn``).
    """
    graph, _ = capture(fn, warmup=warmup, generators=generators)
    ms = bench_ms(graph.replay, "cuda", rep_ms=rep_ms)
    del graph
    return ms
