"""classification: (text, label) examples from JSONL or CSV files, or the rows of a Hugging
Face dataset (`hf_dataset`, its text_column and label_column), as fixed-width token rows.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from queue_client.errors import ConfigError
from queue_providers.base import ProviderContext
from queue_providers.compact import class_ids, pad_mask, token_ids
from queue_providers.tokenized.hf_rows import LABEL, TEXT, Column, HFRows, column_names
from queue_providers.tokenized.labels import derive_label_map, parse_label_map
from queue_providers.tokenized.provider import Arrays, TokenizedProvider
from queue_providers.tokenized.ragged import encode_texts
from queue_providers.tokenized.wordpiece import PAD

WHO = "classification"
SAMPLINGS = ("uniform", "stratified")
HF_COLUMNS = {"text_column": "text", "label_column": "label"}
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


class ClassificationProvider(TokenizedProvider[Example]):
    """input_ids, attention_mask and one label per example."""

    who = WHO

    def __init__(
        self,
        context: ProviderContext,
        *,
        input: str | Sequence[str] | None = None,
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
        remote: dict[str, Any] | None = None,
        hf_dataset: str | None = None,
        hf_splits: Mapping[str, str] | None = None,
        hf_config: str | None = None,
        hf_revision: str | None = None,
        text_column: str | None = None,
        label_column: str | None = None,
    ) -> None:
        if format is not None and format not in ("jsonl", "csv", "tsv"):
            raise ConfigError(f"{WHO}: format must be 'jsonl', 'csv' or 'tsv', got {format!r}")
        if format is not None and hf_dataset is not None:
            raise ConfigError(f"{WHO}: format applies to `input` only: hf_dataset knows its format")
        given = {"text_column": text_column, "label_column": label_column}
        self.hf_columns = column_names(WHO, hf_dataset, given, HF_COLUMNS)
        self.format = format
        self.text_field, self.label_field = text_field, label_field
        if sampling not in SAMPLINGS:
            raise ConfigError(f"{WHO}: sampling must be one of {list(SAMPLINGS)}, got {sampling!r}")
        self.sampling = sampling
        self.config_label_map = parse_label_map(label_map, who=WHO)
        super().__init__(
            context,
            input=input,
            tokenizer=tokenizer,
            block_size=block_size,
            val_input=val_input,
            train_fraction=train_fraction,
            lowercase=lowercase,
            remote=remote,
            hf_dataset=hf_dataset,
            hf_splits=hf_splits,
            hf_config=hf_config,
            hf_revision=hf_revision,
        )

    # ---- examples ---------------------------------------------------------------------------
    def read(self, paths: Sequence[Path]) -> list[Example]:
        return [
            e
            for p in paths
            for e in read_examples(p, self.text_field, self.label_field, self.format)
        ]

    def read_rows(self, rows: HFRows, split: str) -> list[Example]:
        """One example per row; integer labels become their decimal string, as in JSONL."""
        cols = self.hf_columns
        values = rows.read(
            split,
            [
                Column("text_column", cols["text_column"], TEXT),
                Column("label_column", cols["label_column"], LABEL),
            ],
        )
        pairs = zip(values["text_column"], values["label_column"], strict=True)
        return [Example(t, str(y), rows.where(split, i)) for i, (t, y) in enumerate(pairs)]

    def shared_info(self, items: Sequence[Example]) -> dict[str, Any]:
        label_map = self.config_label_map or derive_label_map(e.label for e in items)
        for e in items:  # in file order, so the error names the first bad line
            if e.label not in label_map:
                raise ConfigError(
                    f"{e.where}: label {e.label!r} is not in label_map (labels: {sorted(label_map)})"
                )
        return {"label_map": label_map}

    def tokenize(
        self, split: str, items: Sequence[Example], shared: Mapping[str, Any]
    ) -> tuple[Arrays, dict[str, Any]]:
        if not items:
            raise ConfigError(f"{WHO}: the {split} split has no examples")
        label_map = shared["label_map"]
        labels = np.array([label_map[e.label] for e in items], dtype=np.int64)
        ragged = encode_texts(self.tok, [e.text for e in items])
        # Examples grouped by class, for stratified draws: class c is
        # by_class[class_start[c] : class_start[c] + class_count[c]].
        counts = np.bincount(labels, minlength=len(label_map))
        arrays = {
            "ids": ragged.flat,
            "offsets": ragged.offsets,
            "labels": labels,
            "by_class": np.argsort(labels, kind="stable"),
            "class_start": (np.cumsum(counts) - counts).astype(np.int64),
            "class_count": counts.astype(np.int64),
        }
        info = {
            "examples": len(items),
            "class_counts": [int(c) for c in counts],
            "truncated": int((ragged.lengths > self.block_size - 2).sum()),
        }
        return arrays, info

    def cache_parts(self) -> tuple[object, ...]:
        return (
            self.text_field, self.label_field, self.format, self.config_label_map,
            self.block_size, *self.hf_parts(),
        )  # fmt: skip

    # ---- meta --------------------------------------------------------------------------------
    def meta_fields(self) -> dict[str, Any]:
        t = self.block_size
        label_map = dict(self._info["label_map"])
        return {
            "training_type": "CLASSIFICATION",
            "num_classes": len(label_map),
            "label_map": label_map,
            "sampling": self.sampling,
            # Stored: narrow ids and class ids; the mask follows from [PAD].
            "batch_schema": [
                token_ids("input_ids", [t], self.tok.vocab_size),
                pad_mask("attention_mask", [t], "input_ids", self.tok.id(PAD)),
                class_ids("labels", [], len(label_map)),
            ],
        }

    # ---- sampling ----------------------------------------------------------------------------
    def sample_indices(self, split: str, rng: torch.Generator) -> np.ndarray:
        """Example indices of one batch, uniform or class-balanced."""
        n = len(self.array(split, "labels"))
        if split != "train" or self.sampling == "uniform":
            return torch.randint(n, (self.batch_size,), generator=rng).numpy()
        class_count = self.array(split, "class_count")
        present = np.flatnonzero(class_count)
        cls = present[torch.randint(len(present), (self.batch_size,), generator=rng).numpy()]
        count = class_count[cls]
        within = (
            torch.rand(self.batch_size, generator=rng, dtype=torch.float64).numpy() * count
        ).astype(np.int64)
        start = self.array(split, "class_start")[cls]
        return self.array(split, "by_class")[start + np.minimum(within, count - 1)]

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        idx = self.sample_indices(split, rng)
        layout = self.rows(split, idx)
        return {
            "input_ids": self.input_ids(split, layout),
            "attention_mask": layout.attention_mask(),
            "labels": torch.from_numpy(
                np.asarray(self.array(split, "labels")[idx], dtype=np.int64)
            ),
        }
