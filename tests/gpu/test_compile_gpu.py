"""NVFP4Linear under torch.compile on CUDA (Triton kernels inside the custom ops): the eager
numerics bit for bit, with Inductor and with its CUDA graphs (``mode="reduce-overhead"``), and
``nvfp4lab.train(compile=True)`` with and without ``cuda_graph``.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_compile_gpu.py``.
"""

import copy
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from nvfp4lab.linear import NVFP4Linear  # noqa: E402
from nvfp4lab.recipe import NVFP4Recipe  # noqa: E402
from nvfp4lab.training import TrainConfig, train  # noqa: E402

DEV = "cuda"


def _step(layer, x, gy):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(gy)
    return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("recipe", [NVFP4Recipe(), NVFP4Recipe(disable_stochastic_rounding=True)], ids=["sr", "rne"])
def test_compiled_layer_equals_eager(mode, recipe):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = NVFP4Linear(1024, 768, device=DEV, dtype=torch.bfloat16, recipe=recipe, seed=5)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, mode=mode, fullgraph=True)
    g = torch.Generator(DEV).manual_seed(1)
    for i in range(4):  # reduce-overhead: warm-up runs, then recorded CUDA graphs replayed
        x = torch.randn(2048, 1024, device=DEV, generator=g).to(torch.bfloat16)
        gy = torch.randn(2048, 768, device=DEV, generator=g).to(torch.bfloat16)
        for p in (*eager.parameters(), *compiled_layer.parameters()):
            p.grad = None
        ref = _step(eager, x, gy)
        got = _step(compiled, x, gy)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (mode, i)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["compile", "compile+cuda_graph"])
def test_train_compile(tmp_path, cuda_graph):
    torch._dynamo.reset()
    common = dict(preset="ci", precision="nvfp4", steps=30, device=DEV, progress=False, plot=False,
                  eval_interval=30)
    eager = train(TrainConfig(out=str(tmp_path / "eager"), **common))
    compiled = train(TrainConfig(out=str(tmp_path / "compiled"), compile=True, cuda_graph=cuda_graph, **common))
    assert compiled.status == "completed" and math.isfinite(compiled.final_val_loss)
    assert abs(compiled.final_val_loss - eager.final_val_loss) < 0.05 * eager.final_val_loss
