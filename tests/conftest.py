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
