"""What defines a training run: :class:`TrainConfig`, the presets, the named variants and the
learning-rate schedule (:func:`lr_at`)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..capabilities import require_device
from ..fp8 import FP8Recipe
from ..linear import block_recipe_for
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
    "fp8-delayed": {"precision": "fp8-delayed"},
    "fp8-block": {"precision": "fp8-block"},
    "mxfp8": {"precision": "mxfp8"},
    "mxfp4": {"precision": "mxfp4"},
    "mxfp4-ocp": {"precision": "mxfp4", "block_recipe": {"scale_rounding": "ocp"}},
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
    (:class:`NVFP4Recipe`), ``fp8_recipe`` (fp8-current), ``block_recipe`` (fp8-delayed, fp8-block,
    mxfp8, mxfp4: a ``to_dict()`` mapping of that precision's recipe, e.g. ``{"scale_rounding": "ocp"}``
    for mxfp4; None = TE's defaults; nvfp4lab backend only). Precision switch before the decay (the
    paper's appendix D; quantized precisions only): ``cooldown_frac`` in [0, 1) of the schedule, or
    ``cooldown_step``, with ``cooldown_scope`` ``"all"`` (every GEMM of the quantized layers in BF16;
    the default, the paper's switch), ``"fprop"`` (the forward GEMMs only: most of the gain, appendix
    D, Fig. 7) or ``"bwd"`` (Dgrad and Wgrad only); fprop/bwd need NVFP4 layers of the nvfp4lab backend.
    Data: ``text`` (file or folder; None = built-in ``pydoc_data.topics``), ``val_every``,
    ``chunk_bytes`` (the split).
    Going wrong: ``on_nonfinite="fallback"``, or a spike (``spike_z``: the loss or the gradient norm
    more than that many EMA standard deviations above its running mean, :mod:`.monitor`) with
    ``spike_action="fallback"``, rolls back to the last checkpoint (one is written at step 0) and
    continues in the next precision of ``fallback_chain`` (default nvfp4 -> fp8 -> bf16);
    ``run.json``'s ``precision_segments`` say which steps ran in which precision. ``spike_action``
    "warn" logs the event, "skip" also skips the step's update.
    Health: ``health_interval`` (0: off): every that many steps, one extra side-effect-free forward
    and backward pass records each NVFP4 operand's statistics (:mod:`nvfp4lab.health`) in
    ``health.jsonl`` of the run folder (``nvfp4lab report RUN`` draws them).
    Bookkeeping: ``eval_interval``, ``eval_batches``, ``log_interval``, ``checkpoint_interval``
    (default: ``eval_interval``; 0 = only at the end), ``out`` (run folder), ``name``,
    ``seed``, ``resume`` (checkpoint file or run folder), ``on_nonfinite`` ("stop"/"skip"/"fallback"),
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
    ``compile`` (nvfp4lab backend): the training forward and backward run through
    ``torch.compile(model)``; NVFP4 layers are two custom ops to it (the eager numerics, no graph
    break), the rest is compiled by Inductor. Evaluation runs the same model eagerly. With
    ``cuda_graph`` the compiled step is what the graph captures.
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
    block_recipe: dict[str, Any] | None = None
    cooldown_frac: float = 0.0
    cooldown_step: int | None = None
    health_interval: int = 0
    cooldown_scope: str = "all"
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
    spike_z: float | None = None
    spike_action: str = "warn"
    fallback_chain: tuple = ("nvfp4", "fp8", "bf16")
    device: str = "cpu"
    threads: int | None = None
    progress: bool | None = None
    plot: bool = True
    cuda_graph: bool = False
    compile: bool = False
    schedule_steps: int | None = None
    extend_schedule: bool = False
    graph_optimizer: bool = False
    timing_warmup_steps: int | None = None
    grad_accum_steps: int = 1
    activation_checkpointing: bool = False
    parallel: str = "fsdp"

    # -- resolution and validation
    def resolved(self) -> "TrainConfig":
        """A copy with every preset default filled in, validated.

        Raises:
            ValueError: an unknown preset, or a field outside its range (each message names it).

        Warns:
            UserWarning: ``warmup_steps`` is longer than the schedule (``schedule_steps`` or
                ``steps``): the learning rate never reaches ``lr`` (a short run on a preset with a
                long warm-up, e.g. ``steps=10`` on "laptop").
        """
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
        span = c.schedule_steps or c.steps
        if c.warmup_steps > span:
            warnings.warn(f"warmup_steps={c.warmup_steps} is longer than the {span}-step schedule: the learning "
                          f"rate peaks at {c.lr * span / c.warmup_steps:.3g}, not lr={c.lr:g}; set warmup_steps "
                          f"<= {span} to reach it", UserWarning, stacklevel=2)
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
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"TrainConfig.lr must be a finite number > 0, got {self.lr!r}")
        for k in ("beta1", "beta2"):   # AdamW's betas
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and 0.0 <= v < 1.0):
                raise ValueError(f"TrainConfig.{k} must be in [0, 1), got {v!r}")
        for k in ("grad_clip", "weight_decay"):   # NaN compares False everywhere: it would switch clipping off
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise ValueError(f"TrainConfig.{k} must be a finite number, got {v!r}")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            raise ValueError(f"TrainConfig.min_lr_frac must be in [0, 1], got {self.min_lr_frac}")
        if isinstance(self.health_interval, bool) or not isinstance(self.health_interval, int) or self.health_interval < 0:
            raise ValueError(f"TrainConfig.health_interval must be an int >= 0 (0: off), got {self.health_interval!r}")
        if self.health_interval and (self.backend != "nvfp4lab" or canonical_name(self.precision) != "nvfp4"):
            raise ValueError("health_interval records NVFP4 operands: it needs precision 'nvfp4' on the nvfp4lab backend")
        if self.cooldown_scope not in ("all", "fprop", "bwd"):
            raise ValueError(f"TrainConfig.cooldown_scope must be 'all', 'fprop' or 'bwd', got {self.cooldown_scope!r}")
        if self.cooldown_scope != "all" and (self.backend != "nvfp4lab" or canonical_name(self.precision) != "nvfp4"):
            raise ValueError(f"cooldown_scope={self.cooldown_scope!r} switches single GEMMs of nvfp4lab's NVFP4 layers; "
                             f"precision {self.precision!r} on backend {self.backend!r} switches whole layers "
                             "(cooldown_scope='all')")
        if self.cooldown_step is not None:
            if isinstance(self.cooldown_step, bool) or not isinstance(self.cooldown_step, int) or self.cooldown_step < 0:
                raise ValueError(f"TrainConfig.cooldown_step must be an int >= 0 or None, got {self.cooldown_step!r}")
            if self.cooldown_frac > 0:
                raise ValueError("give cooldown_frac or cooldown_step, not both")
            if canonical_name(self.precision) in ("fp32", "bf16"):
                raise ValueError(f"cooldown_step only makes sense for a quantized precision, not {self.precision!r}")
        if not 0.0 <= self.cooldown_frac < 1.0:
            raise ValueError(f"TrainConfig.cooldown_frac must be in [0, 1), got {self.cooldown_frac}")
        if self.block_recipe is not None:
            if self.backend != "nvfp4lab":
                raise ValueError("TrainConfig.block_recipe applies to the nvfp4lab backend's emulated recipes, "
                                 f"not to backend {self.backend!r}")
            if not isinstance(self.block_recipe, Mapping):
                raise ValueError(f"TrainConfig.block_recipe must be a mapping of recipe fields, got {self.block_recipe!r}")
            block_recipe_for(self.precision, self.block_recipe)  # ValueError naming the precision or field
        if canonical_name(self.precision) == "nvfp4" and self.n_layer is not None:
            self.recipe.check_num_blocks(self.n_layer)   # the BF16 blocks must fit the model (both backends)
        if self.cooldown_frac > 0 and canonical_name(self.precision) in ("fp32", "bf16"):
            raise ValueError(f"cooldown_frac={self.cooldown_frac} only makes sense for precision "
                             f"nvfp4 or fp8 (it switches them to BF16), not {self.precision!r}")
        if self.on_nonfinite not in ("stop", "skip", "fallback"):
            raise ValueError(f"on_nonfinite must be 'stop', 'skip' or 'fallback', got {self.on_nonfinite!r}")
        if self.spike_z is not None and not (isinstance(self.spike_z, (int, float)) and self.spike_z > 0):
            raise ValueError(f"TrainConfig.spike_z must be a number > 0 or None (off), got {self.spike_z!r}")
        if self.spike_action not in ("warn", "skip", "fallback"):
            raise ValueError(f"spike_action must be 'warn', 'skip' or 'fallback', got {self.spike_action!r}")
        if self.spike_z is not None and self.spike_action == "skip" and self.graph_optimizer:
            raise ValueError("spike_action='skip' needs the optimizer step outside the CUDA graph (no graph_optimizer): "
                             "a finite spike cannot stop an update captured in the graph")
        chain = tuple(canonical_name(p) for p in self.fallback_chain)
        if len(set(chain)) != len(chain) or not chain:
            raise ValueError(f"TrainConfig.fallback_chain must name distinct precisions, got {self.fallback_chain!r}")
        if self.falls_back and canonical_name(self.precision) not in chain:
            raise ValueError(f"precision {self.precision!r} is not in fallback_chain {list(self.fallback_chain)}")
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
        if not isinstance(self.compile, bool):
            raise ValueError(f"TrainConfig.compile must be a bool, got {self.compile!r}")
        if self.compile and self.backend != "nvfp4lab":
            raise ValueError("compile needs the nvfp4lab backend (compile a TE model yourself; TE documents "
                             "which of its modules torch.compile supports)")
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
    @property
    def falls_back(self) -> bool:
        """Whether a non-finite step or a spike can switch the run to the next precision of
        ``fallback_chain``."""
        return self.on_nonfinite == "fallback" or (self.spike_z is not None and self.spike_action == "fallback")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["fallback_chain"] = list(self.fallback_chain)
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
        if "fallback_chain" in d:
            d["fallback_chain"] = tuple(d["fallback_chain"])
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
        if "block_recipe" not in overrides and c.block_recipe is not None and c.precision != self.precision:
            c.block_recipe = None  # a base config's block recipe belongs to its own precision
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
