"""Batch files: their names, their bytes, and how they are published and read.

Where they live (queue/<split>/, candidates/<split>/, quarantine/<split>/) and how temp files
are named is layout.py's; this module names the files inside those directories:
`{timestamp_ms:013d}-{seq:010d}-{num_batches}.pt`. FORMAT.md beside it describes both.

Writing is two steps, so that the bytes can be made anywhere and written by whoever owns the
directory: `encode_batch_file` (deterministic bytes and their crc32), then `publish_batch_file`
(layout.atomic_write under the published name; a published file is never written again).
Loading memory-maps the file copy-on-write (`torch.load(mmap=True, weights_only=True)`), so
batches are views into the page cache and nothing in the file can run code.
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

from queue_client.errors import CorruptBatchFile

# META_FILE, TMP_PREFIX and the name checks are re-exported, and the *_dir functions below
# kept, for modules that still import them from here; new code takes every name and path
# from queue_client.layout.
from queue_client.layout import (  # noqa: F401
    META_FILE,
    TMP_PREFIX,
    DatasetLayout,
    atomic_write,
    check_dataset_name,
    check_split_name,
)

FORMAT_NAME = "batchqueue.batchfile"
FORMAT_VERSION = 1

EXT = ".pt"

if TYPE_CHECKING:
    import torch

_NAME_RE = re.compile(r"([0-9]{13})-([0-9]{10})-([0-9]+)\.pt")


def dataset_dir(root: Path, dataset: str) -> Path:
    return DatasetLayout(root, dataset).dir


def queue_dir(root: Path, dataset: str, split: str) -> Path:
    return DatasetLayout(root, dataset).queue_dir(split)


def quarantine_dir(root: Path, dataset: str, split: str) -> Path:
    return DatasetLayout(root, dataset).quarantine_dir(split)


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


@dataclass(frozen=True)
class EncodedBatchFile:
    """A batch file's bytes before publishing: made anywhere (a worker, a Ray actor), written
    by whoever owns the directory."""

    seq: int
    num_batches: int
    data: bytes
    crc32: int


def encode_batch_file(
    *,
    seq: int,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    extras: Mapping[str, torch.Tensor] | None = None,
) -> EncodedBatchFile:
    """The bytes of one batch file. Tensors are [num_batches, batch_size, *sample_shape].

    `extras` are tensors of any shape that travel with the file but are not batches (the
    per-batch token histograms of a curriculum candidate); readers of batches ignore them.
    The bytes depend on the arguments alone, so the same seq encodes identically anywhere.
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
    data = buf.getvalue()
    return EncodedBatchFile(seq, num_batches, data, zlib.crc32(data))


def publish_batch_file(directory: Path, encoded: EncodedBatchFile) -> PublishedFile:
    """Write an encoded file into `directory` atomically under its published name."""
    name = BatchFileName(int(time.time() * 1000), encoded.seq, encoded.num_batches)
    atomic_write(Path(directory) / str(name), encoded.data)
    return PublishedFile(name, len(encoded.data), encoded.crc32)


def write_batch_file(
    directory: Path,
    *,
    seq: int,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    extras: Mapping[str, torch.Tensor] | None = None,
) -> PublishedFile:
    """Encode and publish one batch file (see encode_batch_file)."""
    encoded = encode_batch_file(seq=seq, tensors=tensors, metadata=metadata, extras=extras)
    return publish_batch_file(directory, encoded)


def scan_queue(directory: Path) -> list[BatchFileName]:
    """Published batch files in (timestamp, seq) order; temp and foreign files are ignored."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(p for p in map(BatchFileName.parse, names) if p is not None)


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
    return _checked(payload, path)


def load_batch_bytes(data: bytes, where: str) -> BatchFile:
    """Load a batch file held in memory (one fetched over the network) with the same safe
    loader and checks as load_batch_file. The tensors are copies: `data` may go afterwards."""
    import torch

    try:
        payload = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CorruptBatchFile(f"{where}: cannot be loaded: {type(exc).__name__}: {exc}") from None
    return _checked(payload, where)


def _checked(payload: object, path: Path | str) -> BatchFile:
    """The payload of a loaded batch file as a BatchFile, if it is one; `path` names it."""
    import torch

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
