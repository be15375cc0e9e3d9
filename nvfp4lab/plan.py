"""Memory planner: per-GPU bytes of training a transformer in BF16, FP8 or NVFP4.

:func:`plan` adds up, per GPU, the bytes of the model state (FP32 master weights, the BF16 copy
the GEMMs read, gradients, AdamW moments), the quantized weight copies each precision keeps, and
the activations saved for backward, for a :class:`ModelShape`, a sequence length, a micro-batch,
a world size and a sharding. It is an analytic model: allocator caching, cuBLAS/cuDNN
workspaces and fragmentation are not counted (``tests/test_plan.py`` reports the error against
measured peaks).

Rules and their sources:

* Weight copies. TE's FP8 GEMMs on Hopper are TN-only, so a ``Float8Tensor`` weight holds a
  rowwise copy (Fprop) and a transposed columnwise copy (Dgrad): TE 2.20
  ``transformer_engine/pytorch/tensor/float8_tensor.py`` (``_data`` and ``_transpose``). NVFP4 is
  TN-only too: ``transformer_engine/pytorch/tensor/nvfp4_tensor.py`` keeps ``_rowwise_data`` and
  ``_columnwise_data``, each 4 bits/element, with one E4M3 scale per 16 elements (4.5
  bits/element) and one FP32 amax per copy (NVFP4 paper, arXiv 2509.25149, §2 and §4.3; 2D
  16x16 weight blocks share a scale but TE stores it in the 1x16 layout). Without
  ``quantized_model_init`` the copies are made in each forward and saved for backward (so
  activation checkpointing drops them); with it they are resident parameters. MXFP8: one E8M0 scale
  per 32 elements per copy (``mxfp8_tensor.py``); FP8 block scaling: FP32 scales per 128x128
  weight tile (``float8_blockwise_tensor.py``). Scale-tensor padding is ignored.
* BF16 copy. Unless the model is built under TE's ``quantized_model_init`` (the weights then live
  only in their quantized form), the GEMMs read a BF16 copy of every FP32 master weight (autocast's
  weight cache, or FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``).
* Which layers are quantized: :class:`nvfp4lab.recipe.NVFP4Recipe` (first/last blocks and the LM
  head in BF16), used for every quantized precision here.
* FSDP2 (PyTorch docs, ``torch.distributed.fsdp.fully_shard``): parameters, gradients and
  optimizer states are sharded over the world size; one block's parameters (and its BF16
  gradient) are unsharded at a time. Activations do not depend on the world size.
* Activations saved for backward, per block: the inputs of the linear layers in the precision
  they are saved in (TE saves the quantized columnwise copy of X for Wgrad), the LayerNorm
  inputs, Q/K/V and the attention output (flash attention), and the GELU/SwiGLU inputs, in BF16.
  With activation checkpointing only the block inputs plus one block's worth. Logits: BF16 head
  output, its FP32 cast and the FP32 log-softmax the loss saves (``[B, T, vocab]`` each).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

from nvfp4lab.hardware import GPUS as HARDWARE_GPUS
from nvfp4lab.precisions import canonical_name
from nvfp4lab.recipe import NVFP4Recipe

__all__ = ["ModelShape", "MODEL_SHAPES", "GPUS", "MemoryPlan", "plan", "format_plan", "register",
           "weight_copy_bytes", "QUANTIZED_PRECISIONS", "SHARDINGS"]

#: GPU memory in bytes per GPU, keyed by a CLI name: the ``memory_gb`` of :mod:`nvfp4lab.hardware`'s rows
#: (NVIDIA's datasheets, decimal gigabytes as they print them; each row there names its source).
GPUS: dict[str, tuple[str, int]] = {
    _g.name.lower().replace(" sxm", ""): (f"{_g.name} {_g.memory_gb:.0f}GB", int(_g.memory_gb * 10**9))
    for _g in HARDWARE_GPUS
}

#: Precisions with quantized weight copies (names from :mod:`nvfp4lab.precisions`).
QUANTIZED_PRECISIONS = ("fp8-current", "fp8-delayed", "fp8-block", "mxfp8", "nvfp4")
SHARDINGS = ("none", "fsdp")


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder-only transformer.

    Attributes:
        name: label.
        hidden: model width ``h``; layers: transformer blocks; heads, kv_heads: attention heads
            (``kv_heads < heads`` is grouped-query attention); ffn: MLP hidden width; vocab:
            vocabulary size; gated: SwiGLU MLP (3 matrices) instead of GELU (2); tied: LM head
            shares the token embedding; positions: rows of a learned position embedding (0 for RoPE).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated: bool = False
    tied: bool = False
    positions: int = 0

    def __post_init__(self) -> None:
        for f in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                raise ValueError(f"ModelShape.{f} must be a positive int, got {getattr(self, f)!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("hidden must be divisible by heads and heads by kv_heads")

    @classmethod
    def from_gpt_config(cls, cfg, name: str = "gpt") -> "ModelShape":
        """The shape of :class:`nvfp4lab.model.GPT` built from ``cfg`` (a ``GPTConfig``)."""
        return cls(name, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_head, cfg.mlp_ratio * cfg.n_embd,
                   cfg.vocab_size, gated=False, tied=cfg.tie_weights, positions=cfg.block_size)

    def linear_shapes(self) -> list[tuple[int, int]]:
        """``(out_features, in_features)`` of one block's linear layers (QKV, O, MLP)."""
        kv = self.kv_heads * (self.hidden // self.heads)
        mlp = ([(2 * self.ffn, self.hidden)] if self.gated else [(self.ffn, self.hidden)])
        return [(self.hidden + 2 * kv, self.hidden), (self.hidden, self.hidden), *mlp,
                (self.hidden, self.ffn)]

    def block_params(self) -> int:
        """Parameters of one block (linear weights, no biases, plus two norm weights)."""
        return sum(m * k for m, k in self.linear_shapes()) + 2 * self.hidden

    def num_parameters(self) -> int:
        """All parameters (tied head counted once)."""
        emb = self.vocab * self.hidden * (1 if self.tied else 2) + self.positions * self.hidden
        return self.layers * self.block_params() + emb + self.hidden


def _gpt_presets() -> dict[str, ModelShape]:
    from nvfp4lab.model import PRESETS
    return {k: ModelShape.from_gpt_config(c, k) for k, c in PRESETS.items()}


#: Shapes by name: nvfp4lab's GPT presets and LLaMA-3 8B/70B (Meta's config.json on the
#: Hugging Face hub, meta-llama/Meta-Llama-3-8B and -70B: hidden_size, num_hidden_layers,
#: num_attention_heads, num_key_value_heads, intermediate_size, vocab_size; untied head, RoPE).
MODEL_SHAPES: dict[str, ModelShape] = {
    **_gpt_presets(),
    "llama3-8b": ModelShape("llama3-8b", 4096, 32, 32, 8, 14336, 128256, gated=True),
    "llama3-70b": ModelShape("llama3-70b", 8192, 80, 64, 8, 28672, 128256, gated=True),
}


def weight_copy_bytes(precision: str, m: int, k: int) -> int:
    """Bytes of the quantized copies TE keeps of one ``[m, k]`` weight (rowwise + columnwise).

    Args:
        precision: a name from :data:`QUANTIZED_PRECISIONS` (aliases accepted).
        m, k: the weight's shape.

    Returns:
        Data plus scales of both copies (see the module docstring for the TE files).

    Raises:
        ValueError: ``precision`` is not quantized.
    """
    p = canonical_name(precision)
    n = m * k
    c = math.ceil
    if p in ("fp8-current", "fp8-delayed"):
        return 2 * n + 2 * 4  # _data + _transpose, one FP32 scale_inv each
    if p == "fp8-block":
        return 2 * n + 2 * 4 * c(m / 128) * c(k / 128)
    if p == "mxfp8":
        return 2 * n + m * c(k / 32) + k * c(m / 32)
    if p == "nvfp4":
        return 2 * (n // 2) + m * c(k / 16) + k * c(m / 16) + 2 * 4
    raise ValueError(f"precision {precision!r} keeps no quantized weight copy; "
                     f"quantized ones: {QUANTIZED_PRECISIONS}")


def _saved_input_bytes_per_element(precision: str) -> float:
    """Bytes per element of a linear input saved for Wgrad (its columnwise copy)."""
    return {"bf16": 2.0, "fp32": 4.0, "fp8-current": 1.0, "fp8-delayed": 1.0, "fp8-block": 1 + 4 / 128,
            "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}[precision]


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU bytes of one training configuration (see :func:`plan`)."""

    model: str
    precision: str
    sharding: str
    world_size: int
    seq_len: int
    micro_batch: int
    activation_checkpointing: bool
    quantized_model_init: bool
    master_weights: int
    bf16_weights: int
    quantized_weights: int
    gradients: int
    optimizer_states: int
    activations: int
    logits: int

    @property
    def parameters(self) -> int:
        """FP32 master + BF16 copy."""
        return self.master_weights + self.bf16_weights

    @property
    def total(self) -> int:
        """Sum of all components, in bytes."""
        return (self.master_weights + self.bf16_weights + self.quantized_weights + self.gradients
                + self.optimizer_states + self.activations + self.logits)

    def fits(self, gpu_memory_bytes: int) -> bool:
        """Whether :attr:`total` is at most ``gpu_memory_bytes`` (e.g. ``GPUS["h200"][1]``)."""
        return self.total <= gpu_memory_bytes


def plan(model: str | ModelShape, *, seq_len: int, micro_batch: int = 1, world_size: int = 1,
         sharding: str = "none", activation_checkpointing: bool = False, precision: str = "bf16",
         quantized_model_init: bool = False, grad_dtype_bytes: int = 4,
         recipe: NVFP4Recipe | None = None) -> MemoryPlan:
    """Per-GPU training memory of ``model``.

    Args:
        model: a :data:`MODEL_SHAPES` name or a :class:`ModelShape`.
        seq_len, micro_batch: tokens per sequence, sequences per GPU per step.
        world_size: data-parallel ranks. sharding: ``"none"`` (one process or DDP replicas) or
            ``"fsdp"`` (FSDP2 full sharding, one block all-gathered at a time).
        activation_checkpointing: keep only block inputs plus one block's activations.
        precision: ``bf16`` or a :data:`QUANTIZED_PRECISIONS` name.
        quantized_model_init: weights of quantized layers live only quantized (TE's
            ``quantized_model_init``): no BF16 copy of them.
        grad_dtype_bytes: 4 (FP32 gradients / reduce dtype, the default) or 2 (BF16).
        recipe: which blocks stay BF16 (default ``NVFP4Recipe()``: first and last block, head).

    Returns:
        A :class:`MemoryPlan`; every field is bytes per GPU.

    Raises:
        ValueError: unknown model/precision/sharding, or non-positive sizes.
    """
    shape = MODEL_SHAPES[model] if isinstance(model, str) and model in MODEL_SHAPES else model
    if not isinstance(shape, ModelShape):
        raise ValueError(f"unknown model {model!r}; choose one of {sorted(MODEL_SHAPES)}")
    prec = canonical_name(precision)
    if prec not in ("bf16",) + QUANTIZED_PRECISIONS:
        raise ValueError(f"precision {precision!r} not planned; choose bf16 or {QUANTIZED_PRECISIONS}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding {sharding!r}; choose one of {SHARDINGS}")
    for name, v in (("seq_len", seq_len), ("micro_batch", micro_batch), ("world_size", world_size)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if grad_dtype_bytes not in (2, 4):
        raise ValueError("grad_dtype_bytes must be 2 or 4")
    recipe = recipe or NVFP4Recipe()
    L = shape.layers
    quantized = prec != "bf16"
    q_blocks = [i for i in range(L) if quantized and recipe.bf16_first_layers <= i < L - recipe.bf16_last_layers]
    n_q = len(q_blocks)
    P = shape.num_parameters()
    q_linear_params = n_q * sum(m * k for m, k in shape.linear_shapes())
    shard = world_size if sharding == "fsdp" else 1
    one_block = shape.block_params() if sharding == "fsdp" else 0

    master = 4 * P // shard
    bf16_params = P - (q_linear_params if quantized_model_init else 0)
    # one process / DDP: autocast caches the BF16 copy of every weight for the whole forward;
    # FSDP2 casts the FP32 shard at all-gather time: only the unsharded block is BF16
    bf16 = 2 * one_block if sharding == "fsdp" else 2 * bf16_params
    copies_per_block = sum(weight_copy_bytes(prec, m, k) for m, k in shape.linear_shapes()) if quantized else 0
    if quantized_model_init:
        # resident quantized parameters: sharded, plus the all-gathered block under FSDP2
        qw = n_q * copies_per_block // shard + (copies_per_block if sharding == "fsdp" and n_q else 0)
    else:
        # quantized from the (all-gathered) BF16 weight in each forward and saved for backward;
        # activation checkpointing discards them and recomputes one block at a time
        qw = (copies_per_block if n_q else 0) if activation_checkpointing else n_q * copies_per_block
    grads = grad_dtype_bytes * P // shard + 2 * one_block
    opt = 8 * P // shard

    B, T, h, f = micro_batch, seq_len, shape.hidden, shape.ffn
    kv = shape.kv_heads * (h // shape.heads)
    bt = B * T

    def block_act(precision: str) -> int:
        s = _saved_input_bytes_per_element(precision)
        bf16_terms = 2 * bt * (h + (h + 2 * kv) + h + h + (2 * f if shape.gated else f))
        saved_inputs = s * bt * (h + h + h + f)
        return int(bf16_terms + saved_inputs)

    per_block = [block_act(prec if i in q_blocks else "bf16") for i in range(L)]
    if activation_checkpointing:
        act = L * 2 * bt * h + max(per_block)
    else:
        act = sum(per_block)
    logits = bt * shape.vocab * (2 + 4 + 4)
    return MemoryPlan(shape.name, prec, sharding, world_size, seq_len, micro_batch,
                      activation_checkpointing, quantized_model_init, master, bf16, qw, grads, opt,
                      act, logits)


_ROWS = ("master_weights", "bf16_weights", "quantized_weights", "gradients", "optimizer_states",
         "activations", "logits")


def format_plan(p: MemoryPlan, gpu: str | None = None) -> str:
    """A Markdown table of ``p`` in GiB, with the total and, if ``gpu`` names a :data:`GPUS` key,
    whether it fits."""
    lines = [f"{p.model}, {p.precision}, {p.sharding} x{p.world_size}, seq {p.seq_len}, "
             f"micro-batch {p.micro_batch}, checkpointing {p.activation_checkpointing}, "
             f"quantized init {p.quantized_model_init}", "", "| component | GiB per GPU |", "|---|---:|"]
    lines += [f"| {r} | {getattr(p, r) / 2**30:.2f} |" for r in _ROWS]
    lines.append(f"| **total** | **{p.total / 2**30:.2f}** |")
    if gpu is not None:
        label, mem = GPUS[gpu]
        lines += ["", f"{label}: {'fits' if p.fits(mem) else 'does NOT fit'} ({mem / 2**30:.1f} GiB)"]
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    p = plan(args.model, seq_len=args.seq_len, micro_batch=args.micro_batch, world_size=args.world_size,
             sharding=args.sharding, activation_checkpointing=args.activation_checkpointing,
             precision=args.precision, quantized_model_init=args.quantized_model_init)
    print(format_plan(p, args.gpu))
    return 0


def register(subparsers) -> None:
    """Add ``nvfp4lab plan`` to an ``argparse`` subparsers object; the handler is ``args.func``
    and returns exit code 0."""
    sp = subparsers.add_parser("plan", help="per-GPU training memory (analytic)")
    sp.add_argument("--model", default="llama3-70b", choices=sorted(MODEL_SHAPES))
    sp.add_argument("--world-size", type=int, default=1)
    sp.add_argument("--sharding", default="fsdp", choices=SHARDINGS)
    sp.add_argument("--precision", default="nvfp4")
    sp.add_argument("--seq-len", type=int, default=8192)
    sp.add_argument("--micro-batch", type=int, default=1)
    sp.add_argument("--activation-checkpointing", action="store_true")
    sp.add_argument("--quantized-model-init", action="store_true")
    sp.add_argument("--gpu", choices=sorted(GPUS), default=None)
    sp.set_defaults(func=_run)
