"""classification: (text, label) examples from JSONL or CSV, as fixed-width token rows.

Each row is [CLS] text [SEP] [PAD]..., the text truncated to block_size-2 tokens. Labels are
mapped to ids by `label_map` (given in config, or the sorted labels found in the data) and the
map goes into meta. Train batches draw examples uniformly (`sampling = "uniform"`) or draw a
class uniformly first and then an example of it (`"stratified"`: balanced classes whatever the
class frequencies). Other splits always sample uniformly, so their metrics describe the data as
it is. Examples are read, checked and tokenized once by build_meta and cached under the
dataset dir.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from queue_client.errors import ConfigError
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.tokenize_util import (
    CLS,
    PAD,
    SEP,
    as_paths,
    cache_key,
    check_block_size,
    derive_label_map,
    encode_texts,
    file_identity,
    load_artifacts,
    load_tokenizer,
    parse_label_map,
    single_rows,
    split_indices,
)

WHO = "classification"
SPLITS = ("train", "val")
SAMPLINGS = ("uniform", "stratified")
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv"}


@dataclass(frozen=True)
class Example:
    text: str
    label: str
    where: str  # "file:line", for errors


def _label_str(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where}: label {value!r} must be a string or an integer")


def read_jsonl(path: Path, text_field: str, label_field: str) -> list[Example]:
    examples = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not valid JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in (text_field, label_field) if k not in obj]
            if missing:
                raise ConfigError(f"{where}: object lacks {missing} (keys: {sorted(obj)})")
            if not isinstance(obj[text_field], str):
                raise ConfigError(
                    f"{where}: {text_field} must be a string, got {obj[text_field]!r}"
                )
            examples.append(Example(obj[text_field], _label_str(obj[label_field], where), where))
    return examples


def read_csv(path: Path, text_field: str, label_field: str, delimiter: str) -> list[Example]:
    examples = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        header = reader.fieldnames or []
        missing = [k for k in (text_field, label_field) if k not in header]
        if missing:
            raise ConfigError(f"{path}:1: header {header} lacks column(s) {missing}")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row:
                raise ConfigError(f"{where}: row has more fields than the header's {len(header)}")
            if any(v is None for v in row.values()):
                raise ConfigError(f"{where}: row has fewer fields than the header's {len(header)}")
            examples.append(Example(row[text_field], row[label_field], where))
    return examples


def read_examples(path: Path, text_field: str, label_field: str, fmt: str | None) -> list[Example]:
    kind = fmt or FORMATS.get(path.suffix.lower())
    if kind == "jsonl":
        return read_jsonl(path, text_field, label_field)
    if kind in ("csv", "tsv"):
        return read_csv(path, text_field, label_field, "\t" if kind == "tsv" else ",")
    raise ConfigError(
        f"{WHO}: cannot tell the format of {path}: name it .jsonl, .csv or .tsv, or set format"
    )


class ClassificationProvider(DataProviderBase):
    """input_ids, attention_mask and one label per example."""

    def __init__(
        self,
        context: ProviderContext,
        *,
        input: str | Sequence[str],
        tokenizer: str,
        block_size: int = 128,
        val_input: str | Sequence[str] | None = None,
        train_fraction: float = 0.9,
        text_field: str = "text",
        label_field: str = "label",
        format: str | None = None,
        label_map: Sequence[str] | Mapping[str, int] | None = None,
        sampling: str = "uniform",
        lowercase: bool | None = None,
    ) -> None:
        super().__init__(context)
        self.block_size = check_block_size(block_size, minimum=3, who=WHO)
        self.inputs = as_paths(input, key="input", who=WHO)
        self.val_inputs = (
            None if val_input is None else as_paths(val_input, key="val_input", who=WHO)
        )
        if self.val_inputs is None and not 0.0 < train_fraction < 1.0:
            raise ConfigError(f"{WHO}: train_fraction must lie in (0, 1), got {train_fraction!r}")
        self.train_fraction = float(train_fraction)
        if format is not None and format not in ("jsonl", "csv", "tsv"):
            raise ConfigError(f"{WHO}: format must be 'jsonl', 'csv' or 'tsv', got {format!r}")
        self.format = format
        self.text_field, self.label_field = text_field, label_field
        if sampling not in SAMPLINGS:
            raise ConfigError(f"{WHO}: sampling must be one of {list(SAMPLINGS)}, got {sampling!r}")
        self.sampling = sampling
        self.config_label_map = parse_label_map(label_map, who=WHO)
        self.tok = load_tokenizer(tokenizer, lowercase=lowercase, who=WHO)
        self._arrays: dict[str, np.ndarray] = {}
        self._info: dict[str, Any] = {}
        self._key = ""

    # ---- examples ---------------------------------------------------------------------------
    def _read(self, paths: Sequence[Path]) -> list[Example]:
        return [
            e
            for p in paths
            for e in read_examples(p, self.text_field, self.label_field, self.format)
        ]

    def _build(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        train = self._read(self.inputs)
        val = None if self.val_inputs is None else self._read(self.val_inputs)
        everything = train + (val or [])
        label_map = self.config_label_map or derive_label_map(e.label for e in everything)
        for e in everything:  # in file order, so the error names the first bad line
            if e.label not in label_map:
                raise ConfigError(
                    f"{e.where}: label {e.label!r} is not in label_map (labels: {sorted(label_map)})"
                )
        if val is None:
            tr, va = split_indices(len(train), self.train_fraction, who=WHO)
            by_split = {"train": [train[i] for i in tr], "val": [train[i] for i in va]}
        else:
            by_split = {"train": train, "val": val}
        arrays: dict[str, np.ndarray] = {}
        info: dict[str, Any] = {"label_map": label_map}
        for split, examples in by_split.items():
            if not examples:
                raise ConfigError(f"{WHO}: the {split} split has no examples")
            labels = np.array([label_map[e.label] for e in examples], dtype=np.int64)
            ragged = encode_texts(self.tok, [e.text for e in examples])
            # Examples grouped by class, for stratified draws: class c is
            # by_class[class_start[c] : class_start[c] + class_count[c]].
            counts = np.bincount(labels, minlength=len(label_map))
            arrays |= {
                f"{split}_ids": ragged.flat,
                f"{split}_offsets": ragged.offsets,
                f"{split}_labels": labels,
                f"{split}_by_class": np.argsort(labels, kind="stable"),
                f"{split}_class_start": (np.cumsum(counts) - counts).astype(np.int64),
                f"{split}_class_count": counts.astype(np.int64),
            }
            info[split] = {
                "examples": len(examples),
                "class_counts": [int(c) for c in counts],
                "truncated": int((ragged.lengths > self.block_size - 2).sum()),
            }
        return arrays, info

    def _cache_key(self) -> str:
        files = [file_identity(p) for p in self.inputs]
        val = None if self.val_inputs is None else [file_identity(p) for p in self.val_inputs]
        return cache_key(
            WHO, self.tok.digest, files, val, self.train_fraction, self.text_field,
            self.label_field, self.format, self.config_label_map, self.block_size,
        )  # fmt: skip

    def _load(self, pinned: str | None = None) -> None:
        if not self._arrays:
            self._key, self._arrays, self._info = load_artifacts(
                self.context.dataset_dir, self._cache_key(), pinned, self._build
            )

    # ---- meta --------------------------------------------------------------------------------
    def build_meta(self) -> dict[str, Any]:
        self._load()
        t = self.block_size
        label_map = dict(self._info["label_map"])
        return {
            "training_type": "CLASSIFICATION",
            "num_classes": len(label_map),
            "label_map": label_map,
            "vocab_size": self.tok.vocab_size,
            "block_size": t,
            "tokenizer": os.fspath(self.tok.path),
            "artifacts": self._key,
            "pad_token_id": self.tok.id(PAD),
            "cls_token_id": self.tok.id(CLS),
            "sep_token_id": self.tok.id(SEP),
            "sampling": self.sampling,
            "batch_schema": [
                {"name": "input_ids", "dtype": "int64", "shape": [t], "role": "input"},
                {"name": "attention_mask", "dtype": "int64", "shape": [t], "role": "mask"},
                {"name": "labels", "dtype": "int64", "shape": [], "role": "target"},
            ],
            "split_info": {split: dict(self._info[split]) for split in SPLITS},
        }

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        super().set_meta(meta)
        self._load(meta.get("artifacts"))

    # ---- sampling ----------------------------------------------------------------------------
    def sample_indices(self, split: str, rng: torch.Generator) -> np.ndarray:
        """Example indices of one batch, uniform or class-balanced."""
        self._load()
        a = self._arrays
        n = len(a[f"{split}_labels"])
        if split != "train" or self.sampling == "uniform":
            return torch.randint(n, (self.batch_size,), generator=rng).numpy()
        present = np.flatnonzero(a[f"{split}_class_count"])
        cls = present[torch.randint(len(present), (self.batch_size,), generator=rng).numpy()]
        count = a[f"{split}_class_count"][cls]
        within = (
            torch.rand(self.batch_size, generator=rng, dtype=torch.float64).numpy() * count
        ).astype(np.int64)
        return a[f"{split}_by_class"][
            a[f"{split}_class_start"][cls] + np.minimum(within, count - 1)
        ]

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        a = self._arrays
        idx = self.sample_indices(split, rng)
        offsets = a[f"{split}_offsets"]
        starts = torch.from_numpy(np.asarray(offsets[idx], dtype=np.int64))
        lengths = torch.from_numpy(np.asarray(offsets[idx + 1], dtype=np.int64)) - starts
        layout = single_rows(starts, lengths, self.block_size)
        return {
            "input_ids": layout.input_ids(
                a[f"{split}_ids"], cls=self.tok.id(CLS), sep=self.tok.id(SEP), pad=self.tok.id(PAD)
            ),
            "attention_mask": layout.attention_mask(),
            "labels": torch.from_numpy(np.asarray(a[f"{split}_labels"][idx], dtype=np.int64)),
        }
