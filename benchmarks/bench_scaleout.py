"""FSDP2 training on several GPUs: ``python benchmarks/bench_scaleout.py [--gpus 1,2] [--out FILE] [--smoke]``.

(``--models``, ``--precisions``: some of them; ``--parallel ddp``: DDP instead of FSDP2 on several GPUs;
``--compile``: the training steps through ``torch.compile`` (``nvfp4lab train --compile``), rows marked
``"compile": true``; ``--seed-runs N``; ``--no-resume``; ``--update``: add to a file an earlier call
wrote on the same kind of machine, skipping runs it holds, since one device call is limited to 10 minutes.)

For each model (the ``gpt2-small`` preset and a larger shape that fills more of the GPUs) and each
precision (BF16, FP8 current scaling and NVFP4, emulated by nvfp4lab), ``nvfp4lab train`` runs under
``torchrun --nproc-per-node W`` for every ``W`` of ``--gpus``, with the same global batch and seed
(FSDP2, or DDP with ``--parallel ddp``; eager steps, or compiled with ``--compile``). Recorded per
run, from rank 0's ``run.json``: steady-state tokens/s (the global batch) and median step, peak memory (``torch.cuda.max_memory_allocated``)
of every rank, the validation curve; derived: scaling efficiency against one GPU (tokens/s at W /
(W x tokens/s at 1)), the difference of the final validation loss from the one-GPU run, and the
memory planner's prediction (:func:`nvfp4lab.plan.plan`) against rank 0's measured peak. With
``--seed-runs N`` each model also trains in BF16 on one GPU with seeds 1..N: the seed-to-seed spread
(``seed_spread``) that the loss differences across world sizes are read against. Before the runs, on
each ``W`` > 1, NCCL all-gathers and reduce-scatters FP32 buffers the size of one GPT-2-small block and
of the whole model (``collectives``: time, bus bandwidth, the transport NCCL reports). Then a checkpoint
written by the largest ``W`` resumes on one GPU and on the CPU for one step. Written with provenance
(``nvidia-smi topo -m`` included) to ``results/scaleout_<device>.json``.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1``, exported for the launched processes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nvfp4lab.model import PRESETS, GPTConfig  # noqa: E402
from nvfp4lab.plan import ModelShape, plan  # noqa: E402
from nvfp4lab.provenance import environment  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: name -> (preset, CLI overrides, GPTConfig for the planner)
MODELS = {
    "gpt2-small": ("gpt2-small", [], PRESETS["gpt2-small"]),
    "gpt2-medium-shape": ("gpt2-small", ["--n-layer", "24", "--n-embd", "1024", "--n-head", "16"],
                          GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024, attn_precision="autocast")),
}


def _log(*a: Any) -> None:
    print("[scaleout]", *a, file=sys.stderr, flush=True)


def _env() -> dict[str, str]:
    return {**os.environ, **MULTICAST_OFF, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1"}


#: run under torchrun by :func:`_collectives`: NCCL all-gather and reduce-scatter of FP32 buffers of the
#: sizes given as JSON in argv[1] (name -> elements), timed with CUDA events
_COLLECTIVES_WORKER = r"""
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
out = {}
for name, numel in json.loads(sys.argv[1]).items():
    numel -= numel % world
    full = torch.zeros(numel, device="cuda")
    shard = torch.ones(numel // world, device="cuda")
    for op in ("all_gather", "reduce_scatter"):
        run = ((lambda: dist.all_gather_into_tensor(full, shard)) if op == "all_gather"
               else (lambda: dist.reduce_scatter_tensor(shard, full)))
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); n = 10
        for _ in range(n):
            run()
        b.record(); b.synchronize()
        ms = a.elapsed_time(b) / n
        # NCCL's "bus bandwidth" of these two collectives: bytes of the full buffer x (W-1)/W per time
        out[f"{op}_{name}"] = {"bytes": 4 * numel, "ms": ms, "bus_GBps": 4 * numel * (world - 1) / world / ms / 1e6}
if rank == 0:
    print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


def _collectives(world: int, tmp: Path) -> dict[str, Any]:
    """NCCL all-gather and reduce-scatter timings on ``world`` GPUs, of FP32 buffers the size of what
    FSDP2 moves for one GPT-2-small block and for the whole model (:class:`nvfp4lab.plan.ModelShape`'s
    parameter counts), and the transport NCCL chose (its ``NCCL_DEBUG=INFO`` channel lines, e.g.
    ``via P2P/CUMEM`` or ``via SHM``)."""
    shape = ModelShape.from_gpt_config(MODELS["gpt2-small"][2], "gpt2-small")
    sizes = {"block": shape.block_params(), "model": shape.num_parameters()}
    script = tmp / "collectives.py"
    script.write_text(_COLLECTIVES_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(script),
           json.dumps(sizes)]
    proc = subprocess.run(cmd, env={**_env(), "NCCL_DEBUG": "INFO"}, capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).splitlines()
    result = next((json.loads(l.split("RESULT ", 1)[1]) for l in lines if "RESULT " in l), None)
    transports = sorted({l.split(" via ", 1)[1].strip() for l in lines if "Channel" in l and " via " in l})
    if result is None:
        return {"world_size": world, "error": (proc.stdout + proc.stderr)[-1500:]}
    return {"world_size": world, "transports": transports, **result}


