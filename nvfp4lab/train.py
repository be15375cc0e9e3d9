"""Train the small GPT in BF16, FP32, FP8 or NVFP4 (emulated) and compare precisions.

``train(TrainConfig(...)) -> RunResult`` runs one training; ``compare(config, variants)`` runs
several precisions / recipe ablations on one configuration and writes one table and one plot.

What each precision means here (all on any device; nothing needs a GPU):

* ``fp32``: everything in FP32 (a reference, not a recipe anyone trains LLMs with).
* ``bf16``: ``torch.autocast(dtype=torch.bfloat16)`` mixed precision, the standard "BF16
  training": GEMMs (linear layers, the attention core) take BF16 operands with FP32
  accumulation; master weights, gradients, AdamW state, LayerNorm and the loss stay FP32. This
  is what the paper's BF16 baseline means, and it is honest on a CPU: torch's CPU autocast runs
  real BF16 kernels.
* ``fp8``: the BF16 run with every linear layer inside the transformer blocks swapped for the
  emulated ``Float8CurrentScaling`` :class:`~nvfp4lab.fp8.FP8Linear`.
* ``nvfp4``: the BF16 run with the recipe's linear layers swapped for
  :class:`~nvfp4lab.linear.NVFP4Linear` (default: all blocks but the first and last; the head,
  embeddings, norms and attention core in BF16/FP32). ``cooldown_frac`` switches those layers
  back to BF16 for the last fraction of the steps (paper, appendix).

Training loop: AdamW (decoupled weight decay on matrices only), linear warmup then cosine decay
to ``min_lr_frac * lr``, gradient-norm clipping, periodic validation on a fixed set of windows,
tokens/s and peak memory (CUDA: ``max_memory_allocated``; CPU: peak resident set size of the
process sampled every step), metrics as JSONL, a loss-curve PNG, and a tqdm progress bar on a
terminal (``progress="lines"``: plain start and progress lines for logs, as the CLI prints when
stderr is not a terminal).

Safety: a non-finite loss or gradient norm raises :class:`NonFiniteError` naming the step (the
last checkpoint, written before, is kept), or with ``on_nonfinite="skip"`` the update is skipped
and counted. Checkpoints hold only precision-agnostic FP32 state (model, AdamW, step, the
torch / data / SR generator states, the config as plain data), are written atomically
(temporary file + ``os.replace``; the one before is kept as ``checkpoint.prev.pt``) and load with
``torch.load(weights_only=True)``; a damaged one raises :class:`CheckpointError` naming the file
and the previous good one. A resumed run keeps its learning-rate schedule unless
``extend_schedule`` is set. Resuming on
CPU with the same config continues bit-identically; resuming in another precision works because
the quantized layers share ``nn.Linear``'s parameters and state-dict keys.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn

from .data import ByteTokenizer, get_batch, load_corpus, split_tokens, validation_batches
from .fp8 import FP8Recipe
from .linear import convert_model, layer_precisions, set_quantization_enabled
from .model import GPT, GPTConfig, get_preset
from .precisions import EMULATED, TE_BACKEND, canonical_name
from .capabilities import require_device
from .provenance import environment
from .recipe import NVFP4Recipe

__all__ = [
    "TrainConfig", "RunResult", "CompareResult", "NonFiniteError", "train", "compare",
    "TRAIN_PRESETS", "VARIANTS", "save_checkpoint", "load_checkpoint", "lr_at",
    "plot_metrics", "CHECKPOINT_NAME", "PREVIOUS_CHECKPOINT_NAME", "CheckpointError",
]

CHECKPOINT_NAME = "checkpoint.pt"
#: The checkpoint before the latest one, kept beside it (see :func:`save_checkpoint`).
PREVIOUS_CHECKPOINT_NAME = "checkpoint.prev.pt"  # = _previous_path(Path(CHECKPOINT_NAME)).name
CHECKPOINT_FORMAT = 1

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


class NonFiniteError(RuntimeError):
    """Raised when the loss or the gradient norm is not finite (``on_nonfinite="stop"``).

    Attributes: ``step`` (0-based optimizer step), ``what`` ("loss" or "gradient norm"),
    ``checkpoint`` (path of the last good checkpoint, or None), ``result`` (the
    :class:`RunResult` so far, with ``status="stopped_nonfinite"``).
    """

    def __init__(self, message: str, *, step: int, what: str, checkpoint: str | None,
                 result: "RunResult | None" = None) -> None:
        super().__init__(message)
        self.step, self.what, self.checkpoint, self.result = step, what, checkpoint, result


class CheckpointError(ValueError):
    """A checkpoint file that cannot be resumed from: empty, truncated, corrupt or not a checkpoint.

    The message is one line naming the file, what is wrong with it, and the previous good
    checkpoint beside it when there is one (``previous`` holds its path, or None).
    """

    def __init__(self, message: str, *, path: str, previous: str | None = None) -> None:
        super().__init__(message)
        self.path, self.previous = path, previous


# ----------------------------------------------------------------------------- config
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
    from Python is slower than running them.

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


# ----------------------------------------------------------------------------- results
@dataclass
class RunResult:
    """Outcome of :func:`train` (also written to ``<out>/run.json``).

    status : "completed" or "stopped_nonfinite". Losses are mean cross-entropy in nats per
    byte. ``val_curve`` is a list of ``[step, val_loss]``. ``tokens_per_s`` counts training
    tokens over training time (validation excluded) of this session's steps.
    ``peak_memory_bytes`` is described by ``peak_memory_kind``. ``wall_time_s`` is this
    session's time; ``total_wall_time_s`` adds the time of the sessions before a resume
    (``resumed_from_step`` is None for a run that started at step 0).
    """

    name: str
    precision: str
    status: str
    message: str
    steps_completed: int
    final_val_loss: float | None
    best_val_loss: float | None
    final_train_loss: float | None
    val_curve: list[list[float]]
    tokens_per_s: float
    peak_memory_bytes: int
    peak_memory_kind: str
    wall_time_s: float
    skipped_steps: int
    out_dir: str
    metrics_path: str
    plot_path: str | None
    checkpoint_path: str | None
    config: dict[str, Any]
    data: dict[str, Any]
    environment: dict[str, Any]
    layers: dict[str, int]
    resumed_from_step: int | None = None
    total_wall_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class CompareResult:
    """Outcome of :func:`compare`: one :class:`RunResult` per variant, and the files written."""

    runs: dict[str, RunResult]
    table_path: str
    json_path: str
    plot_path: str | None
    baseline: str | None

    def table(self) -> str:
        return format_table(self.runs, self.baseline)


# ----------------------------------------------------------------------------- helpers
def lr_at(step: int, *, lr: float, steps: int, warmup_steps: int, min_lr_frac: float) -> float:
    """Learning rate at 0-based ``step``: linear warmup to ``lr`` over ``warmup_steps`` steps,
    then cosine decay to ``min_lr_frac * lr`` at the last step."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    min_lr = lr * min_lr_frac
    span = max(1, steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # non-Linux: process-lifetime peak
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _previous_path(path: Path) -> Path:
    """Where the checkpoint before ``path`` is kept: ``checkpoint.prev.pt`` for ``checkpoint.pt``."""
    return path.with_name(path.stem + ".prev" + path.suffix)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not possible on every platform; the file itself was fsynced
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write ``state`` with ``torch.save`` atomically, keeping the previous checkpoint beside it.

    Order: the new state goes to a temporary file in the same folder (flushed, fsynced); the
    current ``path``, if any, is hard-linked to ``checkpoint.prev.pt`` (replacing the older one);
    then the temporary file is ``os.replace``d over ``path``. At every moment ``path`` is a
    complete checkpoint (the old or the new one) and a kill -9 loses nothing already written;
    the last two checkpoints are kept.

    Args:
        path: the checkpoint file (``<run>/checkpoint.pt``).
        state: a mapping of tensors and plain data (loadable with ``weights_only=True``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(state), f)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            prev = _previous_path(path)
            link = prev.with_name(prev.name + ".tmp")
            if link.exists():
                link.unlink()
            os.link(path, link)
            os.replace(link, prev)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_checkpoint(p: Path) -> dict[str, Any]:
    """Load ``p`` or raise :class:`CheckpointError` saying in one line what is wrong with it."""
    if p.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {p} is empty (0 bytes): its write was interrupted", path=str(p))
    with open(p, "rb") as f:
        head = f.read(4)
    if head[:2] != b"PK":  # torch.save writes a zip archive
        kind = "a JSON file" if head[:1] in (b"{", b"[") else "not a file torch.save wrote"
        raise CheckpointError(f"{p} is {kind}, so not an nvfp4lab checkpoint (resume from the run "
                              f"folder or its {CHECKPOINT_NAME})", path=str(p))
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        # torch reports a truncated archive as "PytorchStreamReader failed reading zip archive"
        raise CheckpointError(f"checkpoint {p} is truncated or corrupt ({p.stat().st_size:,} bytes, "
                              f"not a complete torch archive: {type(exc).__name__})", path=str(p)) from None
    except Exception as exc:  # noqa: BLE001 - pickle.UnpicklingError for objects weights_only refuses
        raise CheckpointError(f"{p} holds objects other than tensors and plain data, so nvfp4lab does not "
                              f"load it ({type(exc).__name__}); it is not an nvfp4lab checkpoint", path=str(p)) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{p} is a torch file but not an nvfp4lab checkpoint (format {CHECKPOINT_FORMAT})",
                              path=str(p))
    return ckpt


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint (a file, or a run folder holding ``checkpoint.pt``) with ``weights_only=True``.

    Args:
        path: checkpoint file or run folder.

    Returns:
        The checkpoint's state dict (``format``, ``step``, ``model``, ``optimizer``, ``rng``,
        ``config``, ...).

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: (a ``ValueError``) the file is empty, truncated, corrupt, of another
            kind (e.g. ``run.json``) or of an unknown format. Its one-line message names the file
            and, when the previous checkpoint beside it loads, points to it. It never suggests
            ``weights_only=False``: a checkpoint nvfp4lab wrote loads without it.
    """
    p = Path(path)
    if p.is_dir():
        p = p / CHECKPOINT_NAME
    if not p.exists():
        raise FileNotFoundError(f"no checkpoint at {p}")
    try:
        return _read_checkpoint(p)
    except CheckpointError as exc:
        prev = _previous_path(p)
        if prev == p or not prev.is_file():
            raise
        try:
            step = _read_checkpoint(prev)["step"]
        except CheckpointError:
            raise exc from None
        raise CheckpointError(f"{exc}; the previous checkpoint {prev} (step {step}) is good: "
                              f"--resume {prev}", path=exc.path, previous=str(prev)) from None


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
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
    graph's static inputs, replays, and returns the static ``(loss, grad_norm)`` tensors. The
    parameters' ``.grad`` are then the graph's own tensors, rewritten by every replay: do not set
    them to ``None`` between steps. ``generators``: custom CUDA generators the step draws from
    (the SR generator), registered so that every replay draws fresh numbers. Kernels must have
    been compiled and lazy initialisations done by eager steps on a side stream first (what
    :func:`train` does), and the step must not synchronise with the host (NVFP4Linear's fused
    path does not). Raises whatever ``torch.cuda.graph`` raises on an uncapturable step.
    """

    def __init__(self, model: nn.Module, params: list[torch.nn.Parameter], precision: str,
                 device: torch.device, grad_clip: float, generators: tuple = ()) -> None:
        self.model, self.params, self.precision, self.device = model, params, precision, device
        self.grad_clip, self.generators = grad_clip, generators
        self.graph: torch.cuda.CUDAGraph | None = None

    def _body(self, x: torch.Tensor, y: torch.Tensor):
        with _autocast(self.precision, self.device, cache_enabled=False):
            _, loss = self.model(x, y)
        loss.backward()
        return loss.detach(), _clip_and_norm(self.params, self.grad_clip)

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


