import contextlib
import os

# `pytest -n N` (pytest-xdist) runs N workers side by side, and a test may start more processes
# (papermill kernels, `nvfp4lab train`, torchrun ranks) that inherit this environment. Left alone,
# each would start one OpenMP thread per core, N times too many for the machine, and OpenMP
# threads that outnumber the cores spin-wait for each other: two side-by-side runs of chapter 08b's
# smoke run on a 2-core machine took 451 s with the default threads and 84 s with one thread each.
# So each worker, and what it starts, gets its share of the cores (unless OMP_NUM_THREADS is set);
# torch reads the variable when it is first imported, below.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

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
