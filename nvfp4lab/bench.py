"""``nvfp4lab bench``: a thin entry point to the kernel benchmark of a source checkout.

The benchmark harness is not part of the library: it lives in the repository as
``benchmarks/bench_kernels.py`` (run it directly, or through this subcommand, which finds it
beside the package when nvfp4lab runs from a checkout). Its options are documented there
(``nvfp4lab bench --help``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["HARNESS", "register"]

#: Where the harness is in a source checkout.
HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"


def _harness() -> ModuleType | None:
    if not HARNESS.is_file():
        return None
    spec = importlib.util.spec_from_file_location("nvfp4lab_bench_kernels", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _missing(args: argparse.Namespace) -> int:
    print(f"nvfp4lab bench: error: the benchmark harness is not installed with the package; run it from a "
          f"source checkout (expected {HARNESS})", file=sys.stderr)
    return 2


def register(subparsers) -> None:
    """CLI registrar for ``nvfp4lab bench`` (see :data:`nvfp4lab.cli.SUBCOMMANDS`)."""
    harness = _harness()
    p = subparsers.add_parser("bench", help="benchmark the NVFP4 kernels (JSON + PNG; needs a source checkout)")
    if harness is None:
        p.set_defaults(func=_missing)
        return
    harness.build_parser(p)
    p.set_defaults(func=harness.run)
