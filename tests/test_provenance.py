"""One provenance block, the same keys in every result file (nvfp4lab.provenance)."""

import datetime as dt
import json
import subprocess
from pathlib import Path

import pytest
import torch

from nvfp4lab.provenance import ENVIRONMENT_KEYS, SCHEMA, environment, git_commit, provenance_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "results").glob("*.json"))


def test_environment_keys_and_values():
    env = environment("cpu")
    assert tuple(env) == ENVIRONMENT_KEYS and env["schema"] == SCHEMA
    assert env["device_type"] == "cpu" and env["device"] == env["cpu"] and env["compute_capability"] is None
    assert env["torch"] == torch.__version__ and env["threads"] == torch.get_num_threads()
    assert dt.datetime.fromisoformat(env["date_utc"]).utcoffset() == dt.timedelta(0)
    json.dumps(env)                                   # a result file can hold it as it is


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_git_commit_is_head():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert git_commit().removesuffix("+dirty") == head


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_environment_without_cuda_is_an_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        environment("cuda")


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_result_file_has_one_environment_block(path):
    data = json.loads(path.read_text())
    env = data["environment"]
    assert tuple(env) == ENVIRONMENT_KEYS and env["schema"] == SCHEMA
    assert env["device_type"] in ("cpu", "cuda") and env["date_utc"] and env["git_commit"] and env["torch"]
    table = provenance_table(env, path.name)
    assert f"| what | {path.name} |" in table and env["date_utc"] in table


def test_provenance_table_rejects_an_old_block():
    with pytest.raises(KeyError, match="lacks"):
        provenance_table({"date": "2026-01-01", "device": "cuda"}, "old")
