"""token_shards: pre-tokenized corpora of any size, every window once per epoch.

A split is a list of token files (raw nanoGPT .bin, llm.c shards, .npy arrays, Megatron
indexed datasets, prepared corpora) read as one corpus cut into windows of T+1 tokens at
stride T. Global row r (file seq s holds rows [s*R, (s+1)*R), R = batch_size *
batches_per_file) reads window perm_e(r % n) of epoch e = r // n, a keyed permutation per
epoch (order.py). A window is a pure function of its row, so any worker on any node makes
any seq with no stream state, and since the server serves every seq exactly once, every
window of an epoch is served exactly once before any is served again. `sampling = "random"`
draws nanoGPT's windows instead: uniform starts, with replacement. `order = "documents"`
shuffles whole documents each epoch and packs them shard by shard (documents.py).

Start-up reads headers and indexes only; shards are memory-mapped (or read by range at a
URL) when a window of theirs is first read, and the inputs are fingerprinted by size and
mtime (or the manifest's checksums), so start-up and memory do not grow with the corpus.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from queue_client.errors import ConfigError
from queue_client.format.schema import token_dtype_name
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.compact import lm_window_schema, packed_lm_schema
from queue_providers.provenance import check_rows, window_rows
from queue_providers.remote import RemoteObject, store_for
from queue_providers.seeding import derive_seed, randint_draws
from queue_providers.token_shards.corpus import CorpusIndex
from queue_providers.token_shards.discover import FORMATS, Found, discover
from queue_providers.token_shards.documents import (
    IGNORE,
    DocumentOrder,
    check_built_windows,
    packed_fields,
)
from queue_providers.token_shards.order import EpochOrder
from queue_providers.token_shards.shard import ShardReader

if TYPE_CHECKING:
    import torch

# GPT-2's vocabulary: nanoGPT's and llm.c's default, for uint16 corpora that name none.
GPT2_VOCAB_SIZE = 50257
SAMPLINGS = ("epoch", "random")
ORDERS = ("windows", "documents")
_INT64 = np.dtype(np.int64)
WHERE = "token_shards"


class TokenShardsProvider(DataProviderBase):
    """x/y windows of pre-tokenized shards, each window once per epoch in a seeded order."""

    def __init__(
        self,
        context: ProviderContext,
        *,
        inputs: list[str] | dict[str, list[str]],
        block_size: int = 1024,
        vocab_size: int | None = None,
        token_dtype: str | None = None,
        format: str = "auto",
        sampling: str = "epoch",
        order: str = "windows",
        eos_id: int | None = None,
        remote: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(context)
        _positive(block_size, "block_size")
        if vocab_size is not None:
            _positive(vocab_size, "vocab_size")
        if format not in FORMATS:
            raise ConfigError(f"{WHERE}: format is {format!r}, expected one of {list(FORMATS)}")
        if sampling not in SAMPLINGS:
            raise ConfigError(
                f"{WHERE}: sampling is {sampling!r}, expected one of {list(SAMPLINGS)}"
            )
        if order not in ORDERS:
            raise ConfigError(f"{WHERE}: order is {order!r}, expected one of {list(ORDERS)}")
        if order == "documents" and sampling != "epoch":
            raise ConfigError(f"{WHERE}: order = 'documents' needs sampling = 'epoch'")
        if token_dtype not in (None, "uint16", "uint32"):
            raise ConfigError(
                f"{WHERE}: token_dtype is {token_dtype!r}, expected 'uint16' or 'uint32'"
            )
        self.block_size = block_size
        self.sampling = sampling
        self.order = order
        wanted = None if token_dtype is None else np.dtype(token_dtype).newbyteorder("<")
        # A raw file's ids are in token_dtype, else in nanoGPT's choice for the vocabulary.
        raw_dtype = wanted or np.dtype("<u4" if (vocab_size or 0) > 65535 else "<u2")
        store = store_for(remote, context.layout.input_cache_dir, WHERE)
        self.found: dict[str, Found] = {
            split: discover(entries, format, raw_dtype, wanted, store, f"{WHERE}: inputs.{split}")
            for split, entries in _splits(inputs).items()
        }
        self.vocab_size = self._vocab_size(vocab_size)
        self.eos_id = self._eos_id(eos_id)
        self.corpora = {
            split: CorpusIndex(found.shards, block_size) for split, found in self.found.items()
        }
        for split, corpus in self.corpora.items():
            if corpus.n_windows == 0:
                raise ConfigError(
                    f"{WHERE}: split {split!r} has no window of block_size+1={block_size + 1} "
                    f"tokens: its {len(corpus.shards)} shard(s) hold at most "
                    f"{max(s.tokens for s in corpus.shards)} tokens each"
                )
        self.orders = {
            split: EpochOrder(c.n_windows, context.seed, split) for split, c in self.corpora.items()
        }
        self.documents: dict[str, DocumentOrder] = {}
        if order == "documents":
            for split, corpus in self.corpora.items():
                for shard in corpus.shards:
                    if shard.doc_starts is None:
                        raise ConfigError(
                            f"{WHERE}: order = 'documents' but {shard.shown} ({shard.format}) "
                            "records no document boundaries: only Megatron datasets and "
                            "prepared corpora do"
                        )
                    if shard.check_documents is not None:
                        shard.check_documents()
                self.documents[split] = DocumentOrder(corpus, context.seed, split)
        # With documents and an end-of-document id, batches carry text_lm's fields.
        self.document_fields = order == "documents" and self.eos_id is not None
        self.rows_per_file = context.batch_size * context.batches_per_file
        # Epoch sampling serves every window once per epoch: row r is in epoch r // windows.
        self.ordered_epochs = sampling == "epoch"
        # The current file's served fields, all its rows, and how many were handed out.
        self._file_rows: dict[str, list[Any]] = {}
        self._readers: dict[tuple[str, int], ShardReader] = {}

    def _vocab_size(self, configured: int | None) -> int:
        said = {m: v for f in self.found.values() for m, v in f.vocab_sizes.items()}
        for manifest, size in said.items():
            if configured is not None and configured < size:
                raise ConfigError(
                    f"{WHERE}: vocab_size = {configured} in config but {manifest} says "
                    f"{size}: the corpus may hold ids up to {size - 1}"
                )
        if configured is not None:
            return configured
        if said:
            return max(said.values())
        wide = [s.shown for f in self.found.values() for s in f.shards if s.dtype.itemsize > 2]
        if wide:
            raise ConfigError(
                f"{WHERE}: vocab_size is not set and {wide[0]} holds 32-bit ids: set vocab_size "
                "(every id served is checked against it)"
            )
        return GPT2_VOCAB_SIZE

    def _eos_id(self, configured: int | None) -> int | None:
        said = sorted(set().union(*(f.eos_ids for f in self.found.values())))
        if configured is not None:
            if not isinstance(configured, int) or isinstance(configured, bool):
                raise ConfigError(f"{WHERE}: eos_id must be an int, got {configured!r}")
            if not 0 <= configured < self.vocab_size or (said and said != [configured]):
                raise ConfigError(
                    f"{WHERE}: eos_id = {configured} in config, but it must lie in [0, "
                    f"vocab_size {self.vocab_size}) and agree with the manifests' {said}"
                )
            return configured
        if len(said) > 1:
            raise ConfigError(f"{WHERE}: the manifests name different eos_ids {said}")
        return said[0] if said else None

    def input_files(self) -> list[Any]:
        """Each token file by size and mtime (a prepared corpus's shards by their checksums,
        its manifest hashed): never a read of the tokens themselves."""
        return [item for found in self.found.values() for item in found.inputs]

    def build_meta(self) -> dict[str, Any]:
        t = self.block_size
        meta: dict[str, Any] = {
            "training_type": "LM",
            "vocab_size": self.vocab_size,
            "block_size": t,
            "token_dtype": token_dtype_name(self.vocab_size),
            "sampling": self.sampling,
            "order": self.order,
            "batch_schema": lm_window_schema(t, self.vocab_size),
            "split_info": {
                # tokens: what one epoch serves (its windows' x positions), for epoch counts.
                split: {
                    "tokens": self.epoch_windows(split) * t,
                    "windows": self.epoch_windows(split),
                    "corpus_tokens": c.tokens,
                    "shards": len(c.shards),
                }
                for split, c in self.corpora.items()
            },
        }
        if self.eos_id is not None:
            meta["eos_id"] = self.eos_id
        if self.document_fields:
            assert self.eos_id is not None
            meta["ignore_index"] = IGNORE
            meta["batch_schema"] = packed_lm_schema(
                [t], self.vocab_size, eos_id=self.eos_id, ignore=IGNORE, padded=False
            )
        return meta

    def make_file(self, split: str, seq: int) -> Any:
        """The file of seq: rows [seq*R, (seq+1)*R) of the split's epochs, in order (or
        nanoGPT's draws from the file's generator, batch by batch, as sample_batch makes
        them). The whole file's windows are placed and read at once: straight into the
        stored window where the file keeps x and y as one (the same bytes as int64 x and y
        stacked, checked and narrowed again, at a fifth of the CPU; gather checks every id
        against vocab_size), else handed out by sample_batch."""
        if self.order == "documents":
            rows = np.arange(seq * self.rows_per_file, (seq + 1) * self.rows_per_file)
            self._file_rows[split] = [self.document_rows(split, rows), 0]
            return self._made_by_base(split, seq)
        windows = self.file_windows(split, seq)
        if windows is not None:
            return self.encode_windows(split, seq, windows)
        import torch  # the served fields of an old format, as the base class makes them

        shard, start = self._placed(split, seq)
        self._file_rows[split] = [xy(torch.from_numpy(self.gather(split, shard, start))), 0]
        return self._made_by_base(split, seq)

    def file_windows(self, split: str, seq: int) -> np.ndarray | None:
        dtype = self.window_dtype(split)
        if dtype is None or self.order == "documents":
            return None
        shape = (self.context.batches_per_file, self.batch_size, self.block_size + 1)
        shard, start = self._placed(split, seq)
        return self.gather(split, shard, start, dtype).reshape(shape)

    def _placed(self, split: str, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """Where file seq's windows start: (shard, offset) per row."""
        rows = np.arange(seq * self.rows_per_file, (seq + 1) * self.rows_per_file)
        corpus = self.corpora[split]
        if self.sampling == "epoch":
            return corpus.locate(self.orders[split].windows(rows))
        # file_rng's draws, batch after batch, drawn without torch
        seed = derive_seed(self.context.seed, split, seq)
        return corpus.locate_start(randint_draws(seed, corpus.n_starts, len(rows)))

    def provenance(self, split: str, seq: int, rows: Sequence[int]) -> list[dict[str, Any]]:
        """Each row's shard, first token and document, placed as make_file places them."""
        if split not in self.corpora:
            raise ValueError(f"{WHERE}: no split {split!r}; the splits are {sorted(self.corpora)}")
        at = check_rows(rows, self.rows_per_file, f"{WHERE} split {split!r} seq {seq}")
        if self.order == "documents":  # a window's first token, in its shard's stream
            order = self.documents[split]
            shard, start = order.window_starts(*order.locate(seq * self.rows_per_file + at))
        else:
            shard, start = (column[at] for column in self._placed(split, seq))
        shards = self.corpora[split].shards
        return window_rows([s.shown for s in shards], [s.doc_starts for s in shards], shard, start)

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        super().set_meta(meta)
        windows = {split: self.epoch_windows(split) for split in self.corpora}
        check_built_windows(meta, windows, self.context.dataset_name)

    def epoch_windows(self, split: str) -> int:
        """The windows one epoch of `split` serves: its documents' (order = "documents")."""
        order = self.documents.get(split)
        return order.n_windows if order is not None else self.corpora[split].n_windows

    def _made_by_base(self, split: str, seq: int) -> Any:
        """The base class's file, from the rows placed in _file_rows."""
        try:
            return super().make_file(split, seq)
        finally:
            self._file_rows.pop(split, None)

    def epoch_starts(self, split: str, seq: int) -> list[tuple[int, int]]:
        """The rows of file seq at a multiple of the split's windows (past row 0)."""
        if not self.ordered_epochs:
            return []
        n, first = self.epoch_windows(split), seq * self.rows_per_file
        epoch = -(-first // n)  # the first epoch that starts at or after the file
        out = []
        while epoch * n < first + self.rows_per_file:
            if epoch:
                out.append((epoch * n - first, epoch))
            epoch += 1
        return out

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        planned = self._file_rows.get(split)
        if planned is not None:
            fields, at = planned
            planned[1] = at + self.batch_size
            return {name: v[at : at + self.batch_size] for name, v in fields.items()}
        # nanoGPT's draw (also for corpus statistics, which sample outside a file)
        import torch

        corpus = self.corpora[split]
        drawn = torch.randint(corpus.n_starts, (self.batch_size,), generator=rng).numpy()
        return xy(torch.from_numpy(self.gather(split, *corpus.locate_start(drawn))))

    def document_rows(self, split: str, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """The rows' windows of the shards' document streams, as x/y or text_lm's fields."""
        order = self.documents[split]
        epochs, shards, windows = order.locate(rows)
        positions = windows[:, None] * self.block_size + np.arange(self.block_size + 1)
        tokens = np.empty(positions.shape, dtype=np.int64)
        docs = np.empty(positions.shape, dtype=np.int64)
        last = np.empty(positions.shape, dtype=bool)
        for epoch, shard in sorted(set(zip(epochs.tolist(), shards.tolist(), strict=True))):
            at = (epochs == epoch) & (shards == shard)
            source, docs[at], last[at] = order.stream(shard, epoch).read_positions(positions[at])
            tokens[at] = self._take(split, *order.place(shard, source))
        if not self.document_fields:
            import torch  # document rows go through the base class's torch way

            return xy(torch.from_numpy(tokens))
        assert self.eos_id is not None
        where = {int(s): self.corpora[split].shards[int(s)].shown for s in np.unique(shards)}
        return packed_fields(tokens, docs, last, self.eos_id, where, shards)

    def gather(
        self, split: str, shard: np.ndarray, start: np.ndarray, dtype: np.dtype = _INT64
    ) -> np.ndarray:
        """[len(start), T+1] of `dtype`: row i = tokens [start[i], start[i]+T+1) of shard[i]."""
        length = self.block_size + 1
        out = np.empty((len(start), length), dtype=dtype)
        for index in np.unique(shard).tolist():
            at = shard == index
            out[at] = rows = self._reader(split, index).windows(start[at], length)
            self._check_ids(split, index, rows)
        return out

    def _take(self, split: str, files: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """The tokens at `offsets` of shards `files` (a document may run on into the next)."""
        out = np.empty(offsets.shape, dtype=np.int64)
        for index in np.unique(files).tolist():
            on = files == index
            out[on] = self._reader(split, index).take(offsets[on])
            self._check_ids(split, index, out[on])
        return out

    def _check_ids(self, split: str, index: int, rows: np.ndarray) -> None:
        """ValueError naming the shard when it holds an id outside [0, vocab_size)."""
        low, high = int(rows.min()), int(rows.max())
        if high >= self.vocab_size or low < 0:
            raise ValueError(
                f"{WHERE}: {self.corpora[split].shards[index].shown} holds token id "
                f"{high if high >= self.vocab_size else low} outside [0, vocab_size "
                f"{self.vocab_size})"
            )

    def shard_tokens(self, split: str, index: int) -> np.ndarray:
        """Shard `index` of `split`'s tokens (corpora[split].shards order): the read-only
        memory map its windows are gathered from, mapped on first use and shared with
        make_file, for tools and benchmarks that read what the provider reads. Local shards
        only: a remote one has no map, and ValueError names it."""
        shard = self.corpora[split].shards[index]
        if isinstance(shard.location, RemoteObject):
            raise ValueError(f"{WHERE}: {shard.shown} is remote: only a local shard is mapped")
        return self._reader(split, index).local_map()

    def _reader(self, split: str, index: int) -> ShardReader:
        reader = self._readers.get((split, index))
        if reader is None:
            reader = ShardReader(self.corpora[split].shards[index])
            self._readers[(split, index)] = reader
        return reader


def xy(windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """nanoGPT's x and y: views of windows of T+1 tokens."""
    return {"x": windows[:, :-1], "y": windows[:, 1:]}


def _splits(inputs: Any) -> dict[str, list[str]]:
    """A list is the train split; a table names each split's list."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, list):
        inputs = {"train": inputs}
    if not isinstance(inputs, Mapping) or not inputs:
        raise ConfigError(
            f"{WHERE}: inputs must be a list of files, globs or URLs, or a table of split name "
            f"to such a list; got {inputs!r}"
        )
    out = {}
    for split, entries in inputs.items():
        entries = [entries] if isinstance(entries, str) else entries
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{WHERE}: inputs.{split} must be a non-empty list, got {entries!r}")
        out[str(split)] = entries
    return out


def _positive(value: Any, key: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{WHERE}: {key} must be a positive int, got {value!r}")
