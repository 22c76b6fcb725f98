"""Pieces of the corpus to token ids, in worker processes, handed back in piece order.

Each worker opens the corpus and builds the tokenizer once (from plain specs: nothing but
data crosses to it), then turns a piece's documents into one flat array of ids, an EOS after
each document, already in the shards' dtype (half the bytes to send back for uint16). The
main process keeps at most `2 * workers` pieces in flight and takes the results in piece
order, so the shards are the same for any worker count. With one worker the pieces are
encoded in the main process: no pool, no copies.

Each worker runs one tokenizer thread unless RAYON_NUM_THREADS says otherwise (the knob that
sizes both the `tokenizers` pool and text_lm's tiktoken pool): N workers then keep N cores
busy. In-process (--workers 1) the tokenizer keeps its own default.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from queue_providers.prepare.corpus import CorpusSpec, Piece, piece_texts
from queue_providers.prepare.tokenizer import TokenizerSpec
from queue_providers.text.errors import CorpusError
from queue_providers.text.files import SourceFile, corpus_digest
from queue_providers.text.readers import ReadOptions
from queue_providers.text.tokenizer import TextTokenizer

# Documents handed to the tokenizer at once (text_lm's block), and at most this much text.
BLOCK_DOCS = 1024
BLOCK_BYTES = 8 << 20


@dataclass(frozen=True)
class EncodedPiece:
    index: int
    tokens: np.ndarray  # every document's ids then EOS, in the shards' dtype
    lengths: np.ndarray  # int64 tokens per document, EOS included
    weight: int  # the piece's input bytes, for the progress bar


class _Encoder:
    """One process's corpus and tokenizer."""

    def __init__(
        self, files: Sequence[SourceFile], opts: ReadOptions, tok: TextTokenizer, dtype: str
    ) -> None:
        self.files, self.opts, self.tok, self.dtype = files, opts, tok, np.dtype(dtype)

    def encode(self, piece: Piece) -> EncodedPiece:
        arrays: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        block: list[str] = []
        size = 0
        for text in piece_texts(self.files, piece, self.opts):
            block.append(text)
            size += len(text)
            if len(block) >= BLOCK_DOCS or size >= BLOCK_BYTES:
                self._encode_block(block, arrays, lengths)
                block, size = [], 0
        if block:
            self._encode_block(block, arrays, lengths)
        tokens = np.concatenate(arrays) if arrays else np.empty(0, self.dtype)
        counts = np.concatenate(lengths) if lengths else np.empty(0, np.int64)
        return EncodedPiece(piece.index, tokens, counts, piece.weight)

    def _encode_block(
        self, block: list[str], arrays: list[np.ndarray], lengths: list[np.ndarray]
    ) -> None:
        ids, counts = self.tok.encode_docs(block)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.tok.vocab_size):
            raise CorpusError(
                f"the tokenizer gave id {int(ids.max())} (or {int(ids.min())}), outside its "
                f"vocab_size {self.tok.vocab_size}: the tokenizer file is inconsistent"
            )
        arrays.append(ids.astype(self.dtype))
        lengths.append(counts.astype(np.int64, copy=False))


_worker: _Encoder | None = None


def _exit_with_parent() -> None:
    """End this worker when the main process is gone (killed, say): the pool's queues stay
    open in the workers themselves, so a blocked worker would otherwise never notice."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _init_worker(corpus: CorpusSpec, tokenizer: TokenizerSpec, dtype: str, digest: str) -> None:
    global _worker
    _exit_with_parent()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    files = corpus.open().files
    if corpus_digest(files) != digest:
        raise CorpusError(
            "the inputs changed while this run was starting (another file list or sizes in a "
            "worker process); run again once they stay put"
        )
    _worker = _Encoder(files, corpus.options(), tokenizer.build(), dtype)


def _encode_in_worker(piece: Piece) -> EncodedPiece:
    assert _worker is not None, "the pool's initializer did not run"
    return _worker.encode(piece)


class PieceEncoder:
    """`with PieceEncoder(...) as enc: for done in enc.encode(pieces): ...` in piece order."""

    def __init__(
        self,
        corpus: CorpusSpec,
        files: Sequence[SourceFile],
        tokenizer: TokenizerSpec,
        dtype: str,
        workers: int,
    ) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._local: _Encoder | None = None
        if workers == 1:
            self._local = _Encoder(files, corpus.options(), tokenizer.build(), dtype)
        else:
            # spawn: a fresh interpreter per worker; a fork would inherit this process's
            # tokenizer, whose thread pool does not survive a fork.
            self._pool = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(corpus, tokenizer, dtype, corpus_digest(files)),
            )

    def encode(self, pieces: Iterable[Piece]) -> Iterator[EncodedPiece]:
        if self._local is not None:
            yield from map(self._local.encode, pieces)
            return
        assert self._pool is not None
        pending: collections.deque[Future[EncodedPiece]] = collections.deque()
        todo = iter(pieces)
        for piece in todo:
            pending.append(self._pool.submit(_encode_in_worker, piece))
            if len(pending) >= 2 * self.workers:
                break
        while pending:
            done = pending.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(self._pool.submit(_encode_in_worker, nxt))
            yield done

    def __enter__(self) -> PieceEncoder:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
