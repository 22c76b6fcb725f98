"""Which files make up a corpus, in which order, and a fingerprint to notice when they change.

`source` is a file, a folder (searched recursively for known suffixes) or a glob, or a list of
them; each may also be a URL (s3://, gs://, https://, hf://, ...; see queue_providers.remote),
whose objects are listed here and read as streams. Files are sorted by path (URLs by URL), and
that order is the corpus's canonical document order: the val split is its first `eval_take`
documents. A file's format comes from its suffix unless `format` forces one. "arrow" (Arrow
IPC files, as Hugging Face datasets saves them) is only ever forced, never guessed.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from queue_client.errors import ConfigError
from queue_providers.remote import (
    Location,
    RemoteObject,
    RemoteStore,
    arrow_source,
    is_url,
    local_path,
    shown,
)

FORMATS = ("text", "jsonl", "parquet", "arrow")
SUFFIXES: dict[str, str] = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}


@dataclass(frozen=True)
class SourceFile:
    """One corpus file. `extent` is the length of its key space (see readers.py): bytes for
    separated text and JSONL, rows for Parquet and Arrow, 1 for a text file that is one
    document. `path` is a local Path or a RemoteObject (its str() never shows secrets)."""

    path: Location
    format: str
    size: int
    extent: int


def _expand(pattern: str) -> list[Path]:
    if pattern[:7].lower() == "file://":
        pattern = str(local_path(pattern))
    if glob.has_magic(pattern):
        return [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
    path = local_path(pattern)
    if path.is_dir():
        return [
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix.lower() in SUFFIXES and not p.name.startswith(".")
        ]
    if path.is_file():
        return [path]
    return []


def _format_of(path: Location, forced: str) -> str:
    if forced != "auto":
        return forced
    fmt = SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"text_lm cannot tell the format of {shown(path)!r} from its suffix: use one of "
            f"{sorted(SUFFIXES)} or set format to one of {list(FORMATS)}"
        )
    return fmt


def _parquet_rows(path: Location) -> int:
    import pyarrow.parquet as pq

    try:
        with arrow_source(path) as src, pq.ParquetFile(src) as pf:
            return int(pf.metadata.num_rows)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{shown(path)}: cannot be opened as Parquet: {exc}") from None


def arrow_table(path: Location) -> Any:
    """An Arrow IPC file (file or stream format) as a pyarrow Table, memory-mapped: rows are
    read from the page cache as they are sliced, never copied whole."""
    import pyarrow as pa

    if isinstance(path, RemoteObject):
        raise ConfigError(
            f"{path.shown}: Arrow files are memory-mapped, so they must be on local disk; "
            "give Parquet or JSONL at URLs"
        )
    try:
        source = pa.memory_map(str(path), "r")
        try:
            return pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_stream(source).read_all()
    except (OSError, pa.ArrowException) as exc:
        raise ConfigError(f"{path}: cannot be opened as Arrow IPC: {exc}") from None


def discover(
    source: str | Sequence[str],
    *,
    format: str = "auto",
    one_doc_per_file: bool = True,
    store: RemoteStore | None = None,
) -> list[SourceFile]:
    """The corpus files of `source`, sorted by path. Raises ConfigError when nothing matches.

    URLs are listed through `store` (its fsspec options, cache and retries; the defaults when
    None)."""
    if format not in ("auto", *FORMATS):
        raise ConfigError(f"format must be 'auto' or one of {list(FORMATS)}, got {format!r}")
    patterns = [source] if isinstance(source, str) else list(source)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigError(
            f"text_lm source must be a path or glob, or a list of them, got {source!r}"
        )
    found: dict[str, Location] = {}
    for pattern in patterns:
        if is_url(pattern):
            store = store or RemoteStore()
            objects = store.expand(pattern, suffixes=tuple(SUFFIXES))
            found.update((o.url, o) for o in objects)
            matched = bool(objects)
        else:
            paths = [p.resolve() for p in _expand(pattern)]
            found.update((str(p), p) for p in paths)
            matched = bool(paths)
        if not matched:
            raise _no_match(pattern)
    return [source_file(found[key], format, one_doc_per_file) for key in sorted(found)]


def source_file(path: Location, format: str, one_doc_per_file: bool) -> SourceFile:
    """One corpus file with its format, size and extent (Parquet and Arrow: rows, read from
    the file's metadata)."""
    fmt = _format_of(path, format)
    size = path.size if isinstance(path, RemoteObject) else path.stat().st_size
    if fmt == "parquet":
        extent = _parquet_rows(path)
    elif fmt == "arrow":
        extent = int(arrow_table(path).num_rows)
    elif fmt == "text" and one_doc_per_file:
        extent = 1
    else:
        extent = size
    return SourceFile(path, fmt, size, extent)


def _no_match(pattern: str) -> ConfigError:
    """A source that yields no file; a folder (or a URL prefix) yields only the known
    suffixes, so the message names them: a folder of .log files is not empty to its owner."""
    said = f"text_lm source {_pattern_shown(pattern)!r} matches no files"
    if is_url(pattern):
        folder = not any(c in urlsplit(pattern).path for c in "*[")
    else:
        folder = not glob.has_magic(pattern) and local_path(pattern).is_dir()
    if not folder:
        return ConfigError(said)
    return ConfigError(
        f"{said}: a folder is searched (recursively) for names ending in "
        f"{', '.join(sorted(SUFFIXES))}; give other files by name or by a glob (and a format)"
    )


def _pattern_shown(pattern: str) -> str:
    from queue_providers.remote import redact

    return redact(pattern) if is_url(pattern) else pattern


def corpus_digest(files: Sequence[SourceFile]) -> str:
    """A fingerprint of the file list: names relative to their common folder, formats, sizes.

    Relative names let a corpus move to another folder without counting as changed; objects at
    URLs are named by their URL (without secrets).
    """
    if not files:
        return hashlib.sha256(b"").hexdigest()[:32]
    local = [f.path for f in files if isinstance(f.path, Path)]
    root = os.path.commonpath([str(p.parent) for p in local]) if local else ""
    h = hashlib.sha256()
    for f in files:
        name = f.path.shown if isinstance(f.path, RemoteObject) else os.path.relpath(f.path, root)
        h.update(f"{name}\0{f.format}\0{f.size}\0{f.extent}\n".encode())
    return h.hexdigest()[:32]
