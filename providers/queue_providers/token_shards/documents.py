"""order = "documents": each epoch, whole documents shuffled and packed, shard by shard.

Epoch e visits the shards in an order of its own (a keyed permutation of the shards), and
each shard's documents in an order of their own (a keyed permutation of its documents); a
shard's documents, laid end to end in that order, form a stream as long as the shard, cut
into the same (t - 1) // T windows as in window order. So an epoch still serves every
window of every shard exactly once, and row i of an epoch reads window k of the shard it
falls in. Memory is one shard's documents (their starts and one permutation), never the
corpus's: a file's rows lie in one or two consecutive shards of the epoch's order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from queue_providers.token_shards.corpus import CorpusIndex
from queue_providers.token_shards.order import EpochOrder

if TYPE_CHECKING:
    import torch


class ShardStream:
    """One shard's documents in one epoch's order: where each position of the stream reads."""

    def __init__(
        self, starts: np.ndarray, tokens: int, order_key: tuple[int, str], epoch: int
    ) -> None:
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) == 0 or starts[0] != 0:  # tokens before the first document: one more
            starts = np.concatenate([[0], starts])
        lengths = np.diff(np.concatenate([starts, [tokens]]))
        perm = EpochOrder(len(starts), *order_key).permute(epoch, np.arange(len(starts)))
        self.source_start = starts[perm]
        self.stream_start = np.concatenate([[0], np.cumsum(lengths[perm])]).astype(np.int64)

    def read_positions(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard token index, document number in the stream, last token of a document?) of
        each stream position."""
        doc = np.searchsorted(self.stream_start, positions, side="right") - 1
        source = self.source_start[doc] + (positions - self.stream_start[doc])
        return source, doc, positions == self.stream_start[doc + 1] - 1


class DocumentOrder:
    """Global rows to (shard, window) in the shard-major order, and each shard's stream."""

    def __init__(self, corpus: CorpusIndex, seed: int, split: str) -> None:
        self.corpus = corpus
        self.seed = seed
        self.split = split
        self.windows_per_shard = np.diff(corpus.first_window)
        self.shard_order = EpochOrder(len(corpus.shards), seed, f"{split}/shards")
        self._streams: dict[tuple[int, int], ShardStream] = {}

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, shard, window within the shard) of each global row."""
        n = self.corpus.n_windows
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
            found = ShardStream(starts, s.tokens, (self.seed, f"{self.split}/docs/{shard}"), epoch)
            while len(self._streams) >= 2:
                self._streams.pop(next(iter(self._streams)))
            self._streams[key] = found
        return found


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
