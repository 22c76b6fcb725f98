"""One prepare run: check the output dir, plan, tokenize in workers, write shards, resume.

The steps, each in its own module: state.py decides whether `out` may be written and what a
previous run finished; corpus.py lists the inputs and cuts them into pieces; tokenizer.py
resolves the tokenizer; encode.py tokenizes pieces in worker processes, in order; sharder.py
cuts the stream into shards; layout.py writes each file atomically. After each shard the
progress record is rewritten, so a killed run goes on from its last shard; manifest.json is
written last.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError
from queue_providers.inputs import describe_inputs, inputs_fingerprint
from queue_providers.prepare.corpus import CorpusSpec, Piece, corpus_summary, plan_pieces
from queue_providers.prepare.encode import PieceEncoder
from queue_providers.prepare.layout import INPUT_CACHE_DIR, token_dtype
from queue_providers.prepare.progress import PrepareProgress
from queue_providers.prepare.sharder import ResumePoint, Sharder
from queue_providers.prepare.state import (
    check_same,
    finished_shards,
    locked,
    open_output,
    write_manifest,
    write_progress,
)
from queue_providers.prepare.tokenizer import resolve_tokenizer
from queue_providers.text.corpus import Corpus
from queue_providers.text.errors import CorpusError
from queue_providers.text.files import corpus_digest
from queue_providers.text.plan import iter_corpus

# Smaller shards would make a file (two, with the offsets) per few documents.
MIN_SHARD_TOKENS = 1024
MAX_WORKERS = 256


@dataclass(frozen=True)
class PrepareOptions:
    """A prepare run, as the command line gives it."""

    corpus: CorpusSpec
    tokenizer: str
    out: Path
    shard_tokens: int
    workers: int = 1
    eos_token: str | None = None
    tiktoken_pattern: str | None = None
    overwrite: bool = False
    progress: bool = False

    def __post_init__(self) -> None:
        if self.shard_tokens < MIN_SHARD_TOKENS:
            raise ConfigError(
                f"--shard-tokens {self.shard_tokens} is too small: a shard holds at least "
                f"{MIN_SHARD_TOKENS} tokens (100,000,000 is usual for pretraining)"
            )
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"--workers must be 1 to {MAX_WORKERS}, got {self.workers}")


@dataclass(frozen=True)
class PrepareResult:
    manifest: dict[str, Any]
    resumed_shards: int  # shards a previous run had finished (verified, not redone)
    tokens_per_s: float  # this run's rate
    already_complete: bool = False  # the folder held the finished corpus: only checked


def prepare(opts: PrepareOptions) -> PrepareResult:
    """Prepare (or finish preparing) the corpus into opts.out; see the module docstring."""
    with locked(opts.out):
        return _prepare(opts)


def _prepare(opts: PrepareOptions) -> PrepareResult:
    out = opts.out
    recorded = open_output(out, opts.overwrite)
    corpus_spec = dataclasses.replace(opts.corpus, cache_dir=out / INPUT_CACHE_DIR)
    corpus = corpus_spec.open()
    files, read = corpus.files, corpus_spec.options()
    known = (recorded or {}).get("inputs", {}).get("records", {})
    records = describe_inputs([f.path for f in files], known)
    spec, tok_identity = resolve_tokenizer(
        opts.tokenizer,
        eos_token=opts.eos_token,
        pattern=opts.tiktoken_pattern,
        corpus_texts=lambda: (text for _, _, text in iter_corpus(files, read)),
    )
    pieces = plan_pieces(files)
    identity = _identity(corpus_spec, corpus, records, tok_identity, pieces, opts.shard_tokens)
    if recorded is not None:
        check_same(out, recorded, identity)
        done = finished_shards(out, recorded)
        if done.complete:
            return PrepareResult(recorded, len(done.shards), 0.0, already_complete=True)
    else:
        done = finished_shards(out, {})
    shards = list(done.shards)
    write_progress(out, identity, shards)  # marks the folder ours before any shard exists
    at = done.resume_at
    todo = pieces[at.piece :]
    dtype = identity["dtype"]
    sharder = Sharder(out, opts.shard_tokens, dtype, len(shards), at)
    done_bytes = sum(p.weight for p in pieces[: at.piece])
    total = sum(p.weight for p in pieces)
    with (
        PrepareProgress(total, done_bytes, enabled=opts.progress) as bar,
        PieceEncoder(corpus_spec, files, spec, dtype, opts.workers) as encoder,
    ):
        for piece in encoder.encode(todo):
            skipped = at.offset if piece.index == at.piece else 0
            for record, nxt in sharder.add(piece):
                shards.append((record, nxt))
                write_progress(out, identity, shards)
            bar.advance(piece.weight, len(piece.tokens) - skipped)
        last = sharder.finish()
        rate = bar.rate()
    if last is not None:
        shards.append((last, ResumePoint(len(pieces), 0, False)))
    if not shards:
        raise CorpusError(
            f"the inputs {corpus.shown!r} ({len(files)} file(s)) hold no documents: every "
            "file is empty or whitespace"
        )
    manifest = write_manifest(out, identity, shards)
    return PrepareResult(manifest, len(done.shards), rate)


def _identity(
    spec: CorpusSpec,
    corpus: Corpus,
    records: dict[str, dict[str, Any]],
    tokenizer: dict[str, Any],
    pieces: list[Piece],
    shard_tokens: int,
) -> dict[str, Any]:
    """Everything the shards depend on: a run that differs in any of it may not go on."""
    files = corpus.files
    plan = [[[c.file, c.start, c.end] for c in p.chunks] for p in pieces]
    return {
        "inputs": {
            "fingerprint": inputs_fingerprint(records),
            "corpus_digest": corpus_digest(files),
            **corpus_summary(corpus),
            "records": records,
        },
        "tokenizer": tokenizer,
        "reading": {
            "format": spec.format,
            "separator": spec.separator,
            "text_key": spec.text_key,
            "utf8_errors": spec.utf8_errors,
            "max_document_bytes": spec.max_document_bytes,
        },
        "dtype": token_dtype(tokenizer["vocab_size"]),
        "shard_tokens": shard_tokens,
        "plan": {
            "pieces": len(plan),
            "sha256": hashlib.sha256(json.dumps(plan).encode()).hexdigest(),
        },
    }
