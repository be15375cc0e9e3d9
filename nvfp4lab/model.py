"""A small GPT (decoder-only transformer) in one readable file, nanoGPT style.

Structure (``n_layer`` identical pre-norm blocks)::

    tokens [B, T] -> wte (token embedding) + wpe (learned position embedding)
    for each block:   x = x + attn.proj( SDPA_causal( split_heads( attn.qkv( ln_1(x) ) ) ) )
                      x = x + mlp.proj( GELU( mlp.fc( ln_2(x) ) ) )
    ln_f -> lm_head (optionally tied to wte) -> logits [B, T, vocab]

The four ``nn.Linear`` layers per block (``attn.qkv``, ``attn.proj``, ``mlp.fc``,
``mlp.proj``) are the GEMMs a low-precision recipe quantizes; :func:`nvfp4lab.linear.convert_model`
swaps them. The attention core uses ``torch.nn.functional.scaled_dot_product_attention`` and,
like the embeddings, the norms and ``lm_head``, stays in high precision (paper recipe,
background section 1; FP32 by default here, see ``GPTConfig.attn_precision``). Blocks live in ``model.blocks`` (an ``nn.ModuleList``) so that layer
names look like ``blocks.3.mlp.fc``; the recipe's ``bf16_first_layers`` / ``bf16_last_layers``
count these blocks.

Presets (:data:`PRESETS`): ``ci`` (a few seconds for tens of steps on 2 CPU cores),
``laptop`` (the CPU ablation benchmark) and ``gpt2-small`` (GPT-2 small's 768/12/12 with a
1024 context; byte vocabulary, so ~85M parameters rather than 124M).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

__all__ = ["GPTConfig", "GPT", "PRESETS", "get_preset"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    For NVFP4 every linear dimension should be a multiple of 16 (16-element blocks).

    Attributes:
        vocab_size: tokens in the vocabulary (256 for the byte tokenizer).
        block_size: maximum sequence length (size of the position embedding).
        n_layer, n_head, n_embd: blocks, attention heads, model width (``n_embd % n_head == 0``).
        mlp_ratio: hidden width of the MLP is ``mlp_ratio * n_embd``.
        bias: biases in the linear layers and LayerNorms (default False, as modern LLMs).
        tie_weights: share ``lm_head.weight`` with ``wte.weight``.
        dropout: dropout probability (0 by default: deterministic and the runs are short).
        attn_precision: ``"fp32"`` (default) runs the attention core (``softmax(QK^T)V``) in FP32
            even under BF16 autocast; ``"autocast"`` lets autocast run it in BF16. Both are "high
            precision" in the paper's sense. FP32 is the default because torch's CPU BF16 SDPA
            is several times slower than FP32 (its backward especially); the choice is the same
            in every run of a comparison, so it does not favour any precision of the linear
            layers. The ``gpt2-small`` (GPU) preset uses ``"autocast"`` (BF16 flash attention,
            as the paper).

    Raises:
        ValueError: non-positive sizes or ``n_embd`` not divisible by ``n_head``.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_ratio: int = 4
    bias: bool = False
    tie_weights: bool = True
    dropout: float = 0.0
    attn_precision: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.attn_precision not in ("fp32", "autocast"):
            raise ValueError(f"GPTConfig.attn_precision must be 'fp32' or 'autocast', got {self.attn_precision!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GPTConfig":
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s): {sorted(unknown)}")
        return cls(**dict(data))


#: Model shapes by preset name. All linear dimensions are multiples of 16.
PRESETS: dict[str, GPTConfig] = {
    # CI: 3 blocks so that the default recipe (first and last block in BF16) quantizes one.
    "ci": GPTConfig(block_size=64, n_layer=3, n_head=2, n_embd=64),
    # laptop CPU: the ablation benchmark (8 runs on 2 cores well under 40 minutes).
    "laptop": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    # GPT-2 small shapes for a GPU.
    "gpt2-small": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768, attn_precision="autocast"),
}


def get_preset(name: str) -> GPTConfig:
    """The :class:`GPTConfig` of a preset; ``ValueError`` listing the presets if unknown."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameters of a GPT-shaped model (tied weights counted once); optionally without the
    position embedding ``wpe`` (the token embedding is the tied head, so it stays)."""
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        n -= model.wpe.weight.numel()
    return n


def embed_tokens(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Token + position embeddings (then dropout) of a GPT-shaped model: ``[B, T]`` ids -> ``[B, T, C]``.

    Raises ``ValueError`` for ids that are not ``[B, T]`` or longer than ``config.block_size``.
    """
    if idx.dim() != 2:
        raise ValueError(f"{type(model).__name__} expects token ids of shape [B, T], got {tuple(idx.shape)}")
    T = idx.shape[1]
    if T > model.config.block_size:
        raise ValueError(f"sequence length {T} exceeds block_size {model.config.block_size}")
    pos = torch.arange(T, device=idx.device)
    return model.drop(model.wte(idx) + model.wpe(pos))


def lm_head_and_loss(model: nn.Module, x: torch.Tensor, targets: torch.Tensor | None):
    """Final LayerNorm, LM head and (if ``targets``) the mean cross-entropy in FP32: ``(logits, loss)``."""
    logits = model.lm_head(model.ln_f(x))
    loss = None
    if targets is not None:
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
    return logits, loss


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: fused QKV projection, SDPA core, output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.attn_fp32 = cfg.attn_precision == "fp32"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, n_head, T, head_dim]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        if self.attn_fp32:
            with torch.autocast(device_type=x.device.type, enabled=False):
                y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                   dropout_p=p).to(q.dtype)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    """The block's feed-forward layer: ``proj(gelu(fc(x)))``, hidden width ``mlp_ratio * n_embd``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        x = x + self.drop(self.mlp(self.ln_2(x)))
        return x


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``forward(idx, targets=None)``: ``idx`` int64 [B, T] with ``T <= block_size`` and values in
    ``[0, vocab_size)``; returns ``(logits [B, T, vocab] in the compute dtype, loss)`` where
    ``loss`` is the mean fp32 cross-entropy against ``targets`` [B, T] (or None).
    Raises ``ValueError`` for a sequence longer than ``block_size`` or a non-2-D ``idx``.

    Initialisation as GPT-2/nanoGPT: N(0, 0.02) weights, zero biases, and the residual output
    projections (``attn.proj``, ``mlp.proj``) scaled by ``1/sqrt(2 n_layer)``.

    ``activation_checkpointing`` (attribute, default False): while gradients are recorded, each
    block runs under ``torch.utils.checkpoint`` (non-reentrant): its activations are recomputed
    in backward instead of kept, trading one more forward per block for their memory. The
    recomputed forward is the same computation (the quantized layers' forward is deterministic;
    stochastic rounding only touches backward operands).
    """

    activation_checkpointing: bool = False

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        return count_parameters(self, exclude_embeddings)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = embed_tokens(self, idx)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return lm_head_and_loss(self, x, targets)
