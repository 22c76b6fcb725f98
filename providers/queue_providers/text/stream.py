"""One worker's stream of windows for one split, with a small state that can be journaled.

Each epoch the worker reads its chunks in an order shuffled by (seed, epoch), and reads
documents in *blocks* of `block_docs` (the shuffle buffer, also capped at MAX_BLOCK_CHARS of
text so memory stays flat whatever the documents). A block is tokenized at once, its documents
are shuffled by (seed, epoch, block), and it is packed into windows. Without shuffle (the val
split) the order is the corpus's own, identical every epoch.

Everything about a block is a function of where it starts, so the state is only:
  epoch, block   the block's number (within the epoch)
  start          where its first document is: [chunk in this epoch's order, key, skip]
  window         how many of its windows were handed out already
  carry_*        the tokens left over from the block before, which this block's stream starts
                 with (sequential packing only; fewer than T tokens)
Loading a state reads that one block again (or takes it from a small cache) and packs it, so
producing a window again gives the same bytes. A state made under another layout (corpus,
worker count, T, packing, seed, tokenizer) is refused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from queue_providers.seeding import derive_seed
from queue_providers.text.errors import CorpusError
from queue_providers.text.files import SourceFile
from queue_providers.text.packing import Windows, pack_bin, pack_sequential
from queue_providers.text.plan import Chunk
from queue_providers.text.readers import ReadOptions, iter_docs
from queue_providers.text.tokenizer import TextTokenizer

STATE_VERSION = 1
STATE_KEYS = frozenset(
    {"version", "layout", "epoch", "block", "start", "window", "carry_tokens", "carry_lengths"}
)
MAX_BLOCK_CHARS = 8 << 20
# Blocks kept tokenized: the forward one and the one a replay asked for, so the server's
# "load old state, produce, restore forward state" costs one extra read, not two.
CACHE_BLOCKS = 3


@dataclass(frozen=True)
class Position:
    """Where a document is: chunk `chunk` of the epoch's order, from `key` (None: the chunk's
    start), then `skip` documents further."""

    chunk: int
    key: int | None
    skip: int

    def to_list(self) -> list[int | None]:
        return [self.chunk, self.key, self.skip]


START = Position(0, None, 0)


@dataclass(frozen=True)
class StreamConfig:
    split: str
    seq_len: int
    packing: str
    block_docs: int
    shuffle: bool
    seed: int
    worker_index: int
    num_workers: int
    pad_id: int


@dataclass
class _RawBlock:
    tokens: np.ndarray  # flat, documents in shuffled order, each ending with EOS
    lengths: np.ndarray
    end: Position  # the position just after the block's last document


@dataclass
class _Packed:
    windows: Windows
    end: Position
    carry: tuple[np.ndarray, np.ndarray]


_NO_CARRY = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64))


class SplitStream:
    """Windows of one split for one worker, resumable from `state_dict()`."""

    def __init__(
        self,
        files: Sequence[SourceFile],
        opts: ReadOptions,
        chunks: Sequence[Chunk],
        tokenizer: TextTokenizer,
        config: StreamConfig,
        layout: str,
    ) -> None:
        self.files = files
        self.opts = opts
        self.chunks = list(chunks)
        self.tokenizer = tokenizer
        self.cfg = config
        self.layout = layout
        self._epoch = 0
        self._block = 0
        self._start = START
        self._window = 0
        self._carry = _NO_CARRY
        self._packed: _Packed | None = None
        self._live: tuple[int, Position, Iterator[tuple[int, int, str]]] | None = None
        self._cache: OrderedDict[tuple[int, int, Position], _RawBlock] = OrderedDict()
        self._order_cache: tuple[int, list[int]] | None = None
        self.taken_epochs = np.zeros(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        """The epoch of the last window taken (0 before the first)."""
        return self._epoch

    # ---- windows ----------------------------------------------------------------------------
    def take(self, n: int) -> dict[str, np.ndarray]:
        """The next `n` windows as [n, T] arrays: input_ids, labels, segment_ids, attention_mask.
        taken_epochs is then the epoch of each (the epoch of the block it was packed from)."""
        parts: list[tuple[Windows, int, int]] = []
        epochs: list[tuple[int, int]] = []  # (epoch, windows) of each part
        need = n
        while need:
            self._ensure_block()
            assert self._packed is not None
            windows = self._packed.windows
            avail = len(windows) - self._window
            if avail <= 0:
                self._advance()
                continue
            k = min(need, avail)
            parts.append((windows, self._window, self._window + k))
            epochs.append((self._epoch, k))
            self._window += k
            need -= k
        self.taken_epochs = np.repeat([e for e, _ in epochs], [k for _, k in epochs])
        fields = {
            "input_ids": [w.input_ids[lo:hi] for w, lo, hi in parts],
            "labels": [w.labels[lo:hi] for w, lo, hi in parts],
            "segment_ids": [w.segment_ids[lo:hi] for w, lo, hi in parts],
            "attention_mask": [w.mask(lo, hi) for w, lo, hi in parts],
        }
        return {k: v[0] if len(v) == 1 else np.concatenate(v) for k, v in fields.items()}

    def _advance(self) -> None:
        assert self._packed is not None
        self._carry = self._packed.carry
        self._block += 1
        self._start = self._packed.end
        self._window = 0
        self._packed = None

    def _ensure_block(self) -> None:
        while self._packed is None:
            raw = self._raw_block(self._epoch, self._block, self._start)
            if raw is None:  # the epoch has no documents left
                if self._block == 0:
                    raise CorpusError(
                        f"{self.cfg.split} shard {self.cfg.worker_index} of {self.cfg.num_workers} "
                        f"holds no documents ({len(self.chunks)} chunk(s)): use fewer workers, or "
                        "more documents"
                        + (" (a larger eval_take)" if self.cfg.split == "val" else "")
                    )
                self._epoch, self._block, self._start = self._epoch + 1, 0, START
                continue
            packed = self._pack(raw)
            if len(packed.windows) == 0:  # fewer than T tokens so far: all of them carry on
                self._carry, self._block, self._start = packed.carry, self._block + 1, raw.end
                continue
            if self._window > len(packed.windows):
                raise ValueError(
                    f"text_lm {self.cfg.split} state points at window {self._window} of block "
                    f"{self._block}, which has {len(packed.windows)}: the state does not fit this corpus"
                )
            self._packed = packed

    def _pack(self, raw: _RawBlock) -> _Packed:
        t = self.cfg.seq_len
        if self.cfg.packing == "sequential":
            tokens = np.concatenate([self._carry[0], raw.tokens])
            lengths = np.concatenate([self._carry[1], raw.lengths])
            windows, carry_tokens, carry_lengths = pack_sequential(tokens, lengths, t)
            return _Packed(windows, raw.end, (carry_tokens, carry_lengths))
        rng = self._rng("windows", self._epoch, self._block) if self.cfg.shuffle else None
        return _Packed(
            pack_bin(raw.tokens, raw.lengths, t, pad_id=self.cfg.pad_id, rng=rng),
            raw.end,
            _NO_CARRY,
        )

    # ---- documents --------------------------------------------------------------------------
    def _rng(self, *parts: object) -> np.random.Generator:
        c = self.cfg
        seed = derive_seed(c.seed, "text_lm", c.split, c.worker_index, c.num_workers, *parts)
        return np.random.Generator(np.random.PCG64(seed))

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.chunks)
            order = (
                self._rng("chunks", epoch).permutation(n).tolist()
                if self.cfg.shuffle
                else list(range(n))
            )
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _epoch_docs(self, epoch: int, start: Position) -> Iterator[tuple[int, int, str]]:
        order = self._order(epoch)
        for c in range(start.chunk, len(order)):
            chunk = self.chunks[order[c]]
            resume = start.key if c == start.chunk else None
            skip = start.skip if c == start.chunk else 0
            for key, text in iter_docs(
                self.files[chunk.file], chunk.start, chunk.end, self.opts, resume
            ):
                if skip:
                    skip -= 1
                    continue
                yield c, key, text

    def _raw_block(self, epoch: int, block: int, start: Position) -> _RawBlock | None:
        cache_key = (epoch, block, start)
        cached = self._cache.get(cache_key)
        if cached is not None:
            self._cache.move_to_end(cache_key)
            return cached
        if self._live is not None and self._live[:2] == (epoch, start):
            reader = self._live[2]
        else:
            reader = self._epoch_docs(epoch, start)
        texts: list[str] = []
        last: tuple[int, int] | None = None
        chars = 0
        try:
            for c, key, text in reader:
                texts.append(text)
                last = (c, key)
                chars += len(text)
                if len(texts) >= self.cfg.block_docs or chars >= MAX_BLOCK_CHARS:
                    break
        except BaseException:
            self._live = None  # a generator that raised is finished: never read on from it
            raise
        if last is None:
            self._live = None
            return None
        end = Position(last[0], last[1], 1)
        self._live = (epoch, end, reader)
        if self.cfg.shuffle:  # shuffling texts, not tokens, costs no copy of the block
            perm = self._rng("docs", epoch, block).permutation(len(texts)).tolist()
            texts = [texts[i] for i in perm]
        tokens, lengths = self.tokenizer.encode_docs(texts)
        raw = _RawBlock(tokens, lengths, end)
        self._cache[cache_key] = raw
        while len(self._cache) > CACHE_BLOCKS:
            self._cache.popitem(last=False)
        return raw

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "layout": self.layout,
            "epoch": self._epoch,
            "block": self._block,
            "start": self._start.to_list(),
            "window": self._window,
            "carry_tokens": self._carry[0].tolist(),
            "carry_lengths": self._carry[1].tolist(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        keys = set(state)
        if keys != STATE_KEYS:
            raise ValueError(
                f"text_lm {self.cfg.split} state has keys {sorted(keys)}, expected {sorted(STATE_KEYS)}"
            )
        if state["version"] != STATE_VERSION:
            raise ValueError(f"text_lm state version {state['version']!r} is not {STATE_VERSION}")
        if state["layout"] != self.layout:
            raise ValueError(
                f"text_lm {self.cfg.split} state was made under layout {state['layout']!r}, this "
                f"worker's is {self.layout!r}: the corpus, worker count, seq_len, packing, seed or "
                "tokenizer changed, so the journaled position means nothing here"
            )
        chunk, key, skip = state["start"]
        carry_tokens = np.asarray(state["carry_tokens"], dtype=np.int32)
        carry_lengths = np.asarray(state["carry_lengths"], dtype=np.int64)
        if int(carry_lengths.sum()) != len(carry_tokens):
            raise ValueError("text_lm state: carry_lengths do not add up to len(carry_tokens)")
        self._epoch = int(state["epoch"])
        self._block = int(state["block"])
        self._start = Position(int(chunk), None if key is None else int(key), int(skip))
        self._window = int(state["window"])
        self._carry = (carry_tokens, carry_lengths)
        self._packed = None
