"""Quantization health statistics: exact answers on constructed tensors, equal to a direct
computation on captured operands, and a health pass that leaves the run unchanged."""

import math

import pytest
import torch

from nvfp4lab.health import HEALTH_STATS, health_pass, operand_stats
from nvfp4lab.linear import capture_gemm_operands, convert_model
from nvfp4lab.model import GPT, GPTConfig
from nvfp4lab.quantize import quantize
from nvfp4lab.recipe import NVFP4Recipe


def test_exact_answers_on_a_constructed_tensor():
    x = torch.zeros(16, 64)
    x[0, :16] = 6.0                  # block amax = tensor amax: scale 448 (saturated), exact
    x[1, :16] = 1e-6                 # block scale underflows to 0 next to the large block
    x[2, :16] = torch.tensor([6.0] + [0.01] * 15)  # scale 448, encode scale 1: 0.01 rounds to code 0
    q = quantize(x)
    s = operand_stats(x, q)
    assert set(s) == set(HEALTH_STATS)
    codes = q.codes()
    assert s["underflows%"] == pytest.approx(100 * (int(x.count_nonzero()) - int(((codes & 7) != 0).sum())) / x.numel())
    # row 2's 15 small values flush to code 0; row 1's block keeps codes ±6 under a zero scale, so
    # TE's underflows% does not see it (codes only) and scale_zero% does
    assert s["underflows%"] == pytest.approx(100 * 15 / x.numel())
    assert s["scale_zero%"] == pytest.approx(100 * 1 / (16 * 4))
    assert s["scale_saturated%"] == pytest.approx(100 * 2 / (16 * 4))   # rows 0 and 2 hold a 6.0
    assert s["amax"] == 6.0
    err = q.dequantize() - x
    assert s["mse"] == pytest.approx(float(err.double().square().mean()))
    assert s["sqnr_db"] == pytest.approx(10 * math.log10(float(x.double().square().sum()) / float(err.double().square().sum())))
    exact = torch.tensor([[1.0, 2.0, 3.0, 6.0] * 4])
    assert operand_stats(exact, quantize(exact))["sqnr_db"] == math.inf


def test_health_pass_equals_direct_computation_and_changes_nothing():
    torch.manual_seed(0)
    model = convert_model(GPT(GPTConfig(block_size=32, n_layer=3, n_head=2, n_embd=32)), "nvfp4",
                          NVFP4Recipe(bf16_first_layers=0, bf16_last_layers=1))
    x = torch.randint(0, 256, (2, 32))
    y = torch.randint(0, 256, (2, 32))
    states = [m.sr_streams()[0].get_state() for m in model.modules() if hasattr(m, "sr_streams") and m.sr_streams()]
    records = health_pass(model, x, y)
    assert all(p.grad is None for p in model.parameters())   # .grad untouched
    after = [m.sr_streams()[0].get_state() for m in model.modules() if hasattr(m, "sr_streams") and m.sr_streams()]
    assert all(torch.equal(a, b) for a, b in zip(states, after))  # SR sources restored
    n_layers = sum(1 for m in model.modules() if type(m).__name__ == "NVFP4Linear")
    assert len(records) == 6 * n_layers
    # the same operands captured directly give the same statistics
    with capture_gemm_operands() as ops:
        _, loss = model(x, y)
        loss.backward()
    direct = {(o.layer, o.gemm, o.operand): operand_stats(o.source, o.tensor) for o in ops}
    for r in records:
        d = direct[(r["layer"], r["gemm"], r["operand"])]
        for k in HEALTH_STATS:
            assert r[k] == d[k] or (math.isnan(r[k]) and math.isnan(d[k])), (r["layer"], r["operand"], k)


def test_training_with_health_records_every_interval_and_trains_identically(tmp_path):
    """health_interval=2: health.jsonl holds 6 operands per NVFP4 layer at steps 0, 2, 4; the losses
    equal those of the same run without it (the pass has no side effects)."""
    import json

    from nvfp4lab.training import TrainConfig, train

    common = dict(preset="ci", precision="nvfp4", steps=5, progress=False, plot=False, eval_interval=5)
    plain = train(TrainConfig(out=str(tmp_path / "plain"), **common))
    with_health = train(TrainConfig(out=str(tmp_path / "health"), health_interval=2, **common))
    assert plain.final_train_loss is not None and with_health.final_train_loss == plain.final_train_loss
    assert with_health.final_val_loss == plain.final_val_loss
    recs = [json.loads(line) for line in (tmp_path / "health" / "health.jsonl").read_text().splitlines()]
    nvfp4_layers = with_health.layers["nvfp4"]
    assert sorted({r["step"] for r in recs}) == [0, 2, 4]
    assert len(recs) == 3 * 6 * nvfp4_layers
    assert with_health.health_time_s > 0 and plain.health_time_s is None


def test_report_cli_draws_a_run(tmp_path):
    import subprocess
    import sys

    from nvfp4lab.training import TrainConfig, train

    train(TrainConfig(preset="ci", precision="nvfp4", steps=4, out=str(tmp_path / "run"), progress=False,
                      plot=False, eval_interval=2, health_interval=2, cooldown_step=3))
    out = subprocess.run([sys.executable, "-m", "nvfp4lab", "report", str(tmp_path / "run")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    png = tmp_path / "run" / "report.png"
    assert out.stdout.strip() == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "nvfp4lab", "report", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("nvfp4lab report: error:") and "Traceback" not in bad.stderr
