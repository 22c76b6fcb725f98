"""bert_mlm: BERT's masked-language-model objective over a local text corpus.

The corpus (non-blank lines of the input files, or of the text_column of a Hugging Face
dataset's rows, `hf_dataset`) is tokenized once with a WordPiece vocab
(vocab.txt or tokenizer.json; `python -m queue_providers.tokenizer_training.train_wordpiece` trains one) and the
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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from queue_client.errors import ConfigError
from queue_providers.base import ProviderContext
from queue_providers.compact import labels, pad_mask, second_segment, token_ids
from queue_providers.tokenized.hf_rows import TEXT, Column, HFRows, column_names
from queue_providers.tokenized.provider import SPLITS, Arrays, TokenizedProvider
from queue_providers.tokenized.ragged import encode_texts
from queue_providers.tokenized.rows import IGNORE_INDEX, pair_rows, single_rows
from queue_providers.tokenized.wordpiece import BERT_SPECIALS, MASK, PAD, SEP

WHO = "bert_mlm"
HF_COLUMNS = {"text_column": "text"}


def _probability(name: str, value: Any, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{WHO}: {name} must be a number in [0, 1], got {value!r}")
    if not (0.0 < value <= 1.0 if open_low else 0.0 <= value <= 1.0):
        raise ConfigError(
            f"{WHO}: {name} must lie in {'(0, 1]' if open_low else '[0, 1]'}, got {value!r}"
        )
    return float(value)


def read_lines(paths: Sequence[Path]) -> list[str]:
    """The non-blank lines of text files, stripped, in order."""
    lines: list[str] = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines.extend(s for line in f if (s := line.strip()))
    return lines


def text_lines(texts: Sequence[str]) -> list[str]:
    """The non-blank lines of texts, stripped, in order: what read_lines gives for a file of
    them (every line break, "\r\n", "\r" or "\n", ends a line, as open() reads them)."""
    joined = "\n".join(texts).replace("\r\n", "\n").replace("\r", "\n")
    return [s for line in joined.split("\n") if (s := line.strip())]


class BertMLMProvider(TokenizedProvider[str]):
    """Masked-LM batches: input_ids, attention_mask, labels (+ token_type_ids with pairs)."""

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
        pairs: bool = False,
        lowercase: bool | None = None,
        mlm_probability: float = 0.15,
        mask_replace: float = 0.8,
        random_replace: float = 0.1,
        remote: dict[str, Any] | None = None,
        hf_dataset: str | None = None,
        hf_splits: Mapping[str, str] | None = None,
        hf_config: str | None = None,
        hf_revision: str | None = None,
        text_column: str | None = None,
    ) -> None:
        given = {"text_column": text_column}
        self.hf_columns = column_names(WHO, hf_dataset, given, HF_COLUMNS)
        self.pairs = bool(pairs)
        self.mlm_probability = _probability("mlm_probability", mlm_probability, open_low=True)
        self.mask_replace = _probability("mask_replace", mask_replace)
        self.random_replace = _probability("random_replace", random_replace)
        if self.mask_replace + self.random_replace > 1.0:
            raise ConfigError(
                f"{WHO}: mask_replace + random_replace = {self.mask_replace + self.random_replace} exceeds 1"
            )
        super().__init__(
            context,
            input=input,
            tokenizer=tokenizer,
            block_size=block_size,
            val_input=val_input,
            train_fraction=train_fraction,
            lowercase=lowercase,
            remote=remote,
            min_block_size=5 if self.pairs else 3,
            require=BERT_SPECIALS,
            hf_dataset=hf_dataset,
            hf_splits=hf_splits,
            hf_config=hf_config,
            hf_revision=hf_revision,
        )
        # Masking looks ids up in tables over the vocab rather than searching a list per token.
        self._is_special = np.zeros(self.tok.vocab_size, dtype=bool)
        self._is_special[list(self.tok.special_ids)] = True
        self._normal_ids = np.flatnonzero(~self._is_special)
        if len(self._normal_ids) == 0:
            raise ConfigError(f"{WHO}: tokenizer {self.tok.path} has only special tokens")

    # ---- corpus --------------------------------------------------------------------------------
    def read(self, paths: Sequence[Path]) -> list[str]:
        return read_lines(paths)

    def read_rows(self, rows: HFRows, split: str) -> list[str]:
        """The non-blank lines of every row's text, as if the rows were one text file."""
        column = Column("text_column", self.hf_columns["text_column"], TEXT)
        return text_lines(rows.read(split, [column])["text_column"])

    def cache_parts(self) -> tuple[object, ...]:
        return self.hf_parts()

    def split_items(self, items: list[str]) -> dict[str, list[str]]:
        # Lines of running text: the first train_fraction of them, in order, is train.
        n_train = int(len(items) * self.train_fraction)
        return {"train": items[:n_train], "val": items[n_train:]}

    def tokenize(
        self, split: str, items: Sequence[str], shared: Mapping[str, Any]
    ) -> tuple[Arrays, dict[str, Any]]:
        ragged = encode_texts(self.tok, items).without_empty()  # lines the normalizer emptied
        arrays = {"ids": ragged.flat, "offsets": ragged.offsets}
        return arrays, {"lines": len(ragged), "tokens": len(ragged.flat)}

    def check_info(self, info: Mapping[str, Any]) -> None:
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

    # ---- meta --------------------------------------------------------------------------------------
    def meta_fields(self) -> dict[str, Any]:
        t, vocab = self.block_size, self.tok.vocab_size
        pad, sep = self.tok.id(PAD), self.tok.id(SEP)
        # A file stores input_ids (uint16 up to 65,536 ids) and labels (int16 up to 32,768);
        # the mask and the segments follow from the ids' [PAD] and [SEP].
        fields = [
            token_ids("input_ids", [t], vocab),
            *([second_segment("token_type_ids", [t], "input_ids", sep, pad)] if self.pairs else []),
            pad_mask("attention_mask", [t], "input_ids", pad),
            labels("labels", [t], vocab, ignore=IGNORE_INDEX),
        ]
        return {
            "training_type": "MLM",
            "mask_token_id": self.tok.id(MASK),
            "special_ids": list(self.tok.special_ids),
            "ignore_index": IGNORE_INDEX,
            "pairs": self.pairs,
            "mlm_probability": self.mlm_probability,
            "mask_replace": self.mask_replace,
            "random_replace": self.random_replace,
            "batch_schema": fields,
        }

    # ---- sampling ----------------------------------------------------------------------------
    def clean_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        """Rows before masking: input_ids, attention_mask (and token_type_ids with pairs)."""
        ids, offsets = self.array(split, "ids"), self.array(split, "offsets")
        b, t = self.batch_size, self.block_size
        if self.pairs:
            i = torch.randint(len(offsets) - 2, (b,), generator=rng).numpy()
            a0, a1, b1 = (np.asarray(offsets[i + k], dtype=np.int64) for k in range(3))
            layout = pair_rows(a0, a1 - a0, a1, b1 - a1, t)
        else:
            starts = torch.randint(len(ids) - (t - 2) + 1, (b,), generator=rng).numpy()
            layout = single_rows(starts, np.full(b, t - 2), t)
        out = {
            "input_ids": self.input_ids(split, layout),
            "attention_mask": layout.attention_mask(),
        }
        if self.pairs:
            out["token_type_ids"] = layout.token_type_ids()
        return out

    def mask_tokens(
        self, input_ids: torch.Tensor, rng: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """BERT's corruption of `input_ids`: (corrupted ids, labels). The three draws are
        whole-batch tensors in a fixed order (select, replace kind, random id), so a batch is
        a function of the generator's state alone."""
        ids = input_ids.numpy()
        shape = input_ids.shape
        selected = torch.rand(shape, generator=rng).numpy() < self.mlm_probability
        selected &= ~self._is_special[ids]
        u = torch.rand(shape, generator=rng).numpy()
        to_mask = selected & (u < self.mask_replace)
        to_random = selected & ~to_mask & (u < self.mask_replace + self.random_replace)
        random_ids = self._normal_ids[
            torch.randint(len(self._normal_ids), shape, generator=rng).numpy()
        ]
        corrupted = np.where(to_mask, self.tok.id(MASK), np.where(to_random, random_ids, ids))
        labels = np.where(selected, ids, IGNORE_INDEX)
        return torch.from_numpy(corrupted), torch.from_numpy(labels)

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        batch = self.clean_batch(split, rng)
        batch["input_ids"], batch["labels"] = self.mask_tokens(batch["input_ids"], rng)
        return batch
