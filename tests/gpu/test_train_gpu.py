"""nvfp4lab.train (nvfp4lab.training) on CUDA with ``cuda_graph=True``: the captured step trains like the eager one.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_train_gpu.py``.
"""

import gc
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

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


def test_eager_steady_steps_replay_the_layer_graphs_without_copies(tmp_path):
    """``RunResult.layer_graphs`` over an eager run's timed steps: every NVFP4 layer call, forward and
    backward, replays that layer's own CUDA graph (no direct call, no capture, nothing copied out),
    and, the allocator having settled during the warm-up steps, no activation is copied in either:
    the layers read X and dY where they are (before a35272c every layer copied both in on every
    step). BF16 layers use no layer graphs: all counts zero.

    The run starts as a training process does, with no garbage and an empty caching allocator: in a
    full ``pytest -m gpu`` run (H200, TE installed, 72d2ff4) earlier tests' memory, freed during the
    timed steps or cached, kept the allocator from settling: 20 captures in the timed steps, and
    78 of their 80 layer calls replayed owned graphs."""
    common = dict(preset="ci", steps=20, timing_warmup_steps=10, device="cuda", progress=False, plot=False,
                  eval_interval=20, cooldown_frac=0.0)
    gc.collect()
    torch.cuda.empty_cache()
    r = train(TrainConfig(precision="nvfp4", out=str(tmp_path / "nvfp4"), **common))
    g, n = r.layer_graphs, r.layers["nvfp4"]
    assert r.timed_steps == 10 and n > 0
    assert g["calls"] == g["owned_replays"] == 2 * n * r.timed_steps, g
    assert g["direct"] == g["captures"] == g["copying_replays"] == g["bytes_out"] == 0, g
    assert g["bytes_in"] == 0, g
    b = train(TrainConfig(precision="bf16", out=str(tmp_path / "bf16"), **common))
    assert set(b.layer_graphs.values()) == {0}
