"""The ``nvfp4lab`` command line: subcommand registry, train, compare, errors and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from nvfp4lab import cli
from nvfp4lab.model import GPT
from child_env import child_env

TINY = ["--preset", "ci", "--n-layer", "3", "--n-embd", "32", "--n-head", "2", "--seq-len", "32",
        "--batch-size", "4", "--warmup-steps", "1", "--eval-batches", "1", "--no-progress", "--no-plot"]


def test_registry_and_help(capsys):
    assert {"train", "compare", "probe"} <= set(cli.SUBCOMMANDS)
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "compare" in out


def test_register_a_new_subcommand(capsys, monkeypatch):
    monkeypatch.setattr(cli, "SUBCOMMANDS", dict(cli.SUBCOMMANDS))

    @cli.register_subcommand("hello")
    def _reg(sub):
        p = sub.add_parser("hello")
        p.set_defaults(func=lambda args: print("hi") or 0)

    assert cli.main(["hello"]) == 0 and capsys.readouterr().out == "hi\n"
    cli.SUBCOMMANDS["broken"] = "nvfp4lab.no_such_module:register"
    assert cli.main(["hello"]) == 0                       # a broken lazy registrar only warns
    assert "subcommand 'broken' unavailable" in capsys.readouterr().err


def test_train_command(tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main(["train", "--precision", "nvfp4", *TINY, "--steps", "3", "--eval-interval", "3",
                   "--disable-rht", "--bf16-first-layers", "0", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "final val loss" in text and str(out / "run.json") in text and str(out / "metrics.jsonl") in text
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["recipe"]["disable_rht"] is True and run["config"]["recipe"]["bf16_first_layers"] == 0
    assert run["layers"]["nvfp4"] == 8                     # blocks 0 and 1 of 3, four linears each
    # continue the same run for two more steps
    rc = cli.main(["train", "--precision", "fp8", *TINY, "--steps", "5", "--eval-interval", "5",
                   "--out", str(out), "--resume", str(out)])
    assert rc == 0 and json.loads((out / "run.json").read_text())["steps_completed"] == 5


def test_argument_and_config_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--precision", "fp16"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--cooldown-frac", "1.5"])
    assert e.value.code == 2
    assert cli.main(["train", "--precision", "bf16", "--cooldown-frac", "0.2", *TINY]) == 2
    assert "cooldown_frac" in capsys.readouterr().err
    assert cli.main(["train", *TINY, "--text", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["compare", "--variants", "bf16,nvfp5", *TINY]) == 2
    assert "nvfp5" in capsys.readouterr().err


def test_nonfinite_exit_code(tmp_path, capsys, monkeypatch):
    orig = GPT.forward

    def nan_forward(self, idx, targets=None):
        logits, loss = orig(self, idx, targets)
        return logits, (loss * float("nan") if loss is not None else None)

    monkeypatch.setattr(GPT, "forward", nan_forward)
    rc = cli.main(["train", "--precision", "bf16", *TINY, "--steps", "2", "--out", str(tmp_path / "n")])
    assert rc == 3
    assert "non-finite loss (nan) at step 0" in capsys.readouterr().err


def test_compare_command(tmp_path, capsys):
    rc = cli.main(["compare", "--variants", "bf16,fp8", *TINY, "--steps", "2", "--eval-interval", "2",
                   "--out", str(tmp_path / "cmp")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| fp8 | fp8 |" in out and "compare.md" in out
    assert (tmp_path / "cmp" / "compare.md").exists() and (tmp_path / "cmp" / "fp8" / "run.json").exists()
    # TINY has --no-plot: no PNG at all, neither the runs' nor the comparison's
    assert "plot:" not in out and not list((tmp_path / "cmp").rglob("*.png"))
    plotted = [a for a in TINY if a != "--no-plot"]
    assert cli.main(["compare", "--variants", "bf16", *plotted, "--steps", "1", "--eval-interval", "1",
                     "--out", str(tmp_path / "p")]) == 0
    assert f"plot:  {tmp_path / 'p' / 'compare.png'}" in capsys.readouterr().out
    assert (tmp_path / "p" / "compare.png").exists()


def test_python_dash_m(tmp_path):
    p = subprocess.run([sys.executable, "-m", "nvfp4lab", "train", "--help"], capture_output=True,
                       text=True, env=child_env(), cwd=tmp_path, timeout=120)
    assert p.returncode == 0 and "--precision" in p.stdout and "--cooldown-frac" in p.stdout


def test_backend_te_without_transformer_engine_is_a_clear_error(tmp_path, capsys, monkeypatch):
    """--backend te where TE cannot be imported: exit 2 with the install command, no traceback."""
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails like an absent package
    code = cli.main(["train", "--backend", "te", "--precision", "fp8", "--steps", "1",
                     "--out", str(tmp_path / "te")])
    err = capsys.readouterr().err
    assert code == 2
    assert "transformer-engine[pytorch]==2.20.2" in err and "Traceback" not in err


def test_backend_is_validated():
    from nvfp4lab.training import TrainConfig

    with pytest.raises(ValueError, match="backend"):
        TrainConfig(backend="jax").resolved()


def test_bench_smoke_writes_json_and_plot(tmp_path):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    impls = [row["impl"] for row in data["cpu"]]
    assert impls[0] == "nvfp4lab.quantize" and data["cpu"][0]["ms"] > 0
    from nvfp4lab.provenance import ENVIRONMENT_KEYS

    assert tuple(data["environment"]) == ENVIRONMENT_KEYS and data["environment"]["torch"] == torch.__version__
    assert data["meta"]["kernel_options"]["config"]["rows"]["NB"] > 0 and out.with_suffix(".png").exists()
