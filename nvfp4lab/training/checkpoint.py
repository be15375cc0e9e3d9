"""Checkpoints of a training run: written atomically with the previous one kept, read with
``weights_only=True``, and checked for a compatible resume.

Two formats, both precision-agnostic FP32 state:

* one process: one file, ``checkpoint.pt`` (:func:`save_checkpoint` / :func:`load_checkpoint`);
* several ranks: a ``torch.distributed.checkpoint`` (DCP) folder ``checkpoint-step<N>.dcp/``
  (:func:`save_distributed_checkpoint`): each rank writes its shards of the model and the AdamW
  states, rank 0 adds ``meta.pt`` (step, data position, every rank's RNG and SR generator
  states, the config: plain data and tensors, ``weights_only``). The folder is written under a
  temporary name and renamed once complete; the two newest are kept. DCP reshards on load, so a
  run saved by N ranks resumes on M (one process included) through
  :func:`load_distributed_state`, and :func:`export_weights` turns either format into a
  single-file state dict.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = ["CHECKPOINT_NAME", "PREVIOUS_CHECKPOINT_NAME", "CHECKPOINT_FORMAT", "CheckpointError",
           "save_checkpoint", "load_checkpoint", "check_resume_compatible", "save_distributed_checkpoint",
           "load_distributed_state", "load_full_state", "latest_distributed_checkpoint", "export_weights", "DCP_META_NAME"]

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


def _write_temporary(path: Path, obj: Any) -> str:
    """``torch.save`` ``obj`` to a new temporary file beside ``path`` (flushed, fsynced); its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


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
    tmp = _write_temporary(path, dict(state))

    def keep_previous() -> None:
        if path.exists():
            prev = _previous_path(path)
            link = prev.with_name(prev.name + ".tmp")
            if link.exists():
                link.unlink()
            os.link(path, link)
            os.replace(link, prev)

    _replace_or_discard(tmp, path, before=keep_previous)
    _fsync_dir(path.parent)


def _replace_or_discard(tmp: Path, path: Path, before=None) -> None:
    """``os.replace(tmp, path)`` (after ``before()``, if given); on any failure remove ``tmp`` and re-raise."""
    try:
        if before is not None:
            before()
        os.replace(tmp, path)
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
    """Load a checkpoint (a file, a DCP folder, or a run folder) with ``weights_only=True``.

    A run folder resolves to the newer (by modification time) of its ``checkpoint.pt`` and its
    newest complete ``checkpoint-step<N>.dcp/`` folder.

    Args:
        path: checkpoint file, DCP checkpoint folder or run folder.

    Returns:
        The checkpoint's state dict (``format``, ``step``, ``model``, ``optimizer``, ``rng``,
        ``config``, ...). For a DCP folder, its ``meta.pt`` (no ``model`` / ``optimizer``: they
        stay sharded on disk for :func:`load_distributed_state`) with ``"dcp"`` = the folder and
        ``rng`` holding per-rank lists (``torch_ranks``, ``sr_ranks``).

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: (a ``ValueError``) the file is empty, truncated, corrupt, of another
            kind (e.g. ``run.json``) or of an unknown format. Its one-line message names the file
            and, when the previous checkpoint beside it loads, points to it. It never suggests
            ``weights_only=False``: a checkpoint nvfp4lab wrote loads without it.
    """
    p = _resolve_checkpoint(Path(path))
    if p.is_dir():
        return _read_dcp_meta(p)
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


# ----------------------------------------------------------------------------- distributed (DCP)
#: The file rank 0 adds to a DCP checkpoint folder: everything but the model and optimizer tensors.
DCP_META_NAME = "meta.pt"
_DCP_PATTERN = re.compile(r"^checkpoint-step(\d+)\.dcp$")
_DCP_KEEP = 2


def _dcp_name(step: int) -> str:
    return f"checkpoint-step{step:08d}.dcp"


def latest_distributed_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete DCP checkpoint folder of a run folder (highest step), or None.

    Folders still being written carry a temporary name and are never returned.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    found = [(int(m.group(1)), d) for d in run_dir.iterdir() if (m := _DCP_PATTERN.match(d.name)) and d.is_dir()]
    return max(found)[1] if found else None


def _resolve_checkpoint(p: Path) -> Path:
    """A checkpoint path from what the user gave: a file, a DCP folder, or a run folder."""
    if not p.is_dir() or (p / DCP_META_NAME).exists():
        return p
    single, dcp = p / CHECKPOINT_NAME, latest_distributed_checkpoint(p)
    if dcp is None:
        return single
    if single.exists() and single.stat().st_mtime > (dcp / DCP_META_NAME).stat().st_mtime:
        return single
    return dcp


def _read_dcp_meta(folder: Path) -> dict[str, Any]:
    meta_path = folder / DCP_META_NAME
    if not meta_path.exists() or not (folder / ".metadata").exists():
        raise CheckpointError(f"{folder} is a folder but not a complete nvfp4lab DCP checkpoint "
                              f"(needs {DCP_META_NAME} and DCP's .metadata)", path=str(folder))
    meta = _read_checkpoint(meta_path)
    meta["dcp"] = str(folder)
    return meta


