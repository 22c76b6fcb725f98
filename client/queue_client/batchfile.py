"""Batch files: their names, their bytes, and how they are published and read.

Where they live (queue/<split>/, candidates/<split>/, quarantine/<split>/) and how temp files
are named is layout.py's; this module names the files inside those directories:
`{timestamp_ms:013d}-{seq:010d}-{num_batches}.pt`. FORMAT.md beside it describes both.

Writing is two steps, so that the bytes can be made anywhere and written by whoever owns the
directory: `encode_batch_file` (deterministic bytes and their crc32), then `publish_batch_file`
(layout.atomic_write under the published name; a published file is never written again).
Loading memory-maps the file copy-on-write (`torch.load(mmap=True, weights_only=True)`), so
batches are views into the page cache and nothing in the file can run code.

Version 2 files hold what each schema field's storage says (narrow token ids, one window for
x and y, no derivable masks; storage.py); version 1 files hold the served fields themselves.
Both load: `BatchFile.stored` is what the file holds, `BatchFile.tensors` the served fields.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import re
import time
import types
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from queue_client.errors import BatchQueueError, CorruptBatchFile

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
FORMAT_VERSION = 2
# Version 1 files hold the served fields as they are; an old dataset dir keeps writing them.
VERSIONS = (1, 2)

EXT = ".pt"

if TYPE_CHECKING:
    import torch

    from queue_client.schema import FieldSpec

_NAME_RE = re.compile(r"([0-9]{13})-([0-9]{10})-([0-9]+)\.pt")
# The highest seq a request or a resume state may name: file names hold 10 digits of seq, and
# the windows of files made past this one still fit in them.
MAX_SEQ = 10**9 - 1
# The highest seq a file name can hold: files of the windows past MAX_SEQ are made and
# journaled too, so a restarted server must take them back.
MAX_NAMED_SEQ = 10**10 - 1


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
    epoch_starts: tuple[tuple[str, int, int], ...] = ()  # EncodedBatchFile's, passed on


@dataclass(frozen=True)
class EncodedBatchFile:
    """A batch file's bytes before publishing: made anywhere (a worker, a Ray actor), written
    by whoever owns the directory."""

    seq: int
    num_batches: int
    data: bytes
    crc32: int
    # (source, epoch, row): each epoch of a mixture source whose first row (the source's row
    # `row`) is in this file. Not in the bytes: whoever publishes the file records them
    # (queue_server/mixture/epochs.py), on the data root's machine.
    epoch_starts: tuple[tuple[str, int, int], ...] = ()


def encode_batch_file(
    *,
    seq: int,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    extras: Mapping[str, torch.Tensor] | None = None,
    version: int = FORMAT_VERSION,
) -> EncodedBatchFile:
    """The bytes of one batch file. Tensors are what the file stores, each
    [num_batches, ...]: the served fields in version 1, what metadata["schema"]'s storage
    says in version 2 (storage.BatchCodec.encode makes them from the served fields).

    `extras` are tensors of any shape that travel with the file but are not batches (the
    per-batch token histograms of a curriculum candidate); readers of batches ignore them.
    The bytes depend on the arguments alone, so the same seq encodes identically anywhere.
    """
    import torch

    if not tensors:
        raise ValueError("a batch file needs at least one tensor")
    if version not in VERSIONS:
        raise ValueError(f"batch file format version {version!r} is not one of {VERSIONS}")
    num_batches = int(next(iter(tensors.values())).shape[0])
    payload = {
        "format": FORMAT_NAME,
        "version": version,
        "metadata": {**metadata, "seq": seq, "num_batches": num_batches},
        "tensors": {k: v.contiguous() for k, v in tensors.items()},
    }
    if extras:
        payload["extras"] = {k: v.contiguous() for k, v in extras.items()}
    buf = io.BytesIO()
    torch.save(payload, buf, pickle_module=_CANONICAL_PICKLE)
    data = buf.getvalue()
    return EncodedBatchFile(seq, num_batches, data, zlib.crc32(data))


class _CanonicalPickler(pickle.Pickler):
    """A pickler without a memo: equal metadata pickles to equal bytes whether or not its
    strings and dicts happen to be shared objects (a plain pickler writes a back-reference for
    the second use of one object, so the bytes would depend on how the metadata was built)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast = True  # no memo; batch payloads hold no cycles


# torch.save takes a pickle module and uses its Pickler.
_CANONICAL_PICKLE = types.ModuleType("queue_client.batchfile.canonical_pickle")
_CANONICAL_PICKLE.Pickler = _CanonicalPickler  # type: ignore[attr-defined]


def publish_batch_file(directory: Path, encoded: EncodedBatchFile) -> PublishedFile:
    """Write an encoded file into `directory` atomically under its published name."""
    name = BatchFileName(int(time.time() * 1000), encoded.seq, encoded.num_batches)
    atomic_write(Path(directory) / str(name), encoded.data)
    return PublishedFile(name, len(encoded.data), encoded.crc32, encoded.epoch_starts)


def write_batch_file(
    directory: Path,
    *,
    seq: int,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    extras: Mapping[str, torch.Tensor] | None = None,
    version: int = FORMAT_VERSION,
) -> PublishedFile:
    """Encode and publish one batch file (see encode_batch_file)."""
    encoded = encode_batch_file(
        seq=seq, tensors=tensors, metadata=metadata, extras=extras, version=version
    )
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
    """A loaded batch file: `stored` is what it holds, each [num_batches, ...]."""

    metadata: dict[str, Any]
    stored: dict[str, torch.Tensor]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    @property
    def schema(self) -> tuple[FieldSpec, ...] | None:
        """The file's own schema (metadata["schema"]), or None when it has none."""
        from queue_client.schema import parse_schema

        raw = self.metadata.get("schema")
        return None if raw is None else parse_schema(raw)

    @cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The served fields of every batch, [num_batches, batch_size, *shape] each, as the
        file's own schema reads them from what it stores (for tools and tests; trainers read
        one batch at a time through storage.BatchCodec). Version 1 files and files without
        a schema hold them as they are."""
        schema = self.schema
        if self.version < 2 or schema is None:
            return self.stored
        from queue_client.storage import codec_for

        codec = codec_for(schema)
        if codec.identity:
            return {name: self.stored[name] for name in codec.names}
        return codec.decode(self.stored)


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
    loaded = BatchFile(metadata, tensors, extras, version)
    batch_size = metadata.get("batch_size")
    has_schema = metadata.get("schema") is not None
    if version >= 2 and has_schema and isinstance(batch_size, int) and isinstance(nb, int):
        # A version 2 file says how it stores its fields: what it holds must fit that.
        from queue_client.storage import codec_for

        try:
            schema = loaded.schema
            assert schema is not None
            codec_for(schema).check_stored(tensors, (nb, batch_size))
        except BatchQueueError as exc:
            raise CorruptBatchFile(f"{path}: {exc}") from None
    return loaded
