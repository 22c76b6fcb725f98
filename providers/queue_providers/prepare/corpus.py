"""Which documents a prepare run reads, in which order, cut into pieces of work.

The corpus is what text_lm reads (queue_providers.text: files, folders, globs, URLs, or a
Hugging Face dataset's split), in its canonical order: files sorted, documents in file order.
That order is the shards' order. The work is cut into *pieces*: runs of consecutive chunks
(text.plan's key ranges, so every document lies in exactly one) of about `piece_bytes` of
input each. The cut depends on the corpus alone, never on the worker count, so pieces are
numbered the same in every run and a resume point is (piece, token offset in it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError
from queue_providers.remote import RemoteSettings, RemoteStore, is_url
from queue_providers.text.corpus import Corpus, open_corpus
from queue_providers.text.files import SourceFile
from queue_providers.text.plan import CHUNKS_PER_WORKER, Chunk, make_chunks, split_ranges
from queue_providers.text.readers import ReadOptions, iter_docs

# A piece: enough text that handing it to a worker costs nothing next to tokenizing it, few
# enough bytes that a resume redoes little and the pieces in flight stay small in memory.
MIN_PIECE_BYTES = 64 << 10
MAX_PIECE_BYTES = 4 << 20
PIECES_WANTED = 256


@dataclass(frozen=True)
class CorpusSpec:
    """The inputs as the command line gives them (picklable: each worker opens them again)."""

    sources: tuple[str, ...] | None
    hf_dataset: str | None
    hf_split: str
    hf_config: str | None
    hf_revision: str | None
    format: str
    separator: str | None
    text_key: str
    utf8_errors: str
    max_document_bytes: int
    cache_dir: Path
    remote: dict[str, Any] | None = None  # text_lm's `remote` table: how URLs are fetched

    def options(self) -> ReadOptions:
        return ReadOptions(
            separator=self.separator,
            text_key=self.text_key,
            utf8_errors=self.utf8_errors,
            max_document_bytes=self.max_document_bytes,
            flags=True,  # each of these came from a queue-prepare flag
        )

    def open(self) -> Corpus:
        """The corpus's files, listed and sized (ConfigError for a missing input)."""
        if self.sources is not None:
            for source in self.sources:
                local = not is_url(source) and "://" not in source and not _has_magic(source)
                if local and not Path(source).expanduser().exists():
                    raise ConfigError(f"input {source!r} does not exist")
        settings = RemoteSettings.from_config(self.remote, cache_dir=self.cache_dir, who=WHO)
        store = RemoteStore(settings)
        return open_corpus(
            list(self.sources) if self.sources is not None else None,
            hf_dataset=self.hf_dataset,
            hf_config=self.hf_config,
            hf_revision=self.hf_revision,
            hf_splits=None if self.hf_dataset is None else {"train": self.hf_split},
            format=self.format,
            one_doc_per_file=self.separator is None,
            store=store,
        )


WHO = "queue-prepare"


def _has_magic(source: str) -> bool:
    return any(c in source for c in "*?[")


@dataclass(frozen=True)
class Piece:
    """Consecutive chunks, read in order; `weight` is its share of the input bytes."""

    index: int
    chunks: tuple[Chunk, ...]
    weight: int


def plan_pieces(files: Sequence[SourceFile]) -> list[Piece]:
    """The corpus cut into pieces of about total/PIECES_WANTED bytes (within the bounds)."""
    ranges = split_ranges(files, None)["train"]
    total = sum(f.size for f in files)
    piece_bytes = min(MAX_PIECE_BYTES, max(MIN_PIECE_BYTES, total // PIECES_WANTED))
    # make_chunks aims at total / (n * CHUNKS_PER_WORKER) bytes a chunk: ask for piece_bytes.
    n = max(1, math.ceil(total / (piece_bytes * CHUNKS_PER_WORKER)))
    pieces: list[Piece] = []
    group: list[Chunk] = []
    weight = 0.0
    for chunk in make_chunks(files, ranges, n):
        sf = files[chunk.file]
        group.append(chunk)
        weight += (chunk.end - chunk.start) / sf.extent * max(sf.size, 1)
        if weight >= piece_bytes:
            pieces.append(Piece(len(pieces), tuple(group), round(weight)))
            group, weight = [], 0.0
    if group:
        pieces.append(Piece(len(pieces), tuple(group), round(weight)))
    return pieces


def piece_texts(files: Sequence[SourceFile], piece: Piece, opts: ReadOptions) -> Iterator[str]:
    """The documents of one piece, in canonical order."""
    for chunk in piece.chunks:
        for _key, text in iter_docs(files[chunk.file], chunk.start, chunk.end, opts):
            yield text


def corpus_summary(corpus: Corpus) -> dict[str, Any]:
    """What the manifest says about where the documents came from, besides their records."""
    return {
        "source": corpus.shown if corpus.hf_info is None else None,
        "hf": corpus.hf_info,
        "files": len(corpus.files),
        "bytes": sum(f.size for f in corpus.files),
    }


__all__ = ["CorpusSpec", "Piece", "corpus_summary", "piece_texts", "plan_pieces"]
