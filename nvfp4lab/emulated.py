"""What the emulated FP8 block, delayed-scaling and MX recipes share: block-scaled tensors, the
GEMM, and one linear layer driven by a per-recipe quantization *scheme*.

A linear layer ``Y = X Wᵀ + b`` (X: [M tokens, K], W: [N, K]) runs three GEMMs, each written
``a @ bᵀ`` with both operands quantized along the contraction axis (the last one), as TE does
(``transformer_engine/pytorch/module/linear.py``)::

    GEMM    computes        a                          b
    Fprop   Y  = X Wᵀ       X   rowwise (along K)       W  rowwise (along K)
    Dgrad   dX = dY W       dY  rowwise (along N)       Wᵀ columnwise copy of W (along N)
    Wgrad   dW = dYᵀ X      dYᵀ columnwise copy (M)     Xᵀ columnwise copy of X (along M)

A scheme's :meth:`LinearScheme.quantize` returns both usages of a tensor from its high-precision
values (the columnwise copy is the transpose quantized *separately* along the other axis, unless
the scales make it an exact transpose: per-tensor scales and square 2-D tiles), as TE's quantizers
with ``rowwise=True, columnwise=True`` do. Input and weight are quantized in the forward pass,
grad_output in the backward pass; the bias gradient is the fp32 column sum of the unquantized dY.
Under ``torch.autocast`` the input is cast to the autocast dtype first and the GEMMs run with
autocast off.

The GEMM (:func:`scaled_matmul`) multiplies the dequantized operands in float64 and rounds the
result once to float32. With power-of-two scales (FP8 block's default, every MX format) a dequantized
element has at most 4 significant bits (E4M3; E5M2 3, E2M1 2) times a power of two, so every product
is exact in float64, and so is the sum unless its K terms span more than about ``2**(45 - log2 K)``
in magnitude (``2**33`` at K = 4096):
the result is then the exact GEMM rounded once, independent of accumulation order. With fp32 block
scales (``power_2_scale=False``) a dequantized element has up to 28 significant bits and the float64
products round. Hardware accumulates block partial sums in fp32 (cuBLASLt block-scaled GEMMs), so it
agrees up to its accumulation rounding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .formats import decode_e2m1

__all__ = [
    "BlockScaledTensor", "block_amax", "expand_blocks", "scaled_matmul", "LinearScheme",
    "EmulatedLinearFunction", "EmulatedLinear",
]


def _pad_to_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = x.shape
    pr, pc = (-rows) % block[0], (-cols) % block[1]
    return F.pad(x, (0, pc, 0, pr)) if pr or pc else x


def block_amax(x: torch.Tensor, block: tuple[int, int], *, ignore_nan: bool) -> torch.Tensor:
    """Per-block ``max|x|`` of a 2-D tensor, in float32.

    Args:
        x: ``[R, C]`` floating tensor. Partial blocks at the edges are zero-padded (zeros do not
            change a block's amax).
        block: ``(block_rows, block_cols)``, e.g. ``(1, 128)``, ``(128, 128)``, ``(1, 32)``.
        ignore_nan: treat NaN as 0, as CUDA's ``fmaxf`` reduction of TE's FP8 block and MXFP8
            kernels does; otherwise a NaN makes its block's amax NaN.

    Returns:
        float32 ``[ceil(R / block_rows), ceil(C / block_cols)]``.

    Raises:
        ValueError: ``x`` is not 2-D.
    """
    if x.dim() != 2:
        raise ValueError(f"block_amax needs a 2-D tensor, got shape {tuple(x.shape)}")
    a = x.to(torch.float32).abs()
    if ignore_nan:
        a = torch.nan_to_num(a, nan=0.0, posinf=float("inf"))
    a = _pad_to_blocks(a, block)
    br, bc = block
    r, c = a.shape
    return a.reshape(r // br, br, c // bc, bc).amax(dim=(1, 3))


def expand_blocks(per_block: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Repeat a ``[nR, nC]`` per-block tensor to one value per element and crop it to ``shape``."""
    return per_block.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


@dataclass
class BlockScaledTensor:
    """A 2-D block-scaled quantized tensor (FP8 blockwise, MXFP8 or MXFP4).

    Attributes:
        data: the elements, shape ``[R, C]``: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, or
            ``uint8`` E2M1 codes (0..15, one per byte, bit 3 the sign) when ``element == "e2m1"``.
        scale_inv: float32 ``[ceil(R / block_rows), ceil(C / block_cols)]``, the decode factor of each
            block: ``dequantize() = element value * scale_inv`` (TE's ``scale_inv``; for MX formats
            ``2**(scale_e8m0 - 127)``).
        block: ``(block_rows, block_cols)``; the quantization ran along the last axis for
            ``(1, n)`` blocks.
        element: ``"fp8"`` or ``"e2m1"``.
        scale_e8m0: for MX formats the ``uint8`` E8M0 codes of the scales (same shape as
            ``scale_inv``), else ``None``.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    element: str = "fp8"
    scale_e8m0: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def values(self) -> torch.Tensor:
        """The element values as float32 (exact), before scaling."""
        if self.element == "e2m1":
            return decode_e2m1(self.data)
        return self.data.to(torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``values * scale_inv`` per block, computed in float64 (exact) and cast to ``dtype``."""
        scale = expand_blocks(self.scale_inv.to(torch.float64), self.block, tuple(self.shape))
        return (self.values().to(torch.float64) * scale).to(dtype)

    def t(self) -> "BlockScaledTensor":
        """Exact transpose, for square blocks only (a 128x128 tile is its own transpose's tile).

        Raises:
            ValueError: the blocks are not square (a 1xN-block tensor's transpose is a different
                quantization: quantize the transposed source instead).
        """
        if self.block[0] != self.block[1]:
            raise ValueError(f"only square-block tensors transpose exactly; blocks are {self.block}")
        return BlockScaledTensor(self.data.t(), self.scale_inv.t(), self.block, self.element,
                                 None if self.scale_e8m0 is None else self.scale_e8m0.t())


def scaled_matmul(a: Any, b: Any, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ bᵀ`` of two quantized operands ``[M, K]`` and ``[N, K]`` -> ``[M, N]``.

    Each operand is dequantized exactly to float64 (``dequantize(torch.float64)``), multiplied in
    float64 and rounded once to float32 (then cast to ``out_dtype``). See the module docstring for
    why this equals the exact block-scaled GEMM for power-of-two scales.

    Raises:
        ValueError: the operands are not 2-D with a common last dimension.
    """
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_matmul needs [M, K] x [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    out = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    return out.to(torch.float32).to(out_dtype)


class LinearScheme:
    """How one recipe quantizes the operands of a linear layer's three GEMMs (a base class: the
    GEMM defaults to :func:`scaled_matmul` and the statistics hooks to nothing)."""

    def quantize(self, x: torch.Tensor, role: str, *, rowwise: bool = True,
                 columnwise: bool = True) -> tuple[Any, Any]:
        """``(rowwise, columnwise)`` of a 2-D ``x`` for ``role`` in ``"input"``, ``"weight"``,
        ``"grad"``: the rowwise operand is ``x`` quantized along its last axis, the columnwise one
        is ``xᵀ`` quantized along *its* last axis; an unrequested usage is ``None``."""
        raise NotImplementedError

    def matmul(self, a: Any, b: Any) -> torch.Tensor:
        """``a @ bᵀ`` in float32 (:func:`scaled_matmul`)."""
        return scaled_matmul(a, b)

    def after_forward(self) -> None:
        """Called once after each forward GEMM that recorded statistics (delayed scaling)."""

    def after_backward(self) -> None:
        """Called once after each backward pass (delayed scaling)."""


@contextlib.contextmanager
def _autocast_off(device_type: str):
    with torch.autocast(device_type=device_type, enabled=False):
        yield


class EmulatedLinearFunction(torch.autograd.Function):
    """``Y = X Wᵀ + b`` with the three GEMMs of the module docstring run through ``scheme``."""

    @staticmethod
    def forward(ctx, x, weight, bias, scheme: LinearScheme):  # type: ignore[override]
        in_features = weight.shape[1]
        x2d = x.reshape(-1, in_features)
        need_dx = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1]
        with _autocast_off(x.device.type):
            qx, qx_col = scheme.quantize(x2d, "input", columnwise=need_dw)
            qw, qw_col = scheme.quantize(weight, "weight", columnwise=need_dx)
            y = scheme.matmul(qx, qw)
            if bias is not None:
                y = y + bias.to(torch.float32)
        scheme.after_forward()
        ctx.scheme = scheme
        ctx.qx_col, ctx.qw_col = qx_col, qw_col
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.out_features = weight.shape[0]
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        scheme: LinearScheme = ctx.scheme
        dy = grad_out.reshape(-1, ctx.out_features)
        dx = dw = db = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with _autocast_off(grad_out.device.type):
            qdy, qdy_col = scheme.quantize(dy, "grad", rowwise=need_dx, columnwise=need_dw)
            if need_dx:
                dx = scheme.matmul(qdy, ctx.qw_col).to(ctx.x_dtype).reshape(ctx.x_shape)    # Dgrad
            if need_dw:
                dw = scheme.matmul(qdy_col, ctx.qx_col).to(ctx.w_dtype)                     # Wgrad
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy.to(torch.float32).sum(0).to(ctx.bias_dtype)
        scheme.after_backward()
        ctx.qx_col = ctx.qw_col = None
        return dx, dw, db, None


class EmulatedLinear(nn.Linear):
    """Base of the drop-in ``nn.Linear`` layers of the FP8 block, delayed-scaling and MX recipes.

    Subclasses set ``precision`` (a name of :mod:`nvfp4lab.precisions`), ``recipe_class`` and
    implement :meth:`scheme`. Parameters stay in their dtype (fp32 master weights) and are shared
    with the wrapped layer by :meth:`from_linear`. ``quantize_enabled = False`` makes the layer a
    plain ``nn.Linear``.

    Raises:
        ValueError: (forward) the input's last dimension is not ``in_features``; (construction) a
            recipe of the wrong class.
    """

    precision: str = ""
    recipe_class: type = object

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, recipe: Any = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.setup(recipe)

    def setup(self, recipe: Any) -> None:
        """Set the recipe (``None``: ``recipe_class()``), enable quantization and check the feature sizes;
        called by ``__init__`` and :meth:`from_linear` once the parameters exist. Subclasses extend it to
        create their state (buffers).

        Raises:
            ValueError: a recipe of another class, or feature sizes :meth:`check_shape` refuses.
        """
        recipe = self.recipe_class() if recipe is None else recipe
        if not isinstance(recipe, self.recipe_class):
            raise ValueError(f"{type(self).__name__} needs a {self.recipe_class.__name__} recipe, "
                             f"got {type(recipe).__name__}")
        self.recipe = recipe
        self.quantize_enabled = True
        self.check_shape(self.in_features, self.out_features)

    def check_shape(self, in_features: int, out_features: int) -> None:
        """Raise ``ValueError`` for feature sizes the recipe cannot quantize (default: none)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: Any = None) -> "EmulatedLinear":
        """Wrap an existing ``nn.Linear``, sharing (not copying) its parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.setup(recipe)
        return new

    def scheme(self) -> LinearScheme:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__} expects input [..., {self.in_features}], got {tuple(x.shape)}")
        if not self.quantize_enabled:
            return F.linear(x, self.weight, self.bias)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return EmulatedLinearFunction.apply(x, self.weight, self.bias, self.scheme())

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, {self.precision}"
                f"{'' if self.quantize_enabled else ' (disabled)'}")
