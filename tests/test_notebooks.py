"""Run every notebook in book/ and labs/ with papermill in smoke mode, one test per notebook.

Each notebook's first code cell is tagged ``parameters`` and sets ``smoke = False``; the test
injects ``smoke=True`` (plus drive values for the labs, which move their widgets through the same
callbacks a click would). A failure names the notebook, the failing cell and the error; the
executed notebook is kept under pytest's tmp_path. Notebooks named ``*_gpu.ipynb`` ship committed
outputs and are not executed here.
"""

import os
from pathlib import Path

import pytest

pm = pytest.importorskip("papermill")

ROOT = Path(__file__).resolve().parents[1]
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
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    out = tmp_path / nb.name
    params = {"smoke": True, **PARAMS.get(nb.name, {})}
    # Per cell. The slowest smoke cell takes about 80 s on 2 busy cores. A cell that moves widgets
    # has once waited out the whole timeout for an execute reply the kernel had sent (the kernel
    # idle, the cell then completed; nbclient's open issue jupyter/nbclient#312), so the timeout
    # also bounds that wait.
    try:
        pm.execute_notebook(
            str(nb), str(out), parameters=params, kernel_name="python3", cwd=str(nb.parent),
            execution_timeout=240, progress_bar=False, log_output=False,
        )
    except pm.PapermillExecutionError as e:
        first_line = (e.source or "").strip().splitlines()[0] if (e.source or "").strip() else ""
        pytest.fail(
            f"{nb.relative_to(ROOT)}: cell {e.cell_index} (execution count {e.exec_count}, "
            f"starting {first_line!r}) raised {e.ename}: {e.evalue}\nexecuted notebook: {out}",
            pytrace=False,
        )
