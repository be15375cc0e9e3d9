"""Automatic fallback: a failing NVFP4 step rolls back to the last checkpoint and the run continues
in the next precision of the chain; the decision survives a crash (kill -9)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from nvfp4lab.training import TrainConfig, compare, train
from nvfp4lab.training.loop import NonFiniteError


def _poison_at(monkeypatch, step_to_fail, precision="nvfp4"):
    """Make the loss non-finite at one step of the NVFP4 session only (an injected failure)."""
    import nvfp4lab.model as model_mod

    real = model_mod.GPT.forward
    calls = {"n": 0}

    def forward(self, idx, targets=None):
        logits, loss = real(self, idx, targets)
        nvfp4 = any(type(m).__name__ == "NVFP4Linear" and m.quantize_enabled for m in self.modules())
        if self.training and torch.is_grad_enabled() and nvfp4:
            calls["n"] += 1
            if calls["n"] == step_to_fail + 1:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(model_mod.GPT, "forward", forward)


def _scale_loss_at(monkeypatch, factors: dict[int, float]) -> None:
    """Multiply the training loss by ``factors[i]`` at the i-th training forward (counted from 1,
    in every precision): an injected spike (a finite factor) or failure (NaN)."""
    import nvfp4lab.model as model_mod

    real = model_mod.GPT.forward
    n = {"i": 0}

    def forward(self, idx, targets=None):
        logits, loss = real(self, idx, targets)
        if self.training and torch.is_grad_enabled():
            n["i"] += 1
            if n["i"] in factors:
                loss = loss * factors[n["i"]]
        return logits, loss

    monkeypatch.setattr(model_mod.GPT, "forward", forward)


def test_nonfinite_falls_back_to_fp8_from_the_last_checkpoint(tmp_path, monkeypatch):
    _poison_at(monkeypatch, 5)
    res = train(TrainConfig(preset="ci", precision="nvfp4", steps=8, on_nonfinite="fallback", checkpoint_interval=4,
                            out=str(tmp_path), progress=False, plot=False, eval_interval=4))
    assert res.status == "completed" and res.precision == "fp8"
    assert res.precision_segments == [
        {"precision": "nvfp4", "from_step": 0, "to_step": 4, "ended_by": "non-finite loss at step 5"},
        {"precision": "fp8", "from_step": 4, "to_step": 8, "ended_by": "completed"}]
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"type": "event", "event": "fallback to fp8", "step": 4,
            "reason": "non-finite loss at step 5 in nvfp4"} in recs
    trains = [r for r in recs if r["type"] == "train"]
    assert all(r["precision"] == ("nvfp4" if r["step"] < 4 else "fp8") for r in trains)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["precision_segments"] == res.precision_segments


def test_exhausted_chain_stops_with_the_error(tmp_path, monkeypatch):
    _poison_at(monkeypatch, 2)
    cfg = TrainConfig(preset="ci", precision="nvfp4", steps=6, on_nonfinite="fallback", fallback_chain=("nvfp4",),
                      out=str(tmp_path), progress=False, plot=False)
    with pytest.raises(NonFiniteError, match="last precision of the fallback chain") as info:
        train(cfg)
    res = info.value.result   # the run so far, also in run.json
    assert res.status == "stopped_nonfinite" and res.steps_completed == 2 and res.message == str(info.value)
    assert json.loads((tmp_path / "run.json").read_text())["message"] == res.message
    # compare records such a run and goes on (it failed on the missing result)
    _poison_at(monkeypatch, 2)
    cmp = compare(cfg, ["nvfp4", ("bf16", {"precision": "bf16", "fallback_chain": ("bf16",)})], out=tmp_path / "cmp",
                  baseline=None)
    assert [r.status for r in cmp.runs.values()] == ["stopped_nonfinite", "completed"]


def test_a_spike_with_action_fallback(tmp_path, monkeypatch):
    """A loss multiplied by 50 at step 30 is a spike at z = 6 and falls back to BF16."""
    _scale_loss_at(monkeypatch, {31: 50.0})
    res = train(TrainConfig(preset="ci", precision="nvfp4", steps=34, spike_z=6.0, spike_action="fallback",
                            fallback_chain=("nvfp4", "bf16"), checkpoint_interval=10, out=str(tmp_path),
                            progress=False, plot=False, eval_interval=34))
    assert res.precision == "bf16"
    assert res.precision_segments[0]["ended_by"].startswith("loss spike (z = ")
    assert res.precision_segments[0]["to_step"] == 30


def test_resume_after_kill_continues_in_the_fallback_precision(tmp_path):
    """kill -9 during the fp8 segment; `--resume` with the original command continues in fp8."""
    script = tmp_path / "run.py"
    script.write_text(f"""
import sys, torch
sys.path.insert(0, {os.getcwd()!r})
import nvfp4lab.model as m
from nvfp4lab.training import TrainConfig, train
real = m.GPT.forward
n = {{"i": 0}}
def forward(self, idx, targets=None):
    logits, loss = real(self, idx, targets)
    if self.training and torch.is_grad_enabled() and any(type(x).__name__ == "NVFP4Linear" for x in self.modules()):
        n["i"] += 1
        if n["i"] == 4:
            loss = loss * float("nan")
    return logits, loss
m.GPT.forward = forward
train(TrainConfig(preset="ci", precision="nvfp4", steps=400, on_nonfinite="fallback", checkpoint_interval=2,
                  out={str(tmp_path / 'run')!r}, progress="lines", plot=False, eval_interval=400))
""")
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True)
    ckpt = tmp_path / "run" / "checkpoint.pt"
    deadline = time.time() + 120
    while time.time() < deadline:   # wait until the fp8 segment has written a checkpoint past step 2
        if ckpt.exists():
            try:
                state = torch.load(ckpt, weights_only=True, map_location="cpu")
                if state["config"]["precision"] == "fp8" and state["step"] >= 6:
                    break
            except Exception:
                pass
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    at = int(torch.load(ckpt, weights_only=True, map_location="cpu")["step"])
    res = train(TrainConfig(preset="ci", precision="nvfp4", steps=at + 4, on_nonfinite="fallback", checkpoint_interval=2,
                            out=str(tmp_path / "run"), resume=str(tmp_path / "run"), progress=False, plot=False,
                            eval_interval=2))
    assert res.precision == "fp8" and res.status == "completed"
    assert res.precision_segments[0] == {"precision": "nvfp4", "from_step": 0, "to_step": 2,
                                         "ended_by": "non-finite loss at step 3"}


def test_two_fallbacks_through_an_alias_in_the_chain(tmp_path, monkeypatch):
    """The default chain names "fp8", an alias of "fp8-current": a second failure, in the FP8
    session, must still find its place in the chain and fall back to BF16 (it raised ValueError:
    'fp8-current' is not in list)."""
    _scale_loss_at(monkeypatch, {6: float("nan"), 12: float("nan")})   # once in the NVFP4 session, once in FP8
    res = train(TrainConfig(preset="ci", precision="nvfp4", steps=12, on_nonfinite="fallback", checkpoint_interval=4,
                            out=str(tmp_path), progress=False, plot=False, eval_interval=4))
    assert res.status == "completed" and res.precision == "bf16"
    assert [s["precision"] for s in res.precision_segments] == ["nvfp4", "fp8", "bf16"]
