"""Data-parallel training with PyTorch's own stack: process group, model wrapping, agreed decisions.

:func:`train` calls these when it runs under ``torchrun`` (``WORLD_SIZE > 1``); with one process
every helper is a no-op, so the loop has one body for both.

* **Process group.** :func:`setup` reads torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
  initialises ``torch.distributed`` with NCCL on CUDA and gloo on the CPU (:func:`backend_for`);
  each rank takes the GPU ``cuda:<LOCAL_RANK>``.
* **Model.** :func:`wrap_model` applies FSDP2 (``torch.distributed.fsdp.fully_shard``, each
  transformer block then the root; parameters become DTensor shards, so the FP32 master weights
  and the AdamW states built from them are sharded) or DDP (replicated). The mixed-precision
  policy gathers and reduces in FP32: every NVFP4Linear then sees, in its forward, the full
  FP32 weight the single-process layer sees (FSDP2 swaps the unsharded tensor in before the
  block runs), and autocast casts exactly where it casts in one process, so a rank computes
  what one process computes on the same rows. (A BF16 all-gather would halve the traffic but
  quantize BF16-rounded weights: another computation.)
* **Decisions.** A non-finite loss seen by one rank, the gradient-norm check and the BF16 cooldown
  switch are agreed through one all-reduce (:func:`agree_any`), so every rank takes the same
  branch and the collectives stay matched.
* **Stochastic rounding.** Rank ``r`` draws from its own stream, seeded from ``(seed, r)``
  (:func:`sr_seed`; rank 0's is the single-process seed).

Raises ``ValueError`` with one line naming the problem (bad torchrun variables, a device index
under several ranks, an unknown ``parallel`` mode).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["DistContext", "PARALLEL_MODES", "backend_for", "setup", "teardown", "wrap_model", "unwrap",
           "grad_sync", "agree_any", "mean_across", "gather_objects", "sr_seed", "barrier"]

#: ``TrainConfig.parallel`` values: how the model is spread over ranks when ``WORLD_SIZE > 1``.
PARALLEL_MODES = ("fsdp", "ddp")

_SR_SEED_OFFSET = 1_000_003   # the single-process SR seed is seed + this (rank 0 keeps it)
_SR_RANK_STRIDE = 7_919_000_003


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: ``rank`` of ``world_size`` (0 of 1 in one process).

    ``backend``: "nccl" / "gloo", or None in one process. ``owns_group``: :func:`setup` created
    the process group (and :func:`teardown` destroys it). ``device``: where this rank computes.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    """The collective backend of a device type: NCCL on CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer (set by torchrun)") from None


def setup(device: str | torch.device) -> DistContext:
    """Initialise the process group from torchrun's variables and pick this rank's device.

    Args:
        device: the configured device ("cpu", "cuda"). Under several ranks a bare "cuda" becomes
            ``cuda:<LOCAL_RANK>``.

    Returns:
        The :class:`DistContext`. Without ``WORLD_SIZE`` (or with 1) and no process group already
        initialised, the single-process context on ``device``. A process group initialised by
        the caller is used as it is (and left to the caller).

    Raises:
        ValueError: inconsistent ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, a device index
            (``cuda:1``) under several ranks (every rank would use the same GPU), or a CUDA rank whose
            ``LOCAL_RANK`` has no GPU of its own (more ranks per node than GPUs).
    """
    device = torch.device(device)
    if dist.is_available() and dist.is_initialized():
        rank, world, owns = dist.get_rank(), dist.get_world_size(), False
        local = _env_int("LOCAL_RANK", rank)
    else:
        world = _env_int("WORLD_SIZE", 1)
        rank, local, owns = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0), False
        if world < 1 or not 0 <= rank < world or local < 0:
            raise ValueError(f"torchrun variables are inconsistent: RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}")
        if world == 1:
            return DistContext(device=device)
    if device.type == "cuda":
        if device.index is not None and world > 1:
            raise ValueError(f"--device {device} names one GPU but {world} ranks run: use --device cuda "
                             "(rank r then takes cuda:<LOCAL_RANK>)")
        gpus = torch.cuda.device_count()
        if local >= gpus:
            raise ValueError(f"rank {rank} has LOCAL_RANK={local} but this machine has {gpus} GPU(s), one per rank: "
                             f"start at most {gpus} ranks per node (torchrun --nproc-per-node {gpus}), or train on "
                             "--device cpu (gloo)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = backend_for(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, **({"device_id": device} if device.type == "cuda" else {}))
        owns = True
    else:
        backend = dist.get_backend()
    return DistContext(rank=rank, world_size=world, local_rank=local, backend=backend, device=device,
                       owns_group=owns)


def teardown(ctx: DistContext) -> None:
    """Destroy the process group if :func:`setup` created it."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (no-op in one process)."""
    if ctx.distributed:
        dist.barrier()


def wrap_model(model: nn.Module, parallel: str, ctx: DistContext) -> nn.Module:
    """Spread ``model`` (a :class:`~nvfp4lab.model.GPT`, already converted and on its device) over the ranks.

    Args:
        model: the model; ``model.blocks`` are the units FSDP2 gathers one at a time.
        parallel: "fsdp" (``fully_shard`` per block, then the root, FP32 gather and reduce) or
            "ddp" (``DistributedDataParallel``).
        ctx: from :func:`setup`; in one process the model is returned unchanged.

    Returns:
        The wrapped model: with FSDP2 the same object (its parameters now DTensor shards), with
        DDP the ``DistributedDataParallel`` wrapper (:func:`unwrap` gives the model).

    Raises:
        ValueError: unknown ``parallel``.
    """
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {parallel!r}")
    if not ctx.distributed:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # the mesh on this run's device type: fully_shard's default mesh takes the machine's accelerator, and
    # on a GPU machine training on the CPU (gloo) it would move every rank to cuda:<LOCAL_RANK>
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)   # embeddings, final norm and (tied) head
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 and plain models are returned as they are)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within the block, reduce gradients across ranks in backward only if ``enabled``.

    Gradient accumulation: the micro-batches before the last accumulate locally (DDP's
    ``no_sync``; FSDP2's ``set_requires_gradient_sync(False)``), the last one reduces the sum.
    """
    if enabled:
        yield
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):   # an FSDP2 module
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def _reduce(value: float, ctx: DistContext, op) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def agree_any(flag: bool, ctx: DistContext) -> bool:
    """True on every rank when ``flag`` is true on at least one (one all-reduce; no-op in one process)."""
    if not ctx.distributed:
        return bool(flag)
    return _reduce(1.0 if flag else 0.0, ctx, dist.ReduceOp.MAX) > 0


def mean_across(value: float, ctx: DistContext) -> float:
    """The mean of ``value`` over the ranks (NaN or Inf on any rank gives a non-finite mean)."""
    if not ctx.distributed:
        return float(value)
    return _reduce(value, ctx, dist.ReduceOp.SUM) / ctx.world_size


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def sr_seed(seed: int, rank: int) -> int:
    """Seed of rank ``rank``'s stochastic-rounding stream: distinct per rank, a pure function of
    ``(seed, rank)``; rank 0's is the single-process one (``seed + 1_000_003``)."""
    return seed + _SR_SEED_OFFSET + rank * _SR_RANK_STRIDE
