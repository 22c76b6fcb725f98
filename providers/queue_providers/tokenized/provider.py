"""TokenizedProvider: the skeleton that bert_mlm, classification and token_classification fill in.

Each of them reads its input files, or the rows of a Hugging Face dataset (`hf_dataset`,
tokenized/hf_rows.py), into items (lines, labelled examples, tagged sentences), tokenizes each
split's items into flat arrays, and samples fixed-width rows from those. The base owns the
rest: the config args they share (input, val_input, hf_dataset, hf_splits, hf_config,
hf_revision, train_fraction, tokenizer, lowercase, block_size), the cache of the arrays under
artifacts/<key>/ (built once by build_meta, pinned by meta["artifacts"], memory-mapped by
every worker), and the meta keys every tokenized dataset records.

A subclass sets `hf_columns` (config key -> column it reads from hf_dataset) and fills in
`read`, `read_rows`, `tokenize`, `meta_fields` and `sample_batch`, and where it needs to,
`shared_info` (what all splits share, such as a label map), `split_items` (how train and val
are cut from one input), `cache_parts` (the config its arrays depend on) and `check_info`
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
from queue_providers.inputs import Input
from queue_providers.remote import (
    RemoteStore,
    input_path,
    local_files,
    store_for,
)
from queue_providers.remote import (
    identity as remote_identity,
)
from queue_providers.tokenized.artifacts import cache_key, file_identity, load_artifacts
from queue_providers.tokenized.hf_rows import HFRows, open_hf_rows
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
    hf_columns: dict[str, str]  # set by the subclass before __init__: key -> column name

    def __init__(
        self,
        context: ProviderContext,
        *,
        input: str | Sequence[str] | None,
        tokenizer: str,
        block_size: int,
        val_input: str | Sequence[str] | None,
        train_fraction: float,
        lowercase: bool | None,
        min_block_size: int = 3,
        require: Sequence[str] = (PAD, UNK, CLS, SEP),
        remote: Mapping[str, Any] | None = None,
        hf_dataset: str | None = None,
        hf_splits: Mapping[str, str] | None = None,
        hf_config: str | None = None,
        hf_revision: str | None = None,
    ) -> None:
        super().__init__(context)
        who = self.who
        self.block_size = check_block_size(block_size, minimum=min_block_size, who=who)
        store = store_for(remote, context.layout.input_cache_dir, who)
        self.hf: HFRows | None = None
        self.inputs: list[Path] = []
        self.val_inputs: list[Path] | None = None
        if hf_dataset is None:
            extra = [k for k, v in (("hf_splits", hf_splits), ("hf_config", hf_config),
                                    ("hf_revision", hf_revision)) if v is not None]  # fmt: skip
            if extra:
                raise ConfigError(f"{who}: {extra} apply to hf_dataset only, and there is none")
            if input is None:
                raise ConfigError(
                    f"{who} needs `input` (files or URLs) or `hf_dataset` (a Hugging Face "
                    "dataset: a save_to_disk directory, a folder of data files or a Hub name)"
                )
            self.inputs = as_paths(input, key="input", who=who, store=store)
            if val_input is not None:
                self.val_inputs = as_paths(val_input, key="val_input", who=who, store=store)
        else:
            if input is not None:
                raise ConfigError(
                    f"{who} takes `input` or `hf_dataset`, not both: input = {input!r}, "
                    f"hf_dataset = {hf_dataset!r}"
                )
            if val_input is not None:
                raise ConfigError(
                    f"{who}: val_input = {val_input!r} goes with `input`; with hf_dataset "
                    f"{hf_dataset!r} map val to a split of the dataset in hf_splits"
                )
            self.hf = open_hf_rows(
                who,
                hf_dataset=hf_dataset,
                hf_splits=hf_splits,
                hf_config=hf_config,
                hf_revision=hf_revision,
                store=store,
            )
        has_val = self.val_inputs is not None or (self.hf is not None and self.hf.has_val)
        if not has_val and not 0.0 < train_fraction < 1.0:
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

    @abc.abstractmethod
    def read_rows(self, rows: HFRows, split: str) -> list[Item]:
        """The items of one mapped split of a Hugging Face dataset, in row order; ConfigError
        naming the column key, the dataset and what was found."""

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

    def hf_parts(self) -> tuple[object, ...]:
        """The column names read from hf_dataset, for cache_parts; nothing for files, so the
        keys of caches built from files stay as they were."""
        return () if self.hf is None else (dict(self.hf_columns),)

    def check_info(self, info: Mapping[str, Any]) -> None:
        """Refuse arrays that cannot be sampled from, naming the split (ConfigError)."""

    def input_files(self) -> Sequence[Input]:
        """The input files (or the dataset's), the val input files and the tokenizer file."""
        hf = self.hf.locations() if self.hf is not None else []
        return [*self.inputs, *(self.val_inputs or []), *hf, self.tok.path]

    # ---- the cache ----------------------------------------------------------------------
    def _cache_key(self) -> str:
        files: object = [_identity(p) for p in self.inputs]
        if self.hf is not None:
            files = ("hf_dataset", self.hf.identity())
        val = None if self.val_inputs is None else [_identity(p) for p in self.val_inputs]
        return cache_key(
            self.who, self.tok.digest, files, val, self.train_fraction, *self.cache_parts()
        )

    def _read_splits(self) -> tuple[list[Item], list[Item] | None]:
        """train's items and, when val has inputs of its own, val's (else None)."""
        if self.hf is not None:
            val = self.read_rows(self.hf, "val") if self.hf.has_val else None
            return self.read_rows(self.hf, "train"), val
        # URL inputs are read from local copies in the input cache, by path like the rest.
        # A split's copies are held (never evicted) while it is read, then may be evicted.
        with local_files(self.inputs) as paths:
            train = self.read(paths)
        if self.val_inputs is None:
            return train, None
        with local_files(self.val_inputs) as paths:
            return train, self.read(paths)

    def _build(self) -> tuple[Arrays, dict[str, Any]]:
        train, val = self._read_splits()
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
            "split_info": {split: self._split_info(split) for split in SPLITS},
            **({"hf_dataset": dict(self.hf.info)} if self.hf is not None else {}),
        }

    def _split_info(self, split: str) -> dict[str, Any]:
        """The split's counts, and the dataset split it came from when hf_splits maps it."""
        info = dict(self._info[split])
        if self.hf is not None and self.hf.has_val:
            info["hf_split"] = self.hf.splits[split]
        return info

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
