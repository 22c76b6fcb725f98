"""TokenizedProvider: the skeleton that bert_mlm, classification and token_classification fill in.

Each of them reads its input files into items (lines, labelled examples, tagged sentences),
tokenizes each split's items into flat arrays, and samples fixed-width rows from those. The
base owns the rest: the config args they share (input, val_input, train_fraction, tokenizer,
lowercase, block_size), the cache of the arrays under artifacts/<key>/ (built once by
build_meta, pinned by meta["artifacts"], memory-mapped by every worker), and the meta keys
every tokenized dataset records.

A subclass fills in `read`, `tokenize`, `meta_fields` and `sample_batch`, and where it needs
to, `shared_info` (what all splits share, such as a label map), `split_items` (how train and
val are cut from one input), `cache_parts` (the config its arrays depend on) and `check_info`
(refusing data too small to sample from).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch

from queue_client.errors import ConfigError
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.remote import (
    RemoteStore,
    input_path,
    local_file,
    store_for,
)
from queue_providers.remote import (
    identity as remote_identity,
)
from queue_providers.tokenized.artifacts import cache_key, file_identity, load_artifacts
from queue_providers.tokenized.labels import split_indices
from queue_providers.tokenized.rows import RowLayout, single_rows
from queue_providers.tokenized.wordpiece import CLS, PAD, SEP, UNK, load_tokenizer

SPLITS = ("train", "val")

Item = TypeVar("Item")
Arrays = dict[str, np.ndarray]


def as_paths(
    value: str | Sequence[str], *, key: str, who: str, store: RemoteStore | None = None
) -> list[Path]:
    """A config value that is one path or a list of paths, each an existing file. A URL
    (queue_providers.remote) becomes a RemotePath, read through a local copy when built."""
    items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    if not items:
        raise ConfigError(f"{who}: {key} is empty")
    paths = [input_path(os.fspath(p), store) for p in items]
    for p in paths:
        if not p.is_file():
            raise ConfigError(f"{who}: {key} {str(p)!r} is not a file")
    return paths  # type: ignore[return-value]


def _identity(path: Path) -> tuple[Any, ...]:
    """What the cache key takes of an input: path, size and mtime, or a URL's identity."""
    return file_identity(path) if isinstance(path, Path) else remote_identity(path)


def check_block_size(block_size: Any, *, minimum: int, who: str) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < minimum:
        raise ConfigError(f"{who}: block_size must be an int >= {minimum}, got {block_size!r}")
    return block_size