def _clip_and_norm(params: list[torch.nn.Parameter], grad_clip: float) -> torch.Tensor:
    """Clip the gradients to ``grad_clip`` (if > 0) and return their total norm (a 0-d tensor)."""
    if grad_clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, grad_clip)
    norms = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms))


#: Eager steps (on a side stream) before a step is captured, and again after the BF16 cooldown.
GRAPH_WARMUP_STEPS = 3


def _autocast(precision: str, device: torch.device, cache_enabled: bool = True):
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)


@torch.no_grad()
def _evaluate(model: nn.Module, batches, precision: str, device: torch.device) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with _autocast(precision, device):
            _, loss = model(x.to(device), y.to(device))
        total += float(loss)
    model.train(was_training)
    return total / len(batches)


_MODEL_KEYS = ("preset", "n_layer", "n_head", "n_embd", "seq_len", "tie_weights", "backend")
_DATA_KEYS = ("text", "val_every", "chunk_bytes")


def _check_resume_compatible(saved: Mapping[str, Any], cfg: "TrainConfig", data_info: Mapping[str, Any]) -> None:
    saved_cfg = saved["config"]
    for k in _MODEL_KEYS:
        if saved_cfg.get(k) != getattr(cfg, k):
            raise ValueError(f"cannot resume: checkpoint has {k}={saved_cfg.get(k)!r}, this run "
                             f"has {k}={getattr(cfg, k)!r} (the model shape must match)")
    sd = saved.get("data", {})
    if sd.get("corpus", {}).get("sha256") != data_info["corpus"]["sha256"]:
        raise ValueError("cannot resume: the corpus differs from the checkpoint's "
                         f"(sha256 {sd.get('corpus', {}).get('sha256')} vs {data_info['corpus']['sha256']})")
    for k in ("val_every", "chunk_bytes"):
        if saved_cfg.get(k) != getattr(cfg, k):
            raise ValueError(f"cannot resume: checkpoint has {k}={saved_cfg.get(k)!r}, this run {getattr(cfg, k)!r}")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def plot_metrics(metrics_path: str | os.PathLike, png_path: str | os.PathLike, title: str = "") -> str:
    """Draw train loss (and its moving average) and validation loss against step into a PNG."""
    # The Figure API leaves pyplot and its backend alone (this also runs inside notebooks).
    from matplotlib.figure import Figure

    recs = _read_jsonl(Path(metrics_path))
    tr = [(r["step"], r["loss"]) for r in recs if r.get("type") == "train" and r.get("loss") is not None
          and math.isfinite(r["loss"])]
    ev = [(r["step"], r["val_loss"]) for r in recs if r.get("type") == "eval"]
    events = [r for r in recs if r.get("type") == "event"]
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    if tr:
        s, l = zip(*tr)
        ax.plot(s, l, color="0.75", lw=0.8, label="train (per log step)")
    if ev:
        s, l = zip(*ev)
        ax.plot(s, l, "o-", color="C0", ms=3, label="validation")
    for e in events:
        ax.axvline(e["step"], color="C3", ls="--", lw=0.8)
        ax.text(e["step"], ax.get_ylim()[1], " " + e.get("event", ""), color="C3", va="top", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    return str(png_path)


def _reporter(cfg: TrainConfig):
    """``say(msg)``: one status line on stderr (``[name] msg``), unless ``cfg.progress`` is False."""
    if cfg.progress is False:
        return lambda msg: None
    return lambda msg: print(f"[{cfg.name}] {msg}", file=sys.stderr, flush=True)


class _ProgressLines:
    """Progress as plain lines for logs (``progress="lines"``): every tenth of the run, every
    ``PERIOD_S`` seconds and at the end, with loss, validation loss, tokens/s and ETA."""

    PERIOD_S = 30.0

    def __init__(self, steps: int, start_step: int, tokens_per_step: int) -> None:
        self.steps, self.every, self.tokens_per_step = steps, max(1, steps // 10), tokens_per_step
        self.last_t, self.time, self.timed = time.perf_counter(), 0.0, 0

    def __call__(self, done: int, dt: float, loss: float, val: float | None) -> str | None:
        self.time, self.timed = self.time + dt, self.timed + 1
        now = time.perf_counter()
        if not (done % self.every == 0 or done == self.steps or now - self.last_t >= self.PERIOD_S):
            return None
        self.last_t = now
        eta = (self.steps - done) * self.time / self.timed
        val_text = f"val {val:.4f}" if val is not None else "val -"
        return (f"step {done}/{self.steps}  loss {loss:.4f}  {val_text}  "
                f"{self.tokens_per_step * self.timed / self.time:,.0f} tok/s  ETA {_fmt_seconds(eta)}")


def _fmt_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ----------------------------------------------------------------------------- train
def train(config: TrainConfig) -> RunResult:
    """Train one model as described by ``config``; see the module docstring.

    Writes into ``config.out`` (default ``runs/<name>``): ``metrics.jsonl`` (one JSON object per
    line: ``type`` "train" / "eval" / "event"), ``run.json`` (the :class:`RunResult`),
    ``loss.png`` and ``checkpoint.pt``.

    Raises ``ValueError`` for an invalid config or an incompatible ``resume`` checkpoint,
    ``NonFiniteError`` when the loss or gradient goes non-finite with ``on_nonfinite="stop"``.
    """
    from tqdm.auto import tqdm

    cfg = config.resolved()
    t_start = time.perf_counter()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)

    # data (pure function of the bytes)
    corpus = load_corpus(cfg.text)
    tokenizer = ByteTokenizer()
    split = split_tokens(tokenizer.encode(corpus.text), chunk_bytes=cfg.chunk_bytes, val_every=cfg.val_every)
    data_info = {"corpus": corpus.describe(), "tokenizer": tokenizer.describe(), "split": split.describe()}
    val_batches = validation_batches(split.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches)

    # model and precision; all randomness derives from the seed
    torch.manual_seed(cfg.seed)
    sr_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1_000_003)
    data_gen = torch.Generator().manual_seed(cfg.seed + 2_000_003)
    if cfg.backend == "te":
        # Raises TransformerEngineUnavailable / NVFP4NotSupported (with the fallbacks) up front.
        from .te_model import build_te_model

        model = build_te_model(cfg.model_config(), cfg.precision, cfg.recipe, device=device)
        layers = model.layer_counts()
    else:
        model = GPT(cfg.model_config()).to(device)
        convert_model(model, cfg.precision, cfg.recipe, fp8_recipe=cfg.fp8_recipe, generator=sr_gen)
        precisions = layer_precisions(model)
        layers = {k: sum(1 for v in precisions.values() if v == k) for k in ("nvfp4", "fp8", "high")}
    optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                  betas=(cfg.beta1, cfg.beta2), eps=1e-8)

    out = Path(cfg.out if cfg.out else Path("runs") / cfg.name)
    say = _reporter(cfg)
    start_step, best_val, skipped, elapsed_before = 0, None, 0, 0.0
    schedule_steps = cfg.schedule_steps or cfg.steps
    val_curve: list[list[float]] = []
    ckpt_path = out / CHECKPOINT_NAME
    if cfg.resume:
        saved = load_checkpoint(cfg.resume)
        _check_resume_compatible(saved, cfg, data_info)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_step = int(saved["step"])
        rng = saved["rng"]
        torch.set_rng_state(rng["torch"])
        data_gen.set_state(rng["data"])
        # The SR generator's state is device-specific (CPU Mersenne Twister vs CUDA Philox); it is
        # restored when the device type matches, otherwise the generator stays freshly seeded.
        if rng.get("sr") is not None and rng.get("sr_device", "cpu") == device.type:
            sr_gen.set_state(rng["sr"])
        best_val = saved.get("best_val_loss")
        skipped = int(saved.get("skipped_steps", 0))
        val_curve = [list(v) for v in saved.get("val_curve", [])]
        elapsed_before = float(saved.get("elapsed_s", 0.0))
        if start_step > cfg.steps:
            raise ValueError(f"checkpoint is at step {start_step}, beyond steps={cfg.steps}")
        saved_schedule = saved["config"].get("schedule_steps") or saved["config"]["steps"]
        if cfg.schedule_steps is None and not cfg.extend_schedule:
            schedule_steps = saved_schedule
        say(f"resumed from step {start_step} of {cfg.steps} (precision {cfg.precision}, checkpoint "
            f"{cfg.resume})")
        if schedule_steps != saved_schedule:
            lr_old = lr_at(start_step, lr=cfg.lr, steps=saved_schedule, warmup_steps=cfg.warmup_steps,
                           min_lr_frac=cfg.min_lr_frac)
            lr_new = lr_at(start_step, lr=cfg.lr, steps=schedule_steps, warmup_steps=cfg.warmup_steps,
                           min_lr_frac=cfg.min_lr_frac)
            say(f"the learning-rate schedule now spans {schedule_steps} steps instead of {saved_schedule} "
                f"(extend_schedule): the LR at step {start_step} goes from {lr_old:.3g} to {lr_new:.3g}")
        elif cfg.steps > saved_schedule:
            say(f"steps={cfg.steps} goes past the checkpoint's {saved_schedule}-step learning-rate schedule, "
                f"which is kept: the LR stays at its final value after step {saved_schedule} "
                "(--extend-schedule stretches the schedule instead)")
    cfg.schedule_steps = schedule_steps
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    # On resume, keep the history up to the checkpoint and drop what came after it.
    kept = [r for r in _read_jsonl(metrics_path) if r.get("step", 0) <= start_step and
            not (r.get("type") == "train" and r.get("step", 0) >= start_step)] if cfg.resume else []
    with open(metrics_path, "w") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
    metrics = open(metrics_path, "a")

    def log(rec: dict[str, Any]) -> None:
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()

    cooldown_start = (schedule_steps - int(round(cfg.cooldown_frac * schedule_steps))
                      if cfg.cooldown_frac > 0 else None)
    last_ckpt: str | None = None
    if cfg.resume:
        rp = Path(cfg.resume)
        last_ckpt = str(rp / CHECKPOINT_NAME if rp.is_dir() else rp)

    def make_state(step: int) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "model": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "data": data_gen.get_state(),
                    "sr": sr_gen.get_state(), "sr_device": device.type},
            "config": cfg.to_dict(),
            "data": data_info,
            "best_val_loss": best_val,
            "skipped_steps": skipped,
            "val_curve": val_curve,
            "elapsed_s": elapsed_before + time.perf_counter() - t_start,
            "torch_version": str(torch.__version__),
        }

    def checkpoint(step: int) -> None:
        nonlocal last_ckpt
        save_checkpoint(ckpt_path, make_state(step))
        last_ckpt = str(ckpt_path)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak_rss = _rss_bytes()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    train_time = 0.0
    steps_timed = 0
    last_loss: float | None = None
    status, message = "completed", ""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if start_step == 0:
        log({"type": "event", "event": "start", "step": 0, "precision": cfg.precision,
             "layers": layers, "params": model.num_parameters()})
        say(f"start: precision {cfg.precision} ({cfg.backend}), preset {cfg.preset}, "
            f"{model.num_parameters() / 1e6:.2f}M parameters, {cfg.steps} steps x {tokens_per_step:,} tokens "
            f"on {device} -> {out}")
    else:
        log({"type": "event", "event": "resume", "step": start_step, "precision": cfg.precision,
             "schedule_steps": schedule_steps})
    bar = tqdm(total=cfg.steps, initial=start_step, desc=cfg.name, unit="step", dynamic_ncols=True,
               disable=None if cfg.progress is None else cfg.progress is not True, file=sys.stderr)
    progress_line = _ProgressLines(cfg.steps, start_step, tokens_per_step) if cfg.progress == "lines" else None
    model.train()
    cooled = False
    graphed = GraphedStep(model, params, cfg.precision, device, cfg.grad_clip,
                          (sr_gen,) if cfg.precision == "nvfp4" else ()) if cfg.cuda_graph else None
    warmup_left = GRAPH_WARMUP_STEPS
    try:
        for step in range(start_step, cfg.steps):
            if cooldown_start is not None and step >= cooldown_start and not cooled:
                if cfg.backend == "te":
                    model.quantize_enabled = False
                else:
                    set_quantization_enabled(model, False)
                cooled = True
                if graphed is not None:  # another computation: capture again after a warm-up
                    graphed.graph, warmup_left = None, GRAPH_WARMUP_STEPS
                if step == cooldown_start:
                    log({"type": "event", "event": "bf16 cooldown", "step": step})
            active = "bf16" if cooled else cfg.precision
            lr = lr_at(step, lr=cfg.lr, steps=schedule_steps, warmup_steps=cfg.warmup_steps,
                       min_lr_frac=cfg.min_lr_frac)
            for g in optimizer.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            x, y = get_batch(split.train, cfg.batch_size, cfg.seq_len, data_gen)
            x, y = x.to(device), y.to(device)
            bad = None
            if graphed is not None and warmup_left == 0:
                # replay: the optimizer step below is outside the graph, so a non-finite loss or
                # gradient is caught before it touches the weights, as in the eager branch
                loss_t, gn = graphed(x, y)
                loss_val, grad_norm = float(loss_t), float(gn)
                if not math.isfinite(loss_val):
                    bad, grad_norm = "loss", float("nan")
                elif not math.isfinite(grad_norm):
                    bad = "gradient norm"
            else:
                side = None
                if graphed is not None:  # warm-up on a side stream (kernels compile, lazy inits)
                    side = torch.cuda.Stream(device)
                    side.wait_stream(torch.cuda.current_stream(device))
                    warmup_left -= 1
                with torch.cuda.stream(side) if side is not None else nullcontext():
                    optimizer.zero_grad(set_to_none=True)
                    with _autocast(cfg.precision, device):
                        _, loss = model(x, y)
                    loss_val = float(loss.detach())
                    if not math.isfinite(loss_val):
                        bad = "loss"
                        grad_norm = float("nan")
                    else:
                        loss.backward()
                        grad_norm = float(_clip_and_norm(params, cfg.grad_clip))
                        if not math.isfinite(grad_norm):
                            bad = "gradient norm"
                if side is not None:
                    torch.cuda.current_stream(device).wait_stream(side)
            if bad is not None:
                value = loss_val if bad == "loss" else grad_norm
                log({"type": "nonfinite", "step": step, "what": bad, "value": str(value)})
                if cfg.on_nonfinite == "skip":
                    skipped += 1
                    if graphed is None or graphed.graph is None:
                        optimizer.zero_grad(set_to_none=True)
                    bar.update(1)
                    continue
                status = "stopped_nonfinite"
                message = (f"non-finite {bad} ({value}) at step {step} ({cfg.name}, precision "
                           f"{active}); training stopped. Last good checkpoint: "
                           f"{last_ckpt or 'none written yet'}. Use on_nonfinite='skip' "
                           f"(--on-nonfinite skip) to skip such steps instead.")
                raise NonFiniteError(message, step=step, what=bad, checkpoint=last_ckpt)
            optimizer.step()
            dt = time.perf_counter() - t0
            train_time += dt
            steps_timed += 1
            last_loss = loss_val
            peak_rss = max(peak_rss, _rss_bytes())
            done = step + 1
            if step % cfg.log_interval == 0 or done == cfg.steps:
                log({"type": "train", "step": step, "loss": loss_val, "lr": lr, "grad_norm": grad_norm,
                     "tokens_per_s": tokens_per_step / dt if dt > 0 else None, "precision": active})
            if done % cfg.eval_interval == 0 or done == cfg.steps:
                v = _evaluate(model, val_batches, cfg.precision, device)
                val_curve.append([done, v])
                best_val = v if best_val is None else min(best_val, v)
                log({"type": "eval", "step": done, "val_loss": v, "precision": active})
                bar.set_postfix(loss=f"{loss_val:.3f}", val=f"{v:.3f}")
            if (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0) or done == cfg.steps:
                checkpoint(done)
            bar.update(1)
            if progress_line is not None:
                line = progress_line(done, dt, loss_val, val_curve[-1][1] if val_curve else None)
                if line:
                    say(line)
    except NonFiniteError as exc:
        result = _result(cfg, status, message, step, val_curve, best_val, last_loss, tokens_per_step,
                         steps_timed, train_time, peak_rss, device, t_start, skipped, out, metrics_path,
                         None, last_ckpt, data_info, layers, start_step if cfg.resume else None, elapsed_before)
        exc.result = result
        _write_json(out / "run.json", result.to_dict())
        raise
    finally:
        bar.close()
        metrics.close()
    plot_path = None
    if cfg.plot:
        what = cfg.precision if cfg.name == cfg.precision else f"{cfg.name}: {cfg.precision}"
        plot_path = plot_metrics(metrics_path, out / "loss.png", title=f"{what}, preset {cfg.preset}")
    result = _result(cfg, status, message, cfg.steps, val_curve, best_val, last_loss, tokens_per_step,
                     steps_timed, train_time, peak_rss, device, t_start, skipped, out, metrics_path,
                     plot_path, last_ckpt, data_info, layers, start_step if cfg.resume else None, elapsed_before)
    _write_json(out / "run.json", result.to_dict())
    return result


