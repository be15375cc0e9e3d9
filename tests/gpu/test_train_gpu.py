"""nvfp4lab.train (nvfp4lab.training) on CUDA with ``cuda_graph=True``: the captured step trains like the eager one.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_train_gpu.py``.
"""

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
