"""Training: the small GPT in BF16, FP32, FP8 or NVFP4 (emulated) and compare precisions.

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

Scaling out: under ``torchrun`` the same :func:`train` runs on every rank with FSDP2 (default) or
DDP (:mod:`nvfp4lab.training.distributed`), the global batch split by rank (``batch_size`` means
the same for any number of ranks), DCP checkpoints any number of ranks resumes from, and
``grad_accum_steps`` / ``activation_checkpointing`` in one process or many.
"""


from .checkpoint import (CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME, CheckpointError, export_weights,
                         latest_distributed_checkpoint, load_checkpoint, save_checkpoint)
from .config import TRAIN_PRESETS, VARIANTS, TrainConfig, lr_at
from .loop import NonFiniteError, compare, train
from .report import CompareResult, RunResult, draw_val_curves, format_table, plot_compare, plot_metrics
from .step import GRAPH_WARMUP_STEPS, GraphedStep

__all__ = [
    "TrainConfig", "RunResult", "CompareResult", "NonFiniteError", "train", "compare",
    "TRAIN_PRESETS", "VARIANTS", "save_checkpoint", "load_checkpoint", "lr_at",
    "plot_metrics", "plot_compare", "draw_val_curves", "format_table", "CHECKPOINT_NAME", "PREVIOUS_CHECKPOINT_NAME", "CheckpointError",
    "GraphedStep", "GRAPH_WARMUP_STEPS", "export_weights", "latest_distributed_checkpoint",
]
