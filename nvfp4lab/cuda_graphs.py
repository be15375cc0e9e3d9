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
2. then a *copying* graph per signature, captured at its second call with private twins of the SR
   streams (layers of one shape and recipe share it, whatever their streams): every call copies
   its inputs into the graph's static buffers, each stream's state into its twin, replays, copies
   the advanced state back and returns copies of the static outputs (inputs and outputs each in
   one multi-tensor copy);
3. where the caller names itself (``owner``; for the layer ``KernelOptions.layer_graphs_owned_outputs``,
   on by default), the replay is of an *owned* graph of the caller's own instead. Inputs the caller
   names as steady (``steady``: for the layer all of them: X, the weight and the bias; dY and the
   buffer its forward's graph owns) are read where they are by that graph, not copied, while they
   stay at the addresses it was captured with, and the SR streams are read and advanced where they
   are, not through twins. An input at an address seen for the first time is copied in (into the
   copying graph's static buffers, which that graph reads); one at an address it has had before
   gets a graph that reads it there (a few per caller and signature: the allocator hands out a
   few addresses during warm-up and then settles, or alternates between two). The graphs write
   outputs the caller's graphs share, which the call returns without a copy out. A replay would
   overwrite what the previous replay returned, so it runs only once no caller holds those outputs
   any more (their storages' use counts, as ``torch.compile``'s CUDA graph trees track ownership;
   in training, by a layer's next call the backward has consumed them); otherwise the copies of 2.
   The outputs stay allocated while the graphs are kept. A caller that passes the same tensors
   call after call, or whose allocator hands out the same addresses step after step (or a few in
   turn), pays no copy in; one whose activations keep moving pays as in 2.

The kernels are the ones the direct call launches, with the same arguments and SR keys, so the
results are bit-identical to calling the function directly (``tests/gpu/test_capture_gpu.py``).
The price: one capture per signature (and per owner, with a few more for inputs that move), the
owned graphs' outputs kept between calls, and in the copying tier a copy of every input and output.
This is what ``torch.compile``'s ``mode="reduce-overhead"`` (CUDA graph trees) does for a whole
model, here for one function.

Graphs replayed on one CUDA stream share one memory pool: their intermediates are dead once a
replay's outputs are cloned (copying tier) or written to the owned graph's own outputs, which
live outside the pool; one stream runs one replay at a time.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Hashable, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .rounding import SRStream
from .timing import capture

__all__ = ["GraphedCalls", "GraphStats"]


#: Tensors of at least this many bytes are copied one by one (``Tensor.copy_``); smaller ones together
#: in one multi-tensor copy, whose one launch costs less than theirs. On a lent H100 a 64 MiB copy took
#: 49.4 µs through ``copy_`` and 66.6 µs through ``torch._foreach_copy_`` (which splits large tensors
#: over several launches of its kernel; ``nvfp4lab.timing.bench_ms``, commit 6fd3362).
COPY_ALONE_BYTES = 1 << 20


def _copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> int:
    """``dst.copy_(src)`` for each pair: the large ones alone, the others in one multi-tensor copy
    (:data:`COPY_ALONE_BYTES`). Returns the bytes copied."""
    small_d, small_s = [], []
    total = 0
    for d, s in zip(dsts, srcs):
        nbytes = d.numel() * d.element_size()
        total += nbytes
        if nbytes >= COPY_ALONE_BYTES:
            d.copy_(s)
        else:
            small_d.append(d)
            small_s.append(s)
    if small_d:
        torch._foreach_copy_(small_d, small_s)
    return total


@dataclasses.dataclass
class GraphStats:
    """What a :class:`GraphedCalls` did, counted since it was made or since
    :meth:`GraphedCalls.reset_stats` (:meth:`GraphedCalls.clear` drops graphs, not these counts).

    The diagnostic for a slow eager or compiled training step: once every signature is captured,
    ``direct`` and ``captures`` stop growing, and in a steady step ``bytes_in`` and ``bytes_out``
    grow only where inputs moved to addresses the owned tier had not seen, or a caller still held
    the outputs of its previous call (the tiers of the module docstring).
    ``benchmarks/train_profile.py`` records them per steady training step.

    Attributes:
        calls: calls of the :class:`GraphedCalls`.
        direct: calls that ran the function itself (a signature's first calls, a signature that is
            not captured; each costs its launches).
        captures: CUDA graphs captured (both tiers; failed captures not counted).
        owned_replays: replays of a caller's own graph, whose outputs are returned without a copy.
        copying_replays: replays of a copying graph, whose outputs are copied out.
        bytes_in: bytes of inputs copied into static buffers before a replay (inputs the replayed
            graph does not read where they are; a capture's own copy of its inputs not counted).
        bytes_out: bytes of outputs copied out of a copying graph.
    """

    calls: int = 0
    direct: int = 0
    captures: int = 0
    owned_replays: int = 0
    copying_replays: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def since(self, earlier: "GraphStats") -> "GraphStats":
        """The counts from ``earlier`` (a copy taken before, ``dataclasses.replace(stats)``) to these."""
        return GraphStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name)
                             for f in dataclasses.fields(self)})