def _result(cfg, status, message, steps_completed, val_curve, best_val, last_loss, tokens_per_step,
            steps_timed, train_time, peak_rss, device, t_start, skipped, out, metrics_path,
            plot_path, ckpt, data_info, layers, resumed_from, elapsed_before) -> RunResult:
    if device.type == "cuda":
        peak, kind = int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    else:
        peak, kind = int(peak_rss), "cpu peak resident set size of the process"
    return RunResult(
        name=cfg.name, precision=cfg.precision, status=status, message=message,
        steps_completed=int(steps_completed),
        final_val_loss=val_curve[-1][1] if val_curve else None, best_val_loss=best_val,
        final_train_loss=last_loss, val_curve=val_curve,
        tokens_per_s=tokens_per_step * steps_timed / train_time if train_time > 0 else 0.0,
        peak_memory_bytes=peak, peak_memory_kind=kind,
        wall_time_s=time.perf_counter() - t_start, skipped_steps=skipped, out_dir=str(out),
        resumed_from_step=resumed_from, total_wall_time_s=elapsed_before + time.perf_counter() - t_start,
        metrics_path=str(metrics_path), plot_path=plot_path, checkpoint_path=ckpt,
        config=cfg.to_dict(), data=data_info, environment=environment(device), layers=layers)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- compare
