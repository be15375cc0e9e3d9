"""Stochastic rounding (SR) to the E2M1 grid.

Round-to-nearest-even (RNE, :func:`nvfp4lab.formats.encode_e2m1`) is the best
choice for a single value but is *biased* for a sum of many small ones: an update
smaller than half a grid step is lost every time. Stochastic rounding picks one of
the two E2M1 grid points that bracket a value, going up with probability equal to
the value's fractional position between them, so the expected result equals the
input. NVFP4 training uses it on the **gradient** operands only (grad_output,
rowwise for Dgrad and columnwise for Wgrad); weights and activations keep RNE
(paper arXiv 2509.25149 §4; TE ``NVFP4BlockScaling.fp4_quant_bwd_grad``).

TE draws its random bits from a Philox stream tied to its kernel's thread mapping
(8 bits per element on Blackwell's ``cvt.rs``), which cannot be reproduced outside
the kernel, so SR is checked statistically, not bit for bit. Here a uniform float32
draw from a ``torch.Generator`` is used: the same generator state reproduces the
same codes on the same device.

:class:`SRStream` is the other source of SR randomness: a Philox key and a call counter kept in a
device tensor, advanced by a device operation. The Triton kernels read their Philox seeds from it,
so a CUDA graph (the user's own, or ``torch.compile``'s) that captures a stochastic quantization
draws fresh bits at every replay, the same bits as eager code from the same state, without
registering anything with the graph (a ``torch.Generator`` other than the default one must be
registered, ``torch.cuda.CUDAGraph.register_generator_state``).
"""

from __future__ import annotations

import torch

from .formats import E2M1_MAX, check_no_nan, check_float_tensor

__all__ = ["stochastic_round_e2m1", "sr_codes", "SRStream", "as_generator"]


class SRStream:
    """A stochastic-rounding random stream whose state (Philox key, call counter) lives on a device.

    Each :meth:`seeds` call returns two fresh int64 Philox keys for one quantization (one per
    output copy: rowwise, columnwise) as a device tensor, and advances the counter with an in-place
    device add: no host read, no ``torch.Generator`` offset, so the call can be captured in a CUDA
    graph and every replay draws new keys. The keys of call ``c`` are ``key + 2c`` and
    ``key + 2c + 1`` (Philox is a keyed bijection: distinct keys give independent streams; the key
    is a 62-bit value derived from ``seed``). The same state gives the same keys on every device,
    so :meth:`get_state` / :meth:`set_state` reproduce a run across devices and processes.

    Args:
        seed: any integer; streams with different seeds are independent.
        device: where the state tensor lives (the device of the tensors it quantizes).

    Raises:
        TypeError: ``seed`` is not an ``int``.
    """

    _MASK = (1 << 62) - 1

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"SRStream seed must be an int, got {type(seed).__name__}")
        key = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & self._MASK  # spread small seeds apart
        # [key, counter c, key + 2c, key + 2c + 1]: the next two keys kept ready, so that one add
        # (counter +1, keys +2) advances the stream and a kernel can read the keys in place
        self._buf = torch.tensor([key, 0, key, key + 1], dtype=torch.int64, device=device)
        self._step = torch.tensor([1, 2, 2], dtype=torch.int64, device=device)

    @property
    def device(self) -> torch.device:
        """The device of the state (and of the seeds)."""
        return self._buf.device

    def seeds(self) -> torch.Tensor:
        """Two int64 Philox keys for the next quantization, ``[2]`` on :attr:`device`; advances the
        counter (device operations only: capturable)."""
        out = self._buf[2:].clone()
        self.advance()
        return out

    def next_keys(self) -> torch.Tensor:
        """The keys :meth:`seeds` would return, as a view of the state (no copy, no advance).

        For a kernel launched on the state's stream that reads them before :meth:`advance` is
        issued on that stream: two launches fewer than :meth:`seeds` (stream order keeps the read
        ahead of the add). Anything else should call :meth:`seeds`.
        """
        return self._buf[2:]

    def data_ptr(self) -> int:
        """The address of the state on the device: what a CUDA graph that draws from this stream
        reads and advances in place (:mod:`nvfp4lab.cuda_graphs`' owned graphs record it, and are
        captured again for a stream at another address)."""
        return self._buf.data_ptr()

    def advance(self) -> None:
        """Move to the next keys: counter +1, keys +2 (one in-place device add)."""
        self._buf[1:].add_(self._step)

    def generator(self) -> torch.Generator:
        """A ``torch.Generator`` on :attr:`device` seeded from the next keys (one host read): the
        reference (PyTorch) path's draws, reproducible from this stream's state."""
        seed = int(self.seeds()[0])
        return torch.Generator(device=self.device).manual_seed(seed)

    def get_state(self) -> torch.Tensor:
        """The state as a CPU int64 tensor ``[key, counter]`` (a copy)."""
        return self._buf[:2].detach().to("cpu", copy=True)

    def set_state(self, state: torch.Tensor) -> "SRStream":
        """Restore a state from :meth:`get_state` (any device's) in place; returns ``self``.

        Raises:
            ValueError: ``state`` is not an int64 tensor of shape ``[2]``.
        """
        state = torch.as_tensor(state)
        if state.dtype != torch.int64 or tuple(state.shape) != (2,):
            raise ValueError(f"SRStream state must be an int64 tensor [key, counter], got {state.dtype} "
                             f"{tuple(state.shape)}")
        state = state.detach().to("cpu")
        keys = state[0] + 2 * state[1] + torch.tensor([0, 1], dtype=torch.int64)
        self._buf.copy_(torch.cat([state, keys]))
        return self

    def copy_(self, other: "SRStream") -> "SRStream":
        """Take ``other``'s state (seed and counter) in place, by one device copy (capturable);
        returns ``self``.

        Raises:
            ValueError: ``other`` is not an :class:`SRStream` on this stream's device.
        """
        if not isinstance(other, SRStream) or other.device != self.device:
            raise ValueError(f"SRStream.copy_ needs an SRStream on {self.device}, got {other!r}")
        self._buf.copy_(other._buf)
        return self

    def to(self, device: torch.device | str) -> "SRStream":
        """A stream on ``device`` continuing from this one's state (this one is not advanced)."""
        other = SRStream(0, device)
        return other.set_state(self.get_state())

    def __repr__(self) -> str:
        return f"SRStream(device={self.device})"