def _train(world: int, out: Path, args: list[str], device: str) -> dict[str, Any]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd = [*launcher, "-m", "nvfp4lab", "train", "--device", device, "--out", str(out), "--no-plot",
           "--no-progress", *args]
    t0 = time.time()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        _log("FAILED", " ".join(cmd), proc.stderr[-2000:])
        return {"error": proc.stderr[-1500:], "command": " ".join(cmd[len(launcher):])}
    run = json.loads((out / "run.json").read_text())
    run["launch_s"] = time.time() - t0
    return run


#: precisions run per model (the larger shape: BF16 and NVFP4 only, FP8's emulation is slowest)
PRECISIONS = {"gpt2-medium-shape": ("bf16", "nvfp4")}
DEFAULT_PRECISIONS = ("bf16", "fp8", "nvfp4")


def _compiled(row: dict[str, Any]) -> bool:
    """Whether a run's steps went through ``torch.compile`` (rows without the key ran eagerly)."""
    return bool(row.get("compile", False))


def _seed_spread(runs: list[dict[str, Any]], model: str) -> dict[str, Any] | None:
    """The seed-to-seed spread of the final validation loss: BF16, one GPU, every eager seed run of ``model``."""
    losses = {r["seed"]: r["final_val_loss"] for r in runs
              if r["model"] == model and r["precision"] == "bf16" and r["world_size"] == 1 and "final_val_loss" in r
              and not _compiled(r)}
    if len(losses) < 2:
        return None
    return {"precision": "bf16", "world_size": 1, "seeds": sorted(losses),
            "final_val_losses": [losses[k] for k in sorted(losses)],
            "range": max(losses.values()) - min(losses.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1,2", help="world sizes to run (default 1,2)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true", help="the ci preset on the CPU with gloo, a few steps")
    ap.add_argument("--models", default="", help="comma-separated models of MODELS (default: all)")
    ap.add_argument("--precisions", default="", help="comma-separated precisions (default: each model's)")
    ap.add_argument("--seed-runs", type=int, default=0,
                    help="extra BF16 one-GPU runs of each model with seeds 1..N: the seed spread that the "
                         "loss differences across world sizes are compared with")
    ap.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp",
                    help="how runs on several GPUs spread the model (nvfp4lab train --parallel)")
    ap.add_argument("--compile", action="store_true", help="train through torch.compile (nvfp4lab train --compile)")
    ap.add_argument("--no-resume", action="store_true", help="skip the resume of the largest world's checkpoint")
    ap.add_argument("--update", action="store_true",
                    help="add these runs to --out, written by an earlier call on the same kind of machine "
                         "(same device, device count, torch, steps and batch); refuses otherwise")
    a = ap.parse_args(argv)
    worlds = [int(w) for w in a.gpus.split(",")]
    device = "cpu" if a.smoke else "cuda"
    catalog = {"ci": ("ci", [], PRESETS["ci"])} if a.smoke else MODELS
    models = catalog
    if a.models:
        unknown = set(a.models.split(",")) - set(catalog)
        if unknown:
            ap.error(f"unknown model(s) {sorted(unknown)}; known: {sorted(catalog)}")
        models = {k: v for k, v in catalog.items() if k in a.models.split(",")}
    steps = 4 if a.smoke else a.steps
    batch = 4 if a.smoke else 16
    topo = None
    if not a.smoke:
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        except OSError as exc:
            topo = f"nvidia-smi unavailable: {exc}"
    result: dict[str, Any] = {"environment": environment(None if not a.smoke else "cpu"), "topology": topo,
                              "multicast_env": MULTICAST_OFF, "steps": steps, "global_batch": batch, "runs": [],
                              "resumes": [], "seed_spread": {}}
    out_path = a.out or ROOT / "results" / ("scaleout_smoke.json" if a.smoke else "scaleout_cuda.json")
    if a.update and out_path.exists():
        earlier = json.loads(out_path.read_text())
        for key in ("device", "device_count", "torch"):
            if earlier["environment"].get(key) != result["environment"].get(key):
                raise SystemExit(f"--update: {out_path} was written with {key}={earlier['environment'].get(key)!r}, "
                                 f"this machine has {result['environment'].get(key)!r}")
        for key in ("steps", "global_batch"):
            if earlier[key] != result[key]:
                raise SystemExit(f"--update: {out_path} has {key}={earlier[key]}, this call {result[key]}")
        result["runs"] = earlier["runs"]
        result["resumes"] = earlier.get("resumes", [])
        result["seed_spread"] = earlier.get("seed_spread", {})
        result["collectives"] = earlier.get("collectives", [])
        result["updates"] = earlier.get("updates", []) + [earlier["environment"].get("date_utc")]
    tmp = Path(tempfile.mkdtemp(prefix="scaleout-"))
    if not a.smoke:
        result.setdefault("collectives", [])
        for world in worlds:
            if world > 1 and not any(c["world_size"] == world for c in result["collectives"]):
                result["collectives"].append(_collectives(world, tmp))
                _log(result["collectives"][-1])
    wanted = [p for p in a.precisions.split(",") if p]
    largest: dict[str, Any] | None = None   # the first run at the largest world size: its checkpoint resumes
    for model, (preset, overrides, gpt_cfg) in models.items():
        shape = ModelShape.from_gpt_config(gpt_cfg, model)
        jobs = [(p, w, 0) for p in PRECISIONS.get(model, DEFAULT_PRECISIONS) if not wanted or p in wanted
                for w in worlds]
        if not wanted or "bf16" in wanted:
            jobs += [("bf16", 1, seed) for seed in range(1, a.seed_runs + 1)]
        for precision, world, seed in jobs:
            out = tmp / f"{model}-{precision}-w{world}-s{seed}"
            args = ["--preset", preset, *overrides, "--precision", precision, "--steps", str(steps),
                    "--batch-size", str(batch), "--eval-interval", str(steps), "--eval-batches", "4",
                    "--checkpoint-interval", str(steps), "--log-interval", "1", "--seed", str(seed),
                    "--parallel", a.parallel, *(["--compile"] if a.compile else [])]
            parallel = a.parallel if world > 1 else None
            if any(r["model"] == model and r["precision"] == precision and r["world_size"] == world
                   and r.get("seed", 0) == seed and r.get("parallel") == parallel
                   and _compiled(r) == a.compile for r in result["runs"]):
                _log(f"skipped: {model} {precision} x{world} seed {seed} {parallel or ''}"
                     f"{' compiled' if a.compile else ''} is already in {out_path}")
                continue
            run = _train(world, out, args, device)
            row: dict[str, Any] = {"model": model, "precision": precision, "world_size": world, "seed": seed,
                                   **({"compile": True} if a.compile else {})}
            if "error" in run:
                row["error"] = run["error"]
            else:
                predicted = plan(shape, seq_len=gpt_cfg.block_size, micro_batch=batch // world, world_size=world,
                                 sharding="fsdp" if world > 1 and a.parallel == "fsdp" else "none",
                                 precision=precision).total
                row.update(tokens_per_s=run["tokens_per_s"], peak_memory_bytes=run["peak_memory_bytes"],
                           peak_memory_bytes_per_rank=run.get("peak_memory_bytes_per_rank"),
                           peak_memory_kind=run["peak_memory_kind"], final_val_loss=run["final_val_loss"],
                           val_curve=run["val_curve"], step_ms_median=run.get("step_ms_median"),
                           warmup_time_s=run.get("warmup_time_s"), launch_s=run["launch_s"],
                           parallel=run.get("parallel"), planned_bytes=predicted,
                           plan_error=(predicted - run["peak_memory_bytes"]) / run["peak_memory_bytes"])
                base = next((r for r in result["runs"] if r["model"] == model and r["precision"] == precision
                             and r["world_size"] == 1 and r.get("seed", 0) == 0 and "tokens_per_s" in r
                             and _compiled(r) == a.compile), None)
                if seed == 0 and base is not None:
                    row["scaling_efficiency"] = row["tokens_per_s"] / (world * base["tokens_per_s"])
                    row["val_loss_minus_1gpu"] = row["final_val_loss"] - base["final_val_loss"]
                elif seed == 0 and world == 1:
                    row["scaling_efficiency"] = 1.0
                    row["val_loss_minus_1gpu"] = 0.0
                if seed == 0 and world == max(worlds) and largest is None:
                    largest = {**row, "checkpoint": str(out)}
            result["runs"].append(row)
            spread = _seed_spread(result["runs"], model)
            if spread is not None:
                result["seed_spread"][model] = spread
            _log({k: v for k, v in row.items() if k not in ("val_curve", "error")})
            out_path.write_text(json.dumps(result, indent=2) + "\n")
    # a checkpoint of the largest world size resumes on one GPU and on the CPU
    if largest is not None and not a.no_resume:
        preset, overrides, _ = catalog[largest["model"]]
        for world, dev in ((1, device), (1, "cpu")):
            out = tmp / f"resume-{dev}"
            # the CPU step uses a batch of 2 sequences (the batch size is not part of the checkpoint's model)
            args = ["--preset", preset, *overrides, "--precision", largest["precision"], "--steps", str(steps + 1),
                    "--batch-size", str(batch if dev != "cpu" else 2), "--eval-interval", str(steps + 1),
                    "--eval-batches", "1", "--resume", largest["checkpoint"]]
            run = _train(world, out, args, dev)
            result["resumes"].append({"model": largest["model"], "precision": largest["precision"],
                                      "from_world_size": largest["world_size"], "to": f"{world} x {dev}",
                                      "ok": "error" not in run, "resumed_from_step": run.get("resumed_from_step"),
                                      "final_val_loss": run.get("final_val_loss"), "error": run.get("error")})
            _log(result["resumes"][-1])
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    _log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
