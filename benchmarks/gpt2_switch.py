"""GPT-2-small on a GPU: does NVFP4 trail BF16 by more than the seed noise, and what does a precision
switch before the end recover? ``python benchmarks/gpt2_switch.py --runs bf16,bf16-seed1,nvfp4,... --out FILE``.

The corpus is the Python standard library's source that ships with the interpreter running the
script (every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` that decodes as UTF-8, sorted by
path, joined); its size, file count and SHA-256 are recorded. How much of it a run repeats depends on
the installation: a full CPython 3.11 stdlib is about 30 MB, the lent GPU machine's Python 3.12 held
about 11 MB, which 1600 steps of 16,384 tokens pass over more than twice. Runs (``nvfp4lab.train``, preset ``gpt2-small``, CUDA graphs with the optimizer
in the graph, the same steps and seed unless named):

* ``bf16``, ``bf16-seed1``: the baseline and its seed noise;
* ``nvfp4``: the paper's recipe (nvfp4lab's defaults);
* ``nvfp4-switch-fprop``, ``nvfp4-switch-all``: the same, with the forward GEMMs / every GEMM switched to
  BF16 for the last 18% of the steps (the paper switches at 8.2T of 10T tokens, appendix D).

Results (final and best validation loss, the curve, tokens/s) are appended to ``--out`` (a JSON file
with an ``environment`` block), so the runs can be split over several calls.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvfp4lab.provenance import environment  # noqa: E402
from nvfp4lab.training import TrainConfig, train  # noqa: E402

RUNS = {
    "bf16": dict(precision="bf16"),
    "bf16-seed1": dict(precision="bf16", seed=1),
    "nvfp4": dict(precision="nvfp4"),
    "nvfp4-switch-fprop": dict(precision="nvfp4", cooldown_frac=0.18, cooldown_scope="fprop"),
    "nvfp4-switch-all": dict(precision="nvfp4", cooldown_frac=0.18, cooldown_scope="all"),
}


def stdlib_corpus(out_dir: Path) -> tuple[Path, dict]:
    """The interpreter's standard-library sources as one UTF-8 text file, and its description."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, files = [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts or "dist-packages" in f.parts:
            continue
        try:
            parts.append(f.read_text(encoding="utf-8"))
            files += 1
        except (UnicodeDecodeError, OSError):
            continue
    text = "\n\n".join(parts)
    path = out_dir / "stdlib.txt"
    path.write_text(text, encoding="utf-8")
    data = text.encode("utf-8")
    return path, {"source": f"{root}/**/*.py (site-packages excluded)", "files": files, "bytes": len(data),
                  "sha256": hashlib.sha256(data).hexdigest()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="gpt2-switch-"))
    text, corpus = stdlib_corpus(tmp)
    result = json.loads(a.out.read_text()) if a.out.exists() else {
        "environment": environment(a.device), "corpus": corpus, "steps": a.steps, "runs": {}}
    if result["corpus"]["sha256"] != corpus["sha256"]:
        raise SystemExit(f"{a.out} holds runs on another corpus ({result['corpus']['sha256']})")
    for name in a.runs.split(","):
        cuda = a.device.startswith("cuda")
        cfg = TrainConfig(preset="gpt2-small", steps=a.steps, text=str(text), device=a.device, out=str(tmp / name),
                          name=name, cuda_graph=cuda, graph_optimizer=cuda, progress="lines", plot=False,
                          eval_interval=max(1, a.steps // 12), checkpoint_interval=0, **RUNS[name])
        res = train(cfg)
        result["runs"][name] = {"config": RUNS[name], "final_val_loss": res.final_val_loss,
                                "best_val_loss": res.best_val_loss, "val_curve": res.val_curve,
                                "tokens_per_s": res.tokens_per_s, "wall_time_s": res.wall_time_s,
                                "status": res.status}
        print(f"[gpt2_switch] {name}: val {res.final_val_loss:.4f}, {res.tokens_per_s:,.0f} tok/s", file=sys.stderr)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
