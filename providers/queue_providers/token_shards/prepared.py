"""A batchqueue prepared corpus: manifest.json and the .npy shards it lists.

    manifest.json  {"format": "batchqueue-token-shards", "version": 1,
                    "dtype": "uint16" | "uint32", "vocab_size": int, "eos_id": int,
                    "tokenizer": {...},
                    "shards": [{"file": "shard-000000.npy", "tokens": int,
                                "documents": int, "sha256": hex}, ...]}
    shard-000000.npy        a 1-D array of `dtype` ids
    shard-000000.docs.npy   int64: the start of each document in that shard

Only the manifest and each shard's .npy header are read at start. The manifest's checksums
stand for the shards' content in the inputs fingerprint, so no shard is hashed.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from queue_client.errors import ConfigError
from queue_providers.remote import Location, RemoteObject, RemoteStore, read_input, shown
from queue_providers.token_shards.npy_file import npy_header, read_npy
from queue_providers.token_shards.shard import Shard, size_of

FORMAT = "batchqueue-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclass(frozen=True)
class PreparedCorpus:
    manifest: Location
    vocab_size: int
    eos_id: int | None
    shards: tuple[Shard, ...]
    sha256: tuple[str, ...]  # each shard's checksum, as the manifest gives it


def read_prepared(
    manifest: Location, store: RemoteStore | None, wanted: np.dtype | None
) -> PreparedCorpus:
    """The corpus a manifest describes; ConfigError naming the manifest or shard at fault."""
    where = shown(manifest)
    try:
        doc = json.loads(read_input(manifest))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"token_shards: {where} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(f"token_shards: {where} has format {found!r}, expected {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise ConfigError(
            f"token_shards: {where} is prepared-corpus version {doc.get('version')!r}; this "
            f"batchqueue reads version {VERSION}: upgrade batchqueue or prepare the corpus again"
        )
    dtype = DTYPES.get(doc.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise ConfigError(
            f"token_shards: {where}: dtype is {doc.get('dtype')!r}, expected one of {sorted(DTYPES)}"
        )
    if wanted is not None and dtype != wanted:
        raise ConfigError(
            f"token_shards: {where} says dtype {dtype.name} but token_dtype = {wanted.name!r} in config"
        )
    vocab_size = _positive_int(doc.get("vocab_size"), f"{where}: vocab_size")
    eos_id = doc.get("eos_id")
    if eos_id is not None and (
        not isinstance(eos_id, int) or isinstance(eos_id, bool) or not 0 <= eos_id < vocab_size
    ):
        raise ConfigError(f"{where}: eos_id is {eos_id!r}, expected an int in [0, {vocab_size})")
    entries = doc.get("shards")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"token_shards: {where}: shards must be a non-empty list")
    shards, sums = [], []
    for i, entry in enumerate(entries):
        shard, digest = _shard(manifest, store, entry, f"{where}: shards[{i}]", dtype)
        shards.append(shard)
        sums.append(digest)
    return PreparedCorpus(manifest, vocab_size, eos_id, tuple(shards), tuple(sums))


def _shard(
    manifest: Location, store: RemoteStore | None, entry: Any, where: str, dtype: np.dtype
) -> tuple[Shard, str]:
    if not isinstance(entry, dict):
        raise ConfigError(f"token_shards: {where} is {entry!r}, expected a table")
    name = entry.get("file")
    if (
        not isinstance(name, str)
        or not name.endswith(".npy")
        or PurePosixPath(name).name != name
        or name.startswith(".")
    ):
        raise ConfigError(
            f"token_shards: {where}: file is {name!r}, expected a .npy name beside the manifest"
        )
    tokens = entry.get("tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ConfigError(f"token_shards: {where}: tokens is {tokens!r}, expected an int >= 0")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        raise ConfigError(f"token_shards: {where}: sha256 is {digest!r}, expected 64 hex digits")
    location = _beside(manifest, store, name)
    shard = read_npy(location, dtype)
    if shard.tokens != tokens:
        raise ConfigError(
            f"token_shards: {shard.shown} holds {shard.tokens} tokens but {where} says {tokens}: "
            "the shard and its manifest disagree (prepare the corpus again)"
        )
    docs_name = name[: -len(".npy")] + ".docs.npy"

    def doc_starts() -> np.ndarray:
        return _load_docs(_beside(manifest, store, docs_name))

    def check_documents() -> None:
        _check_docs(_beside(manifest, store, docs_name), entry.get("documents"), tokens)

    made = Shard(
        location, "prepared", shard.dtype, shard.offset, tokens, doc_starts, check_documents
    )
    return made, digest


def _beside(manifest: Location, store: RemoteStore | None, name: str) -> Location:
    if isinstance(manifest, RemoteObject):
        base = manifest.url.rsplit("/", 1)[0]
        return (store or manifest.store).stat(f"{base}/{name}")
    return Path(manifest).parent / name


def _check_docs(location: Location, documents: Any, tokens: int) -> None:
    """A shard's document starts: a 1-D int .npy of the manifest's document count, whole."""
    where = shown(location)
    shape, _, dtype, offset = npy_header(location)
    if len(shape) != 1 or dtype.kind not in "iu":
        raise ConfigError(
            f"token_shards: {where} holds {dtype} {shape}; document starts are int64 [documents]"
        )
    if isinstance(documents, int) and shape[0] != documents:
        raise ConfigError(
            f"token_shards: {where} holds {shape[0]} document starts but the manifest says "
            f"{documents} documents"
        )
    if size_of(location) != offset + shape[0] * dtype.itemsize:
        raise ConfigError(f"token_shards: {where} is truncated")
    if tokens == 0 and shape[0]:
        raise ConfigError(f"token_shards: {where} lists documents in an empty shard")


def _load_docs(location: Location) -> np.ndarray:
    try:
        if isinstance(location, RemoteObject):
            starts = np.load(io.BytesIO(read_input(location)), allow_pickle=False)
        else:
            starts = np.load(location, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"token_shards: {shown(location)} cannot be read: {exc}") from None
    if starts.ndim != 1 or starts.dtype.kind not in "iu":
        raise ValueError(
            f"token_shards: {shown(location)} holds {starts.dtype} {starts.shape}, expected int64 [documents]"
        )
    return np.asarray(starts, dtype=np.int64)


def _positive_int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"token_shards: {where} is {value!r}, expected a positive int")
    return value
