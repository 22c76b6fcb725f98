"""The on-disk contract, for writer and reader alike (FORMAT.md beside this file describes it).

<data_root>/<dataset>/
    meta.pkl                      plain-data pickle (see meta.py)
    queue/<split>/{timestamp_ms}-{seq}-{nb}.pt
    queue/<split>/.tmp-*          being written; never read, removed at server start
    candidates/<split>/           curriculum candidates (same format, with token histograms)
    quarantine/<split>/           files that failed to load, with a .reason.txt each
    journal/<split>.jsonl         the server's append-only log of produced and consumed seqs

Publishing is the Maildir pattern: write a temp file, fsync, os.replace into place, fsync the
directory; a published file is never written again. Loading memory-maps the file copy-on-write
(`torch.load(mmap=True, weights_only=True)`), so batches are views into the page cache and
nothing in the file can run code.
"""

from __future__ import annotations

import io
import mmap
import os
import re
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from queue_client.errors import CorruptBatchFile, InvalidRequest

FORMAT_NAME = "batchqueue.batchfile"
FORMAT_VERSION = 1

META_FILE = "meta.pkl"
QUEUE_DIR = "queue"
CANDIDATES_DIR = "candidates"
QUARANTINE_DIR = "quarantine"
JOURNAL_DIR = "journal"
EXT = ".pt"
TMP_PREFIX = ".tmp-"

if TYPE_CHECKING:
    import torch

_NAME_RE = re.compile(r"([0-9]{13})-([0-9]{10})-([0-9]+)\.pt")
_DATASET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SPLIT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def _clip(value: object, limit: int = 80) -> str:
    """repr() of a rejected name, cut short: an error must not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_dataset_name(name: str) -> str:
    """Reject names that could leave the data root (`..`, `/`, NUL, absolute paths)."""
    if not isinstance(name, str) or not _DATASET_RE.fullmatch(name) or ".." in name:
        raise InvalidRequest(
            f"dataset name {_clip(name)} is not allowed: use letters, digits, '.', '_' and '-' "
            "(no '..', no '/'), at most 128 characters"
        )
    return name


def check_split_name(split: str) -> str:
    if not isinstance(split, str) or not _SPLIT_RE.fullmatch(split):
        raise InvalidRequest(
            f"split name {_clip(split)} is not allowed: use letters, digits, '_' and '-'"
        )
    return split


def dataset_dir(root: Path, dataset: str) -> Path:
    return Path(root) / check_dataset_name(dataset)


def queue_dir(root: Path, dataset: str, split: str) -> Path:
    return dataset_dir(root, dataset) / QUEUE_DIR / check_split_name(split)


def candidates_dir(root: Path, dataset: str, split: str) -> Path:
    """Where a curriculum split's providers publish candidate files for the composer."""
    return dataset_dir(root, dataset) / CANDIDATES_DIR / check_split_name(split)


def quarantine_dir(root: Path, dataset: str, split: str) -> Path:
    return dataset_dir(root, dataset) / QUARANTINE_DIR / check_split_name(split)


@dataclass(frozen=True, order=True)
class BatchFileName:
    """`{timestamp_ms:013d}-{seq:010d}-{num_batches}.pt`; sorts by (timestamp, seq) as names do."""

    timestamp_ms: int
    seq: int
    num_batches: int

    @classmethod
    def parse(cls, name: str) -> BatchFileName | None:
        """The parsed name, or None for anything that is not a published batch file."""
        m = _NAME_RE.fullmatch(name)
        if m is None:
            return None
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)))

    def __str__(self) -> str:
        return f"{self.timestamp_ms:013d}-{self.seq:010d}-{self.num_batches}{EXT}"


@dataclass(frozen=True)
class PublishedFile:
    name: BatchFileName
    size_bytes: int
    crc32: int


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_batch_file(
    directory: Path,
    *,
    seq: int,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    extras: Mapping[str, torch.Tensor] | None = None,
) -> PublishedFile:
    """Publish one batch file atomically. Tensors are [num_batches, batch_size, *sample_shape].

    `extras` are tensors of any shape that travel with the file but are not batches (the
    per-batch token histograms of a curriculum candidate); readers of batches ignore them.
    """
    import torch

    if not tensors:
        raise ValueError("a batch file needs at least one tensor")
    num_batches = int(next(iter(tensors.values())).shape[0])
    payload = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "metadata": {**metadata, "seq": seq, "num_batches": num_batches},
        "tensors": {k: v.contiguous() for k, v in tensors.items()},
    }
    if extras:
        payload["extras"] = {k: v.contiguous() for k, v in extras.items()}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getbuffer()
    crc = zlib.crc32(data)
    name = BatchFileName(int(time.time() * 1000), seq, num_batches)
    directory = Path(directory)
    tmp = directory / f"{TMP_PREFIX}{name.timestamp_ms}-{seq:010d}-{os.getpid()}{EXT}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / str(name))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return PublishedFile(name, len(data), crc)


def scan_queue(directory: Path) -> list[BatchFileName]:
    """Published batch files in (timestamp, seq) order; temp and foreign files are ignored."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(p for p in map(BatchFileName.parse, names) if p is not None)


def remove_temp_files(directory: Path) -> int:
    """Delete leftovers of interrupted writes; returns how many were removed."""
    removed = 0
    for entry in os.scandir(directory):
        if entry.name.startswith(TMP_PREFIX):
            os.unlink(entry.path)
            removed += 1
    return removed


def file_crc32(path: Path) -> int:
    """crc32 of a whole file, read through a map (zlib releases the GIL while it hashes).

    Hashing also faults every page in, so the first batches of a prefetched file cost no I/O.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return zlib.crc32(mm)


@dataclass(frozen=True)
class BatchFile:
    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def load_batch_file(path: Path) -> BatchFile:
    """Map a batch file copy-on-write. Raises CorruptBatchFile naming the file and the fault."""
    import torch

    try:
        payload = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise CorruptBatchFile(f"{path}: cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
        raise CorruptBatchFile(f"{path}: not a {FORMAT_NAME} file")
    version = payload.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CorruptBatchFile(
            f"{path}: format version {version!r} is newer than this reader's {FORMAT_VERSION}; "
            "upgrade batchqueue on the client"
        )
    metadata, tensors = payload.get("metadata"), payload.get("tensors")
    if not isinstance(metadata, dict) or not isinstance(tensors, dict) or not tensors:
        raise CorruptBatchFile(f"{path}: metadata or tensors missing")
    nb = metadata.get("num_batches")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[0] != nb:
            raise CorruptBatchFile(f"{path}: tensor {name!r} does not hold {nb} batches")
    extras = payload.get("extras") or {}
    if not isinstance(extras, dict) or not all(
        isinstance(t, torch.Tensor) for t in extras.values()
    ):
        raise CorruptBatchFile(f"{path}: extras is not a table of tensors")
    return BatchFile(metadata, tensors, extras)
