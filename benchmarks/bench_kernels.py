"""Kernel benchmark, the same as ``nvfp4lab bench``: ``python benchmarks/bench_kernels.py [--smoke]``.

Writes ``results/bench_<device>.json`` and a PNG beside it (see :mod:`nvfp4lab.bench`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvfp4lab.bench import main_bench  # noqa: E402

if __name__ == "__main__":
    sys.exit(main_bench())
