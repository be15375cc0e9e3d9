"""Run every notebook in book/ and labs/ with papermill in smoke mode, one test per notebook.

Each notebook's first code cell is tagged ``parameters`` and sets ``smoke = False``; the test
injects ``smoke=True`` (plus drive values for the labs, which move their widgets through the same
callbacks a click would). A failure names the notebook, the failing cell and the error; the
executed notebook is kept under pytest's tmp_path. Notebooks named ``*_gpu.ipynb`` ship committed
outputs and are not executed here.
"""

import sys
import time
from pathlib import Path
from queue import Empty

import pytest

pm = pytest.importorskip("papermill")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))   # the book build's extensions: the one home of the kernel manager
from notebook_kernel import SlicedPollChannel, SlicedPollKernelManager, install  # noqa: E402
from child_env import pythonpath  # noqa: E402
NOTEBOOKS = sorted(
    p
    for d in ("book", "labs")
    for p in (ROOT / d).rglob("*.ipynb")
    if ".ipynb_checkpoints" not in p.parts and not p.name.endswith("_gpu.ipynb")
)


# Parameters per notebook; every notebook gets smoke=True. The labs also get drive values.
PARAMS = {
    "quantization_explorer.ipynb": {"kind": "student_t", "fmt": "mxfp4", "block_size": 32, "rht": True},
    "rounding_lab.ipynb": {"u_fraction": 0.2, "steps": 300, "seeds": 4, "noise": 0.0},
}


@pytest.mark.notebooks
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_runs(nb, tmp_path, monkeypatch):
    # The kernel inherits this environment: make the package importable without an install,
    # keep progress bars out of outputs, and plot off-screen.
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    out = tmp_path / nb.name
    params = {"smoke": True, **PARAMS.get(nb.name, {})}
    # Per cell. The slowest smoke cell takes about 80 s on 2 busy cores. The kernel manager's
    # clients poll in slices (book/_ext/notebook_kernel.py), so a missed wake-up costs a second, not
    # the timeout.
    try:
        pm.execute_notebook(
            str(nb), str(out), parameters=params, kernel_name="python3", cwd=str(nb.parent),
            execution_timeout=240, progress_bar=False, log_output=False,
            kernel_manager_class=SlicedPollKernelManager,
        )
    except pm.PapermillExecutionError as e:
        first_line = (e.source or "").strip().splitlines()[0] if (e.source or "").strip() else ""
        pytest.fail(
            f"{nb.relative_to(ROOT)}: cell {e.cell_index} (execution count {e.exec_count}, "
            f"starting {first_line!r}) raised {e.ename}: {e.evalue}\nexecuted notebook: {out}",
            pytrace=False,
        )


def test_the_notebook_kernels_clients_poll_in_slices_and_keep_the_timeout_contract():
    """The kernel manager the notebook test passes hands out SlicedPollChannel clients; a reply
    still arrives, a finite timeout still ends in queue.Empty (not before it, nor long after)."""
    import asyncio

    async def main():
        km = SlicedPollKernelManager(kernel_name="python3")
        await km.start_kernel()
        kc = km.client()
        kc.start_channels()
        try:
            assert isinstance(kc.shell_channel, SlicedPollChannel) and isinstance(kc.iopub_channel, SlicedPollChannel)
            await kc.wait_for_ready(timeout=60)
            msg_id = kc.kernel_info()
            reply = await kc.shell_channel.get_msg(timeout=30)
            assert reply["parent_header"]["msg_id"] == msg_id and reply["msg_type"] == "kernel_info_reply"
            t0 = time.monotonic()
            with pytest.raises(Empty):
                await kc.shell_channel.get_msg(timeout=2.5)   # nothing was asked: three slices, then Empty
            assert 2.5 <= time.monotonic() - t0 < 4.0
        finally:
            kc.stop_channels()
            await km.shutdown_kernel(now=True)

    asyncio.run(main())


def test_the_book_build_executes_notebooks_with_the_sliced_poll_kernel_manager(monkeypatch):
    """book/_ext/notebook_kernel.py's install() (its Sphinx setup) makes jupyter-cache's
    single_nb_execution, which myst-nb's cache mode calls, run a notebook through
    SlicedPollChannel clients; the cell's output still arrives."""
    import nbformat
    from jupyter_cache.executors import utils

    monkeypatch.setattr(utils, "executenb", utils.executenb)   # undone after the test
    polls = []
    get_msg = SlicedPollChannel.get_msg

    async def counted(self, timeout=None):
        polls.append(timeout)
        return await get_msg(self, timeout)

    monkeypatch.setattr(SlicedPollChannel, "get_msg", counted)
    install()
    install()   # idempotent: one wrapper, not two
    assert utils.executenb.keywords == {"kernel_manager_class": SlicedPollKernelManager}
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    result = utils.single_nb_execution(nb, cwd=None, timeout=60, allow_errors=False)
    assert result.err is None
    assert nb.cells[0].outputs[0]["text"].strip() == "42"
    assert polls, "the notebook ran without the sliced-poll channels"
