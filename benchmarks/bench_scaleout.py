"""FSDP2 training on several GPUs: ``python benchmarks/bench_scaleout.py [--gpus 1,2] [--out FILE] [--smoke]``.

For each model (the ``gpt2-small`` preset and a larger shape that fills more of the GPUs) and each
precision (BF16, FP8 current scaling and NVFP4, emulated by nvfp4lab), ``nvfp4lab train`` runs under
``torchrun --nproc-per-node W`` for every ``W`` of ``--gpus``, with the same global batch and seed
(FSDP2, eager steps). Recorded per run, from rank 0's ``run.json``: steady-state tokens/s (the
global batch), peak memory of rank 0 (``torch.cuda.max_memory_allocated``), the validation curve;
derived: scaling efficiency against one GPU (tokens/s at W / (W x tokens/s at 1)), the difference of
the final validation loss from the one-GPU run, and the memory planner's prediction
(:func:`nvfp4lab.plan.plan`) against the measured peak. Then a checkpoint written by the largest
``W`` resumes on one GPU and on the CPU for one step. Written with provenance (``nvidia-smi topo -m``
included) to ``results/scaleout_<device>.json``.

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1,2", help="world sizes to run (default 1,2)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true", help="the ci preset on the CPU with gloo, a few steps")
    a = ap.parse_args(argv)
    worlds = [int(w) for w in a.gpus.split(",")]
    device = "cpu" if a.smoke else "cuda"
    models = {"ci": ("ci", [], PRESETS["ci"])} if a.smoke else MODELS
    steps = 4 if a.smoke else a.steps
    batch = 4 if a.smoke else 16
    topo = None
    if not a.smoke:
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        except OSError as exc:
            topo = f"nvidia-smi unavailable: {exc}"
    result: dict[str, Any] = {"environment": environment(None if not a.smoke else "cpu"), "topology": topo,
                              "multicast_env": MULTICAST_OFF, "steps": steps, "global_batch": batch, "runs": []}
    out_path = a.out or ROOT / "results" / ("scaleout_smoke.json" if a.smoke else "scaleout_cuda.json")
    tmp = Path(tempfile.mkdtemp(prefix="scaleout-"))
    precisions = {"gpt2-medium-shape": ("bf16", "nvfp4")}
    for model, (preset, overrides, gpt_cfg) in models.items():
        shape = ModelShape.from_gpt_config(gpt_cfg, model)
        for precision in precisions.get(model, ("bf16", "fp8", "nvfp4")):
            base = None
            for world in worlds:
                out = tmp / f"{model}-{precision}-w{world}"
                args = ["--preset", preset, *overrides, "--precision", precision, "--steps", str(steps),
                        "--batch-size", str(batch), "--eval-interval", str(steps), "--eval-batches", "4",
                        "--checkpoint-interval", str(steps), "--log-interval", "1"]
                run = _train(world, out, args, device)
                row: dict[str, Any] = {"model": model, "precision": precision, "world_size": world}
                if "error" in run:
                    row["error"] = run["error"]
                else:
                    predicted = plan(shape, seq_len=gpt_cfg.block_size, micro_batch=batch // world, world_size=world,
                                     sharding="fsdp" if world > 1 else "none", precision=precision).total
                    row.update(tokens_per_s=run["tokens_per_s"], peak_memory_bytes=run["peak_memory_bytes"],
                               peak_memory_kind=run["peak_memory_kind"], final_val_loss=run["final_val_loss"],
                               val_curve=run["val_curve"], step_ms_median=run.get("step_ms_median"),
                               parallel=run.get("parallel"), planned_bytes=predicted,
                               plan_error=(predicted - run["peak_memory_bytes"]) / run["peak_memory_bytes"],
                               checkpoint=str(out))
                    if base is None:
                        base = row
                    row["scaling_efficiency"] = row["tokens_per_s"] / (world * base["tokens_per_s"])
                    row["val_loss_minus_1gpu"] = row["final_val_loss"] - base["final_val_loss"]
                result["runs"].append(row)
                _log({k: v for k, v in row.items() if k not in ("val_curve", "error")})
                out_path.write_text(json.dumps(result, indent=2) + "\n")
    # a checkpoint of the largest world size resumes on one GPU and on the CPU
    last = [r for r in result["runs"] if r.get("world_size") == max(worlds) and "checkpoint" in r]
    resumes = []
    if last:
        src = last[0]
        preset, overrides, _ = models[src["model"]]
        for world, dev in ((1, device), (1, "cpu")):
            out = tmp / f"resume-{dev}"
            # the CPU step uses a batch of 2 sequences (the batch size is not part of the checkpoint's model)
            args = ["--preset", preset, *overrides, "--precision", src["precision"], "--steps", str(steps + 1),
                    "--batch-size", str(batch if dev != "cpu" else 2), "--eval-interval", str(steps + 1),
                    "--eval-batches", "1", "--resume", src["checkpoint"]]
            run = _train(world, out, args, dev)
            resumes.append({"from_world_size": max(worlds), "to": f"{world} x {dev}", "ok": "error" not in run,
                            "resumed_from_step": run.get("resumed_from_step"), "final_val_loss": run.get("final_val_loss"),
                            "error": run.get("error")})
            _log(resumes[-1])
    result["resumes"] = resumes
    for r in result["runs"]:
        r.pop("checkpoint", None)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    _log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
