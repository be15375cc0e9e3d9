"""What a new user gets when something is wrong: one line, the right exit code, no traceback.

Each test runs the real command line (``python -m nvfp4lab ...``) in a subprocess, with stdout and
stderr piped (so not a terminal, as in CI logs or ``nohup``), and asserts the exit code, the
one-line ``nvfp4lab <cmd>: error: ...`` message and that no ``Traceback`` reaches stderr.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import nvfp4lab
from nvfp4lab.training import PREVIOUS_CHECKPOINT_NAME, lr_at, load_checkpoint
from child_env import child_env

ENV = child_env(TQDM_DISABLE="1", MPLBACKEND="Agg")
TINY = ["--preset", "ci", "--eval-interval", "2", "--eval-batches", "1", "--no-plot"]


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvfp4lab", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def one_error_line(r: subprocess.CompletedProcess, cmd: str) -> str:
    """The single ``nvfp4lab <cmd>: error:`` line of a failed run (exit 2, no traceback)."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"nvfp4lab {cmd}: error: "), r.stderr
    assert "weights_only=False" not in r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    d = tmp_path_factory.mktemp("cli")
    r = cli("train", *TINY, "--steps", "4", "--out", "run", cwd=d)
    assert r.returncode == 0, r.stderr
    return d / "run"


def test_truncated_checkpoint_names_the_file_and_the_previous_good_one(run_dir, tmp_path):
    bad = tmp_path / "run"
    bad.mkdir()
    data = (run_dir / "checkpoint.pt").read_bytes()
    (bad / "checkpoint.pt").write_bytes(data[: len(data) // 2])          # a crash or a full disk
    line = one_error_line(cli("train", *TINY, "--steps", "6", "--resume", str(bad), cwd=tmp_path), "train")
    assert str(bad / "checkpoint.pt") in line and "truncated or corrupt" in line
    assert "previous" not in line                                         # there is none here
    (bad / PREVIOUS_CHECKPOINT_NAME).write_bytes((run_dir / PREVIOUS_CHECKPOINT_NAME).read_bytes())
    line = one_error_line(cli("train", *TINY, "--steps", "6", "--resume", str(bad), cwd=tmp_path), "train")
    assert f"the previous checkpoint {bad / PREVIOUS_CHECKPOINT_NAME} (step 2) is good" in line


def test_empty_checkpoint(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    line = one_error_line(cli("train", *TINY, "--resume", "checkpoint.pt", cwd=tmp_path), "train")
    assert "checkpoint.pt is empty (0 bytes)" in line


def test_wrong_file_is_not_a_checkpoint(run_dir, tmp_path):
    line = one_error_line(cli("train", *TINY, "--resume", str(run_dir / "run.json"), cwd=tmp_path), "train")
    assert "run.json is a JSON file, so not an nvfp4lab checkpoint" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("cmd", ["train", "compare", "bench"])
def test_cuda_device_without_cuda(tmp_path, cmd):
    line = one_error_line(cli(cmd, "--device", "cuda", *(TINY if cmd != "bench" else ["--smoke"]), cwd=tmp_path), cmd)
    assert "CUDA is not available here" in line and "--device cpu" in line


def test_unknown_device(tmp_path):
    line = one_error_line(cli("train", *TINY, "--device", "gpu", cwd=tmp_path), "train")
    assert "'gpu' is not a torch device" in line


def test_piped_output_that_is_cut_short_ends_quietly(tmp_path):
    # `nvfp4lab probe --json | head`: the reader goes away before the command writes.
    p = subprocess.Popen([sys.executable, "-m", "nvfp4lab", "probe", "--json"], cwd=tmp_path, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == ""


def test_non_terminal_output_shows_a_start_line_and_progress(run_dir):
    r = cli("train", *TINY, "--steps", "4", "--warmup-steps", "2", "--out", "progress", cwd=run_dir.parent)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("[nvfp4] start: precision nvfp4 (nvfp4lab), preset ci") and "4 steps" in lines[0]
    steps = [line for line in lines if line.startswith("[nvfp4] step ")]
    assert [s.split()[2] for s in steps] == ["1/4", "2/4", "3/4", "4/4"]   # every tenth of a 4-step run
    assert all("loss" in s and "tok/s" in s and "ETA" in s for s in steps)


def _lrs(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, metrics.read_text().splitlines()) if r["type"] == "train"}


def test_resume_with_more_steps_keeps_the_schedule_unless_extended(run_dir, tmp_path):
    base = dict(lr=3e-3, warmup_steps=5, min_lr_frac=0.1)   # the ci preset's (nvfp4lab.training.TRAIN_PRESETS)
    for extend in (False, True):
        out = tmp_path / f"extend{extend}"
        r = cli("train", *TINY, "--steps", "8", "--log-interval", "1", "--resume", str(run_dir), "--out", str(out),
                *(["--extend-schedule"] if extend else []), cwd=tmp_path)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert "[nvfp4] resumed from step 4 of 8 (precision nvfp4" in r.stderr
        schedule = 8 if extend else 4
        assert ("schedule now spans 8 steps instead of 4" in r.stderr) is extend
        assert ("the LR stays at its final value after step 4" in r.stderr) is not extend
        lrs = _lrs(out / "metrics.jsonl")
        for step in range(4, 8):
            assert math.isclose(lrs[step], lr_at(step, steps=schedule, **base), rel_tol=1e-12)
        assert "resumed at step 4" in r.stdout and "in total" in r.stdout
        result = json.loads((out / "run.json").read_text())
        assert result["resumed_from_step"] == 4 and result["total_wall_time_s"] > result["wall_time_s"]


def test_kill_9_during_training_leaves_a_good_checkpoint(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "nvfp4lab", "train", *TINY, "--steps", "400",
                          "--checkpoint-interval", "1", "--out", "run"], cwd=tmp_path, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / PREVIOUS_CHECKPOINT_NAME).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)                       # somewhere in the middle of later steps and their checkpoints
    p.send_signal(signal.SIGKILL)
    p.wait()
    ckpt = load_checkpoint(tmp_path / "run")                        # the latest is complete
    # the previous one is older, or (killed between the rotation's two renames) the same checkpoint
    # hard-linked under both names: nothing already written is lost either way
    assert ckpt["step"] >= 2 and load_checkpoint(tmp_path / "run" / PREVIOUS_CHECKPOINT_NAME)["step"] <= ckpt["step"]


def test_quantize_inf_keeps_te_numerics_and_warns_once_per_call_site():
    x = torch.tensor([1.0, math.inf, 0.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")              # Python's default: once per location
        outs = [nvfp4lab.quantize(x).dequantize() for _ in range(3)]
    assert [w.category for w in caught] == [RuntimeWarning]
    assert "contains ±Inf" in str(caught[0].message) and caught[0].filename == __file__
    for out in outs:
        assert out.tolist() == [0.0, 2688.0, 0.0]          # TE's reference gives the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nvfp4lab.quantize(torch.tensor([1.0, 3.0e38, 0.0]))   # large but finite: no warning


def test_a_warning_is_one_line_shown_once(tmp_path):
    # the preset's 5 warm-up steps exceed a 2-step run: TrainConfig.resolved warns, and the CLI
    # resolves the config twice (to report errors before training, then in train())
    r = cli("train", *TINY, "--steps", "2", "--out", "short", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "warning" in ln.lower()]
    assert lines == ["nvfp4lab: warning: warmup_steps=5 is longer than the 2-step schedule: the learning rate "
                     "peaks at 0.0012, not lr=0.003; set warmup_steps <= 2 to reach it"]
