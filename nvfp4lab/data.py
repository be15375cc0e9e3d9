"""Byte-level language-modelling data: corpus, tokenizer, deterministic split, batches.

* **Corpus.** The built-in default is the English documentation that every CPython ships in
  ``pydoc_data.topics`` (~460 KB of text: the language reference topics behind ``help()``), so
  training needs no download. Its exact bytes depend on the Python version; the SHA-256 is
  recorded with each run. ``load_corpus(path)`` reads any UTF-8 file, or every regular file
  under a folder (sorted by relative path, hidden files and folders skipped, joined with a blank
  line).
* **Tokenizer.** UTF-8 bytes, vocabulary 256 (:class:`ByteTokenizer`). No merges, no special
  tokens, so loss is in nats per byte.
* **Split.** The token stream is cut into chunks of ``chunk_bytes`` (default 4096); chunk ``i``
  goes to validation iff ``i % val_every == val_every - 1`` (default every 10th, i.e. 10%),
  the rest to training. This spreads validation over the whole corpus (``pydoc_data`` is
  sorted by topic) and is a pure function of the bytes, so every run sees the same split.
* **Batches.** Training batches are random windows of ``seq_len + 1`` tokens drawn with a
  caller-supplied ``torch.Generator`` (its state goes into checkpoints). Validation uses a fixed
  set of evenly spaced windows, identical for every run and precision.
* **Ranks.** Under data parallelism every rank draws the same global batch (same generator,
  same state) and keeps its contiguous slice of rows (:func:`shard_rows`), so the global batch,
  and the generator's position, do not depend on the number of ranks.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["Corpus", "ByteTokenizer", "DataSplit", "load_corpus", "split_tokens",
           "get_batch", "shard_rows", "validation_batches", "BUILTIN_CORPUS"]

BUILTIN_CORPUS = "pydoc_data.topics"


@dataclass(frozen=True)
class Corpus:
    """Raw text of a corpus plus where it came from.

    Attributes:
        text: the full text.
        source: ``"pydoc_data.topics"`` or the path read.
        files: number of files read (1 for the built-in corpus).
    """

    text: str
    source: str
    files: int = 1

    @property
    def num_bytes(self) -> int:
        return len(self.text.encode("utf-8"))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"source": self.source, "files": self.files,
                                "bytes": self.num_bytes, "sha256": self.sha256}
        if self.source == BUILTIN_CORPUS:
            info["python"] = sys.version.split()[0]
        return info


def _builtin_text() -> str:
    from pydoc_data import topics  # ships with every CPython

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not valid UTF-8 text ({exc.reason} at byte {exc.start})") from None


def load_corpus(path: str | os.PathLike | None = None) -> Corpus:
    """Load the built-in corpus (``path=None``) or a UTF-8 file / folder of files.

    Raises ``FileNotFoundError`` if ``path`` does not exist, ``ValueError`` if a file is not
    UTF-8, if a folder holds no readable file, or if the text is empty.
    """
    if path is None:
        corpus = Corpus(_builtin_text(), BUILTIN_CORPUS, 1)
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"--text path {p} does not exist")
        if p.is_dir():
            files = sorted(
                f for f in p.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not files:
                raise ValueError(f"folder {p} contains no (non-hidden) files")
            corpus = Corpus("\n\n".join(_read_utf8(f) for f in files), str(p), len(files))
        else:
            corpus = Corpus(_read_utf8(p), str(p), 1)
    if not corpus.text:
        raise ValueError(f"corpus {corpus.source} is empty")
    return corpus


class ByteTokenizer:
    """UTF-8 byte tokenizer: token id = byte value, vocabulary 256."""

    name = "bytes-utf8"
    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """int64 [n] tensor of byte values."""
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Inverse of :meth:`encode`; invalid UTF-8 sequences are replaced (U+FFFD)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size}


@dataclass
class DataSplit:
    """Train and validation token streams (int64, 1-D) and how they were made."""

    train: torch.Tensor
    val: torch.Tensor
    chunk_bytes: int
    val_every: int
    info: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"method": "interleaved-chunks", "chunk_bytes": self.chunk_bytes,
                "val_every": self.val_every, "train_tokens": int(self.train.numel()),
                "val_tokens": int(self.val.numel()), **self.info}


def split_tokens(tokens: torch.Tensor, *, chunk_bytes: int = 4096, val_every: int = 10) -> DataSplit:
    """Deterministic interleaved train/validation split of a 1-D token tensor.

    Chunk ``i`` (``chunk_bytes`` tokens each, the last one possibly shorter) is validation iff
    ``i % val_every == val_every - 1``. Raises ``ValueError`` if the parameters are not positive
    (``val_every >= 2``) or the corpus is too small to give both splits.
    """
    if tokens.dim() != 1:
        raise ValueError(f"expected a 1-D token tensor, got shape {tuple(tokens.shape)}")
    if chunk_bytes <= 0 or val_every < 2:
        raise ValueError(f"need chunk_bytes > 0 and val_every >= 2, got {chunk_bytes}, {val_every}")
    chunks = list(torch.split(tokens, chunk_bytes))
    val = [c for i, c in enumerate(chunks) if i % val_every == val_every - 1]
    train = [c for i, c in enumerate(chunks) if i % val_every != val_every - 1]
    if not val or not train:
        raise ValueError(f"corpus of {tokens.numel()} tokens is too small for a split with "
                         f"chunk_bytes={chunk_bytes}, val_every={val_every} "
                         f"(needs at least {chunk_bytes * (val_every - 1) + 1} tokens)")
    return DataSplit(torch.cat(train), torch.cat(val), chunk_bytes, val_every)


def shard_rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of the rows of ``t`` (dim 0), ``len(t) / world_size`` of them.

    Args:
        t: a tensor of shape [N, ...] with ``N`` divisible by ``world_size``.
        rank: in ``[0, world_size)``.
        world_size: number of slices (>= 1).

    Returns:
        A view ``t[rank * N/W : (rank + 1) * N/W]``.

    Raises:
        ValueError: ``N`` not divisible by ``world_size`` or ``rank`` out of range.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    n = t.shape[0]
    if n % world_size:
        raise ValueError(f"{n} rows do not split evenly over {world_size} ranks (batch_size must be a multiple "
                         "of the number of ranks)")
    per = n // world_size
    return t[rank * per:(rank + 1) * per]


def get_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator, *,
              rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs ``x`` and next-token targets ``y``, int64 [batch_size / world_size, T].

    ``batch_size`` start offsets (the global batch) are drawn uniformly with ``generator`` (CPU),
    whatever the rank, so every rank's generator stays in step; rank ``rank`` of ``world_size``
    keeps its slice (:func:`shard_rows`). Raises ``ValueError`` if the stream is shorter than
    ``seq_len + 1`` or the batch does not split over the ranks.
    """
    n = tokens.numel() - seq_len - 1
    if n < 0:
        raise ValueError(f"token stream of {tokens.numel()} tokens is shorter than seq_len+1={seq_len + 1}")
    starts = shard_rows(torch.randint(0, n + 1, (batch_size,), generator=generator), rank, world_size)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    w = tokens[idx]
    return w[:, :-1], w[:, 1:]


def validation_batches(tokens: torch.Tensor, batch_size: int, seq_len: int,
                       num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of ``num_batches`` batches of evenly spaced windows over ``tokens``.

    Windows do not overlap when the stream is long enough; otherwise they are spread evenly.
    Raises ``ValueError`` if the stream is shorter than ``seq_len + 1``.
    """
    n = tokens.numel() - seq_len - 1
    if n < 0:
        raise ValueError(f"validation stream of {tokens.numel()} tokens is shorter than seq_len+1")
    total = batch_size * num_batches
    starts = torch.linspace(0, n, total).round().to(torch.int64) if total > 1 else torch.zeros(1, dtype=torch.int64)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    w = tokens[idx]
    return [(w[i:i + batch_size, :-1], w[i:i + batch_size, 1:]) for i in range(0, total, batch_size)]