def as_generator(generator) -> torch.Generator | None:
    """``generator`` as a ``torch.Generator`` for the PyTorch draws: an :class:`SRStream` gives
    :meth:`SRStream.generator`; a generator or ``None`` is returned as is."""
    return generator.generator() if isinstance(generator, SRStream) else generator


def stochastic_round_e2m1(
    x: torch.Tensor, *, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """Stochastically round already-scaled values to E2M1 codes.

    For ``a = min(|x|, 6)`` between neighbouring grid points ``lo <= a < hi``, the
    result is ``hi`` with probability ``(a - lo) / (hi - lo)`` and ``lo`` otherwise;
    grid points map to themselves. Values beyond ±6 saturate to ±6 (the hardware's
    ``cvt.rs.satfinite``). The sign is kept: a negative value that rounds to 0 gives
    code 8 (−0), while an exact ``-0.0`` gives code 0, as in the RNE path.

    Args:
        x: float tensor of any shape, in E2M1 units.
        generator: ``torch.Generator`` on ``x``'s device for the uniform draws
            (``None``: torch's default generator).
        uniform: optional float32 tensor of ``x``'s shape with values in ``[0, 1)``
            to use instead of drawing (for tests and for kernels that bring their own).

    Returns:
        ``uint8`` codes (0..15) of ``x``'s shape.

    Raises:
        TypeError: non-float ``x`` or ``uniform``. ValueError: NaN in ``x``; ``uniform`` of
        the wrong shape, on another device, or with a value outside ``[0, 1)`` (NaN included).
    """
    check_float_tensor(x)
    check_no_nan(x, "stochastic_round_e2m1 input")
    if uniform is not None:
        if not isinstance(uniform, torch.Tensor) or not uniform.dtype.is_floating_point:
            raise TypeError(f"uniform must be a float tensor of draws in [0, 1), got "
                            f"{uniform.dtype if isinstance(uniform, torch.Tensor) else type(uniform).__name__}")
        if uniform.shape != x.shape:
            raise ValueError(f"uniform has shape {tuple(uniform.shape)}, expected {tuple(x.shape)}")
        if uniform.device != x.device:
            raise ValueError(f"uniform is on {uniform.device}, x on {x.device}")
        if not bool(((uniform >= 0) & (uniform < 1)).all()):   # NaN fails both comparisons
            raise ValueError("uniform must hold draws in [0, 1) (no NaN): a draw of 1 or more never rounds up, "
                             "a negative one always does")
    return sr_codes(x.float(), generator=generator, uniform=uniform)


def sr_codes(
    x: torch.Tensor, *, generator: "torch.Generator | SRStream | None" = None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """SR E2M1 codes (uint8, 0..15) of a float32 tensor known to hold no NaN.

    :func:`stochastic_round_e2m1` without its checks, for callers that already validated (the hot
    path of :func:`nvfp4lab.quantize`). ``uniform``: the U[0, 1) draws to use instead of the
    ``generator``'s (one per element). ``generator``: a ``torch.Generator``, an :class:`SRStream`
    (through :func:`as_generator`) or ``None`` (torch's default generator).

    The E2M1 grid is uniform within each binade-like segment: step 0.5 on [0, 2),
    1 on [2, 4) and 2 on [4, 6]. So ``lo = floor(a / step) · step`` (exact: the step
    is a power of two), the probability of rounding up is ``(a - lo) / step``, and a
    grid value ``v`` has the magnitude code ``2v`` below 2, ``v + 2`` below 4, and
    ``v / 2 + 4`` from 4 on (4 -> 6, 6 -> 7).
    """
    a = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(a >= 4, 2.0, torch.where(a >= 2, 1.0, 0.5))
    lo = torch.floor(a / step) * step
    p_up = (a - lo) / step
    if uniform is None:
        uniform = torch.rand(a.shape, generator=as_generator(generator), device=a.device, dtype=torch.float32)
    v = torch.where(uniform < p_up, lo + step, lo)
    mag_code = torch.where(v < 2, 2 * v, torch.where(v < 4, v + 2, v / 2 + 4)).to(torch.uint8)
    return mag_code | ((x < 0).to(torch.uint8) << 3)
