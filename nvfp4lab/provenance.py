"""Provenance: where a measured figure comes from, with the same keys in every result file.

Every result file the project writes (a training run's ``run.json``, the benchmarks' JSON, the
notebook runner's record) carries one ``environment`` block made by :func:`environment`, and the
book renders it with :func:`provenance_table`. The keys are fixed (:data:`ENVIRONMENT_KEYS`), so a
chapter reads any result file the same way:

========================  ====================================================================
key                       value
========================  ====================================================================
``schema``                ``"nvfp4lab.environment/1"``
``date_utc``              ISO 8601 date and time, UTC, seconds
``git_commit``            HEAD of the checkout nvfp4lab runs from (``+dirty`` if ``nvfp4lab/``
                          has uncommitted changes), or ``None`` outside a git checkout
``nvfp4lab``              the package version
``python``, ``platform``  ``platform.python_version()``, ``platform.platform()``
``torch``, ``cuda``       torch's version and the CUDA version it was built with (``None`` on CPU builds)
``cudnn``                 cuDNN version torch loaded, or ``None``
``triton``                Triton's version, or ``None``
``transformer_engine``    TE's installed distribution version (not imported), or ``None``
``numpy``                 numpy's version
``device_type``           ``"cuda"`` or ``"cpu"``: where the figures were measured
``device``                that device's name: the GPU's (``"NVIDIA H200"``) or the CPU model's
``device_count``          CUDA devices visible (0 on CPU)
``compute_capability``    ``[major, minor]`` of the device, or ``None`` on CPU
``total_memory_bytes``    the GPU's memory, or ``None`` on CPU
``driver_version``        the NVIDIA driver (``nvidia-smi``), or ``None``
``cpu``                   the host CPU's model name
``cpu_count``             logical CPUs of the host
``threads``               ``torch.get_num_threads()``
========================  ====================================================================

Nothing here imports Transformer Engine or Triton (their versions come from package metadata), so
:func:`environment` is cheap and safe before either is loaded.
"""

from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata
import os
import platform
import subprocess
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = ["ENVIRONMENT_KEYS", "SCHEMA", "environment", "git_commit", "gpu_facts", "provenance_table",
           "software_versions", "utc_now"]

SCHEMA = "nvfp4lab.environment/1"

#: The keys of every ``environment`` block, in this order.
ENVIRONMENT_KEYS = (
    "schema", "date_utc", "git_commit", "nvfp4lab", "python", "platform", "torch", "cuda", "cudnn",
    "triton", "transformer_engine", "numpy", "device_type", "device", "device_count",
    "compute_capability", "total_memory_bytes", "driver_version", "cpu", "cpu_count", "threads",
)

_REPO = Path(__file__).resolve().parents[1]


def utc_now() -> str:
    """The current date and time, UTC, ISO 8601 to the second (``2026-11-24T01:40:10+00:00``)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def git_commit(root: str | os.PathLike | None = None) -> str | None:
    """HEAD of the git checkout at ``root`` (default: the one nvfp4lab runs from).

    Returns:
        The 40-hex commit, with ``+dirty`` appended when ``nvfp4lab/`` under ``root`` has
        uncommitted changes, or ``None`` when ``root`` is not a git checkout or git is missing.
    """
    root = Path(root) if root is not None else _REPO
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "nvfp4lab"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


@functools.lru_cache(maxsize=None)
def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except Exception:  # noqa: BLE001 - not installed, or broken metadata: not recorded
            continue
    return None


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _driver_version() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    line = r.stdout.strip().splitlines()
    return line[0].strip() if r.returncode == 0 and line else None


def _cudnn_version() -> str | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001 - e.g. another cuDNN loaded first: not recorded
        return None
    return None if v is None else str(v)


def gpu_facts(device: torch.device | str = "cuda") -> dict[str, Any]:
    """The CUDA device's name, count, compute capability and memory, from torch alone.

    No subprocess (unlike :func:`environment`, which also asks git and nvidia-smi), so it is cheap
    enough for code that checks the device on every call (the capability probe behind
    ``nvfp4lab.te.autocast``).

    Returns:
        ``{"device": name, "device_count": n, "compute_capability": [major, minor],
        "total_memory_bytes": bytes}`` for ``device`` (``"cuda"``: the current device).

    Raises:
        ValueError: CUDA is not available.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"gpu_facts({str(device)!r}): CUDA is not available on this machine")
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {"device": str(props.name), "device_count": torch.cuda.device_count(),
            "compute_capability": [int(props.major), int(props.minor)], "total_memory_bytes": int(props.total_memory)}


