"""Emulated NVFP4 linear layer: the paper's recipe in a drop-in ``nn.Linear``.

A linear layer ``Y = X Wᵀ + b`` (X: [M tokens, K], W: [N, K]) costs three GEMMs per training
step. :class:`NVFP4Linear` runs each one as Transformer Engine's ``NVFP4BlockScaling`` recipe
does (TE ``pytorch/module/linear.py`` with the quantizers of
``NVFP4BlockScalingRecipeState.make_quantizers``), every GEMM written ``a @ bᵀ`` with both
operands quantized along the contraction axis::

    GEMM    computes          a (quantized along)          b (quantized along)
    Fprop   Y  = X Wᵀ         X   rowwise 1x16 (K), RNE     W  2D 16x16 (K), RNE
    Dgrad   dX = dY W         dY  rowwise 1x16 (N), SR      Wᵀ 2D 16x16 (N), RNE
    Wgrad   dW = dYᵀ X        dYᵀ 1x16 (M), RHT + SR        Xᵀ 1x16 (M), RHT, RNE

* 2D weights: one E4M3 scale per 16x16 tile, so the Dgrad operand ``Wᵀ`` is exactly the
  transpose of the Fprop operand ``W`` (with ``disable_2d_quantization`` the Dgrad copy is an
  independent 1x16 quantization of ``Wᵀ``, as TE's columnwise weight).
* The Wgrad operands are the *columnwise* copies: the transposes quantized along the token
  axis, each with its own (post-RHT) amax. The RHT rotates 16-token chunks with the same
  matrix on both operands; ``R Rᵀ = I`` cancels it in the GEMM, so the GEMM uses the rotated
  values directly.
* Each GEMM is the exact emulation :func:`nvfp4lab.quantize.nvfp4_matmul`: ``code × block
  scale`` operands (exact in BF16/FP32), FP32 accumulation, then the per-tensor factor
  ``amax_a·amax_b/(6²·448²)`` in FP32.
* Bias: added in FP32 to the Fprop result; its gradient is the FP32 column sum of the
  unquantized dY (TE computes ``dbias`` from the high-precision grad_output).
* Dtypes: master weights (and bias) stay in their own dtype, normally FP32, and their
  gradients come back in it. Under ``torch.autocast`` the input is cast to the autocast dtype
  (BF16), as TE casts activations; the output and dX have the input's dtype. Autocast is
  switched off inside the GEMM emulation so the FP32 accumulation is not silently downcast.

Shapes. The token count M is arbitrary: for the RHT the columnwise copies are zero-padded to a
multiple of 16 tokens (zero tokens add nothing to dW; TE itself requires M % 16 == 0 there).
Feature sizes K, N that are not multiples of 16 are handled by the quantizer's zero padding of
partial blocks (TE's native kernels require multiples of 16; the model keeps them so).

Non-finite values. The quantizer refuses NaN; a NaN reaching this layer instead produces a NaN
output (or NaN gradients) so that the training loop's non-finite check can name the step. On
the fused path (the Triton kernels, see :class:`GemmQuantizer`) no scan is made: the NaN makes
the per-tensor amax NaN and so every GEMM output using that operand (a NaN in X gives a NaN Y
and dW; dX stays what dY and W make it).

Speed. Called eagerly on a GPU for training, the forward and the backward are each replayed from
a CUDA graph captured per shape (:mod:`nvfp4lab.cuda_graphs`, :data:`LAYER_GRAPHS`; off with
``kernels.use_options(layer_graphs=False)``): bit-identical to launching the kernels one by one,
without their launch overhead; under ``torch.compile`` the custom ops replay the same graphs. The
kernels are launched directly without gradients (inference, whose shapes vary), inside someone
else's capture, with a ``torch.Generator``, another quantizer, a precision switch or recorded
operands.

Instrumentation. :func:`capture_gemm_operands` records every quantized GEMM operand with the
options and the SR generator state used, so tests can check them bit for bit against
``quantize(...)`` of the right tensor.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, NamedTuple, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels
from .cuda_graphs import GraphedCalls
from .emulated import EmulatedLinear
from .fp8 import FP8Linear, FP8Recipe
from .fp8_recipes import DelayedScalingLinear, FP8BlockLinear
from .hadamard import WGRAD_SIGNS
from .mx import MXFP4Linear, MXFP8Linear
from .precisions import EMULATED, canonical_name
from .quantize import NVFP4Tensor, nvfp4_matmul, pair_uses_kernels, quantize, quantize_rowwise_columnwise
from .recipe import DEFAULT_BLOCK_PATTERN, NVFP4Recipe, block_index, layer_is_quantized
from .rounding import SRStream

__all__ = [
    "NVFP4Linear", "convert_model", "PRECISIONS", "GemmOperand", "capture_gemm_operands",
    "GemmQuantizer", "NVFP4GemmQuantizer", "IdentityQuantizer", "set_quantization_enabled",
    "layer_precisions", "TOKEN_PAD", "SWITCH_SCOPES", "set_high_precision_scope", "EMULATED_LAYERS",
    "block_recipe_for", "LAYER_GRAPHS",
]

#: Precisions understood by :func:`convert_model` (and the trainer's nvfp4lab backend): the
#: emulated rows of :mod:`nvfp4lab.precisions` (``"fp8"`` is ``"fp8-current"``).
PRECISIONS = EMULATED
#: Token-axis padding multiple for the RHT'd columnwise copies (the RHT length).
TOKEN_PAD = 16


# ----------------------------------------------------------------------------- quantizer plug
class GemmQuantizer(Protocol):
    """What :class:`NVFP4Linear` needs: quantize one operand, multiply two (``a @ bᵀ``).

    ``matmul(a, b, out_dtype=, bias=)`` returns ``cast(RN(a @ bᵀ) + bias)`` ([M, N], ``bias``
    [N] or ``None``, added in FP32 before the one rounding to ``out_dtype``). A quantizer may
    also define ``quantize_pair(x, row_options, col_options, generator=, values=)`` returning
    the rowwise copy of ``x`` [M, K] and the columnwise copy (``xᵀ`` quantized along M)
    together, or ``None`` to decline (``values``: which of the two should carry its BF16 block
    values for the GEMM, see :func:`nvfp4lab.quantize.quantize_rowwise_columnwise`);
    :class:`NVFP4Linear` then
    neither transposes nor scans for NaN (the kernels' NaN-propagating amaxes make the
    outputs NaN instead, with no host synchronisation).
    """

    def quantize(self, x: torch.Tensor, **options: Any) -> Any: ...

    def matmul(self, a: Any, b: Any, *, out_dtype: torch.dtype = torch.float32,
               bias: torch.Tensor | None = None) -> torch.Tensor: ...


class NVFP4GemmQuantizer:
    """The default: :func:`nvfp4lab.quantize.quantize`, :func:`~nvfp4lab.quantize.quantize_rowwise_columnwise`
    and :func:`nvfp4lab.quantize.nvfp4_matmul`, which take the Triton kernels wherever they run and
    cover the options (the decision is theirs); ``quantize_pair`` declines (``None``) where the
    kernels do not cover the pair, so that the layer pads and transposes for the reference itself.
    """

    name = "nvfp4"

    def quantize(self, x: torch.Tensor, **options: Any):
        return quantize(x, **options)

    def quantize_pair(self, x: torch.Tensor, row: dict[str, Any], col: dict[str, Any] | None = None, *,
                      generator: "torch.Generator | SRStream | None" = None, values: tuple[bool, bool] = (False, False),
                      col_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      amax_out: torch.Tensor | None = None, gemm_with: tuple = (None, None)):
        return quantize_rowwise_columnwise(x, row, col, generator=generator, values=values, fallback=False,
                                           col_out=col_out, amax_out=amax_out, gemm_with=gemm_with)

    def matmul(self, a, b, *, out_dtype: torch.dtype = torch.float32,
               bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        return nvfp4_matmul(a, b, out_dtype=out_dtype, bias=bias, out=out)


class IdentityQuantizer:
    """No quantization: operands pass through; the GEMM is an FP32 ``a @ bᵀ``.

    With it (and the recipe's RHT off) :class:`NVFP4Linear` computes exactly what ``nn.Linear``
    computes in FP32: the test that the autograd plumbing (which tensor goes in which GEMM,
    transposes, padding, bias) is right independently of the number format.
    """

    name = "identity"

    def quantize(self, x: torch.Tensor, **options: Any) -> torch.Tensor:
        return x

    def matmul(self, a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        y = a.to(torch.float32) @ b.to(torch.float32).t()
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(out_dtype)


# ----------------------------------------------------------------------------- instrumentation
@dataclass
class GemmOperand:
    """One quantized GEMM operand, as recorded by :func:`capture_gemm_operands`.

    Attributes:
        gemm: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``.
        operand: ``"x"``, ``"w"`` (Fprop), ``"dy"``, ``"wt"`` (Dgrad), ``"dyt"``, ``"xt"`` (Wgrad).
        layer: the layer's name (set by :func:`convert_model`).
        options: the keyword arguments given to the quantizer (without ``generator``).
        rng_state: the SR generator's state just before the call (``None`` when rounding is RNE).
        source: the exact high-precision tensor handed to the quantizer (after transposing and
            padding).
        tensor: the quantized result (an ``NVFP4Tensor`` with the default quantizer).
    """

    gemm: str
    operand: str
    layer: str
    options: dict[str, Any]
    rng_state: torch.Tensor | None
    source: torch.Tensor
    tensor: Any

    def rng(self) -> "torch.Generator | SRStream | None":
        """A fresh SR random source in the state this operand was drawn from (``None`` for RNE):
        ``quantize(source, generator=op.rng(), **op.options)`` reproduces :attr:`tensor`."""
        if self.rng_state is None:
            return None
        if self.rng_state.dtype == torch.int64:  # an SRStream's [key, counter]
            return SRStream(0, self.source.device).set_state(self.rng_state)
        return torch.Generator(device=self.source.device).set_state(self.rng_state)


_OBSERVERS: list[Callable[[GemmOperand], None]] = []


@contextlib.contextmanager
def capture_gemm_operands() -> Iterator[list[GemmOperand]]:
    """Record every quantized operand of every :class:`NVFP4Linear` GEMM run inside the block.

    >>> with capture_gemm_operands() as ops:
    ...     layer(x).sum().backward()
    >>> [(o.gemm, o.operand) for o in ops]   # fprop x, w, (wgrad xt), dgrad dy, wt, wgrad dyt
    """
    records: list[GemmOperand] = []
    _OBSERVERS.append(records.append)
    try:
        yield records
    finally:
        _OBSERVERS.remove(records.append)


# ----------------------------------------------------------------------------- the Function
#: Layer states by key (see _LayerState._register), for the torch.compile custom ops.
_STATES: "weakref.WeakValueDictionary[int, _LayerState]" = weakref.WeakValueDictionary()
#: Keys of layer states collected since the last layer-graph call (list.append: safe from a finalizer).
_GONE: list[int] = []


class _SavedFormat(NamedTuple):
    """What of a layer's recipe shapes the buffer its forward saves for the backward
    (:func:`_saved_layout`): whether Xᵀ's and Wᵀ's columnwise copies use 16x16 blocks, and whether
    they are rotated by the RHT (their own amax slot, their tokens padded to :data:`TOKEN_PAD`).

    As one int (:meth:`code`) it is what the compile-mode custom op is given besides the layer's key,
    so that the op's fake implementation, which sees no layer, can size the buffer. The key cannot
    serve: Dynamo may trace it as a symbolic int — under FSDP2 each block's forward is a frame of its
    own, recompiled for the next block's key with that int made dynamic — and a symbolic int finds
    no layer. The code is the same for every layer of one recipe, so it stays a constant."""
    x_2d: bool
    x_rht: bool
    w_2d: bool
    w_rht: bool

    @classmethod
    def of(cls, recipe: NVFP4Recipe) -> "_SavedFormat":
        x, w = recipe.quantize_options("input_columnwise"), recipe.quantize_options("weight_columnwise")
        return cls(x["block"] == "2d", bool(x["rht"]), w["block"] == "2d", bool(w["rht"]))

    def code(self) -> int:
        return sum(int(flag) << i for i, flag in enumerate(self))

    @classmethod
    def from_code(cls, code: int) -> "_SavedFormat":
        code = int(code)   # (a symbolic int specialises here, guarded: one graph per format)
        return cls(*(bool(code >> i & 1) for i in range(len(cls._fields))))


@dataclass
class _LayerState:
    recipe: NVFP4Recipe
    quantizer: Any
    name: str = ""
    generator: "torch.Generator | SRStream | None" = None
    seed: int = 0
    high_precision: frozenset = frozenset()   # GEMMs run unquantized: subset of {"fprop", "dgrad", "wgrad"}
    _streams: dict[str, SRStream] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._register()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "recipe":   # kept with its recipe: what the saved buffer looks like
            super().__setattr__("saved_format", _SavedFormat.of(value))
            super().__setattr__("saved_code", self.saved_format.code())

    def __setstate__(self, state: dict) -> None:  # copy / deepcopy / pickle: a new object, a new key
        self.__dict__.update(state)
        self._register()

    def _register(self) -> None:
        """Give this state the integer key the compile-mode custom ops find it by (and its layer
        graphs are named by); once the state is gone, those graphs are dropped (:func:`_run_fprop`)."""
        self.key = id(self)
        _STATES[self.key] = self
        weakref.finalize(self, _GONE.append, self.key)

    def sr_generator(self, device: torch.device) -> "torch.Generator | SRStream":
        """The SR random source: the one given, else this layer's :class:`SRStream` on ``device``."""
        if self.generator is not None:
            return self.generator
        key = str(device)
        if key not in self._streams:
            self._streams[key] = SRStream(self.seed, device)
        return self._streams[key]


def _observe(state: _LayerState, gemm: str, operand: str, options: dict, rng_state, source, q) -> None:
    record = GemmOperand(gemm, operand, state.name, options, rng_state, source, q)
    for observer in list(_OBSERVERS):
        observer(record)


def _quantize(state: _LayerState, gemm: str, operand: str, x: torch.Tensor, role: str):
    options = state.recipe.quantize_options(role)
    kwargs = dict(options)
    rng_state = None
    if options["rounding"] == "stochastic":
        gen = state.sr_generator(x.device)
        kwargs["generator"] = gen
        if _OBSERVERS:
            rng_state = gen.get_state()
    q = state.quantizer.quantize(x, **kwargs)
    if _OBSERVERS:
        _observe(state, gemm, operand, options, rng_state, x, q)
    return q


def _quantize_pair(state: _LayerState, x2d: torch.Tensor, row: tuple[str, str, str],
                   col: tuple[str, str, str] | None, values: tuple[bool, bool], col_out: tuple | None = None,
                   amax_out: torch.Tensor | None = None, gemm_with: tuple = (None, None)):
    """Both copies of ``x2d`` from the quantizer's ``quantize_pair`` (None if it has none or declines).

    ``row`` / ``col``: (gemm, operand, role) of the rowwise and columnwise copies. ``values``: ask
    for the BF16 block values of the (rowwise, columnwise) copy along with it: for the copies a GEMM
    uses at once, not for those saved for the backward pass (which stay packed, 4.5 bits a value);
    ``"only"``: the values may come without the codes (Fprop's X, Dgrad's and Wgrad's dY; not
    while GEMM operands are being recorded, which shows them their codes).
    ``col_out``: (data, scale, amax) for the columnwise copy to be written into (only the default
    quantizer's ``quantize_pair`` takes it: the packed forward runs only with it), or None.
    ``amax_out``: a zeroed float32 [2] buffer for the pair's amax kernel (same condition), or None.
    ``gemm_with``: the (rowwise, columnwise) copies' GEMM partners, quantized before, whose GEMM
    factors the kernels then compute (the default quantizer's ``gemm_with``; passed only to it).
    """
    pair_fn = getattr(state.quantizer, "quantize_pair", None)
    if pair_fn is None:
        return None
    row_opts = state.recipe.quantize_options(row[2])
    col_opts = None if col is None else state.recipe.quantize_options(col[2])
    gen = rng_state = None
    if row_opts["rounding"] == "stochastic" or (col_opts and col_opts["rounding"] == "stochastic"):
        gen = state.sr_generator(x2d.device)
        if _OBSERVERS:
            rng_state = gen.get_state()
    given = {k: v for k, v in (("col_out", col_out), ("amax_out", amax_out)) if v is not None}
    if type(state.quantizer) is NVFP4GemmQuantizer and any(q is not None for q in gemm_with):
        given["gemm_with"] = gemm_with
    if _OBSERVERS:
        values = tuple(bool(v) for v in values)
    pair = pair_fn(x2d, row_opts, col_opts, generator=gen, values=values, **given)
    if pair is None:
        return None
    if _OBSERVERS:
        _observe(state, row[0], row[1], row_opts, rng_state, x2d, pair[0])
        if col is not None:
            _observe(state, col[0], col[1], col_opts, rng_state, _columnwise(x2d, col_opts["rht"]), pair[1])
    return pair


def _pad_tokens(xt: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last (token) axis of a [features, M] tensor to a multiple of ``multiple``."""
    pad = (-xt.shape[-1]) % multiple
    return F.pad(xt, (0, pad)) if pad else xt


def _columnwise(x2d: torch.Tensor, rht: bool) -> torch.Tensor:
    """``x2d`` [M, F] -> contiguous [F, M'] (tokens last; zero-padded to 16 tokens for the RHT)."""
    xt = x2d.t().contiguous()
    return _pad_tokens(xt, TOKEN_PAD) if rht else xt


def _nan_operand(rows: int, cols: int, options: dict, dtype: torch.dtype, device) -> NVFP4Tensor:
    """A stand-in for a backward copy of a NaN input: any GEMM with it is NaN (its amax is NaN)."""
    block = options["block"]
    srows = -(-rows // 16) if block == "2d" else rows
    return NVFP4Tensor(data=torch.zeros(rows, -(-cols // 2), dtype=torch.uint8, device=device),
                       scale=torch.zeros(srows, -(-cols // 16), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
                       amax=torch.full((), float("nan"), device=device), shape=torch.Size([rows, cols]),
                       block=block, dtype=dtype, rht=options["rht"], rounding=options["rounding"],
                       rht_signs=torch.as_tensor(options.get("rht_signs", WGRAD_SIGNS), dtype=torch.float32)
                       if options["rht"] else None)


def _copy_shapes(fmt: _SavedFormat, M: int, K: int, N: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Logical shapes of the saved columnwise copies: Xᵀ [K, M'] (tokens padded to 16 for the RHT)
    and Wᵀ [K, N]."""
    return (K, -(-M // TOKEN_PAD) * TOKEN_PAD if fmt.x_rht else M), (K, N)


def _fprop(state: _LayerState, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           need_dgrad: bool, need_wgrad: bool, out_y: torch.Tensor | None = None,
           out_saved: tuple[tuple | None, tuple | None] = (None, None),
           amax_out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)):
    """The forward: ``(Y [M, N], Xᵀ copy or None, Wᵀ copy or None)``, the copies quantized now for
    the backward, as TE does. Shared by the autograd function (eager) and the custom op (compile).
    ``out_y``: where the Fprop GEMM writes Y (only with the default quantizer, whose ``matmul``
    takes ``out``; the layer's CUDA graphs use it), or None for a new tensor. ``out_saved``:
    (data, scale, amax) where the kernels write the Xᵀ and the Wᵀ copy (for a 2D Wᵀ also its
    values: :func:`_saved_layout`; :func:`_fprop_packed`'s buffer; same condition), each or both
    None for new tensors; a path that makes its copies otherwise returns new tensors all the same.
    ``amax_out``: zeroed float32 [2] buffers for the X and the W pair's amax kernels (same
    condition), each or both None."""
    M, K = x2d.shape
    N = weight.shape[0]
    if M == 0:
        return torch.zeros(0, N, dtype=x2d.dtype, device=x2d.device), None, None
    if state.high_precision:  # a precision switch by scope (the paper's appendix D)
        return _fprop_switched(state, x2d, weight, bias, need_dgrad, need_wgrad)
    # values for the Fprop operands only: the columnwise copies wait for the backward packed
    out_xt, out_wt = out_saved
    px = _quantize_pair(state, x2d, ("fprop", "x", "input_rowwise"),
                        ("wgrad", "xt", "input_columnwise") if need_wgrad else None, ("only", False),
                        out_xt if need_wgrad else None, amax_out[0] if need_wgrad else None)
    pw = _quantize_pair(state, weight, ("fprop", "w", "weight"),
                        ("dgrad", "wt", "weight_columnwise") if need_dgrad else None, (True, False),
                        out_wt if need_dgrad else None, amax_out[1] if need_dgrad else None,
                        (px[0], None)) if px else None   # (W's kernel also computes Fprop's alpha)
    if px is not None and pw is not None:
        (qx, qxt), (qw, qwt) = px, pw
    else:
        if bool(torch.isnan(x2d).any()) or bool(torch.isnan(weight).any()):
            # quantize refuses NaN; the layer answers with NaN outputs and gradients instead
            (kx, mx), (kw, nw) = _copy_shapes(state.saved_format, M, K, N)
            recipe = state.recipe
            qxt = _nan_operand(kx, mx, recipe.quantize_options("input_columnwise"), x2d.dtype, x2d.device) \
                if need_wgrad else None
            qwt = _nan_operand(kw, nw, recipe.quantize_options("weight_columnwise"), weight.dtype, x2d.device) \
                if need_dgrad else None
            return torch.full((M, N), float("nan"), dtype=x2d.dtype, device=x2d.device), qxt, qwt
        qx = _quantize(state, "fprop", "x", x2d, "input_rowwise")
        qw = _quantize(state, "fprop", "w", weight, "weight")
        qwt = _quantize(state, "dgrad", "wt", weight.t().contiguous(), "weight_columnwise") if need_dgrad else None
        qxt = (_quantize(state, "wgrad", "xt", _columnwise(x2d, not state.recipe.disable_rht), "input_columnwise")
               if need_wgrad else None)
        for buf, q_row, q_col, role in ((amax_out[0], qx, qxt, "input_columnwise"),
                                        (amax_out[1], qw, qwt, "weight_columnwise")):
            if buf is not None and q_col is not None:   # the pair's amaxes where its kernels put them
                buf[0].copy_(q_row.amax)
                buf[_column_slot(state.saved_format, role)].copy_(q_col.amax)
    return _matmul(state, qx, qw, x2d.dtype, bias, out_y), qxt, qwt   # Fprop


def _fprop_switched(state: _LayerState, x2d, weight, bias, need_dgrad: bool, need_wgrad: bool):
    """:func:`_fprop` with some GEMMs in high precision: Fprop as ``F.linear`` in the input's dtype
    when ``"fprop"`` is switched; a switched backward GEMM keeps the high-precision operand it needs
    (X for Wgrad, W for Dgrad) instead of its quantized copy."""
    hp = state.high_precision
    if "fprop" in hp:
        y = F.linear(x2d, weight.to(x2d.dtype), None if bias is None else bias.to(x2d.dtype))
    else:
        qx = _quantize(state, "fprop", "x", x2d, "input_rowwise")
        qw = _quantize(state, "fprop", "w", weight, "weight")
        y = state.quantizer.matmul(qx, qw, out_dtype=x2d.dtype, bias=bias)
    qxt = qwt = None
    if need_wgrad:
        qxt = x2d if "wgrad" in hp else _quantize(
            state, "wgrad", "xt", _columnwise(x2d, not state.recipe.disable_rht), "input_columnwise")
    if need_dgrad:
        qwt = weight if "dgrad" in hp else _quantize(state, "dgrad", "wt", weight.t().contiguous(), "weight_columnwise")
    return y, qxt, qwt


def _dbias(dy: torch.Tensor, bias_dtype: torch.dtype) -> torch.Tensor:
    """The bias gradient: the FP32-accumulated column sum of the unquantized dY [M, N], cast to
    ``bias_dtype`` (TE computes ``dbias`` from the high-precision grad_output). ``sum(dtype=)``
    accumulates in FP32 as it reads dY once, where ``dy.float().sum(0)`` (the same rule) first
    writes an FP32 copy of dY and then reads that copy."""
    return dy.sum(0, dtype=torch.float32).to(bias_dtype)


def _bprop(state: _LayerState, dy: torch.Tensor, qxt, qwt, K: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
           bias_dtype: torch.dtype | None, need_dgrad: bool, need_wgrad: bool, need_dbias: bool,
           out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The backward: ``(dX [M, K] or None, dW [N, K] or None, db [N] or None)`` from dY [M, N].
    ``out``: (dX, dW) tensors for the Dgrad and Wgrad GEMMs to write into (as ``out_y`` of
    :func:`_fprop`), or None."""
    M, N = dy.shape
    hp = state.high_precision
    if hp & {"dgrad", "wgrad"}:
        return _bprop_switched(state, dy, qxt, qwt, K, x_dtype, w_dtype, bias_dtype, need_dgrad, need_wgrad,
                               need_dbias)
    dx = dw = db = None
    if M == 0:
        dev = dy.device
        return (torch.zeros(0, K, dtype=x_dtype, device=dev) if need_dgrad else None,
                torch.zeros(N, K, dtype=w_dtype, device=dev) if need_wgrad else None,
                torch.zeros(N, dtype=bias_dtype, device=dev) if need_dbias else None)
    recipe = state.recipe
    pdy = None
    if need_dgrad or need_wgrad:
        pdy = _quantize_pair(state, dy, ("dgrad", "dy", "grad_output_rowwise"),
                             ("wgrad", "dyt", "grad_output_columnwise") if need_wgrad else None, ("only", "only"),
                             gemm_with=(qwt if need_dgrad else None, qxt if need_wgrad else None))
    if pdy is not None:
        qdy, qdyt = pdy
    elif (need_dgrad or need_wgrad) and bool(torch.isnan(dy).any()):
        nan = lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype, device=dy.device)  # noqa: E731
        return (nan((M, K), x_dtype) if need_dgrad else None, nan((N, K), w_dtype) if need_wgrad else None,
                nan((N,), bias_dtype) if need_dbias else None)
    else:
        qdy = _quantize(state, "dgrad", "dy", dy, "grad_output_rowwise") if need_dgrad else None
        qdyt = (_quantize(state, "wgrad", "dyt", _columnwise(dy, not recipe.disable_rht), "grad_output_columnwise")
                if need_wgrad else None)
    out_dx, out_dw = out if out is not None else (None, None)
    if need_dgrad:
        dx = _matmul(state, qdy, qwt, x_dtype, None, out_dx)    # Dgrad
    if need_wgrad:
        dw = _matmul(state, qdyt, qxt, w_dtype, None, out_dw)   # Wgrad
    if need_dbias:
        db = _dbias(dy, bias_dtype)
    return dx, dw, db


def _matmul(state: _LayerState, a, b, out_dtype: torch.dtype, bias: torch.Tensor | None,
            out: torch.Tensor | None) -> torch.Tensor:
    """``state.quantizer.matmul``, into ``out`` when one is given (only the default quantizer's
    takes ``out``: the layer's graphs run only with it, :func:`_graph_stream`)."""
    if out is None:
        return state.quantizer.matmul(a, b, out_dtype=out_dtype, bias=bias)
    return state.quantizer.matmul(a, b, out_dtype=out_dtype, bias=bias, out=out)


def _bprop_switched(state: _LayerState, dy, qxt, qwt, K, x_dtype, w_dtype, bias_dtype, need_dgrad, need_wgrad,
                    need_dbias):
    """:func:`_bprop` with Dgrad and/or Wgrad in high precision (BF16 operands under autocast, as
    ``nn.Linear`` would compute them); the other GEMM stays NVFP4."""
    hp = state.high_precision
    dx = dw = db = None
    quantized = [g for g, need in (("dgrad", need_dgrad), ("wgrad", need_wgrad)) if need and g not in hp]
    qdy = qdyt = None
    if "dgrad" in quantized:
        qdy = _quantize(state, "dgrad", "dy", dy, "grad_output_rowwise")
    if "wgrad" in quantized:
        qdyt = _quantize(state, "wgrad", "dyt", _columnwise(dy, not state.recipe.disable_rht), "grad_output_columnwise")
    if need_dgrad:
        dx = (dy.to(x_dtype) @ qwt.to(x_dtype)) if "dgrad" in hp else state.quantizer.matmul(qdy, qwt, out_dtype=x_dtype)
    if need_wgrad:
        dw = ((dy.t().to(x_dtype) @ qxt.to(x_dtype)).to(w_dtype) if "wgrad" in hp
              else state.quantizer.matmul(qdyt, qxt, out_dtype=w_dtype))
    if need_dbias:
        db = _dbias(dy, bias_dtype)
    return dx, dw, db


class _NVFP4LinearFunction(torch.autograd.Function):
    """Autograd function of :class:`NVFP4Linear` in eager mode: see the module docstring for the
    three GEMMs (:func:`_fprop`, :func:`_bprop`; under ``torch.compile`` the custom ops
    ``nvfp4lab::linear_fprop`` / ``linear_bprop`` run the same two functions).

    Two paths with the same numerics. With a quantizer whose ``quantize_pair`` accepts the
    operands (the Triton kernels), each of X, W and dY is read once for both of its copies and
    nothing waits on the GPU. Otherwise every operand is quantized separately from an explicit
    transpose, and NaN is looked for first (``quantize`` refuses NaN; the layer answers with
    NaN outputs and gradients).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, state: _LayerState, grad_enabled: bool):  # type: ignore[override]
        K = weight.shape[1]
        ctx.state = state
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        # needs_input_grad is set even under no_grad: skip the backward copies when not training.
        need_dgrad, need_wgrad = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        x2d = x.reshape(-1, K)
        stream = _graph_stream(state, x2d)
        ctx.flat = stream is not None
        if ctx.flat:  # plain tensors in and out: replayed from a CUDA graph (nvfp4lab.cuda_graphs)
            y, ctx.saved = _run_fprop(state, stream, x2d, weight, bias, need_dgrad, need_wgrad)
            ctx.saved_for = (need_dgrad, need_wgrad)
        else:
            with torch.autocast(device_type=x.device.type, enabled=False):
                y, ctx.qxt, ctx.qwt = _fprop(state, x2d, weight, bias, need_dgrad, need_wgrad)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        K = ctx.x_shape[-1]
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        need_dgrad, need_wgrad, need_dbias = ctx.needs_input_grad[:3]
        if ctx.flat:
            dx, dw, db = _needed(_run_bprop(ctx.state, _graph_stream(ctx.state, dy), dy, ctx.saved, K, ctx.x_dtype,
                                            ctx.w_dtype, ctx.bias_dtype or ctx.w_dtype, *ctx.saved_for,
                                            need_dgrad, need_wgrad, need_dbias),
                                 (need_dgrad, need_wgrad, need_dbias))
            ctx.saved = None
        else:
            with torch.autocast(device_type=grad_out.device.type, enabled=False):
                dx, dw, db = _bprop(ctx.state, dy, ctx.qxt, ctx.qwt, K, ctx.x_dtype, ctx.w_dtype, ctx.bias_dtype,
                                    need_dgrad, need_wgrad, need_dbias)
            ctx.qwt = ctx.qxt = None
        return (None if dx is None else dx.reshape(ctx.x_shape)), dw, db, None, None


# ----------------------------------------------------------------------------- torch.compile
# Under torch.compile the layer is two custom ops, opaque to Dynamo (no graph break, no tracing
# into the Triton kernels) and running _fprop / _bprop: the eager numerics. The saved Xᵀ/Wᵀ copies
# travel as one uint8 buffer (codes, scales, amax of each, at fixed offsets: one tensor to save, to
# copy out of a graph and into the next); the layer's state (recipe, quantizer, SR stream) is found
# from an integer key.
_PACK_ALIGN = 256   # bytes: each saved tensor starts at an aligned offset of the buffer


def _saved_layout(fmt: _SavedFormat, M: int, K: int, N: int, need_dgrad: bool,
                  need_wgrad: bool) -> tuple[tuple[tuple[int, tuple, torch.dtype], ...], int]:
    """((byte offset, shape, dtype) of each of the seven saved tensors — Xᵀ codes, scales, amax, then
    Wᵀ's, then Wᵀ's BF16 block values stored as W's ``[N, K]`` (2D weight blocks only: the
    transpose of the Fprop operand's values, which the forward's kernel writes there and the Dgrad
    GEMM reads, instead of decoding Wᵀ again in the backward), each empty when not needed — in one
    uint8 buffer, the buffer's size in bytes). Codes, scales and values start at multiples of
    ``_PACK_ALIGN`` bytes (what the kernels that write them there need); the amaxes follow them in
    the last ``_AMAX_BYTES``: the X pair's amax buffer (rowwise, columnwise) at its start and the W
    pair's 16 bytes further, where the forward's amax kernels accumulate (:func:`_fprop_packed`);
    each saved amax is the one of its pair's two that the columnwise copy uses."""
    (kx, mx), (kw, nw) = _copy_shapes(fmt, M, K, N)
    meta = []
    for need, (rows, cols), two_d in ((need_wgrad and M > 0, (kx, mx), fmt.x_2d),
                                      (need_dgrad and M > 0, (kw, nw), fmt.w_2d)):
        if need:
            srows = -(-rows // 16) if two_d else rows
            meta += [((rows, -(-cols // 2)), torch.uint8), ((srows, -(-cols // 16)), torch.float8_e4m3fn),
                     ((), torch.float32)]
        else:
            meta += [((0,), torch.uint8), ((0,), torch.float8_e4m3fn), ((0,), torch.float32)]
    two_d = need_dgrad and M > 0 and fmt.w_2d
    meta.append(((nw, kw) if two_d else (0,), torch.bfloat16))
    layout, off = [None] * 7, 0
    for i in (0, 1, 3, 4, 6):
        shape, dtype = meta[i]
        layout[i] = (off, shape, dtype)
        off = -(-(off + math.prod(shape) * dtype.itemsize) // _PACK_ALIGN) * _PACK_ALIGN
    for i, pair, role in ((2, 0, "input_columnwise"), (5, 16, "weight_columnwise")):
        layout[i] = (off + pair + 4 * _column_slot(fmt, role), *meta[i])
    return tuple(layout), off + _PACK_ALIGN   # the amaxes: the first _AMAX_BYTES of the last _PACK_ALIGN


def _column_slot(fmt: _SavedFormat, role: str) -> int:
    """Where a pair's amax buffer holds the columnwise copy's amax (``role``: ``"input_columnwise"``
    or ``"weight_columnwise"``): ``[1]`` after an RHT (its own, post-RHT amax), else ``[0]``, the
    rowwise one (the same value), as the kernels write it."""
    rht, two_d = (fmt.x_rht, fmt.x_2d) if role == "input_columnwise" else (fmt.w_rht, fmt.w_2d)
    return 1 if rht and not two_d else 0


#: Bytes of the forward's two amax buffers, at the start of the saved buffer's last ``_PACK_ALIGN``
#: bytes: X's float32 [2] at 0, W's at 16 (16-byte aligned, as the amax kernels' buffers are).
_AMAX_BYTES = 32


def _amax_region(saved: torch.Tensor) -> torch.Tensor:
    """The saved buffer's amaxes as float32 [8] (:func:`_saved_layout`): ``[0:2]`` the X pair's amax
    buffer, ``[4:6]`` the W pair's."""
    return saved[saved.numel() - _PACK_ALIGN:][:_AMAX_BYTES].view(torch.float32)


def _in_buffer(buf: torch.Tensor, off: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` at byte ``off`` of the uint8 buffer (a view)."""
    return buf[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def _fprop_packed(state: _LayerState, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  need_dgrad: bool, need_wgrad: bool,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_fprop` with plain tensors out: Y and one uint8 buffer holding the saved Xᵀ and Wᵀ
    copies (:func:`_saved_layout`; a copy not needed takes no bytes). What the custom op and the
    graphs carry. ``out``: (Y, buffer) to write into (the layer's graphs), or None for new ones; the
    buffer must be a previous result of this function for these shapes (its padding bytes zero)."""
    out_y, saved = out if out is not None else (None, None)
    layout, size = _saved_layout(state.saved_format, x2d.shape[0], x2d.shape[1], weight.shape[0], need_dgrad,
                                 need_wgrad)
    if saved is None:
        saved = torch.empty(size, dtype=torch.uint8, device=x2d.device)
        spans = sorted((off, off + math.prod(shape) * dtype.itemsize) for off, shape, dtype in layout)
        for (_, end), start in zip(spans, [off for off, _ in spans[1:]] + [size]):
            if start > end:
                saved[end:start].zero_()   # padding bytes defined: reproducible
    views = [_in_buffer(saved, off, shape, dtype) for off, shape, dtype in layout]
    values_t = views[6].t() if views[6].numel() else None   # Wᵀ's values [K, N]
    # the amax kernels accumulate straight into the buffer: one fill for both pairs, no copies
    amaxes = _amax_region(saved).zero_()
    # the kernels write the copies straight into the buffer; any other path's copies are copied in
    out_xt = tuple(views[0:3]) if views[0].numel() else None
    out_wt = (tuple(views[3:6]) + ((values_t,) if values_t is not None else ())) if views[3].numel() else None
    with torch.autocast(device_type=x2d.device.type, enabled=False):
        y, qxt, qwt = _fprop(state, x2d, weight, bias, need_dgrad, need_wgrad, out_y, (out_xt, out_wt),
                             (amaxes[0:2], amaxes[4:6]))
    parts = [t for q in (qxt, qwt) for t in ((q.data, q.scale, q.amax) if q is not None else (None,) * 3)]
    if values_t is not None and qwt is not None:
        parts.append(qwt.block_values(torch.bfloat16))
        views[6] = values_t
    for t, view in zip(parts, views):
        if t is not None and t.numel() and t.data_ptr() != view.data_ptr():
            view.copy_(t)
    if out_y is not None and y is not out_y:   # a path that made its own Y (e.g. no tokens)
        y = out_y.copy_(y)
    return y, saved


def _bprop_packed(state: _LayerState, dy: torch.Tensor, saved: torch.Tensor, K: int, x_dtype: torch.dtype,
                  w_dtype: torch.dtype, bias_dtype: torch.dtype, saved_dgrad: bool, saved_wgrad: bool,
                  need_dgrad: bool, need_wgrad: bool, need_dbias: bool,
                  out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_bprop` from :func:`_fprop_packed`'s buffer (``saved_dgrad`` / ``saved_wgrad``: the
    forward's flags, which say what it holds): (dX, dW, db), empty where not needed. ``out``:
    (dX, dW, db) to write into (the layer's graphs), or None for new ones."""
    M, N = dy.shape
    layout, _ = _saved_layout(state.saved_format, M, K, N, saved_dgrad, saved_wgrad)
    parts = [_in_buffer(saved, off, shape, dtype) for off, shape, dtype in layout]
    (kx, mx), (kw, nw) = _copy_shapes(state.saved_format, M, K, N)
    qxt = _unflat(state, *parts[:3], "input_columnwise", (kx, mx), x_dtype)
    qwt = _unflat(state, *parts[3:6], "weight_columnwise", (kw, nw), w_dtype,
                  values=parts[6].t() if parts[6].numel() else None)
    with torch.autocast(device_type=dy.device.type, enabled=False):
        dx, dw, db = _bprop(state, dy, qxt, qwt, K, x_dtype, w_dtype, bias_dtype, need_dgrad, need_wgrad, need_dbias,
                            None if out is None else out[:2])
    empty = lambda dtype: torch.empty(0, dtype=dtype, device=dy.device)  # noqa: E731
    grads = (dx if dx is not None else empty(x_dtype), dw if dw is not None else empty(w_dtype),
             db if db is not None else empty(bias_dtype))
    if out is None:
        return grads
    return tuple(g if g is o else o.copy_(g) for o, g in zip(out, grads))   # into the given ones


#: The CUDA graphs of eager layer calls (``KernelOptions.layer_graphs``), shared by layers whose
#: recipe and shapes agree; ``LAYER_GRAPHS.clear()`` frees them.
LAYER_GRAPHS = GraphedCalls()


def _graph_stream(state: _LayerState, x2d: torch.Tensor) -> SRStream | None:
    """The SR stream a graph of this layer call would advance, or None where the call must run
    directly: off the GPU, graphs off, inside someone's capture, a quantizer other than the
    default, a precision switch, a ``torch.Generator``
    (its offset lives on the host), GEMM operands being recorded, or a tensor on another GPU than
    the current one (whose stream a replay would use)."""
    if not (x2d.is_cuda and x2d.shape[0] > 0 and kernels.options().layer_graphs) or _OBSERVERS \
            or state.high_precision or type(state.quantizer) is not NVFP4GemmQuantizer:
        return None
    device = x2d.device
    # (torch.cuda.current_device() and is_current_stream_capturing() without their Python wrappers:
    # this runs on every eager call, before its first kernel)
    if device.index != torch._C._cuda_getDevice() or torch._C._cuda_isCurrentStreamCapturing():
        return None
    gen = state.sr_generator(device)
    return gen if isinstance(gen, SRStream) else None


def _covered(state: _LayerState, x2d: torch.Tensor, row: str, col: str, need_col: bool) -> bool:
    """Whether the kernels quantize this operand's pair (else the layer looks for NaN on the host,
    which no graph can hold)."""
    opts = state.recipe.quantize_options
    return pair_uses_kernels(x2d, opts(row), opts(col) if need_col else None)


def _drawing_from(state: _LayerState, streams: tuple) -> _LayerState:
    """``state`` with its SR draws taken from ``streams[0]`` (a graph's private twin of its stream)."""
    if state.sr_generator(streams[0].device) is streams[0]:
        return state
    return replace(state, generator=streams[0], _streams={})


def _run_fprop(state: _LayerState, stream: SRStream | None, x2d, weight, bias, need_dgrad: bool,
               need_wgrad: bool) -> tuple[torch.Tensor, ...]:
    """:func:`_fprop_packed`, from a CUDA graph where ``stream`` (:func:`_graph_stream`) is not None
    (bit-identical)."""
    if stream is None or not (need_dgrad or need_wgrad):   # inference: shapes vary, launches are fewer
        return _fprop_packed(state, x2d, weight, bias, need_dgrad, need_wgrad)
    while _GONE:   # the graphs of deleted layers, and the outputs they keep
        key = _GONE.pop()
        LAYER_GRAPHS.forget(("fprop", key))
        LAYER_GRAPHS.forget(("bprop", key))
    opts = kernels.options()
    return LAYER_GRAPHS(lambda x, w, b, streams, out=None: _fprop_packed(_drawing_from(state, streams), x, w, b,
                                                                         need_dgrad, need_wgrad, out),
                        ("fprop", state.recipe, id(opts), need_dgrad, need_wgrad), (x2d, weight, bias),
                        streams=(stream,), keep=(opts,),
                        owner=("fprop", state.key) if opts.layer_graphs_owned_outputs else None,
                        steady=(0, 1, 2),   # x, the weight and the bias, read where they are while they stay
                        eligible=lambda: _covered(state, x2d, "input_rowwise", "input_columnwise", need_wgrad)
                        and _covered(state, weight, "weight", "weight_columnwise", need_dgrad))


def _run_bprop(state: _LayerState, stream: SRStream | None, dy, saved,
               *rest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_bprop_packed` (``rest``: its arguments after ``saved``), from a CUDA graph where
    ``stream`` (:func:`_graph_stream`) is not None (bit-identical)."""
    need_dgrad, need_wgrad = rest[6], rest[7]
    if stream is None or not (need_dgrad or need_wgrad):
        return _bprop_packed(state, dy, saved, *rest)
    opts = kernels.options()
    return LAYER_GRAPHS(lambda g, buf, streams, out=None: _bprop_packed(_drawing_from(state, streams), g, buf, *rest,
                                                                        out=out),
                        ("bprop", state.recipe, id(opts), *rest), (dy, saved), streams=(stream,), keep=(opts,),
                        owner=("bprop", state.key) if opts.layer_graphs_owned_outputs else None,
                        steady=(0, 1),   # dY, and the saved copies (the forward's graph's own buffer)
                        eligible=lambda: _covered(state, dy, "grad_output_rowwise", "grad_output_columnwise", need_wgrad))


# The two ops are defined with torch.library's define / impl / register_fake / register_autograd,
# the calls that the @torch.library.custom_op decorator makes itself, without the wrapper it puts
# around the implementation (a torch._dynamo.disable frame and an output aliasing check on every
# call): host time that a compiled model pays twice per layer and step (the two no-op rows of
# benchmarks/host_breakdown.py). Our outputs never alias the inputs (fresh tensors, or buffers of
# the layer's own CUDA graphs).
_OPS = torch.library.Library("nvfp4lab", "FRAGMENT")
torch.library.define("nvfp4lab::linear_fprop",
                     "(Tensor x2d, Tensor weight, Tensor? bias, SymInt key, SymInt saved_code, bool need_dgrad, "
                     "bool need_wgrad) -> (Tensor, Tensor)", lib=_OPS, tags=(torch.Tag.pt2_compliant_tag,))
torch.library.define("nvfp4lab::linear_bprop",
                     "(Tensor dy, Tensor saved, SymInt key, SymInt K, ScalarType x_dtype, ScalarType w_dtype, "
                     "ScalarType bias_dtype, bool saved_dgrad, bool saved_wgrad, bool need_dgrad, bool need_wgrad, "
                     "bool need_dbias) -> (Tensor, Tensor, Tensor)", lib=_OPS, tags=(torch.Tag.pt2_compliant_tag,))


@torch.library.impl("nvfp4lab::linear_fprop", "default", lib=_OPS)
def _linear_fprop_op(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int,
                     saved_code: int, need_dgrad: bool, need_wgrad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    state = _STATES[key]
    if saved_code != state.saved_code:   # a graph traced for another recipe (Dynamo guards against it)
        raise RuntimeError(f"nvfp4lab::linear_fprop was traced for saved-buffer format {saved_code}, the layer "
                           f"{state.name or key} now has {state.saved_code} ({state.saved_format})")
    return _run_fprop(state, _graph_stream(state, x2d), x2d, weight, bias, need_dgrad, need_wgrad)


@torch.library.register_fake("nvfp4lab::linear_fprop", lib=_OPS)
def _(x2d, weight, bias, key, saved_code, need_dgrad, need_wgrad):
    # from the format alone: the key may be a symbolic int here, which names no layer (_SavedFormat)
    _, size = _saved_layout(_SavedFormat.from_code(saved_code), x2d.shape[0], x2d.shape[1], weight.shape[0],
                            need_dgrad, need_wgrad)
    return x2d.new_empty((x2d.shape[0], weight.shape[0])), torch.empty(size, dtype=torch.uint8, device=x2d.device)


def _unflat(state: _LayerState, data, scale, amax, role: str, shape, dtype,
            values: torch.Tensor | None = None) -> NVFP4Tensor | None:
    if data.numel() == 0 and amax.dim() == 1:
        return None
    opts = state.recipe.quantize_options(role)
    return NVFP4Tensor(data=data, scale=scale, amax=amax, shape=torch.Size(shape), block=opts["block"], dtype=dtype,
                       values_bf16=values,
                       rht=opts["rht"], rounding=opts["rounding"],
                       four_over_six=opts.get("four_over_six", False), e4m3_max=opts.get("e4m3_max", 448),
                       rht_signs=torch.as_tensor(opts.get("rht_signs", WGRAD_SIGNS), dtype=torch.float32)
                       if opts["rht"] else None)


@torch.library.impl("nvfp4lab::linear_bprop", "default", lib=_OPS)
def _linear_bprop_op(dy: torch.Tensor, saved: torch.Tensor, key: int, K: int, x_dtype: torch.dtype,
                     w_dtype: torch.dtype, bias_dtype: torch.dtype, saved_dgrad: bool, saved_wgrad: bool,
                     need_dgrad: bool, need_wgrad: bool, need_dbias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    state = _STATES[key]
    return _run_bprop(state, _graph_stream(state, dy), dy, saved, K, x_dtype, w_dtype, bias_dtype, saved_dgrad,
                      saved_wgrad, need_dgrad, need_wgrad, need_dbias)


@torch.library.register_fake("nvfp4lab::linear_bprop", lib=_OPS)
def _(dy, saved, key, K, x_dtype, w_dtype, bias_dtype, saved_dgrad, saved_wgrad, need_dgrad, need_wgrad, need_dbias):
    M, N = dy.shape
    dev = dy.device
    return (torch.empty((M, K) if need_dgrad else (0,), dtype=x_dtype, device=dev),
            torch.empty((N, K) if need_wgrad else (0,), dtype=w_dtype, device=dev),
            torch.empty((N,) if need_dbias else (0,), dtype=bias_dtype, device=dev))


def _needed(grads, needs) -> tuple:
    """(dX, dW, db) of :func:`_bprop_packed` with None for those not needed (its empty tensors)."""
    return tuple(g if need else None for g, need in zip(grads, needs))


def _fprop_setup_context(ctx, inputs, output):
    x2d, weight, bias, key, _, need_dgrad, need_wgrad = inputs
    ctx.save_for_backward(output[1])
    ctx.key, ctx.K, ctx.saved_for = key, x2d.shape[1], (need_dgrad, need_wgrad)
    ctx.dtypes = (x2d.dtype, weight.dtype, bias.dtype if bias is not None else weight.dtype)


def _fprop_backward(ctx, gy, *_saved_grads):
    need_dgrad, need_wgrad, need_dbias = ctx.needs_input_grad[:3]
    grads = torch.ops.nvfp4lab.linear_bprop(gy, *ctx.saved_tensors, ctx.key, ctx.K, *ctx.dtypes, *ctx.saved_for,
                                            need_dgrad, need_wgrad, need_dbias)
    return (*_needed(grads, (need_dgrad, need_wgrad, need_dbias)), None, None, None, None)


torch.library.register_autograd("nvfp4lab::linear_fprop", _fprop_backward, setup_context=_fprop_setup_context,
                                lib=_OPS)


def _switched_forward(x, weight, bias, state: _LayerState, grad_enabled: bool):
    """The layer with some GEMMs switched to high precision, always through the eager autograd
    function (under ``torch.compile`` a graph break here: switches are rare, late and brief)."""
    return _NVFP4LinearFunction.apply(x, weight, bias, state, grad_enabled)


_SWITCHED: list = []   # [torch.compiler.disable(_switched_forward)], made with the first layer: the
                       # decorator imports torch._dynamo (and Triton), which importing nvfp4lab must not


# ----------------------------------------------------------------------------- the module
class NVFP4Linear(nn.Linear):
    """Drop-in ``nn.Linear`` (bias supported) whose Fprop, Dgrad and Wgrad GEMMs are emulated NVFP4.

    Input ``[..., in_features]`` of a floating dtype; output ``[..., out_features]`` in the input's
    dtype (the autocast dtype under ``torch.autocast``). ``quantize_enabled = False`` makes the
    layer a plain ``nn.Linear`` (the BF16 cooldown of the paper's appendix D).

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        recipe: :class:`~nvfp4lab.recipe.NVFP4Recipe` (default: TE's defaults, RHT + SR + 2D).
        generator: the random source of stochastic rounding of gradients, on the device of the
            activations: an :class:`~nvfp4lab.rounding.SRStream` (capturable in CUDA graphs with
            no registration) or a ``torch.Generator``. Default: an ``SRStream`` per device seeded
            with ``seed`` (lazily created). Give every layer the same stream, seeded from the
            training seed, and save its state in checkpoints, for bit-identical resumes (what
            :func:`nvfp4lab.train` does).
        seed: seed of the default stream (ignored when ``generator`` is given).
        quantizer: a :class:`GemmQuantizer`; default :class:`NVFP4GemmQuantizer`.
        name: label used in :class:`GemmOperand` records.

    Raises:
        ValueError: the input's last dimension is not ``in_features``.
        TypeError: a non-floating input; a ``recipe`` that is not an :class:`NVFP4Recipe` or a
            ``generator`` that is neither a ``torch.Generator`` nor an :class:`SRStream` (also when
            assigned to the ``recipe`` / ``generator`` attributes later).
        NotImplementedError: a recipe with ``backward_override`` set (the layer's backward GEMMs
            are always quantized; TE's backend emulates it), also when assigned later.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, recipe: NVFP4Recipe | None = None,
                 generator: "torch.Generator | SRStream | None" = None, seed: int = 0,
                 quantizer: GemmQuantizer | None = None, name: str = "") -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(recipe, generator, seed, quantizer, name)

    @staticmethod
    def _check_recipe(recipe: Any) -> None:
        """What the constructor and the ``recipe`` setter accept: an :class:`NVFP4Recipe` this layer emulates."""
        if not isinstance(recipe, NVFP4Recipe):
            raise TypeError(f"recipe must be an NVFP4Recipe, got {type(recipe).__name__}")
        if recipe.backward_override is not None:
            raise NotImplementedError(
                f"NVFP4Recipe.backward_override={recipe.backward_override!r} is not emulated by NVFP4Linear "
                "(its backward GEMMs are always quantized); use backward_override=None, or TE's backend")

    @staticmethod
    def _check_generator(generator: Any) -> None:
        if generator is not None and not isinstance(generator, (torch.Generator, SRStream)):
            raise TypeError(f"generator must be a torch.Generator, an SRStream or None, got {type(generator).__name__}")

    def _setup(self, recipe, generator, seed, quantizer, name) -> None:
        recipe = NVFP4Recipe() if recipe is None else recipe
        self._check_recipe(recipe)
        self._check_generator(generator)
        self._state = _LayerState(recipe=recipe,
                                  quantizer=quantizer if quantizer is not None else NVFP4GemmQuantizer(),
                                  name=name, generator=generator, seed=seed)
        self.quantize_enabled = True
        self._state.sr_generator(self.weight.device)  # made now, not inside someone's CUDA graph capture
        if not _SWITCHED:
            _SWITCHED.append(torch.compiler.disable(_switched_forward))

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        # .to() / .cuda(): the default SR stream follows the weight, made outside any capture (a
        # tensor first allocated inside a captured region would belong to the graph's memory pool)
        self._state.sr_generator(self.weight.device)
        return out

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: NVFP4Recipe | None = None,
                    generator: "torch.Generator | SRStream | None" = None, seed: int = 0,
                    quantizer: GemmQuantizer | None = None, name: str = "") -> "NVFP4Linear":
        """Wrap an existing ``nn.Linear``, sharing (not copying) its ``weight`` and ``bias``."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._setup(recipe, generator, seed, quantizer, name)
        return new

    @property
    def recipe(self) -> NVFP4Recipe:
        return self._state.recipe

    @recipe.setter
    def recipe(self, value: NVFP4Recipe) -> None:
        self._check_recipe(value)
        self._state.recipe = value

    @property
    def generator(self) -> "torch.Generator | SRStream | None":
        return self._state.generator

    @generator.setter
    def generator(self, value: "torch.Generator | SRStream | None") -> None:
        self._check_generator(value)
        self._state.generator = value

    @property
    def quantizer(self) -> GemmQuantizer:
        return self._state.quantizer

    @quantizer.setter
    def quantizer(self, value: GemmQuantizer) -> None:
        self._state.quantizer = value

    @property
    def name(self) -> str:
        return self._state.name

    @name.setter
    def name(self, value: str) -> None:
        self._state.name = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_floating_point(x):
            raise TypeError(f"NVFP4Linear expects a floating-point input, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear({self.in_features} -> {self.out_features}) expects input "
                             f"[..., {self.in_features}], got {tuple(x.shape)}")
        if not self.quantize_enabled:
            return F.linear(x, self.weight, self.bias)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if self._state.high_precision:  # a switch by scope (cooldown): the eager autograd function
            return _SWITCHED[0](x, self.weight, self.bias, self._state, torch.is_grad_enabled())
        if torch.compiler.is_compiling():  # the custom ops: one opaque node for Dynamo, same numerics
            grad = torch.is_grad_enabled()
            y = torch.ops.nvfp4lab.linear_fprop(x.reshape(-1, self.in_features), self.weight, self.bias,
                                                self._state.key, self._state.saved_code, grad and x.requires_grad,
                                                grad and self.weight.requires_grad)[0]
            return y.reshape(*x.shape[:-1], self.out_features)
        return _NVFP4LinearFunction.apply(x, self.weight, self.bias, self._state, torch.is_grad_enabled())

    def sr_streams(self) -> list[SRStream]:
        """The layer's own SR streams (one per device it has run on); empty when it draws from a
        ``generator`` given to it (a shared one, as in training)."""
        return list(self._state._streams.values()) if self._state.generator is None else []

    def extra_repr(self) -> str:
        on = "" if self.quantize_enabled else " (disabled)"
        return f"{super().extra_repr()}, nvfp4=[{self.recipe.describe()}]{on}"


# ----------------------------------------------------------------------------- model conversion
#: Default pattern for "this linear belongs to transformer block i": ``blocks.3.``, ``h.3.``,
#: ``layers.3.`` (nanoGPT, HF GPT-2, Llama naming).


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


#: The emulated layer of each block-scaled / delayed-scaling precision (its ``recipe_class`` is the
#: recipe :func:`convert_model` accepts as ``block_recipe``).
EMULATED_LAYERS: dict[str, type[EmulatedLinear]] = {
    "fp8-delayed": DelayedScalingLinear, "fp8-block": FP8BlockLinear, "mxfp8": MXFP8Linear,
    "mxfp4": MXFP4Linear,
}


def block_recipe_for(precision: str, data: Any = None) -> Any:
    """The recipe of an :data:`EMULATED_LAYERS` precision built from plain data (``to_dict()`` form,
    a recipe object, or ``None`` for the defaults): :class:`~nvfp4lab.fp8_recipes.DelayedScalingRecipe`,
    :class:`~nvfp4lab.fp8_recipes.FP8BlockRecipe`, :class:`~nvfp4lab.mx.MXFP8Recipe` or
    :class:`~nvfp4lab.mx.MXFP4Recipe`.

    Raises:
        ValueError: ``precision`` has no such recipe (the message lists those that do), or a field
            is unknown or invalid (named by the recipe's validation).
    """
    name = canonical_name(precision)
    if name not in EMULATED_LAYERS:
        raise ValueError(f"precision {precision!r} has no block/delayed-scaling recipe; "
                         f"those that do: {', '.join(EMULATED_LAYERS)}")
    return EMULATED_LAYERS[name].recipe_class.from_dict(data)


def convert_model(model: nn.Module, precision: str, recipe: NVFP4Recipe | None = None, *,
                  fp8_recipe: FP8Recipe | None = None, generator: "torch.Generator | SRStream | None" = None,
                  seed: int = 0, quantizer: GemmQuantizer | None = None,
                  block_pattern: str = DEFAULT_BLOCK_PATTERN, block_recipe: Any = None) -> nn.Module:
    """Swap the chosen ``nn.Linear`` layers of ``model`` (in place) for the given precision.

    Parameters are shared with the original layers, so weight tying survives and the
    ``state_dict`` keys do not change: checkpoints are interchangeable across precisions.
    Layers that are already NVFP4/FP8 are converted back to their high-precision view first.
    Which layers are quantized is :func:`nvfp4lab.recipe.layer_is_quantized`.

    Args:
        model: the model, changed in place and returned.
        precision: ``"fp32"`` / ``"bf16"``: nothing is swapped (BF16 is the trainer's autocast).
            ``"nvfp4"``: linear layers inside transformer blocks become :class:`NVFP4Linear`,
            except those in the recipe's first ``bf16_first_layers`` and last
            ``bf16_last_layers`` blocks; linear layers outside the blocks (the LM head) only if
            ``recipe.quantize_lm_head``. ``"fp8"`` / ``"fp8-current"``: every linear layer
            inside the blocks becomes an :class:`~nvfp4lab.fp8.FP8Linear` (TE's FP8 recipes
            quantize every ``te.Linear``; the head, plain torch in a TE model, stays high
            precision); ``recipe`` is ignored. ``"fp8-delayed"``, ``"fp8-block"``, ``"mxfp8"``,
            ``"mxfp4"``: the same layers become the :data:`EMULATED_LAYERS` class
            (:class:`~nvfp4lab.fp8_recipes.DelayedScalingLinear`,
            :class:`~nvfp4lab.fp8_recipes.FP8BlockLinear`, :class:`~nvfp4lab.mx.MXFP8Linear`,
            :class:`~nvfp4lab.mx.MXFP4Linear`) with ``block_recipe``.
        recipe: the NVFP4 recipe (default ``NVFP4Recipe()``).
        fp8_recipe: the FP8 current-scaling recipe (default ``FP8Recipe()``).
        generator, seed: SR generator shared by all NVFP4 layers. Default: each layer lazily
            creates its own generator on the activations' device, seeded with ``seed + i`` for
            the i-th linear layer of the model (distinct, reproducible streams).
        quantizer: the :class:`GemmQuantizer` of every NVFP4 layer (default
            :class:`NVFP4GemmQuantizer`).
        block_pattern: regex whose group 1 is the block index in a module name.
        block_recipe: the recipe of fp8-delayed / fp8-block / mxfp8 / mxfp4 (default: that
            precision's recipe class with TE's defaults; see :func:`block_recipe_for`).

    Returns:
        ``model``.

    Raises:
        ValueError: an unknown precision, a model without numbered blocks (for the quantized
            precisions), a recipe whose layer selection does not fit the model
            (:meth:`NVFP4Recipe.check_num_blocks`), a ``block_recipe`` of another class, or (MX
            formats) a quantized layer whose feature sizes are not multiples of 32 (the message
            names the layer and the size).
        TypeError: (NVFP4) a ``recipe`` that is not an :class:`NVFP4Recipe`, or a ``generator``
            that is neither a ``torch.Generator`` nor an :class:`SRStream`.
        NotImplementedError: (NVFP4) a recipe with ``backward_override`` set.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
    # Undo an earlier conversion so that conversions compose.
    for name, layer in _linear_layers(model):
        if isinstance(layer, (NVFP4Linear, FP8Linear, EmulatedLinear)):
            plain = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(plain)
            plain.in_features, plain.out_features = layer.in_features, layer.out_features
            plain.weight, plain.bias = layer.weight, layer.bias
            _set_module(model, name, plain)
    if precision in ("fp32", "bf16"):
        return model

    layers = _linear_layers(model)
    indices = sorted({b for name, _ in layers if (b := block_index(name, block_pattern)) is not None})
    if not indices:
        raise ValueError(f"no transformer blocks found in the model (no linear layer name matches "
                         f"{block_pattern!r}); pass block_pattern=")
    num_blocks = indices[-1] + 1

    if canonical_name(precision) == "fp8-current":
        fp8_recipe = fp8_recipe if fp8_recipe is not None else FP8Recipe()
        for name, layer in layers:
            if layer_is_quantized(name, precision, num_blocks, block_pattern=block_pattern):
                _set_module(model, name, FP8Linear.from_linear(layer, recipe=fp8_recipe))
        return model
    if canonical_name(precision) in EMULATED_LAYERS:
        cls = EMULATED_LAYERS[canonical_name(precision)]
        for name, layer in layers:
            if layer_is_quantized(name, precision, num_blocks, block_pattern=block_pattern):
                try:
                    _set_module(model, name, cls.from_linear(layer, recipe=block_recipe))
                except ValueError as e:
                    raise ValueError(f"layer {name!r}: {e}") from e
        return model

    recipe = recipe if recipe is not None else NVFP4Recipe()
    NVFP4Linear._check_recipe(recipe)
    NVFP4Linear._check_generator(generator)
    recipe.check_num_blocks(num_blocks)
    for i, (name, layer) in enumerate(layers):
        if layer_is_quantized(name, precision, num_blocks, recipe, block_pattern=block_pattern):
            # without a shared generator, layer i gets its own stream seeded with seed + i
            _set_module(model, name, NVFP4Linear.from_linear(
                layer, recipe=recipe, generator=generator, seed=seed + i, quantizer=quantizer, name=name))
    return model


def set_quantization_enabled(model: nn.Module, enabled: bool) -> int:
    """Switch every NVFP4/FP8 layer of ``model`` on or off (off = plain high-precision Linear).

    Used for the BF16 cooldown. Returns the number of layers switched.
    """
    n = 0
    for m in model.modules():
        if isinstance(m, (NVFP4Linear, FP8Linear, EmulatedLinear)):
            m.quantize_enabled = bool(enabled)
            n += 1
    return n


#: Precision-switch scopes: which GEMMs of every NVFP4 layer a switch runs in high precision.
SWITCH_SCOPES: dict[str, frozenset] = {
    "none": frozenset(),
    "fprop": frozenset({"fprop"}),
    "bwd": frozenset({"dgrad", "wgrad"}),
    "all": frozenset({"fprop", "dgrad", "wgrad"}),
}


def set_high_precision_scope(model: nn.Module, scope: str) -> int:
    """Run the GEMMs named by ``scope`` of every quantized layer in high precision (the precision
    switch of the paper's appendix D: switching the forward GEMMs only recovers most of the loss
    gap, switching the backward only does not).

    Args:
        model: a model with :class:`NVFP4Linear` / :class:`~nvfp4lab.fp8.FP8Linear` layers.
        scope: ``"none"`` (all quantized), ``"fprop"`` (the forward GEMM), ``"bwd"`` (Dgrad and
            Wgrad) or ``"all"`` (the layer becomes a plain high-precision ``nn.Linear``, as
            :func:`set_quantization_enabled` ``(model, False)``).

    Returns:
        The number of layers switched.

    Raises:
        ValueError: an unknown scope, or ``"fprop"``/``"bwd"`` on a model with FP8 layers (their
            emulation switches whole layers only).
    """
    if scope not in SWITCH_SCOPES:
        raise ValueError(f"unknown switch scope {scope!r}; choose one of {list(SWITCH_SCOPES)}")
    gemms = SWITCH_SCOPES[scope]
    n = 0
    for m in model.modules():
        if isinstance(m, FP8Linear):
            if scope in ("fprop", "bwd"):
                raise ValueError(f"switch scope {scope!r} is implemented for NVFP4 layers; FP8 layers switch "
                                 "whole (scope 'all')")
            m.quantize_enabled = scope != "all"
            n += 1
        elif isinstance(m, NVFP4Linear):
            m.quantize_enabled = scope != "all"
            m._state.high_precision = gemms if scope != "all" else frozenset()
            n += 1
    return n


def layer_precisions(model: nn.Module) -> dict[str, str]:
    """``{linear layer name: "nvfp4" | "fp8" | "mxfp4" | "high"}`` (disabled layers count as "high").

    Every FP8 layer (current, delayed, block scaling, MXFP8) is ``"fp8"``."""
    out = {}
    for name, m in _linear_layers(model):
        if isinstance(m, NVFP4Linear) and m.quantize_enabled:
            out[name] = "nvfp4"
        elif isinstance(m, (FP8Linear, FP8BlockLinear, DelayedScalingLinear, MXFP8Linear)) and m.quantize_enabled:
            out[name] = "fp8"
        elif isinstance(m, MXFP4Linear) and m.quantize_enabled:
            out[name] = "mxfp4"
        else:
            out[name] = "high"
    return out
