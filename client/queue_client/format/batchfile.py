"""Batch files: their names, their bytes, and how they are published and read.

Where they live (queue/<split>/, candidates/<split>/, quarantine/<split>/) and how temp files
are named is layout.py's; this module names the files inside those directories:
`{timestamp_ms:013d}-{seq:010d}-{num_batches}.pt`. FORMAT.md beside it describes both.

Writing is two steps, so that the bytes can be made anywhere and written by whoever owns the
directory: `encode_batch_file` (deterministic bytes and their crc32), then `publish_batch_file`
(layout.atomic_write under the published name; a published file is never written again).
Loading memory-maps the file copy-on-write, so batches are views into the page cache, and
nothing in the file can run code.

Version 3 files are a JSON header and aligned raw tensor bytes (batchfile_v3.py): loading one
parses the header and views the map, no unpickler. Versions 1 and 2 are torch.save zips
(batchfile_torch.py), still read, and still written for dataset dirs built with them.
Versions 2 and 3 hold what each schema field's storage says (narrow token ids, one window for
x and y, no derivable masks; storage.py); version 1 files hold the served fields themselves.
All load: `BatchFile.stored` is what the file holds, `BatchFile.tensors` the served fields.
"""

from __future__ import annotations

import mmap
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from queue_client.errors import BatchQueueError, CorruptBatchFile
from queue_client.format import batchfile_torch, batchfile_v3, checksum

# META_FILE, TMP_PREFIX and the name checks are re-exported, and the *_dir functions below
# kept, for modules that still import them from here; new code takes every name and path
# from queue_client.format.layout.
from queue_client.format.layout import (  # noqa: F401
    META_FILE,
    TMP_PREFIX,
    DatasetLayout,
    atomic_write,
    check_dataset_name,
    check_split_name,
)

FORMAT_NAME = "batchqueue.batchfile"
FORMAT_VERSION = batchfile_v3.VERSION
# Versions 1 and 2 are torch.save zips; a dataset dir built with one keeps writing it.
VERSIONS = (1, 2, 3)

EXT = ".pt"

if TYPE_CHECKING:
    import numpy as np
    import torch

    from queue_client.format.schema import FieldSpec

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
    tensors: Mapping[str, torch.Tensor | np.ndarray],
    metadata: Mapping[str, Any],
    extras: Mapping[str, torch.Tensor | np.ndarray] | None = None,
    version: int = FORMAT_VERSION,
) -> EncodedBatchFile:
    """The bytes of one batch file. Tensors are what the file stores, each
    [num_batches, ...]: the served fields in version 1, what metadata["schema"]'s storage
    says in versions 2 and 3 (storage.BatchCodec.encode makes them from the served fields).

    `extras` are tensors of any shape that travel with the file but are not batches (the
    per-batch token histograms of a curriculum candidate); readers of batches ignore them.
    The bytes depend on the arguments alone, so the same seq encodes identically anywhere.
    Version 3 metadata is JSON data: anything else (a numpy scalar, a non-str key, a NaN)
    is refused here with a ValueError naming it; tuples are read back as lists.
    Tensors may also be numpy arrays: version 3 writes them without torch.
    """
    if not tensors:
        raise ValueError("a batch file needs at least one tensor")
    if version not in VERSIONS:
        raise ValueError(f"batch file format version {version!r} is not one of {VERSIONS}")
    name, first = next(iter(tensors.items()))
    shape = getattr(first, "shape", None)
    if not shape:  # not a tensor or array, or one without a batch dimension
        raise ValueError(f"tensors entry {name!r} is not a tensor of [num_batches, ...]")
    num_batches = int(shape[0])
    full = {**metadata, "seq": seq, "num_batches": num_batches}
    if version >= 3:
        data = batchfile_v3.encode(full, tensors, extras or {})
    else:
        data = batchfile_torch.encode(
            FORMAT_NAME, version, full, _as_tensors(tensors), _as_tensors(extras or {}) or None
        )
    return EncodedBatchFile(seq, num_batches, data, checksum.crc32(data))


def _as_tensors(tables: Mapping[str, Any]) -> dict[str, Any]:
    """torch tensors of numpy arrays (versions 1 and 2 are torch.save zips); others as given."""
    import numpy as np
    import torch

    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in tables.items()}


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
    """crc32 of a whole file, read through a map (the hash releases the GIL).

    Hashing also faults every page in, so the first batches of a prefetched file cost no I/O.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return checksum.crc32(mm)


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
        raw = self.metadata.get("schema")
        return None if raw is None else _parse_schema(raw)

    @cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The served fields of every batch, [num_batches, batch_size, *shape] each, as the
        file's own schema reads them from what it stores (for tools and tests; trainers read
        one batch at a time through storage.BatchCodec). Version 1 files and files without
        a schema hold them as they are."""
        schema = self.schema
        if self.version < 2 or schema is None:
            return self.stored
        from queue_client.format.storage import codec_for

        codec = codec_for(schema)
        if codec.identity:
            return {name: self.stored[name] for name in codec.names}
        return codec.decode(self.stored)


# Parsed schemas by their repr: every file of a split carries the same schema, and parsing it
# again for each file would cost more than loading the file.
_SCHEMAS: dict[str, tuple[FieldSpec, ...]] = {}


