"""What a run reports: :class:`RunResult` (``run.json``), :class:`CompareResult`, the metrics
file, tables and plots."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["plot_report", "RunResult", "CompareResult", "format_table", "draw_val_curves", "plot_compare", "plot_metrics",
           "read_jsonl", "write_json"]

# ----------------------------------------------------------------------------- results
@dataclass
class RunResult:
    """Outcome of :func:`train` (also written to ``<out>/run.json``).

    Losses are mean cross-entropy in nats per byte.

    Attributes:
        status: ``"completed"``, ``"stopped_nonfinite"``, or ``"stopped_spike"`` (a loss spike in the
            last precision of a fallback chain).
        val_curve: a list of ``[step, val_loss]``.
        tokens_per_s: the steady state: training tokens over training time (validation
            excluded) of this session's steps after its first ``timing_warmup_steps`` (warm-up,
            CUDA-graph capture, kernel compilation), whose time is ``warmup_time_s``;
            ``tokens_per_s_all_steps`` counts every step, and ``step_ms_median`` is the median
            steady-state step.
        layer_graphs: on a GPU, what the NVFP4 layers' own CUDA graphs did in the steady-state steps
            (:class:`nvfp4lab.cuda_graphs.GraphStats` of ``nvfp4lab.linear.LAYER_GRAPHS`` as a dict:
            calls run directly, captures, replays, bytes copied in and out); all zero where the
            layers replay no graphs of their own (BF16, or inside a captured step). Bytes copied
            in a steady step mean activations the layers' graphs could not read where they are.
        peak_memory_bytes: described by ``peak_memory_kind`` (this rank's).
        peak_memory_bytes_per_rank: under ``torchrun``, every rank's ``peak_memory_bytes`` in rank
            order (gathered when the run completes); ``None`` in one process or for a run that stopped.
        precision_segments: after a fallback, ``[{"precision", "from_step", "to_step", "ended_by"}]`` for
            each precision the run trained in (steps ``from_step`` to ``to_step``, exclusive; a segment
            ending in a fallback ends at the checkpoint it rolled back to); ``None`` without one.
        health_time_s: time spent in the quantization-health passes (``health_interval``), not
            counted in any step's time; ``None`` when they were off.
        wall_time_s: this session's time; ``total_wall_time_s`` adds the time of the sessions
            before a resume (``resumed_from_step`` is ``None`` for a run that started at step 0).
        world_size: the ranks that trained it (each figure is this rank's; tokens count the global
            batch); ``parallel``: ``"fsdp"`` / ``"ddp"``, or ``None`` in one process.
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
    tokens_per_s_all_steps: float | None = None
    warmup_time_s: float | None = None
    timed_steps: int | None = None
    step_ms_median: float | None = None
    layer_graphs: dict[str, int] | None = None
    health_time_s: float | None = None
    precision_segments: list[dict[str, Any]] | None = None
    world_size: int = 1
    parallel: str | None = None
    peak_memory_bytes_per_rank: list[int] | None = None

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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (``metrics.jsonl``), ``[]`` when it does not exist."""
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

    recs = read_jsonl(Path(metrics_path))
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


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON atomically (a temporary file, then ``os.replace``): a
    reader sees the old file or the new one, never half of one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


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


def plot_report(run_dir: str | os.PathLike, png_path: str | os.PathLike | None = None) -> str:
    """The run's report figure: the loss curves with the run's events (cooldown, skipped steps,
    spikes, fallbacks) marked, and, when ``health.jsonl`` exists, one heat map per GEMM operand of
    each NVFP4 layer's SQNR (dB) over the recorded steps (:mod:`nvfp4lab.health`).

    Args:
        run_dir: a run folder written by :func:`nvfp4lab.train` (``metrics.jsonl``, optionally
            ``health.jsonl``).
        png_path: where to write the PNG (default ``<run_dir>/report.png``).

    Returns:
        The PNG's path.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.jsonl``.
    """
    from matplotlib.figure import Figure

    from ..health import HEALTH_NAME

    run = Path(run_dir)
    if not (run / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{run} is not a run folder (no metrics.jsonl)")
    png = Path(png_path) if png_path else run / "report.png"
    recs = read_jsonl(run / "metrics.jsonl")
    health = read_jsonl(run / HEALTH_NAME)
    operands = list(dict.fromkeys((r["gemm"], r["operand"]) for r in health))
    fig = Figure(figsize=(11, 3.6 + (2.6 * ((len(operands) + 2) // 3) if operands else 0)))
    rows = 1 + ((len(operands) + 2) // 3 if operands else 0)
    grid = fig.add_gridspec(rows, 3)
    ax = fig.add_subplot(grid[0, :])
    tr = [(r["step"], r["loss"]) for r in recs if r.get("type") == "train" and r.get("loss") is not None
          and math.isfinite(r["loss"])]
    ev = [(r["step"], r["val_loss"]) for r in recs if r.get("type") == "eval"]
    if tr:
        ax.plot(*zip(*tr), color="0.6", lw=0.8, label="train")
    if ev:
        ax.plot(*zip(*ev), "o-", color="C0", ms=3, label="validation")
    for e in (r for r in recs if r.get("type") == "event"):
        ax.axvline(e["step"], color="C3", ls="--", lw=0.8)
        ax.text(e["step"], 1.0, " " + str(e.get("event", "")), color="C3", va="top", fontsize=8,
                transform=ax.get_xaxis_transform())
    ax.set(xlabel="step", ylabel="loss (nats / byte)", title=run.name)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    layers = list(dict.fromkeys(r["layer"] for r in health))
    steps = sorted({r["step"] for r in health})
    finite = [r["sqnr_db"] for r in health if math.isfinite(r["sqnr_db"])]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    for i, (gemm, operand) in enumerate(operands):
        hax = fig.add_subplot(grid[1 + i // 3, i % 3])
        grid_vals = [[math.nan] * len(steps) for _ in layers]
        for r in health:
            if (r["gemm"], r["operand"]) == (gemm, operand):
                grid_vals[layers.index(r["layer"])][steps.index(r["step"])] = r["sqnr_db"]
        im = hax.imshow(grid_vals, aspect="auto", cmap="viridis", vmin=lo, vmax=hi, interpolation="nearest")
        hax.set_yticks(range(len(layers)), layers, fontsize=6)
        every = max(1, len(steps) // 8)
        hax.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]], fontsize=7)
        hax.set_title(f"{gemm} {operand}: SQNR (dB)", fontsize=9)
        hax.set_xlabel("step", fontsize=8)
        fig.colorbar(im, ax=hax)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return str(png)


def register(subparsers) -> None:
    """The ``nvfp4lab report RUN`` subcommand (see :func:`plot_report`)."""
    p = subparsers.add_parser("report", help="draw a run's loss curve with events and its quantization health",
                              description="Draw a run folder's loss curve with its events and, when it was trained "
                                          "with --health-interval, heat maps of per-layer SQNR over steps.")
    p.add_argument("run", help="run folder (runs/<name>)")
    p.add_argument("--out", help="PNG path (default RUN/report.png)")

    def cmd(args) -> int:
        import sys

        try:
            path = plot_report(args.run, args.out)
        except FileNotFoundError as exc:
            print(f"nvfp4lab report: error: {exc}", file=sys.stderr)
            return 2
        print(path)
        return 0

    p.set_defaults(func=cmd)