class _Entry:
    __slots__ = ("graph", "inputs", "outputs", "twins", "keep", "reads", "draws")

    def __init__(self, graph, inputs, outputs, twins, keep, reads=(), draws=None) -> None:
        self.graph, self.inputs, self.outputs, self.twins, self.keep = graph, inputs, outputs, twins, keep
        # owned tier: (index, address) of each input the graph reads where it is rather than from
        # the copying graph's static buffer; the addresses of the SR streams it draws from and
        # advances where they are (None: it draws from its twins)
        self.reads = reads
        self.draws = draws


class _Owner:
    """The owned tier's graphs of one caller and signature: the outputs they all write, and one
    graph (:class:`_Entry`) per set of addresses it reads in place (``variants``, by ``(reads,
    draws)``, least recently used first)."""
    __slots__ = ("outputs", "refs", "variants", "seen", "captures", "last", "drawn")

    def __init__(self, outputs: tuple, refs: tuple, drawn: tuple[int, ...]) -> None:
        self.outputs = outputs
        self.drawn = drawn   # the indices of the SR streams the graphs draw from
        # a weak reference to each output's storage and its use count while only the graphs hold it
        # (more means a caller still holds the output the last replay returned)
        self.refs = refs
        self.variants: OrderedDict[tuple, _Entry] = OrderedDict()
        # by steady input index (and "streams"): the addresses seen at this owner's calls, latest last
        self.seen: dict[int | str, OrderedDict[Any, None]] = {}
        self.captures = 0
        self.last: _Entry | None = None   # the graph replayed last

    @property
    def draws_sr(self) -> bool:
        """Whether the graphs draw from any SR stream (else where the streams are does not matter)."""
        return bool(self.drawn)

    def outputs_free(self) -> bool:
        """Whether no caller holds an output of the last replay."""
        return all(torch._C._storage_Use_Count(ref.cdata) <= base for ref, base in self.refs)

    def saw(self, where: int | str, address: Any) -> bool:
        """Whether ``address`` was seen at an earlier call for steady input ``where``; records it
        (the latest :attr:`GraphedCalls.OWNER_SEEN` per input are kept)."""
        seen = self.seen.setdefault(where, OrderedDict())
        known = address in seen
        seen[address] = None
        seen.move_to_end(address)
        while len(seen) > GraphedCalls.OWNER_SEEN:
            seen.popitem(last=False)
        return known


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
        max_owned: callers' own graphs kept, counted per caller and signature (least recently
            used dropped first, with the outputs they own); after ``2 * max_owned`` such first
            captures (besides those for moved inputs) no new caller gets one. 0 turns the owned
            tier off.

    Attributes:
        stats: what the calls did (:class:`GraphStats`: direct calls, captures, replays of each
            tier, bytes copied in and out); :meth:`reset_stats` starts it again.

    Raises:
        ValueError: ``max_entries < 1``, ``capture_after < 1`` or ``max_owned < 0``.
    """

    def __init__(self, max_entries: int = 64, capture_after: int = 1, max_owned: int = 256) -> None:
        if max_entries < 1 or capture_after < 1 or max_owned < 0:
            raise ValueError(f"GraphedCalls needs max_entries >= 1, capture_after >= 1 and max_owned >= 0, got "
                             f"{max_entries}, {capture_after}, {max_owned}")
        self.max_entries, self.capture_after, self.max_owned = max_entries, capture_after, max_owned
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._owned: OrderedDict[Hashable, _Owner] = OrderedDict()   # by (sig, owner): the owned-outputs tier
        self._owned_captures = 0
        self._owned_failed: set[Hashable] = set()
        self._calls: dict[Hashable, int] = {}
        self._direct: set[Hashable] = set()     # failed to capture, or dropped from the cache
        self._captures = 0
        self._pools: dict[tuple[int, int], Any] = {}
        # one capture stream per caller stream, kept across clear(): PyTorch keeps a cuBLAS workspace
        # (32 MiB on Hopper) for every stream cuBLAS ran on, so a new stream per capture held one per graph
        self._capture_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        self._lock = threading.RLock()
        self.stats = GraphStats()   # counts of what the calls did (:class:`GraphStats`)

    def reset_stats(self) -> GraphStats:
        """Start :attr:`stats` from zero; returns the counts until now."""
        with self._lock:
            before, self.stats = self.stats, GraphStats()
        return before

    def __len__(self) -> int:
        return len(self._entries) + len(self._owned)

    def clear(self) -> None:
        """Drop every graph and its static buffers, and forget the signatures seen (the capture
        streams, one per caller stream, are kept, and with them their cuBLAS workspaces)."""
        with self._lock:
            self._entries.clear()
            self._owned.clear()
            self._owned_captures = 0
            self._owned_failed.clear()
            self._calls.clear()
            self._direct.clear()
            self._pools.clear()
            self._captures = 0

    def forget(self, owner: Hashable) -> None:
        """Drop the graphs of ``owner`` (the name given as ``owner``) and the
        outputs they keep: for a caller that is gone (a deleted layer), whose graphs would
        otherwise hold that memory until the least-recently-used rule drops them."""
        with self._lock:
            for who in [w for w in self._owned if w[1] == owner]:
                del self._owned[who]

    def __call__(self, fn: Callable[..., tuple[torch.Tensor, ...]], key: Hashable,
                 tensors: Sequence[torch.Tensor | None], *, streams: Sequence[SRStream] = (),
                 keep: Sequence[Any] = (), eligible: Callable[[], bool] | None = None,
                 owner: Hashable | None = None,
                 steady: Sequence[int] = ()) -> tuple[torch.Tensor, ...]:
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
            tensors: the inputs (copied into the graph's static buffers on replay, but see ``steady``).
            streams: the :class:`~nvfp4lab.rounding.SRStream` objects ``fn`` draws SR keys from
                (on the inputs' device); each advances exactly as by a direct call.
            keep: objects held as long as the graph.
            eligible: asked once per signature, at its first call: False makes the signature
                always run directly (for a ``fn`` that is pure only for some inputs).
            owner: a name for the caller (a layer and a direction), for a ``fn`` that also takes
                ``out=`` (a tuple of tensors shaped as its outputs, which it writes and returns, or
                None): when no one holds the outputs of its previous call any more, its calls
                replay a graph of its own that reads the ``steady`` inputs where they are (the
                others copied in) and writes outputs it owns, returned without a copy
                (:meth:`_owned_entry`); otherwise the copies above. None: no such graph.
            steady: indices of ``tensors`` that may stay at one address from call to call (a
                layer's parameters; a buffer an owner's graph returned; activations a caller
                passes again or that the allocator puts at the same place each step): the owner's
                graph reads them where they are instead of from the copying graph's static
                buffers, so they are not copied in. One at an address this owner has not seen
                before is copied in like the others; one back at an address seen before gets a
                graph that reads it there (at most :attr:`OWNER_CAPTURES` such captures per owner
                and signature, :meth:`_owned_entry`).

        Returns:
            ``fn``'s outputs: fresh tensors (clones of the static outputs) the caller owns, or, from
            an owner's graph, aliases of its own outputs, which it writes again only once the
            caller has dropped them.
            Bit-identical to ``fn(*tensors, streams=streams)``.

        Raises:
            What ``fn`` raises when called directly. A failed capture is not raised: the
            signature then always runs directly, after a ``RuntimeWarning`` naming the error.
        """
        streams = tuple(streams)
        index = torch._C._cuda_getDevice()
        where = (index, torch._C._cuda_getCurrentRawStream(index))   # the current stream, as the graphs' pool key
        sig = (key, *where, len(streams),
               tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors))
        with self._lock:
            stats = self.stats
            stats.calls += 1
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
                    stats.direct += 1
                    return fn(*tensors, streams=streams)
                entry = self._capture(fn, sig, tensors, streams, keep, where)
                if entry is None:
                    stats.direct += 1
                    return fn(*tensors, streams=streams)
            else:
                self._entries.move_to_end(sig)
                own = None if owner is None else self._owned_entry(fn, sig, entry, tensors, streams, keep, where,
                                                                   owner, steady)
                stats.bytes_in += self._copy_in(entry, tensors, () if own is None else own.reads)
                if own is not None:   # outputs of the caller's own graph, no copy out
                    self._replay(own, streams)
                    stats.owned_replays += 1
                    return tuple(o.detach() for o in own.outputs)
            self._replay(entry, streams)
            stats.copying_replays += 1
            outputs = [torch.empty_like(o) if o.numel() else o for o in entry.outputs]
            full = [i for i, o in enumerate(entry.outputs) if o.numel()]
            stats.bytes_out += _copy([outputs[i] for i in full], [entry.outputs[i] for i in full])
            return tuple(outputs)

    @staticmethod
    def _copy_in(entry: _Entry, tensors: Sequence[torch.Tensor | None], reads: tuple = ()) -> int:
        """This call's inputs into the copying graph's static buffers, but those that the graph to be
        replayed reads where they are (``reads``: (index, address) pairs). Returns the bytes copied."""
        skip = {i for i, _ in reads}
        dsts, srcs = [], []
        for i, (dst, src) in enumerate(zip(entry.inputs, tensors)):
            if dst is not None and i not in skip and dst.numel():
                dsts.append(dst)
                srcs.append(src)
        return _copy(dsts, srcs) if dsts else 0

    @staticmethod
    def _replay(entry: _Entry, streams: tuple[SRStream, ...]) -> None:
        """Replay ``entry``'s graph, the SR streams it draws from carried into its twins and back."""
        for i, twin in entry.twins:
            twin.copy_(streams[i])
        entry.graph.replay()
        for i, twin in entry.twins:
            streams[i].copy_(twin)

    def _owned_entry(self, fn, sig, entry: _Entry, tensors, streams, keep, where, owner: Hashable,
                     steady: Sequence[int]) -> _Entry | None:
        """The owned-outputs tier: the graph of ``owner``'s own to replay for this call, or None where
        the copying graph's copies out must run instead.

        An owner's graphs (one :class:`_Owner` per owner and signature) all write the same outputs,
        allocated for them outside the graphs' pool, which the call returns as aliases
        (``detach()``). A replay would overwrite what the previous replay returned, so one runs only
        once no caller holds any of those outputs (their storages' use counts,
        :meth:`_Owner.outputs_free`); layers of one shape each have their own graphs, so in training
        an owner's outputs are free again by its next call (the previous step's backward has
        consumed them). Each graph reads the copying graph's static inputs (the call copies its
        inputs there as usual), except the ``steady`` inputs it reads where they are (its
        ``reads``: indices and addresses), and draws from the SR streams themselves, advancing them
        in place (``draws``), or from twins (``None``). It replays only while this call's steady
        inputs sit at the addresses it reads (shapes, strides and dtypes are in the signature), so
        it reads them, whatever memory once held there.

        The owner's first graph, captured at its first call once the copying graph exists, reads
        every steady input and the streams in place. A call whose steady inputs are not all where
        one graph reads them gets a graph (:meth:`_variant`) that reads in place those at an address
        seen at an earlier call of this owner, and copies in those at an address seen for the first
        time: an address the allocator hands out once (warm-up, activations that keep moving) costs
        a copy, not a capture, and one that comes back (an allocator that settles after a few steps,
        or alternates between two places) gets a graph that reads it where it is. At most
        :attr:`OWNER_CAPTURES` such captures per owner and signature and :attr:`OWNER_VARIANTS`
        graphs kept (least recently used dropped); after that a call replays a kept graph whose
        in-place inputs are where it reads them, the others copied in. Owners: at most
        :attr:`max_owned` kept (least recently used dropped, with their outputs) and
        ``2 * max_owned`` first captures."""
        who = (sig, owner)
        own = self._owned.get(who)
        at = tuple((i, tensors[i].data_ptr()) for i in steady if tensors[i] is not None)
        draws = tuple(s.data_ptr() for s in streams) if own is None or own.draws_sr else ()
        if own is None:
            if who in self._owned_failed or not self.max_owned or self._owned_captures >= 2 * self.max_owned:
                return None
            self._owned_captures += 1
            own = self._capture_owned(fn, entry, tensors, at, streams, keep, where)
            if own is None:
                self._owned_failed.add(who)
                return None
            self._owned[who] = own
            while len(self._owned) > self.max_owned:
                self._owned.popitem(last=False)
            graph = own.last
        else:
            if not own.outputs_free():
                return None
            graph = own.variants.get((at, draws))   # the usual call: every steady input where a graph reads it
            if graph is None:
                graph = self._variant(fn, who, own, entry, tensors, at, streams, draws, keep, where)
                if graph is None:
                    return None
            else:
                own.variants.move_to_end((at, draws))
        own.last = graph
        self._owned.move_to_end(who)
        return graph

    def _variant(self, fn, who, own: _Owner, entry: _Entry, tensors, at: tuple, streams, draws: tuple, keep,
                 where) -> _Entry | None:
        """A graph of ``own`` for a call whose steady inputs (``at``: (index, address)) or streams are
        not all where one of its graphs reads them (:meth:`_owned_entry`): the one reading in place
        the inputs at addresses seen before (captured if need be), or a kept one whose in-place
        inputs are where it reads them; None if there is none."""
        reads = tuple((i, p) for i, p in at if own.saw(i, p))
        key = (reads, draws if own.saw("streams", draws) else None)
        graph = own.variants.get(key)
        if graph is None and own.captures < self.OWNER_CAPTURES:
            own.captures += 1
            made = self._capture_graph(fn, entry, tensors, reads, streams, keep, where, own.outputs,
                                       key[1] is not None, own.drawn)
            if made is None:   # this caller then always takes the copies out
                del self._owned[who]
                self._owned_failed.add(who)
                return None
            graph = made[0]
            own.variants[key] = graph
            while len(own.variants) > self.OWNER_VARIANTS:
                own.variants.popitem(last=False)
        if graph is None:   # captures used up: a kept graph whose in-place reads are where they are
            graph = next((g for g in reversed(own.variants.values())
                          if all(tensors[i].data_ptr() == p for i, p in g.reads)
                          and g.draws in (None, draws)), None)
        if graph is not None:
            own.variants.move_to_end((graph.reads, graph.draws))
        return graph

    def _capture_owned(self, fn, entry: _Entry, tensors, reads: tuple, streams, keep, where) -> _Owner | None:
        """An owner's first graph, reading ``reads`` and the streams in place, with the outputs it
        writes, as an :class:`_Owner`; None if the capture failed."""
        made = self._capture_graph(fn, entry, tensors, reads, streams, keep, where, None, True)
        if made is None:
            return None
        graph, refs, drawn = made
        own = _Owner(graph.outputs, refs, drawn)
        for i, p in reads:
            own.saw(i, p)
        own.saw("streams", graph.draws)
        own.variants[(reads, graph.draws)] = own.last = graph
        return own

    def _capture_graph(self, fn, entry: _Entry, tensors, reads: tuple, streams, keep, where,
                       outputs: tuple | None, streams_in_place: bool,
                       drawn: tuple[int, ...] = ()) -> tuple[_Entry, tuple, tuple[int, ...]] | None:
        """One owned-tier graph, its outputs' references (:meth:`_capture_into`) and the indices of
        the streams it draws from; None if the capture failed. The graph reads the steady inputs
        ``reads`` ((index, address)) where they are and the copying graph ``entry``'s static buffers
        for the rest, draws from the streams in place (``streams_in_place``) or from twins, and
        writes ``outputs``. For an owner's first graph (``outputs`` None) a direct call makes the
        outputs and shows which streams it draws from (it advances their twins); the others are
        captured without one (``drawn``: the streams the first drew from), so that they allocate
        nothing outside the graphs' pool: allocations of the caller's allocator between steps move
        the addresses its next steps get."""
        read_at = {i for i, _ in reads}
        inputs = [t if i in read_at else buf for i, (t, buf) in enumerate(zip(tensors, entry.inputs))]
        twins = tuple(SRStream(0, s.device).copy_(s) for s in streams)
        if outputs is None:
            # on the inputs the graph reads (whatever the static buffers hold: the graph, not this
            # call, computes what is returned)
            before = [t.get_state() for t in twins]
            outputs = tuple(fn(*inputs, streams=twins))
            drawn = tuple(i for i, (t, b) in enumerate(zip(twins, before)) if not torch.equal(t.get_state(), b))
        used = tuple((i, twins[i]) for i in drawn)
        draw = streams if streams_in_place else twins
        done = self._capture_into(lambda: fn(*inputs, streams=draw, out=outputs), outputs, where,
                                  "these calls copy their outputs out")
        if done is None:
            return None
        # inputs: the copying graph's static buffers, which this graph reads, held as long as it is;
        # not the steady inputs (holding the buffer a forward's graph returned would count as a
        # caller holding that graph's outputs): a replay happens only while this call's steady inputs
        # sit at the addresses in ``reads``, so it reads them, whatever was there before
        held = tuple(None if i in read_at else t for i, t in enumerate(inputs))
        # draws: where the streams it advances in place are (() where it draws from none), None for twins
        draws = (tuple(s.data_ptr() for s in streams) if drawn else ()) if streams_in_place else None
        graph = _Entry(done[0], held, outputs, () if streams_in_place else used, tuple(keep), reads, draws)
        return graph, done[1], drawn

    def _capture_stream(self, where: tuple[int, int]) -> "torch.cuda.Stream":
        """The stream the graphs replayed on caller stream ``where`` are captured on (made once)."""
        side = self._capture_streams.get(where)
        if side is None:
            side = self._capture_streams[where] = torch.cuda.Stream(torch.device("cuda", where[0]))
        return side

    def _capture_into(self, run: Callable[[], tuple], outputs: tuple[torch.Tensor, ...], where: tuple[int, int],
                      failure: str) -> tuple[Any, tuple] | None:
        """Capture ``run()``, a call that writes into ``outputs`` and returns them, on a capture stream
        of its own, in the graphs' pool of the caller's stream ``where`` (device index, raw stream):
        (the graph, a weak reference to each output's
        storage with its use count now, while only the graph's entry will hold it), or None after a
        ``RuntimeWarning`` ending in ``failure``."""
        pool = self._pools.setdefault(where, torch.cuda.graph_pool_handle())
        try:
            graph, returned = capture(run, warmup=0, pool=pool, stream=self._capture_stream(where),
                                      capture_error_mode="thread_local", free_cache=False)
            if len(returned) != len(outputs) or any(r is not o for r, o in zip(returned, outputs)):
                raise RuntimeError("the function did not return the out= tensors it was given")
        except Exception as err:  # noqa: BLE001 -- the caller falls back to copies
            self._pools.pop(where, None)
            self._capture_streams.pop(where, None)
            warnings.warn(f"nvfp4lab: a CUDA graph writing outputs of its own could not be captured "
                          f"({type(err).__name__}: {err}); {failure}", RuntimeWarning, stacklevel=5)
            return None
        del returned
        self.stats.captures += 1
        return graph, tuple((ref, torch._C._storage_Use_Count(ref.cdata))
                            for ref in (StorageWeakRef(o.untyped_storage()) for o in outputs))

    #: The owned tier's captures after an owner's first, per owner and signature, for steady inputs
    #: (or SR streams) at other addresses than its graphs read (:meth:`_owned_entry`); after that a
    #: kept graph replays, with the inputs that moved copied in.
    OWNER_CAPTURES = 6
    #: The owned tier's graphs kept per owner and signature (least recently used dropped first).
    OWNER_VARIANTS = 4
    #: The addresses remembered per steady input and owner, to tell one seen before.
    OWNER_SEEN = 8

    def _capture(self, fn, sig, tensors, streams, keep, where) -> _Entry | None:
        inputs = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                  .copy_(t) for t in tensors]
        twins = tuple(SRStream(0, s.device).copy_(s) for s in streams)
        before = [t.get_state() for t in twins]
        pool = self._pools.setdefault(where, torch.cuda.graph_pool_handle())
        try:
            graph, outputs = capture(lambda: fn(*inputs, streams=twins), warmup=1, pool=pool,
                                     stream=self._capture_stream(where),
                                     capture_error_mode="thread_local", free_cache=False)
        except Exception as err:  # noqa: BLE001 -- e.g. a host synchronization inside fn: run it directly
            self._direct.add(sig)
            # a capture that fails leaves its stream (and pool) tied to the allocator's recording
            # state, so neither is used again
            self._pools.pop(where, None)
            self._capture_streams.pop(where, None)
            warnings.warn(f"nvfp4lab: a CUDA graph could not be captured ({type(err).__name__}: {err}); "
                          "this call signature runs without one", RuntimeWarning, stacklevel=3)
            return None
        # the warm-up call advanced the twins of the streams fn draws from (the capture ran nothing):
        # only those need their state carried in and out on replay
        used = tuple((i, t) for i, (t, b) in enumerate(zip(twins, before)) if not torch.equal(t.get_state(), b))
        self._captures += 1
        self.stats.captures += 1
        entry = _Entry(graph, inputs, tuple(outputs), used, tuple(keep))
        self._entries[sig] = entry
        while len(self._entries) > self.max_entries:
            self._direct.add(self._entries.popitem(last=False)[0])
        return entry