def format_table(runs: Mapping[str, RunResult], baseline: str | None = "bf16") -> str:
    """Markdown table: variant, precision, final validation loss, relative gap to ``baseline``."""
    base = runs.get(baseline) if baseline else None
    base_loss = base.final_val_loss if base is not None and base.status == "completed" else None
    lines = ["| variant | precision | final val loss | vs " + (baseline or "-") +
             " | status | tokens/s | wall time (s) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        loss = f"{r.final_val_loss:.4f}" if r.final_val_loss is not None else "-"
        if base_loss and r.final_val_loss is not None and r.status == "completed":
            gap = f"{100.0 * (r.final_val_loss - base_loss) / base_loss:+.2f}%"
        else:
            gap = "-"
        status = r.status if r.status == "completed" else f"{r.status} at step {r.steps_completed}"
        lines.append(f"| {name} | {r.precision} | {loss} | {gap} | {status} | "
                     f"{r.tokens_per_s:,.0f} | {r.wall_time_s:.0f} |")
    return "\n".join(lines)


def draw_val_curves(ax, ax2, curves: Mapping[str, tuple[Sequence, Mapping[str, Any]]], title: str = "") -> None:
    """Draw validation-loss curves on ``ax`` and their second half, zoomed, on ``ax2``.

    ``curves`` maps a run name to ``(val_curve, style)``: ``val_curve`` is a list of
    ``[step, loss]`` pairs and ``style`` matplotlib line keywords (``label`` defaults to the name).
    """
    for name, (val_curve, style) in curves.items():
        if not val_curve:
            continue
        s, l = zip(*val_curve)
        style = {"label": name, **style}
        ax.plot(s, l, **style)
        half = len(s) // 2
        ax2.plot(s[half:], l[half:], marker="o", ms=3, **style)
    ax.set_title(title or "validation loss")
    ax2.set_title("second half (zoom)")
    for a in (ax, ax2):
        a.set_xlabel("step")
        a.set_ylabel("validation loss (nats / byte)")
        a.grid(alpha=0.3)
    ax2.legend(fontsize=8)


def plot_compare(runs: Mapping[str, RunResult], png_path: str | os.PathLike, title: str = "") -> str:
    """Validation-loss curves of several runs in one PNG."""
    # The Figure API leaves pyplot and its backend alone (this also runs inside notebooks).
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    ax, ax2 = fig.subplots(1, 2)
    draw_val_curves(ax, ax2, {name: (r.val_curve, {"color": f"C{i % 10}", "lw": 1.2})
                              for i, (name, r) in enumerate(runs.items())}, title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    return str(png_path)


def compare(config: TrainConfig, variants: Sequence[str | tuple[str, Mapping[str, Any]]] = (
        "bf16", "fp8", "nvfp4"), *, out: str | os.PathLike | None = None,
        baseline: str | None = "bf16") -> CompareResult:
    """Train ``config`` once per variant and write ``compare.md``, ``compare.json``, ``compare.png``.

    ``variants``: names from :data:`VARIANTS` or ``(name, overrides)`` pairs. Each run goes to
    ``<out>/<name>/``. A run that stops on a non-finite loss is recorded (status
    ``stopped_nonfinite``) and the comparison goes on. ``baseline`` names the variant the
    relative gaps are computed against (None: no gaps).
    Raises ``ValueError`` for an unknown or duplicate variant name.
    """
    base = config
    out_dir = Path(out if out is not None else (config.out or "runs/compare"))
    named: list[tuple[str, TrainConfig]] = []
    for v in variants:
        if isinstance(v, str):
            name, c = v, base.with_variant(v)
        else:
            name, over = v
            c = base.with_variant(over, name=name)
        named.append((name, c))
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate variant names in {names}")
    runs: dict[str, RunResult] = {}
    for name, c in named:
        c = dataclasses.replace(c, out=str(out_dir / name), name=name, resume=None)
        try:
            runs[name] = train(c)
        except NonFiniteError as exc:
            print(f"[compare] {exc}", file=sys.stderr)
            assert exc.result is not None
            runs[name] = exc.result
    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_table(runs, baseline if baseline in runs else None)
    table_path = out_dir / "compare.md"
    table_path.write_text(table + "\n")
    json_path = out_dir / "compare.json"
    _write_json(json_path, {"baseline": baseline, "runs": {k: r.to_dict() for k, r in runs.items()}})
    plot_path = plot_compare(runs, out_dir / "compare.png",
                             title=f"validation loss, preset {base.preset}")
    return CompareResult(runs, str(table_path), str(json_path), plot_path,
                         baseline if baseline in runs else None)