def software_versions() -> dict[str, Any]:
    """The software part of :func:`environment`: ``python``, ``platform``, ``torch``, ``cuda``,
    ``cudnn``, ``triton``, ``transformer_engine``, ``numpy`` (``None`` where absent). No subprocess
    and no import of Triton or TE (their versions come from package metadata)."""
    return dict(
        python=platform.python_version(),
        platform=platform.platform(),
        torch=str(torch.__version__),
        cuda=torch.version.cuda,
        cudnn=_cudnn_version(),
        triton=_distribution_version("triton"),
        transformer_engine=_distribution_version("transformer-engine", "transformer_engine"),
        numpy=_distribution_version("numpy"),
    )


def package_version() -> str:
    """nvfp4lab's version from the installed distribution's metadata (``pyproject.toml``), or
    ``"0+unknown"`` when the package runs from a source tree without being installed."""
    try:
        return importlib.metadata.version("nvfp4lab")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """The environment block of a result file: versions, device, git commit and date.

    Args:
        device: where the figures are measured. ``None``: the current CUDA device when CUDA is
            available, else the CPU. A ``"cuda:N"`` device reports GPU ``N``.

    Returns:
        A JSON-serialisable dict with exactly the keys of :data:`ENVIRONMENT_KEYS` (see the
        module docstring for their meaning); values that cannot be found are ``None``.

    Raises:
        ValueError: ``device`` is a CUDA device but CUDA is not available.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"environment({str(device)!r}): CUDA is not available on this machine")
    env: dict[str, Any] = dict.fromkeys(ENVIRONMENT_KEYS)
    env.update(
        schema=SCHEMA,
        date_utc=utc_now(),
        git_commit=git_commit(),
        nvfp4lab=package_version(),
        **software_versions(),
        device_type=device.type,
        device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        cpu=_cpu_name(),
        cpu_count=os.cpu_count(),
        threads=torch.get_num_threads(),
    )
    if device.type == "cuda":
        env.update(gpu_facts(device), driver_version=_driver_version())
    else:
        env["device"] = env["cpu"]
    return env


def provenance_table(env: Mapping[str, Any], what: str) -> str:
    """A small Markdown table saying where a recorded result comes from, for the book.

    Args:
        env: an ``environment`` block (:func:`environment`'s keys).
        what: what was measured, and by which command (Markdown).

    Returns:
        Markdown: what, device, driver, software, date (UTC) and code (git commit). Values an older
        file did not record (``None``) are left out or shown as "not recorded".

    Raises:
        KeyError: ``env`` lacks one of :data:`ENVIRONMENT_KEYS` (an old result file).
    """
    missing = [k for k in ENVIRONMENT_KEYS if k not in env]
    if missing:
        raise KeyError(f"environment block lacks {missing}: not written by nvfp4lab.provenance.environment")
    device = env["device"] or (env["cpu"] if env["device_type"] == "cpu" else None) or "not recorded"
    if env["device_type"] == "cuda":
        cc, mem = env["compute_capability"], env["total_memory_bytes"]
        device += f", compute capability {cc[0]}.{cc[1]}" if cc else ""
        device += f", {mem / 2**30:.0f} GiB" if mem else ""
        device += f" ({env['device_count']} visible)" if env["device_count"] and env["device_count"] > 1 else ""
    else:
        cpus = [f"{env[k]} {what}" for k, what in (("cpu_count", "logical CPUs"), ("threads", "torch threads")) if env[k]]
        device += f" ({', '.join(cpus)})" if cpus else ""
    software = [f"Python {env['python']}", f"torch {env['torch']}" + (f" (CUDA {env['cuda']})" if env["cuda"] else "")]
    software += [f"{name} {env[key]}" for name, key in (("Transformer Engine", "transformer_engine"),
                                                          ("Triton", "triton"), ("nvfp4lab", "nvfp4lab"))
                 if env[key]]
    rows = ["| provenance | |", "|---|---|", f"| what | {what} |", f"| device | {device} |"]
    if env["device_type"] == "cuda":
        rows.append(f"| driver | {env['driver_version'] or 'not recorded'} |")
    rows += [f"| software | {', '.join(software)} |", f"| date (UTC) | {env['date_utc']} |",
             f"| code | {env['git_commit'] or 'not recorded'} |"]
    return "\n".join(rows)
