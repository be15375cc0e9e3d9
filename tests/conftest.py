import contextlib
import os

import pytest
import torch

# Without a GPU, Triton's kernels can only run in its interpreter, and Triton reads this
# variable when it is first imported (by the probe, the kernels or anything else): set it
# before any test module imports Triton, so tests/test_kernels.py checks the kernels on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fused_pair_calls(monkeypatch):
    """Wrap ``nvfp4lab.kernels.quantize_rowwise_columnwise``: the returned list gets ``True`` each
    time the fused rowwise + columnwise kernels run."""
    from nvfp4lab import kernels

    calls: list[bool] = []
    real = kernels.quantize_rowwise_columnwise

    def counting(*args, **kwargs):
        calls.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "quantize_rowwise_columnwise", counting)
    return calls


@pytest.fixture
def kernel_options():
    """``kernel_options(**changes)``: run the kernels with :func:`nvfp4lab.kernels.use_options`
    changes until the end of the test (later calls stack on earlier ones)."""
    from nvfp4lab import kernels

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(kernels.use_options(**changes))
