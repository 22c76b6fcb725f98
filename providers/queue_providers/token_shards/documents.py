"""order = "documents": each epoch, whole documents shuffled and packed, shard by shard.

Epoch e visits the shards in an order of its own (a keyed permutation of the shards), and
each shard's documents in an order of their own (a keyed permutation of its documents); a
shard's documents, laid end to end in that order, form a stream as long as the shard, cut
into (t - 1) // T windows as in window order. So an epoch serves every window of every
shard's stream exactly once, and row i of an epoch reads window k of the shard it falls in.
A document cut by a shard's end (a prepared corpus's continues_document) belongs to the
shard it starts in and is read on from the next, whose stream starts at its own first
document: a stream's t is then its documents' tokens. Memory is one shard's documents
(their starts and one permutation), never the corpus's: a file's rows lie in one or two
consecutive shards of the epoch's order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from queue_client.errors import ConfigError, MetaError
from queue_providers.token_shards.corpus import CorpusIndex
from queue_providers.token_shards.order import EpochOrder

if TYPE_CHECKING:
    import torch


class ShardStream:
    """One shard's documents in one epoch's order: where each position of the stream reads.

    `starts` are the documents that start in the shard; the stream runs from the first to
    `end` (past the shard's own tokens when its last document goes on in the next shards).
    Tokens before `begin`, the end of a document of the shard before, are not the shard's."""

    def __init__(
        self, starts: np.ndarray, begin: int, end: int, order_key: tuple[int, str], epoch: int
    ) -> None:
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) == 0 or starts[0] != begin:  # tokens before the first document: one more
            starts = np.concatenate([[begin], starts])
        lengths = np.diff(np.concatenate([starts, [end]]))
        perm = EpochOrder(len(starts), *order_key).permute(epoch, np.arange(len(starts)))
        self.source_start = starts[perm]
        self.stream_start = np.concatenate([[0], np.cumsum(lengths[perm])]).astype(np.int64)

    def read_positions(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token index from the shard's start, which may lie past its end, document number in
        the stream, last token of a document?) of each stream position."""
        doc = np.searchsorted(self.stream_start, positions, side="right") - 1
        source = self.source_start[doc] + (positions - self.stream_start[doc])
        return source, doc, positions == self.stream_start[doc + 1] - 1


class DocumentOrder:
    """Global rows to (shard, window) in the shard-major order, and each shard's stream.

    A shard's stream holds the documents that start in it, whole: one cut by the shard's end
    (a prepared corpus's continues_document) is read on into the next shards, and those
    shards' streams start at their own first document. So a shard has (own - 1) // T windows
    of its `own` tokens, and the epoch's windows are those of the documents, not of the
    files (window order's CorpusIndex)."""

    def __init__(self, corpus: CorpusIndex, seed: int, split: str) -> None:
        self.corpus = corpus
        self.seed = seed
        self.split = split
        tokens = np.array([s.tokens for s in corpus.shards], dtype=np.int64)
        self.token_start = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        # lead[i]: tokens at shard i's start that end the document before (one read each).
        self.lead = np.array(
            [s.continuation() if i and s.continuation else 0 for i, s in enumerate(corpus.shards)],
            dtype=np.int64,
        )
        # run_on[i]: tokens past shard i's end that its last document takes from the shards
        # after it: their leads, through every shard no document starts in.
        run_on = np.zeros_like(tokens)
        for i in range(len(tokens) - 2, -1, -1):
            whole = self.lead[i + 1] == tokens[i + 1]
            run_on[i] = self.lead[i + 1] + (run_on[i + 1] if whole else 0)
        self.end = tokens + run_on
        own = np.where(self.lead < tokens, self.end - self.lead, 0)
        block = corpus.block_size
        self.windows_per_shard = np.where(own > block, (own - 1) // block, 0)
        self.first_window = np.concatenate([[0], np.cumsum(self.windows_per_shard)])
        self.n_windows = int(self.first_window[-1])
        if self.n_windows == 0:
            raise ConfigError(
                f"token_shards: split {split!r} has no window of block_size+1={block + 1} tokens "
                f"of documents that start in one shard: they hold at most {int(own.max())}"
            )
        self.shard_order = EpochOrder(len(corpus.shards), seed, f"{split}/shards")
        self._streams: dict[tuple[int, int], ShardStream] = {}

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, shard, window within the shard) of each global row."""
        n = self.n_windows
        epochs, positions = np.divmod(np.asarray(rows, dtype=np.int64), n)
        shards = np.empty_like(positions)
        windows = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            at = epochs == epoch
            visit = self.shard_order.permute(int(epoch), np.arange(len(self.corpus.shards)))
            first = np.concatenate([[0], np.cumsum(self.windows_per_shard[visit])])
            slot = np.searchsorted(first, positions[at], side="right") - 1
            shards[at] = visit[slot]
            windows[at] = positions[at] - first[slot]
        return epochs, shards, windows

    def stream(self, shard: int, epoch: int) -> ShardStream:
        """The shard's stream in `epoch`; the last two are kept (a file spans at most a few)."""
        key = (shard, epoch)
        found = self._streams.get(key)
        if found is None:
            s = self.corpus.shards[shard]
            starts = s.doc_starts() if s.doc_starts is not None else np.zeros(1, np.int64)
            found = ShardStream(
                starts,
                int(self.lead[shard]),
                int(self.end[shard]),
                (self.seed, f"{self.split}/docs/{shard}"),
                epoch,
            )
            while len(self._streams) >= 2:
                self._streams.pop(next(iter(self._streams)))
            self._streams[key] = found
        return found

    def window_starts(
        self, epochs: np.ndarray, shards: np.ndarray, windows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(shard, token index in it) of each window's first token, for provenance: a window
        may start in the next shard, in the end of a document that runs on."""
        files, offsets = np.empty_like(windows), np.empty_like(windows)
        for epoch, index in set(zip(epochs.tolist(), shards.tolist(), strict=True)):
            now = (epochs == epoch) & (shards == index)
            positions = windows[now] * self.corpus.block_size
            source = self.stream(index, epoch).read_positions(positions)[0]
            files[now], offsets[now] = self.place(index, source)
        return files, offsets

    def place(self, shard: int, source: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, token index in it) of each token index counted from `shard`'s start:
        those past its end lie in the shards after it."""
        at = self.token_start[shard] + source
        files = np.searchsorted(self.token_start, at, side="right") - 1
        return files, at - self.token_start[files]


def check_built_windows(meta: Mapping[str, Any], windows: Mapping[str, int], dataset: str) -> None:
    """MetaError when meta, built earlier, gives an epoch of a split other windows than its
    inputs give now: a dataset built when order = "documents" served a document cut at a
    shard's end in two pieces (its epochs had the files' windows) would mix two orders."""
    for split, info in meta.get("split_info", {}).items():
        built = info.get("windows") if isinstance(info, Mapping) else None
        if split in windows and isinstance(built, int) and built != windows[split]:
            raise MetaError(
                f"token_shards: dataset {dataset!r} was built with {built} windows in an epoch "
                f"of split {split!r}, and its inputs now give {windows[split]} (order = "
                '"documents" now packs a document cut at a shard\'s end whole, with the shard it '
                "starts in): the files still to be made would follow another order than those "
                f"made. Run `queue-server reset {dataset}` (it moves the dataset aside; nothing "
                "is deleted) to build it again"
            )


IGNORE = -100


def packed_fields(
    tokens: np.ndarray,
    docs: np.ndarray,
    last: np.ndarray,
    eos_id: int,
    shown: dict[int, str],
    shards: np.ndarray,
) -> dict[str, torch.Tensor]:
    """text_lm's fields of windows of T+1 tokens of packed documents (`docs`: each position's
    document number, `last`: a document's last token there): input_ids, labels (IGNORE at a
    document's last token), segment_ids from 1 in each window, attention_mask. Every
    document must end in eos_id, as text_lm's stream does: the stored form derives the
    boundaries from it."""
    bad = last & (tokens != eos_id)
    if bad.any():
        row = int(np.nonzero(bad.any(1))[0][0])
        raise ValueError(
            f"token_shards: a document of {shown[int(shards[row])]} ends with id "
            f"{int(tokens[bad][0])}, not eos_id {eos_id}: document fields need documents that "
            "end in the end-of-document id (unset eos_id to serve x and y instead)"
        )
    labels = tokens[:, 1:].copy()
    labels[last[:, :-1]] = IGNORE
    segments = docs[:, :-1] - docs[:, :1] + 1
    import torch  # document rows go through the codec's torch encoding

    return {
        "input_ids": torch.from_numpy(tokens[:, :-1].astype(np.int32)),
        "labels": torch.from_numpy(labels.astype(np.int32)),
        "attention_mask": torch.ones(labels.shape, dtype=torch.bool),
        "segment_ids": torch.from_numpy(segments.astype(np.int32)),
    }
