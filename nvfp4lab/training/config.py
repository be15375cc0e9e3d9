"""What defines a training run: :class:`TrainConfig`, the presets, the named variants and the
learning-rate schedule (:func:`lr_at`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..capabilities import require_device
from ..fp8 import FP8Recipe
from ..model import GPTConfig, get_preset
from ..precisions import EMULATED, TE_BACKEND, canonical_name
from ..recipe import NVFP4Recipe
from .distributed import PARALLEL_MODES

__all__ = ["TrainConfig", "TRAIN_PRESETS", "VARIANTS", "lr_at"]

#: Optimisation defaults per preset (the model shape comes from :data:`nvfp4lab.model.PRESETS`).
TRAIN_PRESETS: dict[str, dict[str, Any]] = {
    "ci": dict(batch_size=8, steps=30, lr=3e-3, warmup_steps=5, eval_interval=10, eval_batches=2),
    "laptop": dict(batch_size=8, steps=400, lr=2e-3, warmup_steps=40, eval_interval=50,
                   eval_batches=16),
    "gpt2-small": dict(batch_size=16, steps=5000, lr=6e-4, warmup_steps=200, eval_interval=250,
                       eval_batches=32),
}

#: Named variants for :func:`compare` and ``nvfp4lab compare``: overrides of a base config.
#: ``recipe`` entries are merged into the base config's recipe.
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32"},
    "bf16": {"precision": "bf16"},
    "fp8": {"precision": "fp8"},
    "nvfp4": {"precision": "nvfp4"},
    "nvfp4-all-layers": {"precision": "nvfp4",
                         "recipe": {"bf16_first_layers": 0, "bf16_last_layers": 0,
                                    "quantize_lm_head": True}},
    "nvfp4-no-rht": {"precision": "nvfp4", "recipe": {"disable_rht": True}},
    "nvfp4-no-sr": {"precision": "nvfp4", "recipe": {"disable_stochastic_rounding": True}},
    "nvfp4-no-2d": {"precision": "nvfp4", "recipe": {"disable_2d_quantization": True}},
    "nvfp4-cooldown": {"precision": "nvfp4", "cooldown_frac": 0.2},
}


@dataclass
class TrainConfig:
    """Everything that defines a training run. ``None`` fields take the preset's value.

    Model: ``preset`` ("ci", "laptop", "gpt2-small") plus optional overrides ``n_layer``,
    ``n_head``, ``n_embd``, ``seq_len`` (= block size), ``tie_weights``.
    Optimisation: ``batch_size`` (sequences), ``steps``, ``lr`` (peak), ``min_lr_frac``,
    ``warmup_steps``, ``weight_decay``, ``beta1``, ``beta2``, ``grad_clip`` (<= 0: off).
    Backend: ``"nvfp4lab"`` (the GPT of :mod:`nvfp4lab.model`, NVFP4/FP8 emulated exactly, any
    device) or ``"te"`` (the same GPT built from Transformer Engine modules, CUDA only; FP8 runs
    natively through TE, NVFP4 needs compute capability 10.0: :mod:`nvfp4lab.te_model`).
    Precision: ``precision``, a name of :mod:`nvfp4lab.precisions` (the emulated ones for the
    nvfp4lab backend, every TE recipe for the te backend), ``recipe``
    (:class:`NVFP4Recipe`), ``fp8_recipe``, ``cooldown_frac`` in [0, 1) (nvfp4/fp8 only).
    Data: ``text`` (file or folder; None = built-in ``pydoc_data.topics``), ``val_every``,
    ``chunk_bytes`` (the split).
    Bookkeeping: ``eval_interval``, ``eval_batches``, ``log_interval``, ``checkpoint_interval``
    (default: ``eval_interval``; 0 = only at the end), ``out`` (run folder), ``name``,
    ``seed``, ``resume`` (checkpoint file or run folder), ``on_nonfinite`` ("stop"/"skip"),
    ``device``, ``threads``, ``progress`` (None: a tqdm bar on a terminal, nothing otherwise;
    True: always the bar; False: silent; ``"lines"``: a start line and a progress line every
    tenth of the run or 30 s, for logs and CI, which is what the CLI uses when stderr is not a
    terminal), ``plot``.
    Resuming: the learning-rate schedule spans ``schedule_steps`` (None: ``steps``). A resumed
    run with a larger ``steps`` keeps the checkpoint's schedule (the LR stays at its final value
    past its end) unless ``extend_schedule`` is True, which stretches it over the new ``steps``
    (the LR then changes at the resume step).
    Speed: ``cuda_graph`` (CUDA, nvfp4lab backend): after a few eager warm-up steps, forward,
    backward and gradient clipping of a step are captured once in a CUDA graph and replayed
    (:class:`GraphedStep`); the optimizer step and the non-finite checks stay outside it, so
    the run means the same as without it. Worth it for small models, where launching kernels
    from Python is slower than running them. ``graph_optimizer`` (with ``cuda_graph``) captures the
    AdamW step too (fused AdamW with a device learning rate); a non-finite loss or gradient norm
    sets the optimizer's ``found_inf`` inside the graph, which makes the fused kernel skip the update
    (as ``torch.amp.GradScaler`` does), so stop/skip keep their meaning.
    Throughput: ``tokens_per_s`` of the result excludes the first ``timing_warmup_steps`` steps of
    the session (None: ``min(10, steps // 5)``): warm-up, graph capture, Triton compilation; the
    all-steps figure and the warm-up time are reported beside it.
    Scaling out: ``batch_size`` is the global batch, the same for any number of ranks. Each step
    draws it once, rank ``r`` of ``W`` takes its ``batch_size / W`` rows, and runs them as
    ``grad_accum_steps`` micro-batches (``batch_size`` must be divisible by
    ``W * grad_accum_steps``). Under ``torchrun`` with more than one rank the model is spread by
    ``parallel``: "fsdp" (FSDP2 ``fully_shard``, default) or "ddp"
    (:mod:`nvfp4lab.training.distributed`). ``activation_checkpointing`` recomputes each
    transformer block's activations in backward (``torch.utils.checkpoint``) instead of keeping them.

    :meth:`resolved` fills the preset values and validates (``ValueError`` naming the field).
    """

    precision: str = "nvfp4"
    backend: str = "nvfp4lab"
    preset: str = "ci"
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    seq_len: int | None = None
    tie_weights: bool | None = None
    batch_size: int | None = None
    steps: int | None = None
    lr: float | None = None
    min_lr_frac: float = 0.1
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    recipe: NVFP4Recipe = field(default_factory=NVFP4Recipe)
    fp8_recipe: FP8Recipe = field(default_factory=FP8Recipe)
    cooldown_frac: float = 0.0
    text: str | None = None
    val_every: int = 10
    chunk_bytes: int = 4096
    eval_interval: int | None = None
    eval_batches: int | None = None
    log_interval: int = 10
    checkpoint_interval: int | None = None
    out: str | None = None
    name: str | None = None
    seed: int = 0
    resume: str | None = None
    on_nonfinite: str = "stop"
    device: str = "cpu"
    threads: int | None = None
    progress: bool | None = None
    plot: bool = True
    cuda_graph: bool = False
    schedule_steps: int | None = None
    extend_schedule: bool = False
    graph_optimizer: bool = False
    timing_warmup_steps: int | None = None
    grad_accum_steps: int = 1
    activation_checkpointing: bool = False
    parallel: str = "fsdp"

    # -- resolution and validation
    def resolved(self) -> "TrainConfig":
        """A copy with every preset default filled in, validated."""
        if self.preset not in TRAIN_PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(TRAIN_PRESETS)}")
        c = dataclasses.replace(self)
        c.recipe = NVFP4Recipe.from_dict(self.recipe)
        c.fp8_recipe = FP8Recipe.from_dict(self.fp8_recipe)
        for k, v in TRAIN_PRESETS[self.preset].items():
            if getattr(c, k) is None:
                setattr(c, k, v)
        mp = get_preset(self.preset)
        c.n_layer = mp.n_layer if c.n_layer is None else c.n_layer
        c.n_head = mp.n_head if c.n_head is None else c.n_head
        c.n_embd = mp.n_embd if c.n_embd is None else c.n_embd
        c.seq_len = mp.block_size if c.seq_len is None else c.seq_len
        c.tie_weights = mp.tie_weights if c.tie_weights is None else c.tie_weights
        if c.checkpoint_interval is None:
            c.checkpoint_interval = c.eval_interval
        if c.name is None:
            c.name = c.precision
        c._validate()
        return c

    def _validate(self) -> None:
        if self.backend not in ("nvfp4lab", "te"):
            raise ValueError(f"backend must be 'nvfp4lab' or 'te', got {self.backend!r}")
        allowed = EMULATED if self.backend == "nvfp4lab" else TE_BACKEND
        if self.precision not in allowed:
            hint = "; TE runs it: --backend te" if self.precision in TE_BACKEND else ""
            raise ValueError(f"precision {self.precision!r} is not one the {self.backend} backend trains; "
                             f"choose one of {', '.join(allowed)}{hint}")
        for k in ("batch_size", "steps", "eval_interval", "eval_batches", "log_interval", "seq_len"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TrainConfig.{k} must be a positive int, got {v!r}")
        for k in ("warmup_steps", "checkpoint_interval", "seed"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{k} must be an int >= 0, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr!r}")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            raise ValueError(f"TrainConfig.min_lr_frac must be in [0, 1], got {self.min_lr_frac}")
        if not 0.0 <= self.cooldown_frac < 1.0:
            raise ValueError(f"TrainConfig.cooldown_frac must be in [0, 1), got {self.cooldown_frac}")
        if self.cooldown_frac > 0 and canonical_name(self.precision) in ("fp32", "bf16"):
            raise ValueError(f"cooldown_frac={self.cooldown_frac} only makes sense for precision "
                             f"nvfp4 or fp8 (it switches them to BF16), not {self.precision!r}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0):
            raise ValueError(f"TrainConfig.threads must be a positive int, got {self.threads!r}")
        if self.val_every < 2 or self.chunk_bytes <= 0:
            raise ValueError("TrainConfig needs val_every >= 2 and chunk_bytes > 0")
        if self.graph_optimizer and not self.cuda_graph:
            raise ValueError("graph_optimizer=True captures the optimizer step in the step's CUDA graph: it needs cuda_graph=True")
        if self.timing_warmup_steps is not None and (isinstance(self.timing_warmup_steps, bool) or not isinstance(
                self.timing_warmup_steps, int) or self.timing_warmup_steps < 0):
            raise ValueError(f"TrainConfig.timing_warmup_steps must be an int >= 0 or None, got {self.timing_warmup_steps!r}")
        if isinstance(self.grad_accum_steps, bool) or not isinstance(self.grad_accum_steps, int) or \
                self.grad_accum_steps <= 0:
            raise ValueError(f"TrainConfig.grad_accum_steps must be a positive int, got {self.grad_accum_steps!r}")
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by grad_accum_steps="
                             f"{self.grad_accum_steps} (each micro-batch holds batch_size / grad_accum_steps sequences)")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"TrainConfig.parallel must be one of {', '.join(PARALLEL_MODES)}, got {self.parallel!r}")
        if self.activation_checkpointing and self.backend != "nvfp4lab":
            raise ValueError("activation_checkpointing is implemented for the nvfp4lab backend's GPT, "
                             f"not backend {self.backend!r}")
        if self.cuda_graph and (self.grad_accum_steps > 1 or self.activation_checkpointing):
            raise ValueError("cuda_graph captures one forward and backward per step: it does not combine with "
                             "grad_accum_steps > 1 or activation_checkpointing")
        if self.progress not in (None, True, False, "lines"):
            raise ValueError(f"TrainConfig.progress must be None, True, False or 'lines', got {self.progress!r}")
        if self.schedule_steps is not None and (isinstance(self.schedule_steps, bool) or not isinstance(
                self.schedule_steps, int) or self.schedule_steps <= 0):
            raise ValueError(f"TrainConfig.schedule_steps must be a positive int or None, got {self.schedule_steps!r}")
        if self.cuda_graph and (self.backend != "nvfp4lab" or not str(self.device).startswith("cuda")):
            raise ValueError(f"cuda_graph needs the nvfp4lab backend on a CUDA device, got backend "
                             f"{self.backend!r} on {self.device!r} (TE models: te.make_graphed_callables)")
        require_device(self.device)
        self.model_config()  # shape checks

    def model_config(self) -> GPTConfig:
        base = get_preset(self.preset)
        return dataclasses.replace(
            base,
            n_layer=self.n_layer if self.n_layer is not None else base.n_layer,
            n_head=self.n_head if self.n_head is not None else base.n_head,
            n_embd=self.n_embd if self.n_embd is not None else base.n_embd,
            block_size=self.seq_len if self.seq_len is not None else base.block_size,
            tie_weights=self.tie_weights if self.tie_weights is not None else base.tie_weights,
        )

    # -- plain-data form (JSON, checkpoints)
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["recipe"] = NVFP4Recipe.from_dict(self.recipe).to_dict()
        d["fp8_recipe"] = FP8Recipe.from_dict(self.fp8_recipe).to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s): {sorted(unknown)}")
        d = dict(data)
        if "recipe" in d:
            d["recipe"] = NVFP4Recipe.from_dict(d["recipe"])
        if "fp8_recipe" in d:
            d["fp8_recipe"] = FP8Recipe.from_dict(d["fp8_recipe"])
        return cls(**d)

    def with_variant(self, variant: str | Mapping[str, Any], name: str | None = None) -> "TrainConfig":
        """A copy with a named :data:`VARIANTS` entry (or an override mapping) applied."""
        if isinstance(variant, str):
            if variant not in VARIANTS:
                raise ValueError(f"unknown variant {variant!r}; choose from {sorted(VARIANTS)}")
            name = name or variant
            variant = VARIANTS[variant]
        overrides = dict(variant)
        recipe_over = overrides.pop("recipe", None)
        c = dataclasses.replace(self, **overrides)
        if recipe_over:
            c.recipe = NVFP4Recipe.from_dict(self.recipe).replace(**recipe_over)
        if c.precision in ("fp32", "bf16") and "cooldown_frac" not in overrides:
            c.cooldown_frac = 0.0  # a base-config cooldown only applies to quantized variants
        c.name = name or c.name
        return c


def lr_at(step: int, *, lr: float, steps: int, warmup_steps: int, min_lr_frac: float) -> float:
    """Learning rate at 0-based ``step``: linear warmup to ``lr`` over ``warmup_steps`` steps,
    then cosine decay to ``min_lr_frac * lr`` at the last step."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    min_lr = lr * min_lr_frac
    span = max(1, steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
