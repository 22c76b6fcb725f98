"""Token sequences as one flat array plus offsets, and the encoders that make them.

A corpus of a million lines is two arrays, not a million lists: cheap to save, to memory-map
in every worker, and to gather rows from with one indexing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from queue_providers.tokenized.wordpiece import LoadedTokenizer

# Encoding in chunks bounds the memory held by `tokenizers.Encoding` objects at once.
_ENCODE_CHUNK = 8192


@dataclass(frozen=True)
class Ragged:
    """Sequences as one flat array and offsets: sequence i is flat[offsets[i]:offsets[i+1]]."""

    flat: np.ndarray
    offsets: np.ndarray  # int64, len = number of sequences + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def starts(self) -> np.ndarray:
        return self.offsets[:-1]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]], dtype: Any = np.int32) -> Ragged:
        lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=dtype, count=int(offsets[-1]))
        return cls(flat, offsets)

    def without_empty(self) -> Ragged:
        """The same sequences less the empty ones (an empty one only repeats an offset)."""
        return Ragged(self.flat, np.unique(self.offsets))


def encode_texts(tok: LoadedTokenizer, texts: Sequence[str]) -> Ragged:
    """Token ids of each text, without special tokens."""
    # encode_batch_fast skips character offsets, which nothing here needs (tokenizers >= 0.21).
    encode = getattr(tok.tokenizer, "encode_batch_fast", tok.tokenizer.encode_batch)
    ids: list[list[int]] = []
    for lo in range(0, len(texts), _ENCODE_CHUNK):
        chunk = encode(list(texts[lo : lo + _ENCODE_CHUNK]), add_special_tokens=False)
        ids.extend(e.ids for e in chunk)
    return Ragged.from_lists(ids)


def encode_words(tok: LoadedTokenizer, sentences: Sequence[Sequence[str]]) -> tuple[Ragged, Ragged]:
    """Subword ids of each pre-split sentence, and for each subword the index of its word."""
    ids: list[list[int]] = []
    words: list[list[int]] = []
    for lo in range(0, len(sentences), _ENCODE_CHUNK):
        chunk = [list(s) for s in sentences[lo : lo + _ENCODE_CHUNK]]
        for enc in tok.tokenizer.encode_batch(
            chunk, is_pretokenized=True, add_special_tokens=False
        ):
            ids.append(enc.ids)
            words.append(enc.word_ids)
    return Ragged.from_lists(ids), Ragged.from_lists(words)
