"""Checkpoints of a training run: written atomically with the previous one kept, read with
``weights_only=True``, and checked for a compatible resume."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = ["CHECKPOINT_NAME", "PREVIOUS_CHECKPOINT_NAME", "CHECKPOINT_FORMAT", "CheckpointError",
           "save_checkpoint", "load_checkpoint", "check_resume_compatible"]

CHECKPOINT_NAME = "checkpoint.pt"
#: The checkpoint before the latest one, kept beside it (see :func:`save_checkpoint`).
PREVIOUS_CHECKPOINT_NAME = "checkpoint.prev.pt"  # = _previous_path(Path(CHECKPOINT_NAME)).name
CHECKPOINT_FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint file that cannot be resumed from: empty, truncated, corrupt or not a checkpoint.

    The message is one line naming the file, what is wrong with it, and the previous good
    checkpoint beside it when there is one (``previous`` holds its path, or None).
    """

    def __init__(self, message: str, *, path: str, previous: str | None = None) -> None:
        super().__init__(message)
        self.path, self.previous = path, previous


def _previous_path(path: Path) -> Path:
    """Where the checkpoint before ``path`` is kept: ``checkpoint.prev.pt`` for ``checkpoint.pt``."""
    return path.with_name(path.stem + ".prev" + path.suffix)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not possible on every platform; the file itself was fsynced
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write ``state`` with ``torch.save`` atomically, keeping the previous checkpoint beside it.

    Order: the new state goes to a temporary file in the same folder (flushed, fsynced); the
    current ``path``, if any, is hard-linked to ``checkpoint.prev.pt`` (replacing the older one);
    then the temporary file is ``os.replace``d over ``path``. At every moment ``path`` is a
    complete checkpoint (the old or the new one) and a kill -9 loses nothing already written;
    the last two checkpoints are kept.

    Args:
        path: the checkpoint file (``<run>/checkpoint.pt``).
        state: a mapping of tensors and plain data (loadable with ``weights_only=True``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(state), f)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            prev = _previous_path(path)
            link = prev.with_name(prev.name + ".tmp")
            if link.exists():
                link.unlink()
            os.link(path, link)
            os.replace(link, prev)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_checkpoint(p: Path) -> dict[str, Any]:
    """Load ``p`` or raise :class:`CheckpointError` saying in one line what is wrong with it."""
    if p.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {p} is empty (0 bytes): its write was interrupted", path=str(p))
    with open(p, "rb") as f:
        head = f.read(4)
    if head[:2] != b"PK":  # torch.save writes a zip archive
        kind = "a JSON file" if head[:1] in (b"{", b"[") else "not a file torch.save wrote"
        raise CheckpointError(f"{p} is {kind}, so not an nvfp4lab checkpoint (resume from the run "
                              f"folder or its {CHECKPOINT_NAME})", path=str(p))
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        # torch reports a truncated archive as "PytorchStreamReader failed reading zip archive"
        raise CheckpointError(f"checkpoint {p} is truncated or corrupt ({p.stat().st_size:,} bytes, "
                              f"not a complete torch archive: {type(exc).__name__})", path=str(p)) from None
    except Exception as exc:  # noqa: BLE001 - pickle.UnpicklingError for objects weights_only refuses
        raise CheckpointError(f"{p} holds objects other than tensors and plain data, so nvfp4lab does not "
                              f"load it ({type(exc).__name__}); it is not an nvfp4lab checkpoint", path=str(p)) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{p} is a torch file but not an nvfp4lab checkpoint (format {CHECKPOINT_FORMAT})",
                              path=str(p))
    return ckpt


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint (a file, or a run folder holding ``checkpoint.pt``) with ``weights_only=True``.

    Args:
        path: checkpoint file or run folder.

    Returns:
        The checkpoint's state dict (``format``, ``step``, ``model``, ``optimizer``, ``rng``,
        ``config``, ...).

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: (a ``ValueError``) the file is empty, truncated, corrupt, of another
            kind (e.g. ``run.json``) or of an unknown format. Its one-line message names the file
            and, when the previous checkpoint beside it loads, points to it. It never suggests
            ``weights_only=False``: a checkpoint nvfp4lab wrote loads without it.
    """
    p = Path(path)
    if p.is_dir():
        p = p / CHECKPOINT_NAME
    if not p.exists():
        raise FileNotFoundError(f"no checkpoint at {p}")
    try:
        return _read_checkpoint(p)
    except CheckpointError as exc:
        prev = _previous_path(p)
        if prev == p or not prev.is_file():
            raise
        try:
            step = _read_checkpoint(prev)["step"]
        except CheckpointError:
            raise exc from None
        raise CheckpointError(f"{exc}; the previous checkpoint {prev} (step {step}) is good: "
                              f"--resume {prev}", path=exc.path, previous=str(prev)) from None


_MODEL_KEYS = ("preset", "n_layer", "n_head", "n_embd", "seq_len", "tie_weights", "backend")
_DATA_KEYS = ("text", "val_every", "chunk_bytes")


def check_resume_compatible(saved: Mapping[str, Any], cfg: Any, data_info: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` when ``cfg`` (a resolved ``TrainConfig``) cannot continue the checkpoint
    ``saved``: another model shape or backend, another corpus, or another data split."""
    saved_cfg = saved["config"]
    for k in _MODEL_KEYS:
        if saved_cfg.get(k) != getattr(cfg, k):
            raise ValueError(f"cannot resume: checkpoint has {k}={saved_cfg.get(k)!r}, this run "
                             f"has {k}={getattr(cfg, k)!r} (the model shape must match)")
    sd = saved.get("data", {})
    if sd.get("corpus", {}).get("sha256") != data_info["corpus"]["sha256"]:
        raise ValueError("cannot resume: the corpus differs from the checkpoint's "
                         f"(sha256 {sd.get('corpus', {}).get('sha256')} vs {data_info['corpus']['sha256']})")
    for k in ("val_every", "chunk_bytes"):
        if saved_cfg.get(k) != getattr(cfg, k):
            raise ValueError(f"cannot resume: checkpoint has {k}={saved_cfg.get(k)!r}, this run {getattr(cfg, k)!r}")