def save_distributed_checkpoint(run_dir: str | os.PathLike, model: Any, optimizer: Any, meta: Mapping[str, Any],
                                *, rank: int, barrier: Any) -> Path:
    """Write a DCP checkpoint of a (possibly sharded) model and optimizer; every rank calls it.

    Order: rank 0 clears a leftover temporary folder; every rank writes its shards with
    ``torch.distributed.checkpoint.save`` into ``.checkpoint-step<N>.dcp.tmp`` (DCP writes its
    ``.metadata`` once all shards are in); rank 0 writes ``meta.pt`` (fsynced), renames the
    folder to ``checkpoint-step<N>.dcp`` and deletes the older ones but the previous. A folder
    with the final name is therefore complete; a kill leaves at most a temporary folder, which
    nothing reads.

    Args:
        run_dir: the run folder.
        model: the model (FSDP2-sharded, DDP-wrapped or plain).
        optimizer: its optimizer.
        meta: plain data and tensors (``format``, ``step``, ``config``, ``rng``, ...), the same on
            every rank (only rank 0's is written).
        rank: this process's rank.
        barrier: a callable that waits for every rank.

    Returns:
        The checkpoint folder.
    """
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run_dir = Path(run_dir)
    final = run_dir / _dcp_name(int(meta["step"]))
    tmp = run_dir / f".{final.name}.tmp"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_quiet():   # one process (no process group) writes the whole state
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    if rank == 0:
        os.replace(_write_temporary(tmp / DCP_META_NAME, dict(meta)), tmp / DCP_META_NAME)
        if final.exists():   # the same step written again (a resumed run): move the old one aside
            old = run_dir / f".{final.name}.old"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(run_dir)
        found = sorted((int(m.group(1)), d) for d in run_dir.iterdir() if (m := _DCP_PATTERN.match(d.name)))
        for _, d in found[:-_DCP_KEEP]:
            shutil.rmtree(d, ignore_errors=True)
    barrier()
    return final


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns when it runs without a process group; here that is the intent (one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def load_distributed_state(folder: str | os.PathLike, model: Any, optimizer: Any) -> None:
    """Load a DCP checkpoint's model and optimizer into ``model`` / ``optimizer``, resharding.

    Works under any number of ranks (each reads the pieces of its own shards) and in one process
    without a process group. Every rank calls it.

    Raises:
        CheckpointError: the folder is not a complete DCP checkpoint or does not match the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = Path(folder)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(folder))
    except Exception as exc:  # noqa: BLE001 - DCP raises CheckpointException, RuntimeError, KeyError ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load the DCP checkpoint {folder} into this model: {first}",
                              path=str(folder)) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_full_state(model: Any, optimizer: Any, saved: Mapping[str, Any], names: list[str]) -> None:
    """Load a single-process checkpoint (``checkpoint.pt``) into a sharded or wrapped model and optimizer.

    Args:
        model, optimizer: the (FSDP2 / DDP) model and its optimizer.
        saved: the checkpoint (its ``model`` state dict and ``optimizer`` state dict with
            parameters numbered in optimizer order).
        names: the parameter names in optimizer order (the FQNs ``get_state_dict`` uses).

    Raises:
        ValueError: the checkpoint's optimizer holds another number of parameters than ``names``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    osd = saved["optimizer"]
    if sum(len(g["params"]) for g in osd["param_groups"]) != len(names):
        raise ValueError(f"cannot resume: the checkpoint's optimizer has "
                         f"{sum(len(g['params']) for g in osd['param_groups'])} parameters, this model {len(names)}")
    optim = {"state": {names[i]: v for i, v in osd["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=dict(saved["model"]), optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True))


def export_weights(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write a checkpoint's FP32 model weights as one ``torch.save`` file of a plain state dict.

    The file loads with ``torch.load(out, weights_only=True)`` into ``GPT(config)``'s
    ``load_state_dict``. A DCP checkpoint is read in this one process (no process group) into
    an unsharded model built from its config; it is written atomically (temporary file, then
    ``os.replace``).

    Args:
        source: a run folder, a ``checkpoint.pt`` or a DCP checkpoint folder.
        out: the file to write.

    Returns:
        ``out`` as a Path.

    Raises:
        FileNotFoundError: nothing at ``source``.
        CheckpointError: ``source`` is not a readable nvfp4lab checkpoint.
    """
    saved = load_checkpoint(source)
    if "dcp" in saved:
        import torch.distributed.checkpoint as dcp

        from .config import TrainConfig
        from ..model import GPT

        cfg = TrainConfig.from_dict(saved["config"])
        model = GPT(cfg.model_config())
        state = {"model": model.state_dict()}
        try:
            with _single_process_quiet():
                dcp.load(state, checkpoint_id=saved["dcp"])
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"cannot read the weights of {saved['dcp']}: {exc}".splitlines()[0],
                                  path=saved["dcp"]) from None
        weights = {k: v.detach().clone() for k, v in state["model"].items()}
    else:
        weights = {k: v.detach().clone() for k, v in saved["model"].items()}
    out = Path(out)
    _replace_or_discard(_write_temporary(out, weights), out)
    return out