class TokenizedProvider(DataProviderBase, Generic[Item]):
    """Rows of WordPiece tokens over local input files; see the module docstring."""

    who: ClassVar[str]  # the provider's config name, which starts its error messages

    def __init__(
        self,
        context: ProviderContext,
        *,
        input: str | Sequence[str],
        tokenizer: str,
        block_size: int,
        val_input: str | Sequence[str] | None,
        train_fraction: float,
        lowercase: bool | None,
        min_block_size: int = 3,
        require: Sequence[str] = (PAD, UNK, CLS, SEP),
        remote: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(context)
        who = self.who
        self.block_size = check_block_size(block_size, minimum=min_block_size, who=who)
        store = store_for(remote, context.layout.input_cache_dir, who)
        self.inputs = as_paths(input, key="input", who=who, store=store)
        self.val_inputs = (
            None
            if val_input is None
            else as_paths(val_input, key="val_input", who=who, store=store)
        )
        if self.val_inputs is None and not 0.0 < train_fraction < 1.0:
            raise ConfigError(f"{who}: train_fraction must lie in (0, 1), got {train_fraction!r}")
        self.train_fraction = float(train_fraction)
        self.tok = load_tokenizer(tokenizer, lowercase=lowercase, require=require, who=who)
        self._arrays: Arrays = {}
        self._info: dict[str, Any] = {}
        self._key = ""

    # ---- what a provider fills in -----------------------------------------------------------
    @abc.abstractmethod
    def read(self, paths: Sequence[Path]) -> list[Item]:
        """The items of some input files, in file order; ConfigError naming file:line."""

    @abc.abstractmethod
    def tokenize(
        self, split: str, items: Sequence[Item], shared: Mapping[str, Any]
    ) -> tuple[Arrays, dict[str, Any]]:
        """One split's arrays (saved as "{split}_{name}") and its split_info."""

    @abc.abstractmethod
    def meta_fields(self) -> dict[str, Any]:
        """training_type, batch_schema and the provider's own meta keys."""

    def shared_info(self, items: Sequence[Item]) -> dict[str, Any]:
        """What every split shares (a label map), from the items of all splits."""
        return {}

    def split_items(self, items: list[Item]) -> dict[str, list[Item]]:
        """train and val from one input: a fixed shuffle, since labelled files are often
        sorted by label and a contiguous cut would put whole classes in val."""
        tr, va = split_indices(len(items), self.train_fraction, who=self.who)
        return {"train": [items[i] for i in tr], "val": [items[i] for i in va]}

    def cache_parts(self) -> tuple[object, ...]:
        """The config the arrays depend on, besides the inputs and the tokenizer."""
        return ()

    def check_info(self, info: Mapping[str, Any]) -> None:
        """Refuse arrays that cannot be sampled from, naming the split (ConfigError)."""

    def input_files(self) -> list[Path]:
        """The input files, the val input files and the tokenizer file."""
        return [*self.inputs, *(self.val_inputs or []), self.tok.path]

    # ---- the cache ----------------------------------------------------------------------
    def _cache_key(self) -> str:
        files = [_identity(p) for p in self.inputs]
        val = None if self.val_inputs is None else [_identity(p) for p in self.val_inputs]
        return cache_key(
            self.who, self.tok.digest, files, val, self.train_fraction, *self.cache_parts()
        )

    def _build(self) -> tuple[Arrays, dict[str, Any]]:
        # URL inputs are read from local copies in the input cache, by path like the rest.
        train = self.read([local_file(p) for p in self.inputs])
        val = (
            None if self.val_inputs is None else self.read([local_file(p) for p in self.val_inputs])
        )
        shared = self.shared_info([*train, *(val or [])])
        by_split = self.split_items(train) if val is None else {"train": train, "val": val}
        arrays: Arrays = {}
        info: dict[str, Any] = dict(shared)
        for split, items in by_split.items():
            split_arrays, info[split] = self.tokenize(split, items, shared)
            arrays |= {f"{split}_{name}": a for name, a in split_arrays.items()}
        return arrays, info

    def _load(self, pinned: str | None = None) -> None:
        if self._arrays:
            return
        key, arrays, info = load_artifacts(
            self.context.layout, self._cache_key(), pinned, self._build
        )
        self.check_info(info)
        self._key, self._arrays, self._info = key, arrays, info

    def array(self, split: str, name: str) -> np.ndarray:
        """One cached array of `split` (loading the cache on first use)."""
        self._load()
        return self._arrays[f"{split}_{name}"]

    # ---- meta ---------------------------------------------------------------------------
    def build_meta(self) -> dict[str, Any]:
        self._load()
        return {
            **self.meta_fields(),
            "vocab_size": self.tok.vocab_size,
            "block_size": self.block_size,
            "tokenizer": os.fspath(self.tok.path),
            "artifacts": self._key,
            "pad_token_id": self.tok.id(PAD),
            "cls_token_id": self.tok.id(CLS),
            "sep_token_id": self.tok.id(SEP),
            "split_info": {split: dict(self._info[split]) for split in SPLITS},
        }

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        super().set_meta(meta)
        self._load(meta.get("artifacts"))

    # ---- rows ---------------------------------------------------------------------------
    def rows(self, split: str, idx: np.ndarray) -> RowLayout:
        """[CLS] item [SEP] [PAD]... for the items at `idx`, each cut to block_size-2."""
        offsets = self.array(split, "offsets")
        starts = torch.from_numpy(np.asarray(offsets[idx], dtype=np.int64))
        lengths = torch.from_numpy(np.asarray(offsets[idx + 1], dtype=np.int64)) - starts
        return single_rows(starts, lengths, self.block_size)

    def input_ids(self, split: str, layout: RowLayout) -> torch.Tensor:
        """The token ids of `layout`'s rows, with this tokenizer's [CLS], [SEP] and [PAD]."""
        return layout.input_ids(
            self.array(split, "ids"),
            cls=self.tok.id(CLS),
            sep=self.tok.id(SEP),
            pad=self.tok.id(PAD),
        )
