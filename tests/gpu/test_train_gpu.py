"""nvfp4lab.train (nvfp4lab.training) on CUDA with ``cuda_graph=True``: the captured step trains like the eager one.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_train_gpu.py``.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from child_env import child_env  # noqa: E402
from nvfp4lab.training import TrainConfig, train  # noqa: E402


@pytest.mark.parametrize("precision", ["nvfp4", "bf16"])
def test_cuda_graph_training_matches_eager_closely(tmp_path, precision):
    common = dict(preset="ci", precision=precision, steps=30, device="cuda", progress=False, plot=False,
                  eval_interval=30, cooldown_frac=0.2 if precision == "nvfp4" else 0.0)
    eager = train(TrainConfig(out=str(tmp_path / "eager"), **common))
    graph = train(TrainConfig(out=str(tmp_path / "graph"), cuda_graph=True, **common))
    assert graph.status == eager.status == "completed"
    assert math.isfinite(graph.final_val_loss)
    # same data, model, optimizer and recipe; only SR draws and FP32 accumulation order may differ
    assert abs(graph.final_val_loss - eager.final_val_loss) < 0.05 * eager.final_val_loss


@pytest.mark.parametrize("precision", ["nvfp4", "bf16"])
def test_graph_with_optimizer_matches_eager_closely(tmp_path, precision):
    """The optimizer captured too (graph_optimizer): the same run, within SR and accumulation-order noise."""
    common = dict(preset="ci", precision=precision, steps=30, device="cuda", progress=False, plot=False,
                  eval_interval=30, cooldown_frac=0.2 if precision == "nvfp4" else 0.0)
    eager = train(TrainConfig(out=str(tmp_path / "eager"), **common))
    graph = train(TrainConfig(out=str(tmp_path / "graph"), cuda_graph=True, graph_optimizer=True, **common))
    assert graph.status == eager.status == "completed" and math.isfinite(graph.final_val_loss)
    assert abs(graph.final_val_loss - eager.final_val_loss) < 0.05 * eager.final_val_loss
    assert graph.timed_steps == eager.timed_steps == 30 - min(10, 30 // 5)   # steady state, as documented


def test_graph_with_optimizer_skips_a_nonfinite_step_like_eager(tmp_path, monkeypatch):
    """A NaN batch inside the captured step: the fused AdamW update is skipped in the graph and the run
    counts the skip, exactly as the eager loop does with on_nonfinite='skip'."""
    import nvfp4lab.training.loop as loop

    real = loop.get_batch
    calls = {"n": 0}

    def poisoned(*args, **kwargs):        # the 8th batch's targets point past the vocabulary -> NaN loss
        x, y = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 8:
            y = torch.full_like(y, -100)      # ignore_index everywhere: mean over no tokens = NaN
        return x, y

    monkeypatch.setattr(loop, "get_batch", poisoned)
    common = dict(preset="ci", precision="bf16", steps=12, device="cuda", progress=False, plot=False,
                  eval_interval=12, on_nonfinite="skip")
    graph = train(TrainConfig(out=str(tmp_path / "graph"), cuda_graph=True, graph_optimizer=True, **common))
    calls["n"] = 0
    eager = train(TrainConfig(out=str(tmp_path / "eager"), **common))
    assert graph.skipped_steps == eager.skipped_steps == 1
    assert abs(graph.final_val_loss - eager.final_val_loss) < 0.02 * eager.final_val_loss


ROOT = Path(__file__).resolve().parents[2]


def _timed_layer_graphs(tmp_path, precision: str) -> dict:
    """``RunResult.layer_graphs``, the NVFP4 layer count and the timed steps of a short eager run
    (the CI preset, 20 steps, 10 of them timed) trained in a process of its own."""
    code = ("import json, sys; from nvfp4lab.training import TrainConfig, train; "
            "r = train(TrainConfig(precision=sys.argv[1], out=sys.argv[2], preset='ci', steps=20, "
            "timing_warmup_steps=10, device='cuda', progress=False, plot=False, eval_interval=20, cooldown_frac=0.0)); "
            "print(json.dumps(dict(g=r.layer_graphs, n=r.layers['nvfp4'], timed=r.timed_steps)))")
    done = subprocess.run([sys.executable, "-c", code, precision, str(tmp_path / precision)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_eager_steady_steps_replay_the_layer_graphs_without_copies(tmp_path):
    """``RunResult.layer_graphs`` over an eager run's timed steps: every NVFP4 layer call, forward and
    backward, replays that layer's own CUDA graph (no direct call, no capture, nothing copied out),
    and, the allocator having settled during the warm-up steps, no activation is copied in either:
    the layers read X and dY where they are (before a35272c every layer copied both in on every
    step). BF16 layers use no layer graphs: all counts zero.

    Each run trains in a process of its own, as a training run does: inside the process of a full
    ``pytest -m gpu`` run (H200, TE installed, 72d2ff4 and 2a7ed7a) the timed steps captured 20 graphs
    and 78 of their 80 layer calls replayed owned graphs, even after ``gc.collect()`` and
    ``torch.cuda.empty_cache()``; alone, after importing TE, or after the TE, capture or compile tests
    alone, none. Training the same run in-process after each test file of a full run (H200, the tree of 4c95af5):
    0 captures after the capture, compile, kernel and quantize tests, 20 captures and 2 copying replays
    from the TE tests on (``test_te_gpu.py``, run after those four), to the end."""
    r = _timed_layer_graphs(tmp_path, "nvfp4")
    g, n = r["g"], r["n"]
    assert r["timed"] == 10 and n > 0
    assert g["calls"] == g["owned_replays"] == 2 * n * r["timed"], g
    assert g["direct"] == g["captures"] == g["copying_replays"] == g["bytes_out"] == 0, g
    assert g["bytes_in"] == 0, g
    b = _timed_layer_graphs(tmp_path, "bf16")
    assert set(b["g"].values()) == {0}


def test_two_cpu_ranks_on_a_gpu_machine_stay_on_the_cpu(tmp_path):
    """``torchrun --nproc-per-node 2 ... --device cpu`` on a GPU machine trains two gloo ranks on the CPU.
    FSDP2's default mesh takes the machine's accelerator and moved rank r to ``cuda:r``, which a one-GPU
    machine lacks ("invalid device ordinal": chapter 09b failed so on the H200 at c5bbbb4); ``wrap_model``
    now gives ``fully_shard`` a mesh on the run's device type."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "nvfp4lab", "train", "--precision", "nvfp4", "--preset", "ci", "--steps", "2",
                           "--batch-size", "4", "--eval-interval", "2", "--eval-batches", "1", "--no-plot",
                           "--device", "cpu", "--out", str(tmp_path / "run")],
                          cwd=tmp_path, env=child_env(OMP_NUM_THREADS="1", TQDM_DISABLE="1"), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "completed"