def _parse_schema(raw: Any) -> tuple[FieldSpec, ...]:
    from queue_client.format.schema import parse_schema

    key = repr(raw)  # equal reprs of plain data are equal data
    schema = _SCHEMAS.get(key)
    if schema is None:
        schema = parse_schema(raw)
        if len(_SCHEMAS) >= 64:
            _SCHEMAS.clear()
        _SCHEMAS[key] = schema
    return schema


def load_batch_file(path: Path, *, crc32: int | None = None) -> BatchFile:
    """Map a batch file copy-on-write: its tensors are views of the page cache, and writing
    into one never changes the file. Raises CorruptBatchFile naming the file and the fault,
    and FileNotFoundError for a file that is gone (also one deleted while it is opened).

    With `crc32` (what the server recorded for the file), the bytes are checked first,
    hashed through the very map the tensors view: one map per file, and the hash leaves its
    pages mapped, so the first batches read from it take no page faults."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            if not batchfile_v3.has_magic(os.pread(fd, len(batchfile_v3.MAGIC), 0)):
                mm = None
            else:  # ACCESS_COPY is MAP_PRIVATE: a write into a view copies its page only
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise CorruptBatchFile(f"{path}: cannot be read: {type(exc).__name__}: {exc}") from None
    if crc32 is not None:
        _check_crc32(path, crc32, file_crc32(path) if mm is None else checksum.crc32(mm))
    if mm is None:
        return _checked(batchfile_torch.load_path(Path(path)), path)
    layout = batchfile_v3.parse(mm, str(path), FORMAT_VERSION)
    return _from_layout(layout, _byte_tensor(mm), layout.data_start, path)


def _check_crc32(path: Path, recorded: int, found: int) -> None:
    if found != recorded:
        raise CorruptBatchFile(f"{path} has crc32 {found:#010x}, the server wrote {recorded:#010x}")


def load_batch_bytes(data: bytes, where: str) -> BatchFile:
    """Load a batch file held in memory (one fetched over the network) with the same checks
    as load_batch_file, and nothing that can run code. The tensors are views of one copy of
    the data, so `data` may go afterwards and writing into them leaves it alone."""
    if not batchfile_v3.has_magic(data):
        return _checked(batchfile_torch.load_bytes(data, where), where)
    layout = batchfile_v3.parse(memoryview(data), where, FORMAT_VERSION)
    import numpy as np
    import torch

    # One copy of the data region (numpy copies without the GIL).
    copy = np.frombuffer(data, np.uint8, layout.data_bytes, layout.data_start).copy()
    return _from_layout(layout, torch.from_numpy(copy), 0, where)


def _byte_tensor(buffer: mmap.mmap) -> torch.Tensor:
    import torch

    return torch.frombuffer(buffer, dtype=torch.uint8)


def _from_layout(
    layout: batchfile_v3.Layout, base: torch.Tensor, shift: int, path: Path | str
) -> BatchFile:
    try:
        tensors = batchfile_v3.views(base, shift, layout.tensors)
        extras = batchfile_v3.views(base, shift, layout.extras)
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:  # parse checked sizes
        raise CorruptBatchFile(f"{path}: a tensor cannot be viewed: {exc}") from None
    if not tensors:
        raise CorruptBatchFile(f"{path}: metadata or tensors missing")
    return _batch_file(layout.metadata, tensors, extras, layout.version, path)


def _checked(payload: object, path: Path | str) -> BatchFile:
    """The payload of a loaded version 1 or 2 file as a BatchFile, if it is one."""
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
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise CorruptBatchFile(f"{path}: tensors is not a table of tensors")
    extras = payload.get("extras") or {}
    if not isinstance(extras, dict) or not all(
        isinstance(t, torch.Tensor) for t in extras.values()
    ):
        raise CorruptBatchFile(f"{path}: extras is not a table of tensors")
    return _batch_file(metadata, tensors, extras, version, path)


def _batch_file(
    metadata: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    extras: dict[str, torch.Tensor],
    version: int,
    path: Path | str,
) -> BatchFile:
    """A BatchFile of what a file holds, if its tensors hold its batches as it says."""
    nb = metadata.get("num_batches")
    for name, t in tensors.items():
        if t.dim() < 2 or t.shape[0] != nb:
            raise CorruptBatchFile(f"{path}: tensor {name!r} does not hold {nb} batches")
    loaded = BatchFile(metadata, tensors, extras, version)
    batch_size = metadata.get("batch_size")
    has_schema = metadata.get("schema") is not None
    if version >= 2 and has_schema and isinstance(batch_size, int) and isinstance(nb, int):
        # A file says how it stores its fields: what it holds must fit that.
        from queue_client.format.storage import codec_for

        try:
            schema = loaded.schema
            assert schema is not None
            codec_for(schema).check_stored(tensors, (nb, batch_size))
        except BatchQueueError as exc:
            raise CorruptBatchFile(f"{path}: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a schema of junk
            raise CorruptBatchFile(
                f"{path}: metadata schema is malformed: {type(exc).__name__}: {exc}"
            ) from None
    return loaded
