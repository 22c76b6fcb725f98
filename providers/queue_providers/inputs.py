"""What a dataset was built from: each input file's size, mtime and sha256, and one fingerprint.

A dataset's batch files and meta (vocab_size, stoi, tokenized caches) are functions of its
inputs' bytes, so a dataset dir is only valid while those bytes are the same. At build the
server records every input file a provider declares (`DataProviderBase.input_files`); at each
later start it compares them again and refuses to serve a dataset whose inputs changed.

Hashing a large corpus at every start would be slow, so a file whose size and mtime match its
record is trusted, and only a file whose size or mtime moved is hashed again: a file touched
but unchanged is accepted, a file rewritten with other bytes is refused. The fingerprint
covers paths and content (sha256) only, never mtimes, so a touch does not change it.

An input at a URL (queue_providers.remote) is recorded by its URL without secrets, its size
and its identity: the version id, content hash, ETag or modification time its server gives
(fsspec info()), read when the provider listed it. Fetching a remote object to hash it at
every start would cost a download, and the server's own identity changes whenever its bytes do.

An input a provider declares as `StatOnly` (token_shards' shards: terabytes) is never hashed:
its record is its size and mtime, or a checksum its own manifest gives, so a touch of it
counts as a change.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError
from queue_providers.input_records import inputs_fingerprint, record_content
from queue_providers.remote import RemoteObject, RemotePath, is_url, redact

# Files are hashed in chunks of this size; hashlib releases the GIL on each, so a few threads
# hash a few files at once.
_CHUNK_BYTES = 1 << 20
_HASH_THREADS = 4

InputRecords = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class StatOnly:
    """A local input recorded by its size and mtime, never read: for corpora too large to hash
    at a start (terabytes of token shards). A touch counts as a change. When the input's own
    index gives a checksum (a prepared corpus's manifest), that stands for its content."""

    path: Path
    sha256: str | None = None

    def __fspath__(self) -> str:
        return os.fspath(self.path)


# What input_files() may hold: local paths, objects at URLs, or URLs as config strings.
Input = Path | str | RemoteObject | RemotePath | StatOnly


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, read in chunks (a corpus may not fit in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def describe_inputs(
    paths: Iterable[Input], known: Mapping[str, Mapping[str, Any]] | None = None
) -> InputRecords:
    """{path: {"size", "mtime_ns", "sha256"}} for each file, keyed as the provider names it;
    {url: {"size", "version"}} for each input at a URL, keyed by the URL without secrets.

    A file whose size and mtime_ns equal its entry in `known` keeps that entry's sha256 unread;
    any other file is hashed. Raises ConfigError naming a file that cannot be read.
    """
    known = known or {}
    records: InputRecords = {}
    to_hash: list[str] = []
    for path in paths:
        if isinstance(path, RemotePath):
            path = path.object()
        if isinstance(path, RemoteObject) or is_url(path):
            obj = path if isinstance(path, RemoteObject) else _listed(str(path))
            records[obj.shown] = {"size": obj.size, "version": obj.identity}
            continue
        if isinstance(path, StatOnly):
            records[os.fspath(path)] = _stat_record(path)
            continue
        key = os.fspath(path)
        try:
            st = os.stat(key)
        except OSError as exc:
            raise ConfigError(f"input {_shown(key)} cannot be read: {exc.strerror}") from None
        record: dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        old = known.get(key)
        if old and old.get("size") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns:
            record["sha256"] = old["sha256"]
        else:
            to_hash.append(key)
        records[key] = record
    if to_hash:
        with ThreadPoolExecutor(min(_HASH_THREADS, len(to_hash))) as pool:
            for key, digest in zip(to_hash, pool.map(_hash_or_raise, to_hash), strict=True):
                records[key]["sha256"] = digest
    return records


def _stat_record(item: StatOnly) -> dict[str, Any]:
    key = os.fspath(item)
    try:
        st = os.stat(key)
    except OSError as exc:
        raise ConfigError(f"input {_shown(key)} cannot be read: {exc.strerror}") from None
    version = f"sha256:{item.sha256}" if item.sha256 else f"mtime_ns:{st.st_mtime_ns}"
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "version": version}


def _listed(url: str) -> RemoteObject:
    from queue_providers.remote import RemoteStore

    return RemoteStore().stat(url)


def _hash_or_raise(key: str) -> str:
    try:
        return sha256_file(Path(key))
    except OSError as exc:
        raise ConfigError(f"input {_shown(key)} cannot be read: {exc.strerror}") from None


def check_inputs(
    paths: Sequence[Input],
    recorded: Mapping[str, Mapping[str, Any]],
    fingerprint: str,
    *,
    dataset: str,
) -> InputRecords:
    """The inputs as they are now, or ConfigError if their fingerprint is not `fingerprint`.

    The error names each file that changed (with its old and new size and sha256), was added
    or is gone, both fingerprints, and the two ways out: reset the dataset, or restore the file.
    """
    now = describe_inputs(paths, recorded)
    found = inputs_fingerprint(now)
    if found == fingerprint:
        return now
    changes = _changes(recorded, now) or [
        f"inputs {sorted(_shown(k) for k in now)} (no per-file record to say which changed)"
    ]
    raise ConfigError(
        f"dataset {dataset!r} was built from other inputs: {'; '.join(changes)}. Its inputs "
        f"fingerprint was {fingerprint} when it was built and is {found} now, so its meta "
        f"(vocab_size, ...) and batch files are stale. Run `queue-server reset {dataset}` with "
        "the same --config and --data-root to rebuild it (the old directory is moved aside, "
        "not deleted), or restore the file"
    )


def input_changes(recorded: Mapping[str, Mapping[str, Any]], now: InputRecords) -> list[str]:
    """Each input that is new, gone or changed between two sets of records, in words."""
    return _changes(recorded, now)


def _changes(recorded: Mapping[str, Mapping[str, Any]], now: InputRecords) -> list[str]:
    changes = []
    for key in sorted(set(recorded) | set(now)):
        old, new = recorded.get(key), now.get(key)
        if old is None:
            changes.append(f"input {_shown(key)} is new")
        elif new is None:
            changes.append(f"input {_shown(key)} is no longer an input (removed or renamed)")
        elif "version" in new and record_content(old) != record_content(new):
            changes.append(
                f"input {_shown(key)} changed: {old.get('size')} bytes, {old.get('version')} "
                f"then; {new['size']} bytes, {new['version']} now"
            )
        elif "sha256" in new and old.get("sha256") != new["sha256"]:
            changes.append(
                f"input {_shown(key)} changed: {old.get('size')} bytes, sha256 "
                f"{str(old.get('sha256'))[:16]} then; {new['size']} bytes, sha256 "
                f"{new['sha256'][:16]} now"
            )
    return changes


def _shown(key: str) -> str:
    """A path as the user can find it: absolute (a relative one is relative to the config);
    a URL as it is (its secrets were removed when it was recorded)."""
    if is_url(key):
        return repr(redact(key))
    return repr(os.path.abspath(key))


def path_args(value: Any, exclude: Path | None = None) -> list[Path]:
    """Every existing file named by a string in `value` (nested in dicts and lists), and every
    file under a directory so named, sorted; nothing under `exclude` (the data root, whose
    files the server itself writes)."""
    found: set[Path] = set()
    _collect(value, found)
    if exclude is not None:
        root = Path(os.path.abspath(exclude))
        found = {p for p in found if not Path(os.path.abspath(p)).is_relative_to(root)}
    return sorted(found)


def _collect(value: Any, found: set[Path]) -> None:
    if isinstance(value, Mapping):
        for v in value.values():
            _collect(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, found)
    elif isinstance(value, str) and value and len(value) < 4096 and "\0" not in value:
        path = Path(value).expanduser()
        try:
            if path.is_file():
                found.add(path)
            elif path.is_dir():
                for root, dirs, files in os.walk(path):
                    dirs.sort()
                    found.update(Path(root, name) for name in files)
        except OSError:
            return
