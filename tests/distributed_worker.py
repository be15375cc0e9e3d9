"""The ranks' side of tests/test_distributed.py: ``torchrun --nproc-per-node 2 tests/distributed_worker.py OUT``.

One process group for every scenario (each ``train`` call uses it and leaves it up), so the
test pays torch's start-up once. Each rank writes ``OUT/rank<r>.json`` with what it saw; the runs
write their folders under ``OUT``. Scenarios:

* ``<precision>``: 4 steps of fp32, bf16 and nvfp4 (SR off), gradient clipping off, FSDP2;
* ``nvfp4-ac``: the nvfp4 run with activation checkpointing; ``nvfp4-ddp``: with DDP;
  ``nvfp4-accum`` / ``nvfp4-ddp-accum``: 2 micro-batches per rank (FSDP2 / DDP);
* ``sr`` (nvfp4, SR on, 6 steps, checkpoints at 3 and 6) and ``sr-resumed`` (from step 3);
* ``nvfp4-cooldown``: BF16 for the last half of the steps;
* ``nvfp4-4`` / ``nvfp4-4-compile``: 4 blocks (two of them NVFP4), eager / through ``torch.compile``;
* ``nonfinite`` / ``nonfinite-skip``: rank 1 alone sees a NaN loss at step 1: every rank must stop
  there / skip that step;
* the decision helpers, and the layer under FSDP2 seeing the full, unsharded weight.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nvfp4lab.model import GPT
from nvfp4lab.training import NonFiniteError, TrainConfig, train
from nvfp4lab.training import distributed as D


def config(out: Path, name: str, **kw) -> TrainConfig:
    """The test's shared run: the smallest GPT, global batch 8, 4 steps, no clipping (see the test)."""
    base = dict(preset="ci", n_layer=3, n_embd=32, n_head=2, seq_len=32, batch_size=8, steps=4,
                warmup_steps=2, eval_interval=2, eval_batches=1, log_interval=1, grad_clip=0.0,
                out=str(out / name), name=name, progress=False, plot=False)
    base.update(kw)
    return TrainConfig(**base)


def no_sr(precision: str) -> dict:
    return {"precision": precision, "recipe": {"disable_stochastic_rounding": True}}


def unsharded_weight_check(ctx: D.DistContext) -> dict:
    """FSDP2 shards the parameters, yet NVFP4Linear's forward sees the full weight: same logits
    as the unwrapped model, bit for bit."""
    from nvfp4lab.linear import NVFP4Linear, convert_model
    from nvfp4lab.recipe import NVFP4Recipe

    cfg = config(Path("."), "x").resolved().model_config()
    torch.manual_seed(0)
    ref = GPT(cfg)
    convert_model(ref, "nvfp4", NVFP4Recipe(disable_stochastic_rounding=True))
    sharded = GPT(cfg)
    sharded.load_state_dict(ref.state_dict())
    convert_model(sharded, "nvfp4", NVFP4Recipe(disable_stochastic_rounding=True))
    D.wrap_model(sharded, "fsdp", ctx)
    layer = sharded.blocks[1].attn.qkv
    assert isinstance(layer, NVFP4Linear)
    seen = []
    layer.register_forward_pre_hook(lambda m, args: seen.append((type(m.weight).__name__, list(m.weight.shape))))
    x = torch.randint(0, 256, (2, cfg.block_size), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        a, _ = sharded(x)
        b, _ = ref(x)
    # one AdamW step: its moments are FP32 shards like the master weights
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sharded(x, x)[1].backward()
    opt.step()
    moment = opt.state[layer.weight]["exp_avg"]
    return {"param_type": type(layer.weight).__name__, "local_shape": list(layer.weight.to_local().shape),
            "param_dtype": str(layer.weight.dtype), "seen_in_forward": seen,
            "full_shape": list(ref.blocks[1].attn.qkv.weight.shape), "logits_equal": bool(torch.equal(a, b)),
            "moment": [type(moment).__name__, str(moment.dtype), list(moment.to_local().shape)]}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    ctx = D.setup("cpu")
    report: dict = {"rank": ctx.rank, "world_size": ctx.world_size}
    for p in ("fp32", "bf16", "nvfp4"):
        train(config(out, p, **no_sr(p)))
    train(config(out, "nvfp4-ac", activation_checkpointing=True, **no_sr("nvfp4")))
    train(config(out, "nvfp4-ddp", parallel="ddp", **no_sr("nvfp4")))
    train(config(out, "nvfp4-cooldown", cooldown_frac=0.5, **no_sr("nvfp4")))
    train(config(out, "nvfp4-accum", grad_accum_steps=2, **no_sr("nvfp4")))
    train(config(out, "nvfp4-ddp-accum", grad_accum_steps=2, parallel="ddp", **no_sr("nvfp4")))
    # torch.compile under FSDP2 with two NVFP4 blocks: each block's forward is a frame of its own
    train(config(out, "nvfp4-4", n_layer=4, **no_sr("nvfp4")))
    train(config(out, "nvfp4-4-compile", n_layer=4, compile=True, **no_sr("nvfp4")))
    train(config(out, "sr", precision="nvfp4", steps=6, checkpoint_interval=3))
    train(config(out, "sr-resumed", precision="nvfp4", steps=6, checkpoint_interval=3,
                 resume=str(out / "sr" / "checkpoint-step00000003.dcp")))

    # decisions: one rank's flag is every rank's
    report["agree_any_rank1"] = D.agree_any(ctx.rank == 1, ctx)
    report["agree_any_none"] = D.agree_any(False, ctx)
    report["mean_across"] = D.mean_across(float(ctx.rank), ctx)
    real_forward, calls = GPT.forward, []

    def nan_on_rank1(self, idx, targets=None):   # rank 1's loss goes NaN at step 1
        logits, loss = real_forward(self, idx, targets)
        if targets is not None and self.training:
            calls.append(1)
            if ctx.rank == 1 and len(calls) == 2:
                loss = loss * float("nan")
        return logits, loss

    GPT.forward = nan_on_rank1
    try:
        try:
            train(config(out, "nonfinite", precision="bf16", steps=3))
            report["nonfinite"] = None
        except NonFiniteError as exc:
            report["nonfinite"] = {"step": exc.step, "what": exc.what}
        calls.clear()
        result = train(config(out, "nonfinite-skip", precision="bf16", steps=3, on_nonfinite="skip"))
        report["skip"] = {"status": result.status, "skipped": result.skipped_steps}
    finally:
        GPT.forward = real_forward
    report["unsharded"] = unsharded_weight_check(ctx)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
