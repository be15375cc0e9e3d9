"""Training loop, checkpoints (atomic, weights_only, bit-identical resume), safety, compare."""

from __future__ import annotations

import importlib
import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch

from nvfp4lab.model import GPT, get_preset
from nvfp4lab.recipe import NVFP4Recipe
# the loop's module (its save_checkpoint is patched to simulate a crash)
train_mod = importlib.import_module("nvfp4lab.training.loop")

from nvfp4lab.training import (  # noqa: E402
    CHECKPOINT_NAME,
    NonFiniteError,
    TrainConfig,
    compare,
    load_checkpoint,
    lr_at,
    save_checkpoint,
    train,
)


def tiny(out, **kw) -> TrainConfig:
    """A model small enough for a training step in a few milliseconds (3 blocks of width 32)."""
    base = dict(preset="ci", n_layer=3, n_embd=32, n_head=2, seq_len=32, batch_size=4, steps=6,
                warmup_steps=2, eval_interval=3, eval_batches=1, log_interval=1, out=str(out),
                progress=False, plot=False)
    base.update(kw)
    return TrainConfig(**base)


def records(run_dir, kind):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["type"] == kind]


def model_state(run_dir):
    return load_checkpoint(run_dir)["model"]


def test_lr_schedule():
    kw = dict(lr=1.0, steps=110, warmup_steps=10, min_lr_frac=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(109, **kw) == pytest.approx(0.1)
    assert lr_at(10 + 99 // 2, **kw) == pytest.approx(0.55, abs=0.02)
    lrs = [lr_at(s, **kw) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_a_warmup_longer_than_the_schedule_warns_with_the_peak_it_reaches():
    with pytest.warns(UserWarning, match=r"warmup_steps=40 is longer than the 10-step schedule.*peaks at 0.0005"):
        c = TrainConfig(preset="laptop", steps=10, lr=2e-3).resolved()
    peak = max(lr_at(s, lr=c.lr, steps=c.steps, warmup_steps=c.warmup_steps, min_lr_frac=c.min_lr_frac)
               for s in range(c.steps))
    assert peak == pytest.approx(5e-4)
    with pytest.warns(UserWarning, match="20-step schedule"):   # the schedule, not the run, is what counts
        TrainConfig(preset="laptop", steps=10, schedule_steps=20).resolved()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainConfig(preset="laptop", steps=10, schedule_steps=400).resolved()
        TrainConfig(preset="ci", steps=5).resolved()   # warm-up as long as the run: lr reached at its last step


def test_config_resolution_and_validation():
    c = TrainConfig(preset="laptop").resolved()
    assert c.batch_size > 0 and c.steps > 0 and c.n_embd == 128 and c.checkpoint_interval == c.eval_interval
    assert TrainConfig.from_dict(c.to_dict()) == c
    json.dumps(c.to_dict())                                            # plain data
    for bad in (dict(precision="fp16"), dict(preset="huge"), dict(cooldown_frac=1.0),
                dict(precision="bf16", cooldown_frac=0.2), dict(on_nonfinite="ignore"), dict(steps=0),
                dict(n_embd=30, n_head=4)):
        with pytest.raises(ValueError):
            TrainConfig(**bad).resolved()
    # non-finite or out-of-range optimizer settings (a NaN grad_clip would switch clipping off unnoticed)
    for bad, field in ((dict(lr=math.inf), "lr"), (dict(lr=math.nan), "lr"), (dict(beta1=1.5), "beta1"),
                       (dict(beta2=math.nan), "beta2"), (dict(grad_clip=math.nan), "grad_clip"),
                       (dict(weight_decay=math.inf), "weight_decay")):
        with pytest.raises(ValueError, match=f"TrainConfig.{field} must be"):
            TrainConfig(**bad).resolved()
    assert TrainConfig(grad_clip=0.0, weight_decay=0.0, beta1=0.0).resolved().grad_clip == 0.0   # 0: clipping off
    # the recipe's BF16 blocks are checked against the resolved depth (ci: 3 blocks) before anything runs
    with pytest.raises(ValueError, match="keeps all 3 blocks in BF16"):
        TrainConfig(preset="ci", recipe=NVFP4Recipe(bf16_first_layers=1, bf16_last_layers=2)).resolved()
    with pytest.raises(ValueError, match="= 4 blocks in BF16, but the model has only 3"):
        TrainConfig(preset="ci", recipe=NVFP4Recipe(bf16_first_layers=2, bf16_last_layers=2)).resolved()
    assert TrainConfig(preset="ci", precision="bf16", recipe=NVFP4Recipe(bf16_first_layers=2, bf16_last_layers=2)
                       ).resolved().n_layer == 3                       # no NVFP4 layer: the recipe is not used
    v = TrainConfig().with_variant("nvfp4-all-layers")
    assert v.recipe == NVFP4Recipe(bf16_first_layers=0, bf16_last_layers=0, quantize_lm_head=True)
    assert v.name == "nvfp4-all-layers"
    with pytest.raises(ValueError, match="unknown variant"):
        TrainConfig().with_variant("nvfp2")
    cooled = TrainConfig(cooldown_frac=0.2)
    assert cooled.with_variant("bf16").cooldown_frac == 0.0            # no cooldown for a BF16 run
    assert cooled.with_variant("nvfp4-no-sr").cooldown_frac == 0.2


def test_train_writes_everything_and_learns(tmp_path):
    r = train(tiny(tmp_path / "bf16", precision="bf16", steps=12, lr=1e-2, eval_interval=6, plot=True))
    assert r.status == "completed" and r.steps_completed == 12
    out = Path(r.out_dir)
    for f in ("metrics.jsonl", "run.json", "loss.png", CHECKPOINT_NAME):
        assert (out / f).exists(), f
    losses = [x["loss"] for x in records(out, "train")]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5          # from ~5.5 nats (uniform)
    assert [e["step"] for e in records(out, "eval")] == [6, 12]
    assert r.final_val_loss == records(out, "eval")[-1]["val_loss"]
    run = json.loads((out / "run.json").read_text())
    assert run["data"]["tokenizer"]["name"] == "bytes-utf8"
    assert run["data"]["split"]["method"] == "interleaved-chunks"
    assert run["data"]["corpus"]["source"] == "pydoc_data.topics"
    assert run["config"]["precision"] == "bf16" and run["environment"]["torch"] == torch.__version__
    assert r.tokens_per_s > 0 and r.peak_memory_bytes > 0
    # checkpoints load with weights_only=True (load_checkpoint uses it) and hold only FP32 state
    ck = load_checkpoint(out)
    assert ck["step"] == 12 and all(v.dtype == torch.float32 for v in ck["model"].values())
    assert set(ck["rng"]) == {"torch", "data", "sr"} and ck["rng"]["sr"].dtype == torch.int64
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]    # no temp files left


def test_resume_is_bit_identical_nvfp4(tmp_path):
    """8 steps straight == 4 steps, checkpoint, resume for 4 more (SR generator state restored)."""
    full = train(tiny(tmp_path / "full", precision="nvfp4", steps=8, eval_interval=4))
    ck4 = tmp_path / "step4.pt"
    _train_until(tiny(tmp_path / "b", precision="nvfp4", steps=8, eval_interval=4, checkpoint_interval=4), 4, ck4)
    r2 = train(tiny(tmp_path / "b", precision="nvfp4", steps=8, eval_interval=4, resume=str(ck4)))
    a, b = model_state(full.out_dir), model_state(r2.out_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = load_checkpoint(full.out_dir)["optimizer"], load_checkpoint(r2.out_dir)["optimizer"]
    assert all(torch.equal(oa["state"][i]["exp_avg_sq"], ob["state"][i]["exp_avg_sq"]) for i in oa["state"])
    assert r2.val_curve == full.val_curve
    assert [x["loss"] for x in records(r2.out_dir, "train")] == [x["loss"] for x in records(full.out_dir, "train")]


def _train_until(cfg: TrainConfig, step: int, copy_to: Path) -> None:
    """Run ``cfg`` but abort right after the checkpoint of ``step`` is written; copy it to ``copy_to``."""
    real_save = train_mod.save_checkpoint

    class Stop(Exception):
        pass

    def save_and_stop(path, state):
        real_save(path, state)
        if state["step"] == step:
            real_save(copy_to, state)
            raise Stop

    train_mod.save_checkpoint = save_and_stop
    try:
        with pytest.raises(Stop):
            train(cfg)
    finally:
        train_mod.save_checkpoint = real_save


@pytest.mark.parametrize("first,second", [("fp8", "nvfp4"), ("nvfp4", "fp8")])
def test_resume_in_another_precision(tmp_path, first, second):
    r1 = train(tiny(tmp_path / first, precision=first, steps=4, eval_interval=4))
    r2 = train(tiny(tmp_path / second, precision=second, steps=8, eval_interval=4, resume=r1.out_dir))
    assert r2.status == "completed" and r2.steps_completed == 8
    assert [e["step"] for e in records(r2.out_dir, "eval")] == [8]
    assert {x["precision"] for x in records(r2.out_dir, "train")} == {second}
    assert math.isfinite(r2.final_val_loss)


def test_resume_refuses_a_different_model(tmp_path):
    r1 = train(tiny(tmp_path / "a", precision="bf16", steps=2, eval_interval=2))
    with pytest.raises(ValueError, match="n_embd"):
        train(tiny(tmp_path / "b", precision="bf16", n_embd=48, steps=4, resume=r1.out_dir))


def nan_after(n):
    """A GPT.forward replacement whose training-mode loss is NaN from the (n+1)-th call on."""
    orig = GPT.forward
    calls = [0]

    def forward(model, idx, targets=None):
        logits, loss = orig(model, idx, targets)
        if model.training:
            calls[0] += 1
            if calls[0] > n and loss is not None:
                loss = loss * float("nan")
        return logits, loss

    return forward


def test_nonfinite_loss_stops_naming_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(GPT, "forward", nan_after(5))
    cfg = tiny(tmp_path / "nan", precision="nvfp4", steps=10, eval_interval=2, checkpoint_interval=2)
    with pytest.raises(NonFiniteError, match="non-finite loss .* at step 5") as ei:
        train(cfg)
    exc = ei.value
    assert exc.step == 5 and exc.what == "loss"
    assert exc.checkpoint is not None and load_checkpoint(exc.checkpoint)["step"] == 4   # last good one
    assert exc.result.status == "stopped_nonfinite"
    run = json.loads((tmp_path / "nan" / "run.json").read_text())
    assert run["status"] == "stopped_nonfinite" and "step 5" in run["message"]


def test_nonfinite_skip_option(tmp_path, monkeypatch):
    monkeypatch.setattr(GPT, "forward", nan_after(3))
    r = train(tiny(tmp_path / "skip", precision="bf16", steps=6, on_nonfinite="skip"))
    assert r.status == "completed" and r.skipped_steps == 3
    assert [x["step"] for x in records(r.out_dir, "nonfinite")] == [3, 4, 5]


def test_cooldown_switches_to_bf16(tmp_path):
    r = train(tiny(tmp_path / "cool", precision="nvfp4", steps=8, cooldown_frac=0.25, eval_interval=8))
    prec = [x["precision"] for x in records(r.out_dir, "train")]
    assert prec == ["nvfp4"] * 6 + ["bf16"] * 2
    assert [e["step"] for e in records(r.out_dir, "event") if e["event"] == "bf16 cooldown"] == [6]


def test_checkpoint_atomic_and_validated(tmp_path):
    p = tmp_path / "c.pt"
    save_checkpoint(p, {"format": 1, "step": 3, "x": torch.ones(2)})
    assert load_checkpoint(p)["step"] == 3
    assert os.listdir(tmp_path) == ["c.pt"]

    class Boom:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(Exception):
        save_checkpoint(p, {"format": 1, "step": 4, "bad": Boom()})
    assert load_checkpoint(p)["step"] == 3 and os.listdir(tmp_path) == ["c.pt"]   # old file intact
    torch.save({"hello": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an nvfp4lab checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.pt")


def test_compare_writes_table_and_plot(tmp_path):
    res = compare(tiny(tmp_path, steps=3, eval_interval=3, plot=True),
                  ["bf16", "nvfp4-no-rht", ("custom", {"precision": "fp8"})], out=tmp_path / "cmp")
    assert list(res.runs) == ["bf16", "nvfp4-no-rht", "custom"]
    assert res.runs["nvfp4-no-rht"].config["recipe"]["disable_rht"] is True
    table = Path(res.table_path).read_text()
    assert "| nvfp4-no-rht | nvfp4 |" in table and "+0.00%" in table   # bf16 vs itself
    assert Path(res.plot_path).exists() and json.loads(Path(res.json_path).read_text())["baseline"] == "bf16"
    with pytest.raises(ValueError, match="duplicate"):
        compare(tiny(tmp_path), ["bf16", "bf16"], out=tmp_path / "dup")


def test_compare_in_two_processes_gives_the_bits_of_one_process(tmp_path):
    """jobs=2 trains the variants in spawned processes: the same results, in the variants' order."""
    cfg = tiny(tmp_path, steps=4, eval_interval=2, threads=1)
    variants = ["nvfp4", "bf16", ("nvfp4-sr-off", {"recipe": {"disable_stochastic_rounding": True}})]
    one = compare(cfg, variants, out=tmp_path / "one")
    two = compare(cfg, variants, out=tmp_path / "two", jobs=2)
    assert list(two.runs) == list(one.runs) == ["nvfp4", "bf16", "nvfp4-sr-off"]
    for name, r in one.runs.items():
        assert two.runs[name].val_curve == r.val_curve and two.runs[name].final_train_loss == r.final_train_loss
        assert two.runs[name].status == "completed" and Path(two.runs[name].out_dir).parent == tmp_path / "two"
    assert Path(two.table_path).exists()
    assert one.plot_path is two.plot_path is None and not list(tmp_path.rglob("*.png"))   # plot=False: no PNG
    with pytest.raises(ValueError, match="jobs must be a positive int"):
        compare(cfg, variants, jobs=0)
    with pytest.raises(ValueError, match="threads must be a positive int"):   # refused before anything trains
        compare(cfg, ["bf16", ("bad", {"threads": -1})], out=tmp_path / "bad", jobs=2)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):   # a worker's error reaches the caller
        compare(cfg, ["bf16", ("bad", {"text": str(tmp_path / "missing.txt")})], out=tmp_path / "bad2", jobs=2)
    with pytest.raises(ValueError, match="baseline 'bf61' is not one of the variants"):
        compare(cfg, ["bf16", "nvfp4"], out=tmp_path / "typo", baseline="bf61")


def test_compare_refuses_jobs_under_several_ranks(tmp_path, monkeypatch):
    """Under torchrun every variant already trains on all ranks: jobs > 1 is an error there."""
    from nvfp4lab.training import distributed

    monkeypatch.setattr(distributed, "setup", lambda device: distributed.DistContext(rank=0, world_size=2))
    monkeypatch.setattr(distributed, "teardown", lambda ctx: None)
    with pytest.raises(ValueError, match="jobs=2 under torchrun with 2 ranks"):
        compare(tiny(tmp_path), ["bf16", "nvfp4"], out=tmp_path / "c", jobs=2)


def test_cuda_graph_needs_cuda_and_the_nvfp4lab_backend():
    with pytest.raises(ValueError, match="cuda_graph needs the nvfp4lab backend on a CUDA device"):
        TrainConfig(preset="ci", cuda_graph=True, device="cpu").resolved()
    with pytest.raises(ValueError, match="te.make_graphed_callables"):
        TrainConfig(preset="ci", cuda_graph=True, backend="te", device="cuda").resolved()


def test_graphed_step_with_optimizer_skips_a_nonfinite_update():
    """GraphedStep's body with the optimizer inside (what graph_optimizer=True captures on CUDA): a
    finite step updates like AdamW; a NaN loss sets found_inf and the fused kernel leaves weights,
    moments and the step count untouched, as the eager loop's skip/stop does. (The capture itself
    runs in tests/gpu.)"""
    from nvfp4lab.training.step import GraphedStep, param_groups

    torch.manual_seed(0)
    model = GPT(get_preset("ci"))
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=torch.tensor(1e-3), fused=True)
    opt.found_inf = torch.zeros(())
    params = [p for g in opt.param_groups for p in g["params"]]
    ref = GPT(get_preset("ci"))
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(param_groups(ref, 0.1), lr=1e-3)
    step = GraphedStep(model, params, "fp32", torch.device("cpu"), 1.0, optimizer=opt)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    loss, _ = step._body(x, y)
    _, ref_loss = ref(x, y)
    ref_loss.backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
    ref_opt.step()
    assert torch.equal(loss, ref_loss.detach())
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)          # fused vs for-loop AdamW
    with torch.no_grad():
        model.wte.weight[0, 0] = float("nan")
    snapshot = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in opt.state[params[0]].items()}
    loss, _ = step._body(x, y)
    assert not torch.isfinite(loss) and opt.found_inf.item() == 1.0
    for a, p in zip(snapshot, params):
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(p.detach()))
    assert all(torch.equal(state[k], opt.state[params[0]][k]) for k in state)


