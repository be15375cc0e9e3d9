"""Per-layer quantization health: how well each NVFP4 GEMM operand is represented, during training.

Every ``health_interval`` steps, :func:`health_pass` runs one extra forward and backward pass of the
model on the step's batch with :func:`nvfp4lab.linear.capture_gemm_operands` on, and
:func:`operand_stats` measures each of the six operands of each quantized layer (Fprop X, W; Dgrad
dY, Wᵀ; Wgrad dYᵀ, Xᵀ) against the high-precision tensor it was quantized from:

=====================  ===========================================================================
stat                   meaning
=====================  ===========================================================================
``underflows%``        TE 2.20's ``LogNvfp4TensorStats`` stat of that name: (non-zero input
                       elements − non-zero E2M1 codes) / elements × 100: the share of the tensor
                       flushed to zero by quantization (``transformer_engine/debug/features/
                       log_nvfp4_tensor_stats.py``; counted here in the quantized domain, after the
                       RHT for the RHT'd Wgrad operands)
``mse``                TE's ``mse``: mean of (dequantized − input)², in the input's domain
``sqnr_db``            signal-to-quantization-noise ratio, 10·log10(Σx² / Σ(x̂ − x)²) (inf: exact)
``scale_zero%``        blocks holding a non-zero element whose E4M3 block scale underflowed to 0
                       (every element of such a block decodes to 0), per 100 blocks
``scale_saturated%``   blocks whose block scale is E4M3's largest value, 448 (the block's amax
                       reached 6·448/2688 of the per-tensor amax: the global scale's ceiling)
``amax``               the per-tensor amax (FP32; post-RHT for RHT'd operands)
=====================  ===========================================================================

The pass changes nothing in the run: gradients come from ``torch.autograd.grad`` (parameters'
``.grad`` untouched) and the stochastic-rounding sources are restored to their state before it.
Its cost is one more forward and backward pass plus the statistics, every ``health_interval``
steps (``health_time_s`` in ``run.json``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.nn as nn

from . import metrics
from .hadamard import random_hadamard_transform
from .linear import GemmOperand, NVFP4Linear, capture_gemm_operands
from .quantize import BLOCK_SIZE, NVFP4Tensor

__all__ = ["HEALTH_STATS", "HEALTH_NAME", "operand_stats", "health_pass", "sr_sources"]

#: The file of a run folder the training loop appends health records to (one JSON object per line).
HEALTH_NAME = "health.jsonl"

#: The statistics of :func:`operand_stats`, in order.
HEALTH_STATS = ("underflows%", "mse", "sqnr_db", "scale_zero%", "scale_saturated%", "amax")

_E4M3_MAX_BYTE = 0x7E  # 448


def operand_stats(source: torch.Tensor, q: NVFP4Tensor) -> dict[str, float]:
    """The :data:`HEALTH_STATS` of one quantized operand.

    Args:
        source: the high-precision tensor that was quantized, ``[..., K]`` (as recorded in
            :attr:`nvfp4lab.linear.GemmOperand.source`: before the RHT, after any transpose and
            padding).
        q: its :class:`~nvfp4lab.quantize.NVFP4Tensor`.

    Returns:
        ``{stat: float}`` for every name of :data:`HEALTH_STATS`.

    Raises:
        ValueError: ``source`` and ``q`` disagree in shape.
    """
    if tuple(source.shape) != tuple(q.shape):
        raise ValueError(f"operand_stats: source shape {tuple(source.shape)} != quantized shape {tuple(q.shape)}")
    x = source.detach().reshape(q.rows, q.cols).float()
    x_q = random_hadamard_transform(x, signs=q.rht_signs) if q.rht else x   # the quantized domain
    codes = q.codes()
    n = x.numel()
    nonzero_codes = int(((codes & 7) != 0).sum())
    underflows = 100.0 * (int(x_q.count_nonzero()) - nonzero_codes) / n if n else 0.0
    x_hat = q.dequantize(torch.float32).reshape(q.rows, q.cols)
    # block amax in the quantized domain, in the scale's layout (1x16 rows or 16x16 tiles)
    rows_p, cols_p = -(-q.rows // BLOCK_SIZE) * BLOCK_SIZE, -(-q.cols // BLOCK_SIZE) * BLOCK_SIZE
    xa = torch.nn.functional.pad(x_q.abs(), (0, cols_p - q.cols, 0, rows_p - q.rows))
    if q.block == "2d":
        bamax = xa.view(rows_p // 16, 16, cols_p // 16, 16).amax(dim=(1, 3))
    else:
        bamax = xa[: q.rows].view(q.rows, cols_p // 16, 16).amax(dim=-1)
    scale = q.scale.view(torch.uint8)[: bamax.shape[0], : bamax.shape[1]]
    live = bamax > 0
    nblocks = max(int(live.numel()), 1)
    return {
        "underflows%": underflows,
        "mse": metrics.mse(x, x_hat) if n else 0.0,
        "sqnr_db": metrics.sqnr_db(x, x_hat) if n else math.inf,
        "scale_zero%": 100.0 * int((live & (scale == 0)).sum()) / nblocks,
        "scale_saturated%": 100.0 * int((scale == _E4M3_MAX_BYTE).sum()) / nblocks,
        "amax": float(q.amax.max()) if q.amax.numel() else 0.0,   # row-scaled: the largest row amax
    }


def sr_sources(model: nn.Module) -> list[Any]:  # SRStream or torch.Generator
    """Every stochastic-rounding source (``SRStream`` or ``torch.Generator``) the NVFP4 layers of
    ``model`` draw from, each once."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        if isinstance(m, NVFP4Linear):
            srcs: Iterable[Any] = [m.generator] if m.generator is not None else m.sr_streams()
            for s in srcs:
                seen.setdefault(id(s), s)
    return list(seen.values())


def health_pass(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, autocast=None) -> list[dict[str, Any]]:
    """One side-effect-free forward and backward pass recording every quantized operand's health.

    Args:
        model: a model returning ``(logits, loss)`` from ``model(x, y)`` (:class:`nvfp4lab.model.GPT`)
            with :class:`~nvfp4lab.linear.NVFP4Linear` layers.
        x, y: one batch (token ids and targets).
        autocast: a context manager factory for the forward (the training step's autocast), or None.

    Returns:
        One record per quantized operand: ``{"layer", "gemm", "operand", **operand_stats}``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    states = [(s, s.get_state()) for s in sr_sources(model)]
    try:
        with capture_gemm_operands() as ops:
            ctx = autocast() if autocast is not None else torch.autocast("cpu", enabled=False)
            with ctx:
                _, loss = model(x, y)
            torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for s, st in states:
            s.set_state(st)
    return [_record(op) for op in ops if isinstance(op.tensor, NVFP4Tensor)]


def _record(op: GemmOperand) -> dict[str, Any]:
    return {"layer": op.layer, "gemm": op.gemm, "operand": op.operand, **operand_stats(op.source, op.tensor)}

