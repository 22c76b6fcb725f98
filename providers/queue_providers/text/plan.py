"""Where each split's documents lie, and which of them each worker reads.

The corpus is one sequence of documents in canonical order (files sorted, documents in file
order). A `Boundary` (file, key) is the first train document: val is everything before it,
train everything from it on, so the two are disjoint by construction. Each split's range is cut
into chunks of keys, about eight per worker and at most 64 MiB each, at offsets that depend only
on file sizes and the worker count; worker w of N takes chunks w, w+N, w+2N, ... Because every
document belongs to exactly one chunk (readers.py), the workers' shards are disjoint and
together cover the split.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from queue_providers.text.errors import CorpusError
from queue_providers.text.files import SourceFile
from queue_providers.text.readers import ReadOptions, iter_docs

CHUNKS_PER_WORKER = 8
MAX_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True, order=True)
class Boundary:
    """A point in canonical order: the document with key >= `key` in file `file`."""

    file: int
    key: int


@dataclass(frozen=True)
class Chunk:
    """The documents of file `file` whose key lies in [start, end)."""

    file: int
    start: int
    end: int


def iter_corpus(files: Sequence[SourceFile], opts: ReadOptions) -> Iterator[tuple[int, int, str]]:
    """(file index, key, text) for every document, in canonical order."""
    for i, sf in enumerate(files):
        for key, text in iter_docs(sf, 0, sf.extent, opts):
            yield i, key, text


def find_boundary(
    files: Sequence[SourceFile], opts: ReadOptions, eval_take: int, source: object
) -> Boundary:
    """The first train document, after `eval_take` val documents. Reads only that far.

    Raises CorpusError when the corpus has no documents, or none left for train.
    """
    seen = 0
    for i, key, _ in iter_corpus(files, opts):
        if seen == eval_take:
            return Boundary(i, key)
        seen += 1
    if seen == 0:
        raise CorpusError(
            f"text_lm source {source!r} ({len(files)} file(s)) holds no documents: every file is "
            "empty or whitespace"
        )
    raise CorpusError(
        f"text_lm source {source!r} has only {seen} document(s) but eval_take={eval_take}: "
        "train would be empty; lower eval_take or add documents"
    )


def split_ranges(files: Sequence[SourceFile], boundary: Boundary | None) -> dict[str, list[Chunk]]:
    """Per split, its key range in each file it touches. boundary None means no val split."""
    end = Boundary(len(files), 0)
    if boundary is None:
        return {"train": _range(files, Boundary(0, 0), end)}
    return {"val": _range(files, Boundary(0, 0), boundary), "train": _range(files, boundary, end)}


def _range(files: Sequence[SourceFile], lo: Boundary, hi: Boundary) -> list[Chunk]:
    out = []
    for f in range(lo.file, min(hi.file + 1, len(files))):
        a = lo.key if f == lo.file else 0
        b = hi.key if f == hi.file else files[f].extent
        if b > a:
            out.append(Chunk(f, a, b))
    return out


def make_chunks(
    files: Sequence[SourceFile], ranges: Sequence[Chunk], num_workers: int
) -> list[Chunk]:
    """Cut a split's ranges into chunks: about CHUNKS_PER_WORKER per worker, each at most
    MAX_CHUNK_BYTES, never finer than one key."""
    weights = [
        (r.end - r.start) / files[r.file].extent * max(files[r.file].size, 1) for r in ranges
    ]
    total = sum(weights)
    target = min(max(total / (num_workers * CHUNKS_PER_WORKER), 1.0), MAX_CHUNK_BYTES)
    chunks: list[Any] = []
    for r, w in zip(ranges, weights, strict=True):
        n = min(r.end - r.start, max(1, math.ceil(w / target)))
        span = r.end - r.start
        cuts = [r.start + span * i // n for i in range(n + 1)]
        chunks.extend(Chunk(r.file, a, b) for a, b in itertools.pairwise(cuts) if b > a)
    return chunks


def shard(chunks: Sequence[Chunk], worker_index: int, num_workers: int) -> list[Chunk]:
    """Worker `worker_index`'s chunks: every num_workers-th, so shards are disjoint."""
    return list(chunks[worker_index::num_workers])
