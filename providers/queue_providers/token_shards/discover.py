"""From `inputs` (files, directories, globs, URLs) to the shards of a corpus, in order.

Each input is expanded (a glob or directory to its files, sorted), then each file's format
is told by its name and first bytes unless `format` names one: `manifest.json` (or a
directory holding one) is a prepared corpus, `X.idx` (or `X.bin` with `X.idx` beside it) a
Megatron indexed dataset, `.npy` a numpy array, a `.bin` starting with the llm.c magic an
llm.c shard, any other `.bin` raw ids. Only headers are read.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from queue_client.errors import ConfigError
from queue_providers.inputs import StatOnly
from queue_providers.remote import Location, RemoteObject, RemoteStore, is_url, local_path, shown
from queue_providers.token_shards.llmc import is_llmc, read_llmc
from queue_providers.token_shards.megatron import megatron_pair, read_megatron
from queue_providers.token_shards.npy_file import read_npy
from queue_providers.token_shards.prepared import MANIFEST, read_prepared
from queue_providers.token_shards.raw_bin import read_raw
from queue_providers.token_shards.shard import Shard, read_head

FORMATS = ("auto", "raw", "llmc", "npy", "megatron", "prepared")
SUFFIXES = (".bin", ".npy", ".idx")


@dataclass
class Found:
    """A split's shards, what fingerprints them, and what prepared manifests say."""

    shards: list[Shard] = field(default_factory=list)
    inputs: list[Any] = field(default_factory=list)
    vocab_sizes: dict[str, int] = field(default_factory=dict)  # manifest -> its vocab_size
    eos_ids: set[int] = field(default_factory=set)


def discover(
    entries: list[str],
    fmt: str,
    raw_dtype: np.dtype,
    wanted: np.dtype | None,
    store: RemoteStore,
    where: str,
) -> Found:
    found = Found()
    files = [loc for entry in entries for loc in _expand(entry, store, where)]
    names = {shown(loc) for loc in files}
    done: set[str] = set()
    for loc in files:
        name = shown(loc)
        if name in done:
            continue
        done.add(name)
        kind = _kind(loc, fmt, names)
        if kind == "prepared":
            corpus = read_prepared(loc, store, wanted)
            found.shards += corpus.shards
            found.vocab_sizes[name] = corpus.vocab_size
            if corpus.eos_id is not None:
                found.eos_ids.add(corpus.eos_id)
            found.inputs.append(loc)  # the manifest itself is small: hashed
            for shard, digest in zip(corpus.shards, corpus.sha256, strict=True):
                found.inputs.append(_cheap(shard.location, digest))
        elif kind == "megatron":
            bin_loc, idx_loc = _megatron_pair(loc, store)
            done.update({shown(bin_loc), shown(idx_loc)})
            found.shards.append(read_megatron(bin_loc, idx_loc, wanted))
            found.inputs += [_cheap(bin_loc), _cheap(idx_loc)]
        else:
            shard = _read_single(loc, kind, raw_dtype, wanted)
            found.shards.append(shard)
            found.inputs.append(_cheap(loc))
    if not found.shards:
        raise ConfigError(f"{where}: inputs {entries!r} name no token files")
    return found


def _read_single(loc: Location, kind: str, raw_dtype: np.dtype, wanted: np.dtype | None) -> Shard:
    if kind == "npy":
        return read_npy(loc, wanted)
    if kind == "llmc":
        return read_llmc(loc, wanted)
    return read_raw(loc, raw_dtype)


def _expand(entry: Any, store: RemoteStore, where: str) -> list[Location]:
    if not isinstance(entry, str) or not entry:
        raise ConfigError(f"{where}: each input must be a path, glob or URL, got {entry!r}")
    if is_url(entry):
        objects = store.expand(entry)
        if len(objects) == 1 and objects[0].url == entry:
            return list(objects)  # one object, named: whatever its suffix
        manifests = [o for o in objects if o.name == MANIFEST]
        return list(manifests or [o for o in objects if _token_file(o.name)])
    path = local_path(entry)
    if any(c in entry for c in "*?["):
        matches = [Path(p) for p in sorted(glob.glob(str(path))) if Path(p).is_file()]
        if not matches:
            raise ConfigError(f"{where}: input glob {entry!r} matches no file")
        return list(matches)
    if path.is_dir():
        if (path / MANIFEST).is_file():
            return [path / MANIFEST]
        files = sorted(p for p in path.iterdir() if p.is_file() and _token_file(p.name))
        if not files:
            raise ConfigError(
                f"{where}: input directory {entry!r} holds no .bin, .npy or .idx file"
            )
        return list(files)
    if not path.is_file():
        raise ConfigError(f"{where}: input {entry!r} does not exist")
    return [path]


def _token_file(name: str) -> bool:
    """Whether a file found in a directory listing is a token file (or a Megatron index), not
    a hidden file, a prepared corpus's document starts or anything else beside them."""
    lower = name.lower()
    return not name.startswith(".") and lower.endswith(SUFFIXES) and not lower.endswith(".docs.npy")


def _kind(loc: Location, fmt: str, names: set[str]) -> str:
    name = loc.name if isinstance(loc, RemoteObject) else Path(loc).name
    suffix = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    if fmt != "auto":
        return fmt
    if name == MANIFEST:
        return "prepared"
    if suffix == "idx":
        return "megatron"
    if suffix == "npy":
        return "npy"
    idx_name = shown(loc)[: -len(suffix)] + "idx" if suffix else ""
    if suffix == "bin" and (
        idx_name in names or (isinstance(loc, Path) and megatron_pair(loc)[1].is_file())
    ):
        return "megatron"
    return "llmc" if is_llmc(read_head(loc, 4)) else "raw"


def _megatron_pair(loc: Location, store: RemoteStore) -> tuple[Location, Location]:
    """(PREFIX.bin, PREFIX.idx) for either of the two."""
    if isinstance(loc, RemoteObject):
        prefix = loc.url.rsplit(".", 1)[0]
        return store.stat(prefix + ".bin"), store.stat(prefix + ".idx")
    path = Path(loc)
    bin_path, idx_path = megatron_pair(path)
    for p in (bin_path, idx_path):
        if not p.is_file():
            raise ConfigError(
                f"token_shards: {p} is missing: a Megatron dataset is a .bin and a .idx"
            )
    return bin_path, idx_path


def _cheap(loc: Location, sha256: str | None = None) -> Any:
    """What fingerprints a token file without reading it: its size and mtime (or the checksum
    its manifest gives) locally, its server's identity at a URL."""
    return loc if isinstance(loc, RemoteObject) else StatOnly(Path(loc), sha256)
