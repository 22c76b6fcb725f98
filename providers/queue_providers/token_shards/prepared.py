"""A batchqueue prepared corpus: manifest.json and the .npy shards it lists.

    manifest.json  {"format": "batchqueue-token-shards", "version": 1,
                    "dtype": "uint16" | "uint32", "vocab_size": int, "eos_id": int,
                    "tokenizer": {...},
                    "shards": [{"file": "shard-000000.npy", "tokens": int,
                                "documents": int, "sha256": hex,
                                "continues_document": bool}, ...]}
    shard-000000.npy        a 1-D array of `dtype` ids
    shard-000000.docs.npy   int64: the start of each document that starts in that shard

A document cut by a shard's end goes on at offset 0 of the next shard, whose entry then says
continues_document; order = "documents" packs it whole with the shard it starts in
(Shard.continuation says how many tokens of the next shard are its end).

Only the manifest and each shard's .npy header are read at start; a shard's document starts
are read, and checked entry by entry (doc_starts.py), when order = "documents" first packs
its documents. The manifest's checksums stand for the shards' content in the inputs
fingerprint and are never checked here: hashing every shard at every start would read the
whole corpus (a terabyte, at each start of each server), so `queue-prepare verify FOLDER`
checks them once, after a copy. Each shard must lie in the manifest's folder: a symlink
that leads out of it is refused (one inside it, or a folder reached through a link, is not).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from queue_client.errors import ConfigError
from queue_providers.remote import Location, RemoteObject, RemoteStore, read_input, shown
from queue_providers.token_shards.doc_starts import check_doc_starts
from queue_providers.token_shards.npy_file import npy_header, npy_values, read_npy
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
        shard, digest = _shard(manifest, store, entry, f"{where}: shards[{i}]", dtype, i)
        shards.append(shard)
        sums.append(digest)
    return PreparedCorpus(manifest, vocab_size, eos_id, tuple(shards), tuple(sums))


def _shard(
    manifest: Location,
    store: RemoteStore | None,
    entry: Any,
    where: str,
    dtype: np.dtype,
    index: int,
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

    documents = entry.get("documents")
    documents = documents if isinstance(documents, int) else None
    first_zero = entry.get("continues_document") is False

    def doc_starts() -> np.ndarray:
        location = _beside(manifest, store, docs_name)
        starts = npy_values(location, "document starts", "iu")
        return check_doc_starts(starts, tokens, documents, shown(location), first_zero=first_zero)

    def check_documents() -> None:
        _check_docs(_beside(manifest, store, docs_name), entry.get("documents"), tokens)

    def continuation() -> int:
        """The tokens before the shard's first document start: one ranged read of it."""
        location = _beside(manifest, store, docs_name)
        first = npy_values(location, "document starts", "iu", limit=1)
        if not len(first):
            return tokens
        check_doc_starts(first, tokens, None, shown(location), first_zero=False)
        return int(first[0])

    continues = index > 0 and entry.get("continues_document") is True
    made = Shard(
        location,
        "prepared",
        shard.dtype,
        shard.offset,
        tokens,
        doc_starts,
        check_documents,
        continuation if continues else None,
    )
    return made, digest


def _beside(manifest: Location, store: RemoteStore | None, name: str) -> Location:
    """The file `name` in the manifest's folder; ConfigError for a local symlink that leads
    out of it (the folder itself may be reached through a link)."""
    if isinstance(manifest, RemoteObject):
        base = manifest.url.rsplit("/", 1)[0]
        return (store or manifest.store).stat(f"{base}/{name}")
    path = Path(manifest).parent / name
    folder = path.parent.resolve()
    target = path.resolve()
    if not target.is_relative_to(folder):
        raise ConfigError(
            f"token_shards: {path} is a symlink to {target}, outside the corpus folder {folder}: "
            "a prepared corpus's files lie in its folder (copy the file in, or link within it)"
        )
    return path


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


def _positive_int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"token_shards: {where} is {value!r}, expected a positive int")
    return value
