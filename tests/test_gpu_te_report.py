"""``benchmarks/gpu_te_report.py --smoke`` runs here (CPU, no TE) and writes a well-formed report.

The full run is the GPU machine's (see the script's docstring); here every section must end
"ok" or "skipped" (never "error"), TE/GPU parts must say why they were skipped, and the
nvfp4lab training runs must produce finite losses. ~10 s on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_te_report.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("gpu_te_report", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("te_gpu")
    threads = torch.get_num_threads()
    rc = mod.main(["--smoke", "--out", str(out), "--strict"])
    assert torch.get_num_threads() == threads  # the smoke run restores the thread count
    assert rc == 0
    data = json.loads((out / "te_gpu.json").read_text())
    return mod, out, data


def test_files_and_schema(report):
    mod, out, data = report
    assert data["schema"] == "nvfp4lab.te_gpu_report/1" and data["mode"] == "smoke"
    assert list(data["sections"]) == list(mod.SECTIONS)
    assert data["files"] == {"json": "te_gpu.json", "png": "te_gpu.png"}
    assert (out / "te_gpu.png").stat().st_size > 1000
    assert sorted(p.name for p in out.iterdir()) == ["te_gpu.json", "te_gpu.png"]  # no stray files
    for name, sec in data["sections"].items():
        assert sec["status"] in ("ok", "skipped"), (name, sec)
        assert sec["seconds"] >= 0
        if sec["status"] == "skipped":
            assert sec["reason"], name


def test_environment_and_probe(report):
    _, _, data = report
    from nvfp4lab.provenance import ENVIRONMENT_KEYS

    assert tuple(data["environment"]) == ENVIRONMENT_KEYS           # the one provenance block
    assert data["environment"]["device_type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert {"nvte_env", "tf32_matmul", "transformer_engine_error"} <= set(data["sections"]["environment"])
    probe = data["sections"]["probe"]
    assert set(probe["caps"]["formats"]) == {"bf16", "fp8-delayed", "fp8-current", "fp8-block", "mxfp8", "nvfp4"}
    assert "recommendation" in probe["table"]


def test_training_section(report):
    _, _, data = report
    tr = data["sections"]["training"]
    runs = tr["runs"]
    assert set(runs) == {"te-bf16", "te-fp8-current", "te-fp8-delayed", "te-fp8-block", "te-nvfp4",
                         "nvfp4lab-bf16", "nvfp4lab-nvfp4", "nvfp4lab-bf16-graph", "nvfp4lab-nvfp4-graph"}
    for name in ("nvfp4lab-bf16", "nvfp4lab-nvfp4"):
        r = runs[name]
        assert r["status"] == "ok", r
        assert len(r["train_loss"]) == tr["setup"]["steps"]
        assert all(math.isfinite(v) for v in r["train_loss"])
        assert abs(r["train_loss"][0] - math.log(256)) < 1.0  # starts near chance (byte vocabulary)
        assert r["tokens_per_s"] > 0 and r["val_curve"][-1][0] == tr["setup"]["steps"]
    assert runs["nvfp4lab-nvfp4"]["layers"]["nvfp4"] == 4  # ci preset: 3 blocks, the middle one NVFP4
    if not torch.cuda.is_available():
        for name in ("te-bf16", "te-fp8-current", "te-nvfp4", "nvfp4lab-nvfp4-graph"):
            assert runs[name]["status"] == "skipped" and runs[name]["reason"]


def test_reference_and_timings_sections(report):
    mod, _, data = report
    ref = data["sections"]["reference_vs_nvfp4lab"]
    lt = data["sections"]["linear_timings"]
    assert lt["status"] == "ok"
    assert lt["results"]["torch-bf16"]["status"] == "ok" and lt["results"]["nvfp4lab-nvfp4"]["status"] == "ok"
    assert lt["results"]["torch-bf16"]["vs_torch_bf16"] == 1.0
    if not torch.cuda.is_available():
        assert ref["status"] == "skipped"
        assert lt["results"]["te-fp8-current"]["status"] == "skipped"
    assert mod.REL_TOL < 8e-3  # below TE's own NVFP4 GEMM tolerance
