"""Which files make up a corpus, in which order, and a fingerprint to notice when they change.

`source` is a file, a folder (searched recursively for known suffixes) or a glob, or a list of
them. Files are sorted by path, and that order is the corpus's canonical document order: the
val split is its first `eval_take` documents. A file's format comes from its suffix unless
`format` forces one.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from queue_client.errors import ConfigError

FORMATS = ("text", "jsonl", "parquet")
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
    separated text and JSONL, rows for Parquet, 1 for a text file that is one document."""

    path: Path
    format: str
    size: int
    extent: int


def _expand(pattern: str) -> list[Path]:
    if glob.has_magic(pattern):
        return [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
    path = Path(pattern).expanduser()
    if path.is_dir():
        return [
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix.lower() in SUFFIXES and not p.name.startswith(".")
        ]
    if path.is_file():
        return [path]
    return []


def _format_of(path: Path, forced: str) -> str:
    if forced != "auto":
        return forced
    fmt = SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"text_lm cannot tell the format of {str(path)!r} from its suffix: use one of "
            f"{sorted(SUFFIXES)} or set format to one of {list(FORMATS)}"
        )
    return fmt


def _parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as pf:
            return int(pf.metadata.num_rows)
    except Exception as exc:
        raise ConfigError(f"{path}: cannot be opened as Parquet: {exc}") from None


def discover(
    source: str | Sequence[str], *, format: str = "auto", one_doc_per_file: bool = True
) -> list[SourceFile]:
    """The corpus files of `source`, sorted by path. Raises ConfigError when nothing matches."""
    if format not in ("auto", *FORMATS):
        raise ConfigError(f"format must be 'auto' or one of {list(FORMATS)}, got {format!r}")
    patterns = [source] if isinstance(source, str) else list(source)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigError(
            f"text_lm source must be a path or glob, or a list of them, got {source!r}"
        )
    paths: set[Path] = set()
    for pattern in patterns:
        found = _expand(pattern)
        if not found:
            raise ConfigError(f"text_lm source {pattern!r} matches no files")
        paths.update(p.resolve() for p in found)
    files = []
    for path in sorted(paths, key=str):
        fmt = _format_of(path, format)
        size = path.stat().st_size
        if fmt == "parquet":
            extent = _parquet_rows(path)
        elif fmt == "text" and one_doc_per_file:
            extent = 1
        else:
            extent = size
        files.append(SourceFile(path, fmt, size, extent))
    return files


def corpus_digest(files: Sequence[SourceFile]) -> str:
    """A fingerprint of the file list: names relative to their common folder, formats, sizes.

    Relative names let a corpus move to another folder without counting as changed.
    """
    if not files:
        return hashlib.sha256(b"").hexdigest()[:32]
    root = os.path.commonpath([str(f.path.parent) for f in files])
    h = hashlib.sha256()
    for f in files:
        h.update(f"{os.path.relpath(f.path, root)}\0{f.format}\0{f.size}\0{f.extent}\n".encode())
    return h.hexdigest()[:32]
