"""One training step's pieces: optimizer parameter groups, gradient clipping, the autocast of a
precision, and :class:`GraphedStep` (a step captured in a CUDA graph)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn

__all__ = ["param_groups", "clip_and_norm", "autocast_for", "GraphedStep", "GRAPH_WARMUP_STEPS"]

def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: matrices (``dim >= 2``) decay with ``weight_decay``; biases, norms
    and other vectors do not (nanoGPT's rule). Shared (tied) parameters appear once."""
    seen: set[int] = set()
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class GraphedStep:
    """Forward, backward and gradient clipping of a training step, captured once in a CUDA graph.

    The first call captures (on the inputs' shapes); every call copies ``x``, ``y`` into the
    graph's static inputs, replays, and returns the static ``(loss, grad_norm)`` tensors. With
    ``optimizer`` (fused AdamW with a device learning rate and a ``found_inf`` tensor) the update
    is captured too and skipped inside the graph when the loss or gradient norm is not finite. The
    parameters' ``.grad`` are then the graph's own tensors, rewritten by every replay: do not set
    them to ``None`` between steps. ``generators``: custom CUDA generators the step draws from
    (the SR generator), registered so that every replay draws fresh numbers. Kernels must have
    been compiled and lazy initialisations done by eager steps on a side stream first (what
    :func:`train` does), and the step must not synchronise with the host (NVFP4Linear's fused
    path does not). Raises whatever ``torch.cuda.graph`` raises on an uncapturable step.
    """

    def __init__(self, model: nn.Module, params: list[torch.nn.Parameter], precision: str,
                 device: torch.device, grad_clip: float, generators: tuple = (),
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model, self.params, self.precision, self.device = model, params, precision, device
        self.grad_clip, self.generators, self.optimizer = grad_clip, generators, optimizer
        if optimizer is not None and not isinstance(getattr(optimizer, "found_inf", None), torch.Tensor):
            raise ValueError("GraphedStep(optimizer=...) needs a fused optimizer with a found_inf tensor "
                             "(the update is skipped inside the graph on a non-finite loss or gradient)")
        self.graph: torch.cuda.CUDAGraph | None = None

    def _body(self, x: torch.Tensor, y: torch.Tensor):
        with autocast_for(self.precision, self.device, cache_enabled=False):
            _, loss = self.model(x, y)
        loss.backward()
        loss, norm = loss.detach(), clip_and_norm(self.params, self.grad_clip)
        if self.optimizer is not None:
            # found_inf = 1 makes the fused AdamW kernel skip the update and undo its step count,
            # exactly when the eager loop would skip or stop (torch.optim.adam._fused_adam)
            self.optimizer.found_inf.copy_((~torch.isfinite(loss) | ~torch.isfinite(norm)).float())
            self.optimizer.step()
        return loss, norm

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph is None:
            self.static_x, self.static_y = x.clone(), y.clone()
            for p in self.params:
                p.grad = None  # the capture allocates them from the graph's pool
            self.graph = torch.cuda.CUDAGraph()
            for g in self.generators:
                self.graph.register_generator_state(g)
            with torch.cuda.graph(self.graph):
                self.out = self._body(self.static_x, self.static_y)
        self.static_x.copy_(x)
        self.static_y.copy_(y)
        self.graph.replay()
        return self.out


def clip_and_norm(params: list[torch.nn.Parameter], grad_clip: float) -> torch.Tensor:
    """Clip the gradients to ``grad_clip`` (if > 0) and return their total norm (a 0-d tensor)."""
    if grad_clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, grad_clip)
    # get_total_norm reduces FSDP2's DTensor gradient shards too (the norm of the whole gradient)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


#: Eager steps (on a side stream) before a step is captured, and again after the BF16 cooldown.
GRAPH_WARMUP_STEPS = 3


def autocast_for(precision: str, device: torch.device, cache_enabled: bool = True):
    """The autocast around a step's forward pass: none for ``fp32``, BF16 ``torch.autocast`` for
    every other precision (the quantized layers run their own GEMMs inside it)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)
