"""bert_mlm: BERT's masked-language-model objective over a local text corpus.

The corpus (non-blank lines of the input files) is tokenized once with a WordPiece vocab
(vocab.txt or tokenizer.json; `python -m queue_providers.train_wordpiece` trains one) and the
ids are cached under the dataset dir, so worker processes map them instead of tokenizing again.

Rows: with pairs = false, [CLS] + a random window of block_size-2 tokens of the corpus (lines
run together) + [SEP], so no row has padding. With pairs = true, [CLS] line_i [SEP] line_i+1
[SEP], truncated longest-first and padded, with token_type_ids 0 for the first segment and 1
for the second.

Masking, as in BERT: each non-special token is selected with probability mlm_probability
(0.15); a selected token becomes [MASK] with probability mask_replace (0.8), a uniformly random
non-special token with probability random_replace (0.1), and stays as it is otherwise. labels
hold the original id where a token was selected and -100 everywhere else. Special tokens
([PAD] [UNK] [CLS] [SEP] [MASK] and any other the tokenizer marks special) are never selected.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from queue_client.errors import ConfigError
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.tokenize_util import (
    BERT_SPECIALS,
    CLS,
    IGNORE_INDEX,
    MASK,
    PAD,
    SEP,
    as_paths,
    cache_key,
    check_block_size,
    encode_texts,
    file_identity,
    load_artifacts,
    load_tokenizer,
    pair_rows,
    read_lines,
    single_rows,
)

WHO = "bert_mlm"
SPLITS = ("train", "val")


def _probability(name: str, value: Any, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{WHO}: {name} must be a number in [0, 1], got {value!r}")
    if not (0.0 < value <= 1.0 if open_low else 0.0 <= value <= 1.0):
        raise ConfigError(
            f"{WHO}: {name} must lie in {'(0, 1]' if open_low else '[0, 1]'}, got {value!r}"
        )
    return float(value)


class BertMLMProvider(DataProviderBase):
    """Masked-LM batches: input_ids, attention_mask, labels (+ token_type_ids with pairs)."""

    def __init__(
        self,
        context: ProviderContext,
        *,
        input: str | Sequence[str],
        tokenizer: str,
        block_size: int = 128,
        val_input: str | Sequence[str] | None = None,
        train_fraction: float = 0.9,
        pairs: bool = False,
        lowercase: bool | None = None,
        mlm_probability: float = 0.15,
        mask_replace: float = 0.8,
        random_replace: float = 0.1,
    ) -> None:
        super().__init__(context)
        self.pairs = bool(pairs)
        self.block_size = check_block_size(block_size, minimum=5 if self.pairs else 3, who=WHO)
        self.inputs = as_paths(input, key="input", who=WHO)
        self.val_inputs = (
            None if val_input is None else as_paths(val_input, key="val_input", who=WHO)
        )
        if self.val_inputs is None and not 0.0 < train_fraction < 1.0:
            raise ConfigError(f"{WHO}: train_fraction must lie in (0, 1), got {train_fraction!r}")
        self.train_fraction = float(train_fraction)
        self.mlm_probability = _probability("mlm_probability", mlm_probability, open_low=True)
        self.mask_replace = _probability("mask_replace", mask_replace)
        self.random_replace = _probability("random_replace", random_replace)
        if self.mask_replace + self.random_replace > 1.0:
            raise ConfigError(
                f"{WHO}: mask_replace + random_replace = {self.mask_replace + self.random_replace} exceeds 1"
            )
        self.tok = load_tokenizer(tokenizer, lowercase=lowercase, require=BERT_SPECIALS, who=WHO)
        self._special = torch.tensor(self.tok.special_ids, dtype=torch.int64)
        self._normal_ids = torch.tensor(
            np.setdiff1d(np.arange(self.tok.vocab_size), self.tok.special_ids), dtype=torch.int64
        )
        if len(self._normal_ids) == 0:
            raise ConfigError(f"{WHO}: tokenizer {self.tok.path} has only special tokens")
        self._arrays: dict[str, np.ndarray] = {}
        self._info: dict[str, Any] = {}
        self._key = ""

    # ---- corpus --------------------------------------------------------------------------------
    def _cache_key(self) -> str:
        files = [file_identity(p) for p in self.inputs]
        val = None if self.val_inputs is None else [file_identity(p) for p in self.val_inputs]
        return cache_key(WHO, self.tok.digest, files, val, self.train_fraction)

    def _build(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        lines = read_lines(self.inputs)
        if self.val_inputs is None:
            n_train = int(len(lines) * self.train_fraction)
            by_split = {"train": lines[:n_train], "val": lines[n_train:]}
        else:
            by_split = {"train": lines, "val": read_lines(self.val_inputs)}
        arrays: dict[str, np.ndarray] = {}
        info: dict[str, Any] = {}
        for split, split_lines in by_split.items():
            ragged = encode_texts(self.tok, split_lines)
            ragged = ragged.without_empty()  # lines the normalizer emptied
            arrays[f"{split}_ids"], arrays[f"{split}_offsets"] = ragged.flat, ragged.offsets
            info[split] = {"lines": len(ragged), "tokens": len(ragged.flat)}
        return arrays, info

    def _load(self, pinned: str | None = None) -> None:
        if self._arrays:
            return
        key, arrays, info = load_artifacts(
            self.context.dataset_dir, self._cache_key(), pinned, self._build
        )
        for split in SPLITS:
            lines, tokens = info[split]["lines"], info[split]["tokens"]
            if self.pairs and lines < 2:
                raise ConfigError(
                    f"{WHO}: the {split} split has {lines} non-empty line(s); pairs need 2 or more"
                )
            if not self.pairs and tokens < self.block_size - 2:
                raise ConfigError(
                    f"{WHO}: the {split} split has {tokens} tokens, fewer than block_size-2="
                    f"{self.block_size - 2}: use more text or a smaller block_size"
                )
        self._key, self._arrays, self._info = key, arrays, info

    # ---- meta --------------------------------------------------------------------------------------
    def build_meta(self) -> dict[str, Any]:
        self._load()
        t = self.block_size
        fields = [
            "input_ids",
            *(["token_type_ids"] if self.pairs else []),
            "attention_mask",
            "labels",
        ]
        roles = {
            "input_ids": "input",
            "token_type_ids": "input",
            "attention_mask": "mask",
            "labels": "target",
        }
        return {
            "training_type": "MLM",
            "vocab_size": self.tok.vocab_size,
            "block_size": t,
            "tokenizer": os.fspath(self.tok.path),
            "artifacts": self._key,
            "pad_token_id": self.tok.id(PAD),
            "cls_token_id": self.tok.id(CLS),
            "sep_token_id": self.tok.id(SEP),
            "mask_token_id": self.tok.id(MASK),
            "special_ids": list(self.tok.special_ids),
            "ignore_index": IGNORE_INDEX,
            "pairs": self.pairs,
            "mlm_probability": self.mlm_probability,
            "mask_replace": self.mask_replace,
            "random_replace": self.random_replace,
            "batch_schema": [
                {"name": n, "dtype": "int64", "shape": [t], "role": roles[n]} for n in fields
            ],
            "split_info": {split: dict(self._info[split]) for split in SPLITS},
        }

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        super().set_meta(meta)
        self._load(meta.get("artifacts"))

    # ---- sampling ----------------------------------------------------------------------------
    def clean_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        """Rows before masking: input_ids, attention_mask (and token_type_ids with pairs)."""
        self._load()
        ids, offsets = self._arrays[f"{split}_ids"], self._arrays[f"{split}_offsets"]
        b, t = self.batch_size, self.block_size
        if self.pairs:
            i = torch.randint(len(offsets) - 2, (b,), generator=rng).numpy()
            a0, a1, b1 = (
                torch.from_numpy(np.asarray(offsets[i + k], dtype=np.int64)) for k in range(3)
            )
            layout = pair_rows(a0, a1 - a0, a1, b1 - a1, t)
        else:
            starts = torch.randint(len(ids) - (t - 2) + 1, (b,), generator=rng)
            layout = single_rows(starts, torch.full((b,), t - 2), t)
        out = {
            "input_ids": layout.input_ids(
                ids, cls=self.tok.id(CLS), sep=self.tok.id(SEP), pad=self.tok.id(PAD)
            ),
            "attention_mask": layout.attention_mask(),
        }
        if self.pairs:
            out["token_type_ids"] = layout.token_type_ids()
        return out

    def mask_tokens(
        self, input_ids: torch.Tensor, rng: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """BERT's corruption of `input_ids`: (corrupted ids, labels)."""
        shape = input_ids.shape
        candidate = ~torch.isin(input_ids, self._special)
        selected = (torch.rand(shape, generator=rng) < self.mlm_probability) & candidate
        u = torch.rand(shape, generator=rng)
        to_mask = selected & (u < self.mask_replace)
        to_random = (
            selected & (u >= self.mask_replace) & (u < self.mask_replace + self.random_replace)
        )
        random_ids = self._normal_ids[torch.randint(len(self._normal_ids), shape, generator=rng)]
        corrupted = torch.where(to_mask, self.tok.id(MASK), input_ids)
        corrupted = torch.where(to_random, random_ids, corrupted)
        return corrupted, torch.where(selected, input_ids, IGNORE_INDEX)

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        batch = self.clean_batch(split, rng)
        batch["input_ids"], batch["labels"] = self.mask_tokens(batch["input_ids"], rng)
        return batch