def test_graph_optimizer_needs_cuda_graph():
    with pytest.raises(ValueError, match="graph_optimizer=True .* needs cuda_graph=True"):
        TrainConfig(preset="ci", graph_optimizer=True).resolved()


def test_steady_state_throughput_excludes_the_warmup_steps(tmp_path):
    r = train(TrainConfig(preset="ci", steps=6, timing_warmup_steps=2, eval_interval=6, eval_batches=1,
                          out=str(tmp_path / "t"), progress=False, plot=False))
    assert r.timed_steps == 4 and r.warmup_time_s > 0 and r.step_ms_median > 0
    assert r.tokens_per_s > 0 and r.tokens_per_s_all_steps > 0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["nvfp4", "fp8"])
def test_compile_trains_like_eager(tmp_path, precision):
    """compile=True: the NVFP4 layers are custom ops to torch.compile (eager numerics); Inductor
    compiles the rest (layer norms, attention, loss), whose float32 rounding may differ from eager's,
    so the runs agree closely rather than bit for bit."""
    torch._dynamo.reset()
    common = dict(preset="ci", precision=precision, steps=6, progress=False, plot=False, eval_interval=6,
                  timing_warmup_steps=1)
    eager = train(TrainConfig(out=str(tmp_path / "eager"), **common))
    compiled = train(TrainConfig(out=str(tmp_path / "compiled"), compile=True, **common))
    assert compiled.status == "completed"
    assert abs(compiled.final_val_loss - eager.final_val_loss) < 0.01 * eager.final_val_loss
    run = json.loads((tmp_path / "compiled" / "run.json").read_text())
    assert run["config"]["compile"] is True


def test_compile_needs_the_nvfp4lab_backend():
    with pytest.raises(ValueError, match="compile needs the nvfp4lab backend"):
        TrainConfig(preset="ci", compile=True, backend="te").resolved()
