"""Train-ablation benchmark: BF16 vs FP8 vs NVFP4 and the NVFP4 recipe's ingredients.

Trains the ``laptop`` preset GPT on the built-in corpus (``pydoc_data.topics``) once per variant,
all with the same seed (same initial weights, same batches), and reports the final validation
loss of each, relative to BF16:

    bf16              BF16 autocast mixed precision (the baseline)
    fp8               emulated TE Float8CurrentScaling (E4M3 forward, E5M2 gradients) in every block
    nvfp4             the paper's full recipe: RHT + SR + 2D weights, first and last block in BF16
    nvfp4-all-layers  every linear layer in NVFP4, LM head included (no BF16 layers)
    nvfp4-no-rht      full recipe without the random Hadamard transform on Wgrad operands
    nvfp4-no-sr       full recipe with round-to-nearest gradients instead of stochastic rounding
    nvfp4-no-2d       full recipe with 1x16 weight blocks instead of 16x16 tiles
    nvfp4-cooldown    full recipe, switched to BF16 for the last 20% of steps
    fp32              everything in FP32 (context for the BF16 baseline; cheap)

Extra BF16 runs with other seeds (``--noise-seeds``, default 2) measure the run-to-run noise, so
that the table says which differences are resolved at all.

Writes ``results/train_ablation.json`` (versions, device, date, seed, steps, per-run wall time,
curves, table, seed noise) and ``results/train_ablation.png``, which the book reads. Run folders (metrics,
checkpoints, per-run plots) go to ``runs/train_ablation/``.

Usage (from the repository root; the recorded runs' wall times are in ``results/train_ablation.json``:
``runs[*].wall_time_s``, their sum ``runs_wall_time_s_sum``, and the note on how many ran at once)::

    nice python benchmarks/train_ablation.py                      # the full benchmark
    nice python benchmarks/train_ablation.py --jobs 2             # two runs at a time, 1 thread each
    nice python benchmarks/train_ablation.py --jobs 2 --reuse     # finish an interrupted benchmark
    python benchmarks/train_ablation.py --preset ci --steps 20 --out /tmp/abl.json   # smoke test
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime as dt
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_VARIANTS = ("bf16", "fp8", "nvfp4", "nvfp4-all-layers", "nvfp4-no-rht", "nvfp4-no-sr",
                    "nvfp4-no-2d", "nvfp4-cooldown", "fp32")
TARGET_REL_GAP = 0.02  # the target: NVFP4 full recipe within 2% of BF16


def _run_one(config_dict: dict, threads: int | None) -> dict:
    """Train one variant (in a worker process or inline) and return its RunResult as a dict."""
    import torch

    from nvfp4lab.training import NonFiniteError, TrainConfig, train

    if threads:
        torch.set_num_threads(threads)
    cfg = TrainConfig.from_dict(config_dict)
    try:
        return train(cfg).to_dict()
    except NonFiniteError as exc:
        print(f"[train_ablation] {exc}", file=sys.stderr)
        return exc.result.to_dict()


def _plot(runs: dict, baseline: str, png: Path, title: str, noise: dict | None = None) -> None:
    # The Figure API leaves pyplot and its backend alone (this also runs inside notebooks).
    from matplotlib.figure import Figure

    from nvfp4lab.training import draw_val_curves

    fig = Figure(figsize=(16, 4.6))
    ax, ax2, ax3 = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 0.9]})
    curves = {}
    for i, (name, r) in enumerate(runs.items()):
        style = dict(color=f"C{i % 10}", lw=1.6 if name in (baseline, "nvfp4") else 1.0)
        if name.startswith(baseline + "-seed"):
            style = dict(color="0.6", lw=0.8, ls=":")
        curves[name] = (r["val_curve"], style)
    draw_val_curves(ax, ax2, curves, title)
    base = runs.get(baseline, {}).get("final_val_loss")
    names = [n for n in runs if n != baseline and runs[n]["final_val_loss"] is not None and base]
    gaps = [100 * (runs[n]["final_val_loss"] - base) / base for n in names]
    colors = ["C3" if runs[n]["status"] != "completed" else ("C2" if g <= 100 * TARGET_REL_GAP else "C1")
              for n, g in zip(names, gaps)]
    ax3.barh(names[::-1], gaps[::-1], color=colors[::-1])
    ax3.axvline(100 * TARGET_REL_GAP, color="0.4", ls="--", lw=0.8)
    if noise:
        band = 100 * noise["rel_std"]
        ax3.axvspan(-band, band, color="0.85", zorder=0, label=f"BF16 seed noise (±1 std)")
        ax3.legend(fontsize=8, loc="lower right")
    ax3.set_xlabel(f"final validation loss vs {baseline} (%)")
    ax3.set_title("cost of each variant")
    ax3.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


_IGNORED_FOR_REUSE = ("out", "threads", "progress", "resume", "plot")


def _reusable(run_dir: Path, config_dict: dict) -> dict | None:
    """The finished run in ``run_dir`` if its config equals ``config_dict`` (bookkeeping aside)."""
    path = run_dir / "run.json"
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    if r.get("status") != "completed":
        return None
    a = {k: v for k, v in r["config"].items() if k not in _IGNORED_FOR_REUSE}
    b = {k: v for k, v in config_dict.items() if k not in _IGNORED_FOR_REUSE}
    return r if a == b else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="laptop")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated VARIANTS names")
    p.add_argument("--noise-seeds", type=int, default=2,
                   help="extra BF16 runs with seeds seed+1..seed+N, to measure run-to-run noise (default 2)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at the same time (processes)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per run (default: all cores / jobs)")
    p.add_argument("--reuse", action="store_true",
                   help="reuse finished runs in --runs-dir whose config matches (to complete an interrupted benchmark)")
    p.add_argument("--note", default=None, help="free text recorded in the results JSON")
    p.add_argument("--out", default=str(REPO / "results" / "train_ablation.json"),
                   help="results JSON (the PNG goes next to it)")
    p.add_argument("--runs-dir", default=str(REPO / "runs" / "train_ablation"), help="per-run folders")
    args = p.parse_args(argv)

    import statistics

    from nvfp4lab.provenance import environment, git_commit
    from nvfp4lab.training import VARIANTS, RunResult, TrainConfig, format_table

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    base = TrainConfig(preset=args.preset, steps=args.steps, seed=args.seed, progress=False, threads=threads)
    planned: dict[str, TrainConfig] = {v: base.with_variant(v) for v in variants}
    noise_names = []
    for k in range(1, args.noise_seeds + 1):
        name = f"bf16-seed{args.seed + k}"
        planned[name] = dataclasses.replace(base.with_variant("bf16", name=name), seed=args.seed + k)
        noise_names.append(name)
    configs = {n: dataclasses.replace(c, out=str(Path(args.runs_dir) / n)).resolved().to_dict()
               for n, c in planned.items()}
    resolved = TrainConfig.from_dict(next(iter(configs.values()))).resolved()

    results: dict[str, dict] = {}
    reused = []
    if args.reuse:
        for n, c in configs.items():
            r = _reusable(Path(c["out"]), c)
            if r is not None:
                results[n] = r
                reused.append(n)
    todo = [n for n in configs if n not in results]

    t0 = time.perf_counter()
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    commit_at_start = git_commit()
    print(f"[train_ablation] {len(todo)} runs to train ({len(reused)} reused), preset {args.preset}, "
          f"{resolved.steps} steps, {args.jobs} job(s) x {threads} thread(s)", flush=True)

    def report(n):
        print(f"[train_ablation] {n}: val {results[n]['final_val_loss']}, {results[n]['wall_time_s']:.0f} s",
              flush=True)

    if args.jobs <= 1:
        for n in todo:
            results[n] = _run_one(configs[n], threads)
            report(n)
    else:
        with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as ex:
            futs = {ex.submit(_run_one, configs[n], threads): n for n in todo}
            for f in cf.as_completed(futs):
                results[futs[f]] = f.result()
                report(futs[f])
    results = {n: results[n] for n in configs}
    total = time.perf_counter() - t0

    baseline = "bf16" if "bf16" in results else None
    base_loss = results[baseline]["final_val_loss"] if baseline else None
    runs_out = {}
    for v, r in results.items():
        gap = None
        if base_loss and r["final_val_loss"] is not None and r["status"] == "completed":
            gap = (r["final_val_loss"] - base_loss) / base_loss
        runs_out[v] = {
            "precision": r["precision"], "status": r["status"], "message": r["message"],
            "seed": r["config"]["seed"], "reused": v in reused,
            "final_val_loss": r["final_val_loss"], "best_val_loss": r["best_val_loss"],
            "rel_gap_vs_bf16": gap, "final_train_loss": r["final_train_loss"],
            "steps_completed": r["steps_completed"], "wall_time_s": r["wall_time_s"],
            "tokens_per_s": r["tokens_per_s"], "peak_memory_bytes": r["peak_memory_bytes"],
            "recipe": r["config"]["recipe"], "cooldown_frac": r["config"]["cooldown_frac"],
            "layers": r["layers"], "val_curve": r["val_curve"],
            "finished": r["environment"].get("date_utc"), "git_commit": r["environment"].get("git_commit"),
            "run_dir": os.path.relpath(r["out_dir"], REPO),
        }
    bf16_losses = [results[n]["final_val_loss"] for n in ["bf16", *noise_names]
                   if n in results and results[n]["final_val_loss"] is not None]
    noise = None
    if len(bf16_losses) >= 2:
        mean = statistics.fmean(bf16_losses)
        noise = {"runs": ["bf16", *noise_names], "final_val_losses": bf16_losses, "mean": mean,
                 "std": statistics.stdev(bf16_losses), "rel_std": statistics.stdev(bf16_losses) / mean,
                 "rel_range": (max(bf16_losses) - min(bf16_losses)) / mean,
                 "note": "BF16 with different seeds (init, data order): differences between variants "
                         "smaller than this are not resolved by this benchmark"}
    table = format_table({v: RunResult(**r) for v, r in results.items()}, baseline)
    first = results[variants[0]]
    env = environment("cpu")
    nvfp4_gap = runs_out.get("nvfp4", {}).get("rel_gap_vs_bf16")
    summary = {
        "benchmark": "train_ablation",
        "command": " ".join(["benchmarks/train_ablation.py", *(argv if argv is not None else sys.argv[1:])]),
        "started": started,
        "date": env["date_utc"],
        "script_wall_time_s": total,
        "runs_wall_time_s_sum": sum(r["wall_time_s"] for r in results.values()),
        "reused_runs": reused,
        "jobs": args.jobs,
        "threads_per_run": threads,
        "seed": args.seed,
        "preset": args.preset,
        "steps": resolved.steps,
        "batch_size": resolved.batch_size,
        "seq_len": resolved.seq_len,
        "tokens_per_step": resolved.batch_size * resolved.seq_len,
        "model": resolved.model_config().to_dict(),
        "optimizer": {"lr": resolved.lr, "warmup_steps": resolved.warmup_steps,
                      "min_lr_frac": resolved.min_lr_frac, "weight_decay": resolved.weight_decay,
                      "betas": [resolved.beta1, resolved.beta2], "grad_clip": resolved.grad_clip},
        "data": first["data"],
        "environment": env,
        "versions": {k: env.get(k) for k in ("python", "torch", "numpy", "nvfp4lab")},
        "git_commit": commit_at_start,
        "note": args.note,
        "device": env["device"],
        "baseline": baseline,
        "seed_noise": noise,
        "target": {"rel_gap_vs_bf16_max": TARGET_REL_GAP, "nvfp4_rel_gap": nvfp4_gap,
                   "met": (nvfp4_gap is not None and nvfp4_gap <= TARGET_REL_GAP)},
        "table_markdown": table,
        "runs": runs_out,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, out)
    png = out.with_suffix(".png")
    _plot(runs_out, baseline or variants[0], png,
          f"{args.preset}: {resolved.steps} steps x {resolved.batch_size * resolved.seq_len} tokens, seed {args.seed}",
          noise)
    print(table)
    if noise:
        print(f"BF16 seed noise: std {noise['std']:.4f} ({100 * noise['rel_std']:.2f}%), "
              f"range {100 * noise['rel_range']:.2f}% over {len(bf16_losses)} seeds")
    print(f"[train_ablation] {total / 60:.1f} min this time ({len(reused)} runs reused); wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
