"""Eager calls replayed from CUDA graphs: a layer's launches paid once per input signature.

An eager :class:`~nvfp4lab.linear.NVFP4Linear` step on a GPU is bound by the host, not the GPU:
about twenty kernel launches (quantization, block decoding, GEMMs, epilogues) each cost tens of
microseconds of Python and launcher time, more than their kernels take at GPT-2 sizes (the
performance appendix measures it: ``benchmarks/host_breakdown.py``). The layer's forward and
backward are pure functions of tensors — no host reads of device data, and the only state they
change, the stochastic-rounding stream, is a device tensor advanced in place
(:class:`~nvfp4lab.rounding.SRStream`) — so each can be captured once in a CUDA graph per input
signature and replayed:

1. the first call with a signature runs the function directly (it compiles the Triton kernels);
2. the second captures it, with private twins of the SR streams it draws from (so the graph does
   not belong to one stream: layers of one shape and recipe share it, whatever their streams);
3. every call then copies its inputs into the graph's static buffers, copies each stream's state
   into its twin (a device copy), replays, copies the advanced state back and returns copies of
   the static outputs (inputs and outputs each in one multi-tensor copy).

The kernels are the ones the direct call launches, with the same arguments and SR keys, so the
results are bit-identical to calling the function directly (``tests/gpu/test_capture_gpu.py``).
The price: a copy of every input and output (their bytes once more through memory) and one
capture per signature. This is what ``torch.compile``'s ``mode="reduce-overhead"`` (CUDA graph
trees) does for a whole model, here for one function, with copies instead of tracked ownership.

Graphs replayed on one CUDA stream share one memory pool: their intermediates are dead once a
replay's outputs are cloned, and one stream runs one replay at a time.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Hashable, Sequence

import torch

from .rounding import SRStream
from .timing import capture

__all__ = ["GraphedCalls"]


class _Entry:
    __slots__ = ("graph", "inputs", "outputs", "twins", "keep")

    def __init__(self, graph, inputs, outputs, twins, keep) -> None:
        self.graph, self.inputs, self.outputs, self.twins, self.keep = graph, inputs, outputs, twins, keep


class GraphedCalls:
    """A cache of CUDA graphs, one per call signature, replaying a pure tensor function.

    Args:
        max_entries: graphs kept (least recently used dropped first, with their static buffers;
            a signature dropped once then runs directly, so that a working set larger than the
            cache never captures on every call). After ``2 * max_entries`` captures no new
            signature is captured (shapes that keep changing would pay a capture each), with a
            ``RuntimeWarning``; :meth:`clear` starts again.
        capture_after: calls of a signature run directly before it is captured (>= 1: the first
            call compiles the kernels outside any capture).

    Raises:
        ValueError: ``max_entries < 1`` or ``capture_after < 1``.
    """

    def __init__(self, max_entries: int = 64, capture_after: int = 1) -> None:
        if max_entries < 1 or capture_after < 1:
            raise ValueError(f"GraphedCalls needs max_entries >= 1 and capture_after >= 1, got {max_entries}, "
                             f"{capture_after}")
        self.max_entries, self.capture_after = max_entries, capture_after
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._calls: dict[Hashable, int] = {}
        self._direct: set[Hashable] = set()     # failed to capture, or dropped from the cache
        self._captures = 0
        self._pools: dict[tuple[int, int], Any] = {}
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every graph and its static buffers, and forget the signatures seen."""
        with self._lock:
            self._entries.clear()
            self._calls.clear()
            self._direct.clear()
            self._pools.clear()
            self._captures = 0

    def __call__(self, fn: Callable[..., tuple[torch.Tensor, ...]], key: Hashable,
                 tensors: Sequence[torch.Tensor | None], *, streams: Sequence[SRStream] = (),
                 keep: Sequence[Any] = (), eligible: Callable[[], bool] | None = None) -> tuple[torch.Tensor, ...]:
        """``fn(*tensors, streams=streams)``, from a CUDA graph once the signature has been seen
        ``capture_after`` times.

        Args:
            fn: a pure function of ``tensors`` (CUDA tensors or None) and the keyword ``streams``
                returning a tuple of tensors: no host reads of device data, no host-side
                randomness, no state changed but the streams'. Its outputs must not alias its
                inputs.
            key: everything else ``fn`` depends on (options; the identity of the objects it
                reads, which ``keep`` then holds). The signature is ``key`` with the inputs'
                shapes, strides, dtypes and device and the current CUDA stream.
            tensors: the inputs (copied into the graph's static buffers on replay).
            streams: the :class:`~nvfp4lab.rounding.SRStream` objects ``fn`` draws SR keys from
                (on the inputs' device); each advances exactly as by a direct call.
            keep: objects held as long as the graph.
            eligible: asked once per signature, at its first call: False makes the signature
                always run directly (for a ``fn`` that is pure only for some inputs).

        Returns:
            ``fn``'s outputs: fresh tensors (clones of the static outputs) the caller owns.
            Bit-identical to ``fn(*tensors, streams=streams)``.

        Raises:
            What ``fn`` raises when called directly. A failed capture is not raised: the
            signature then always runs directly, after a ``RuntimeWarning`` naming the error.
        """
        streams = tuple(streams)
        stream = torch.cuda.current_stream()
        sig = (key, stream.device_index, stream.cuda_stream, len(streams),
               tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors))
        with self._lock:
            entry = self._entries.get(sig)
            if entry is None:
                n = self._calls.get(sig, 0)
                if n == 0 and eligible is not None and sig not in self._direct and not eligible():
                    self._direct.add(sig)
                if n >= self.capture_after and sig not in self._direct and self._captures >= 2 * self.max_entries:
                    self._direct.add(sig)
                    if self._captures == 2 * self.max_entries:
                        self._captures += 1     # warn once
                        warnings.warn(f"nvfp4lab: {2 * self.max_entries} CUDA graphs captured, more than the "
                                      f"{self.max_entries} kept: new call signatures (shapes) now run without "
                                      "one; keep shapes fixed (pad), or clear() the cache", RuntimeWarning,
                                      stacklevel=2)
                if sig in self._direct or n < self.capture_after:
                    if len(self._calls) > 16 * self.max_entries:
                        self._calls.clear()
                    self._calls[sig] = n + 1
                    return fn(*tensors, streams=streams)
                entry = self._capture(fn, sig, tensors, streams, keep, stream)
                if entry is None:
                    return fn(*tensors, streams=streams)
            else:
                self._entries.move_to_end(sig)
                pairs = [(dst, src) for dst, src in zip(entry.inputs, tensors) if dst is not None and dst.numel()]
                if pairs:   # one multi-tensor copy for all inputs: launches cost more than these bytes
                    torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
            for i, twin in entry.twins:
                twin.copy_(streams[i])
            entry.graph.replay()
            for i, twin in entry.twins:
                streams[i].copy_(twin)
            outputs = [torch.empty_like(o) if o.numel() else o for o in entry.outputs]
            full = [i for i, o in enumerate(entry.outputs) if o.numel()]
            if full:
                torch._foreach_copy_([outputs[i] for i in full], [entry.outputs[i] for i in full])
            return tuple(outputs)

    def _capture(self, fn, sig, tensors, streams, keep, stream) -> _Entry | None:
        inputs = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                  .copy_(t) for t in tensors]
        twins = tuple(SRStream(0, s.device).copy_(s) for s in streams)
        before = [t.get_state() for t in twins]
        where = (stream.device_index, stream.cuda_stream)
        pool = self._pools.setdefault(where, torch.cuda.graph_pool_handle())
        try:
            # a capture stream of its own: a capture that fails leaves its stream (and pool) tied to
            # the allocator's recording state, so neither is used again
            graph, outputs = capture(lambda: fn(*inputs, streams=twins), warmup=1, pool=pool,
                                     stream=torch.cuda.Stream(stream.device), capture_error_mode="thread_local")
        except Exception as err:  # noqa: BLE001 -- e.g. a host synchronization inside fn: run it directly
            self._direct.add(sig)
            self._pools.pop(where, None)
            warnings.warn(f"nvfp4lab: a CUDA graph could not be captured ({type(err).__name__}: {err}); "
                          "this call signature runs without one", RuntimeWarning, stacklevel=3)
            return None
        # the warm-up call advanced the twins of the streams fn draws from (the capture ran nothing):
        # only those need their state carried in and out on replay
        used = tuple((i, t) for i, (t, b) in enumerate(zip(twins, before)) if not torch.equal(t.get_state(), b))
        self._captures += 1
        entry = _Entry(graph, inputs, tuple(outputs), used, tuple(keep))
        self._entries[sig] = entry
        while len(self._entries) > self.max_entries:
            self._direct.add(self._entries.popitem(last=False)[0])
        return entry
