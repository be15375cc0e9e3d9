"""The environment of a child process (a subprocess, a torchrun rank, a notebook's kernel) that imports this
checkout of nvfp4lab without an install: the tests' one home for that PYTHONPATH rule."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pythonpath() -> str:
    """This checkout first, then the PYTHONPATH the tests themselves run with (if any)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with ``extra`` set and :func:`pythonpath` as PYTHONPATH."""
    return {**os.environ, **extra, "PYTHONPATH": pythonpath()}
