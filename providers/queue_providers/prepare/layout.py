"""The on-disk contract of a prepared corpus: file names, the manifest, one shard's files.

    OUT/
        manifest.json            written last: its presence says the corpus is complete
        shard-000000.npy         1-D token ids (uint16, or uint32 when vocab_size > 65536)
        shard-000000.docs.npy    int64: the offset of each document that starts in the shard
        ...
        progress.json            only while a run is unfinished: what is done, where to go on
        input-cache/             only while a run reads URL inputs: their cached blocks

Every file is written whole under a temp name, fsynced and renamed into place (atomic_write),
so a killed run leaves each file either absent or complete; a write that fails (a full disk)
removes its temp file and raises OutputUnwritable, and the files before it stay as they were.
A shard is exactly shard_tokens long except the last; a document cut by a shard's end goes on
at offset 0 of the next shard, whose manifest entry then says "continues_document": true.
docs/providers/prepare.md is the user's description; this module is its one implementation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from queue_client.errors import BatchQueueError, ConfigError
from queue_client.format.layout import atomic_write, is_temp_name

FORMAT = "batchqueue-token-shards"
VERSION = 1
MANIFEST_FILE = "manifest.json"
PROGRESS_FILE = "progress.json"
INPUT_CACHE_DIR = "input-cache"
SHARD_PREFIX = "shard-"
TOKENS_SUFFIX = ".npy"
DOCS_SUFFIX = ".docs.npy"
UINT16_MAX_VOCAB = 1 << 16
UINT32_MAX_VOCAB = 1 << 32
_HASH_CHUNK = 1 << 20


class OutputUnwritable(BatchQueueError):
    """The output folder cannot be written (a full disk, a quota, a read-only folder). What
    was written before is intact: the same command, run again once the fault is fixed, goes
    on from the last recorded shard."""


@contextlib.contextmanager
def writing(out: Path, name: str) -> Iterator[None]:
    """Turn an OSError while writing `name` in `out` into OutputUnwritable, naming both."""
    try:
        yield
    except OSError as exc:
        error = os.strerror(exc.errno) if exc.errno else str(exc)
        raise OutputUnwritable(
            f"cannot write {name} in {out}: {error}; what is already written there is kept: "
            "fix that and run the same command again to go on from it"
        ) from None


def token_dtype(vocab_size: int) -> str:
    """ "uint16" while every id fits (vocab_size <= 65536), else "uint32"; larger is refused."""
    if vocab_size <= UINT16_MAX_VOCAB:
        return "uint16"
    if vocab_size <= UINT32_MAX_VOCAB:
        return "uint32"
    raise ConfigError(
        f"the tokenizer's vocab_size {vocab_size:,} does not fit the largest shard dtype, "
        f"uint32 (at most {UINT32_MAX_VOCAB:,} ids)"
    )


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:06d}{TOKENS_SUFFIX}"


def docs_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:06d}{DOCS_SUFFIX}"


def is_ours(name: str) -> bool:
    """Whether a file name in an output dir is one this format writes (or a temp of one)."""
    if is_temp_name(name):
        return True
    return name in (MANIFEST_FILE, PROGRESS_FILE, INPUT_CACHE_DIR) or (
        name.startswith(SHARD_PREFIX) and name.endswith(TOKENS_SUFFIX)
    )


class _HashingWriter:
    """A binary file that hashes what goes through it, so a shard is hashed as it is written."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        self.sha.update(data)
        return self._f.write(data)


def save_array(path: Path, array: np.ndarray) -> str:
    """Write `array` as a .npy file (numpy's format, no pickle) atomically; its sha256."""
    holder: dict[str, str] = {}

    def write(f: BinaryIO) -> None:
        hashing = _HashingWriter(f)
        np.lib.format.write_array(hashing, array, allow_pickle=False)
        holder["sha"] = hashing.sha.hexdigest()

    with writing(path.parent, path.name):
        atomic_write(path, write)
    return holder["sha"]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class ShardRecord:
    """One shard's manifest entry."""

    file: str
    tokens: int
    documents: int
    sha256: str
    docs_file: str
    docs_sha256: str
    continues_document: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "tokens": self.tokens,
            "documents": self.documents,
            "sha256": self.sha256,
            "docs_file": self.docs_file,
            "docs_sha256": self.docs_sha256,
            "continues_document": self.continues_document,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ShardRecord:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__})


def write_shard(
    out: Path, index: int, tokens: np.ndarray, doc_starts: np.ndarray, continues: bool
) -> ShardRecord:
    """Write shard `index` (its tokens, then its document offsets) and return its entry."""
    starts = np.ascontiguousarray(doc_starts, dtype=np.int64)
    docs_sha = save_array(out / docs_name(index), starts)
    sha = save_array(out / shard_name(index), np.ascontiguousarray(tokens))
    return ShardRecord(
        shard_name(index), len(tokens), len(starts), sha, docs_name(index), docs_sha, continues
    )


def verify_shard(out: Path, record: ShardRecord) -> str | None:
    """None when both files of a finished shard are there with their recorded sha256, else
    what is wrong with them."""
    for name, sha in ((record.file, record.sha256), (record.docs_file, record.docs_sha256)):
        path = out / name
        if not path.is_file():
            return f"{path} is missing"
        if sha256_of(path) != sha:
            return f"{path} is not the file this run wrote (its sha256 differs)"
    return None


def write_json(path: Path, doc: dict[str, Any]) -> None:
    with writing(path.parent, path.name):
        atomic_write(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when absent; ConfigError when not ours."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{path} cannot be read as JSON ({exc}): it is not a prepared corpus's"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a {FORMAT!r} file: this folder holds something else")
    if doc.get("version") != VERSION:
        raise ConfigError(
            f"{path} is {FORMAT} version {doc.get('version')!r}; this batchqueue writes and "
            f"reads version {VERSION}"
        )
    return doc
