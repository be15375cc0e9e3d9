"""Execute every book chapter and lab with papermill on this machine and record what happened.

    python benchmarks/run_notebooks.py --out results/notebooks_<device>.json [--smoke]

Each notebook runs in its own folder with its default parameters (``--smoke`` injects
``smoke=True``, the test suite's small sizes), outputs are thrown away (the committed notebooks
stay output-free), and a JSON file records per notebook the status, seconds and, on failure,
the cell and the error, with the device, driver, versions and date. On the lent GPU this is
issue 5's "the book's and labs' notebooks run on the GPU with papermill"; ``tests/test_notebooks.py``
runs the same notebooks in smoke mode on CPU in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nvfp4lab.provenance import environment  # noqa: E402


def notebooks() -> list[Path]:
    """The book's chapters and the labs, in order (checkpoints excluded)."""
    return sorted(p for d in ("book", "labs") for p in (ROOT / d).rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--smoke", action="store_true", help="inject smoke=True (the test suite's sizes)")
    p.add_argument("--only", default="", help="comma-separated notebook names (default: all)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    p.add_argument("--update", action="store_true",
                   help="add to the records already in --out (written by an earlier call on this machine, same commit "
                        "and smoke setting) instead of starting a new file")
    args = p.parse_args(argv)

    import papermill as pm

    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    from notebook_kernel import SlicedPollKernelManager   # the kernel manager of the tests and the book build

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    result = {"environment": environment(), "smoke": args.smoke, "notebooks": {}}
    if args.update and args.out.exists():
        earlier = json.loads(args.out.read_text())
        for key in ("git_commit", "device", "torch", "transformer_engine"):
            if earlier["environment"].get(key) != result["environment"].get(key):
                raise SystemExit(f"--update: {args.out} was written with {key}={earlier['environment'].get(key)!r}, "
                                 f"this run has {result['environment'].get(key)!r}; start a new file")
        if earlier["smoke"] != args.smoke:
            raise SystemExit(f"--update: {args.out} has smoke={earlier['smoke']}, this run smoke={args.smoke}")
        result["notebooks"] = earlier["notebooks"]
    with tempfile.TemporaryDirectory() as tmp:
        for nb in notebooks():
            if wanted and nb.name not in wanted:
                continue
            name = str(nb.relative_to(ROOT))
            t0 = time.perf_counter()
            rec: dict = {"status": "ok"}
            try:
                pm.execute_notebook(str(nb), str(Path(tmp) / nb.name), parameters={"smoke": True} if args.smoke else {},
                                    kernel_name="python3", cwd=str(nb.parent), execution_timeout=args.timeout,
                                    progress_bar=False, log_output=False,
                                    kernel_manager_class=SlicedPollKernelManager)
            except pm.PapermillExecutionError as e:
                rec = {"status": "error", "cell": e.cell_index, "error": f"{e.ename}: {e.evalue}"[:500]}
            except Exception as e:  # noqa: BLE001 - a kernel that died, a timeout
                rec = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
            rec["seconds"] = round(time.perf_counter() - t0, 1)
            result["notebooks"][name] = rec
            print(f"[notebooks] {name}: {rec['status']} in {rec['seconds']} s {rec.get('error', '')}", flush=True)
            _write(args.out, result)   # after every notebook: a run cut short keeps what it finished
    _write(args.out, result)
    failed = sum(r["status"] != "ok" for r in result["notebooks"].values())
    print(f"[notebooks] {len(result['notebooks']) - failed}/{len(result['notebooks'])} ran; wrote {args.out}")
    return 1 if failed else 0


def _write(path: Path, result: dict) -> None:
    """``result`` as JSON at ``path``, replaced atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
