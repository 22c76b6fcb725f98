"""token_classification: CoNLL-style tagged sentences (NER, POS, chunking) as token rows.

Sentences come from CoNLL files (`input`), or from the rows of a Hugging Face dataset
(`hf_dataset`): a list of words in tokens_column and a tag per word in tags_column.

Input files hold one token per line with whitespace-separated columns (the token in
token_column, its tag in tag_column), blank lines between sentences, and "-DOCSTART-" lines
ignored. Every token line of a file must have the same number of columns (num_columns, or else
the file's first token line): a stray line is reported with its file and line at start-up.

Words are split into subwords by the WordPiece tokenizer. Alignment: the first subword of a word
carries the word's tag id and the word's other subwords carry -100, as do [CLS], [SEP] and
padding, so a loss with ignore_index=-100 scores each word exactly once. A word the tokenizer
maps to no subword at all (only characters its normalizer drops) loses its tag; split_info
counts those. Sentences longer than block_size-2 subwords are truncated (split_info counts
them too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from queue_client.errors import ConfigError
from queue_providers.base import ProviderContext
from queue_providers.compact import labels, pad_mask, token_ids
from queue_providers.tokenized.hf_rows import TAGS, WORDS, Column, HFRows, column_names
from queue_providers.tokenized.labels import derive_label_map, parse_label_map
from queue_providers.tokenized.provider import Arrays, TokenizedProvider
from queue_providers.tokenized.ragged import Ragged, encode_words
from queue_providers.tokenized.rows import IGNORE_INDEX
from queue_providers.tokenized.wordpiece import PAD

WHO = "token_classification"
DOCSTART = "-DOCSTART-"
HF_COLUMNS = {"tokens_column": "tokens", "tags_column": "ner_tags"}


@dataclass(frozen=True)
class Sentence:
    words: list[str]
    tags: list[str]
    origin: str  # its file, or its dataset row
    first_line: int | None  # in a file, tag k is on line first_line + k

    def where(self, k: int) -> str:
        if self.first_line is None:
            return f"{self.origin} word {k}"
        return f"{self.origin}:{self.first_line + k}"


def check_columns(num_columns: int, token_column: int, tag_column: int, *, where: str) -> None:
    """Both columns exist in a line of num_columns, and are not the same one."""
    for key, col in (("token_column", token_column), ("tag_column", tag_column)):
        if not -num_columns <= col < num_columns:
            raise ConfigError(f"{where}: {key}={col} but a line has {num_columns} column(s)")
    if token_column % num_columns == tag_column % num_columns:
        raise ConfigError(
            f"{where}: one column holds both token and tag; a CoNLL line needs a token column "
            "and a tag column"
        )


def read_conll(
    path: Path, *, token_column: int, tag_column: int, num_columns: int | None
) -> list[Sentence]:
    """Sentences of one CoNLL file; ConfigError naming file:line for a line that doesn't fit."""
    sentences: list[Sentence] = []
    words: list[str] = []
    tags: list[str] = []
    first_line = 0
    expected, expected_from = num_columns, "num_columns"

    def flush() -> None:
        if words:
            sentences.append(Sentence(list(words), list(tags), str(path), first_line))
            words.clear()
            tags.clear()

    with open(path, encoding="utf-8") as f:
        for line_no, raw in enumerate(f, 1):
            cols = raw.split()
            if not cols or cols[0] == DOCSTART:
                flush()
                continue
            if expected is None:
                expected, expected_from = len(cols), f"line {line_no}, the file's first token line"
                check_columns(expected, token_column, tag_column, where=f"{path}:{line_no}")
            if len(cols) != expected:
                raise ConfigError(
                    f"{path}:{line_no}: {len(cols)} column(s), expected {expected} (as {expected_from}): {raw.rstrip()!r}"
                )
            if not words:
                first_line = line_no
            words.append(cols[token_column])
            tags.append(cols[tag_column])
    flush()
    return sentences


class TokenClassificationProvider(TokenizedProvider[Sentence]):
    """input_ids, attention_mask and a tag id (or -100) per subword."""

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
        token_column: int = 0,
        tag_column: int = -1,
        num_columns: int | None = None,
        label_map: Sequence[str] | Mapping[str, int] | None = None,
        lowercase: bool | None = None,
        remote: dict[str, Any] | None = None,
        hf_dataset: str | None = None,
        hf_splits: Mapping[str, str] | None = None,
        hf_config: str | None = None,
        hf_revision: str | None = None,
        tokens_column: str | None = None,
        tags_column: str | None = None,
    ) -> None:
        given = {"tokens_column": tokens_column, "tags_column": tags_column}
        self.hf_columns = column_names(WHO, hf_dataset, given, HF_COLUMNS)
        for key, col in (("token_column", token_column), ("tag_column", tag_column)):
            if not isinstance(col, int) or isinstance(col, bool):
                raise ConfigError(
                    f"{WHO}: {key} must be an int (negative counts from the end), got {col!r}"
                )
        if num_columns is not None and (
            not isinstance(num_columns, int) or isinstance(num_columns, bool) or num_columns < 2
        ):
            raise ConfigError(f"{WHO}: num_columns must be an int >= 2, got {num_columns!r}")
        if num_columns is not None:
            check_columns(
                num_columns, token_column, tag_column, where=f"{WHO}: num_columns={num_columns}"
            )
        self.columns: dict[str, Any] = {
            "token_column": token_column,
            "tag_column": tag_column,
            "num_columns": num_columns,
        }
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

    # ---- sentences ----------------------------------------------------------------------------
    def read(self, paths: Sequence[Path]) -> list[Sentence]:
        return [s for p in paths for s in read_conll(p, **self.columns)]

    def read_rows(self, rows: HFRows, split: str) -> list[Sentence]:
        """One sentence per row with words; integer tags become their decimal string, as a
        CoNLL file holding ids would give them. A row's words and tags must pair up."""
        cols = self.hf_columns
        values = rows.read(
            split,
            [
                Column("tokens_column", cols["tokens_column"], WORDS),
                Column("tags_column", cols["tags_column"], TAGS),
            ],
        )
        sentences = []
        pairs = zip(values["tokens_column"], values["tags_column"], strict=True)
        for i, (words, tags) in enumerate(pairs):
            if len(words) != len(tags):
                raise ConfigError(
                    f"{rows.where(split, i)}: {len(words)} word(s) in tokens_column "
                    f"{cols['tokens_column']!r} but {len(tags)} tag(s) in tags_column "
                    f"{cols['tags_column']!r}"
                )
            if words:  # an empty row is no sentence, as a blank line in a file
                sentences.append(
                    Sentence(words, [str(t) for t in tags], rows.where(split, i), None)
                )
        return sentences

    def shared_info(self, items: Sequence[Sentence]) -> dict[str, Any]:
        label_map = self.config_label_map or derive_label_map(t for s in items for t in s.tags)
        for sent in items:  # in file order, so the error names the first bad line
            for k, tag in enumerate(sent.tags):
                if tag not in label_map:
                    raise ConfigError(
                        f"{sent.where(k)}: tag {tag!r} is not in label_map (tags: {sorted(label_map)})"
                    )
        return {"label_map": label_map}

    def _align(
        self, sentences: Sequence[Sentence], label_map: Mapping[str, int]
    ) -> tuple[Ragged, np.ndarray]:
        """Subword ids and, aligned to them, the tag of each word's first subword, -100 elsewhere."""
        ids, word_of = encode_words(self.tok, [s.words for s in sentences])
        tags = Ragged.from_lists(
            [[label_map[t] for t in s.tags] for s in sentences], dtype=np.int64
        )
        sentence_of = np.repeat(np.arange(len(sentences)), ids.lengths)
        w = word_of.flat.astype(np.int64)
        starts_sentence = np.zeros(len(w), dtype=bool)
        starts_sentence[ids.starts[ids.lengths > 0]] = True
        first = starts_sentence | np.concatenate([[True], w[1:] != w[:-1]])[: len(w)]
        word_tag = tags.flat[tags.offsets[sentence_of] + w]
        return ids, np.where(first, word_tag, IGNORE_INDEX)

    def tokenize(
        self, split: str, items: Sequence[Sentence], shared: Mapping[str, Any]
    ) -> tuple[Arrays, dict[str, Any]]:
        if not items:
            raise ConfigError(f"{WHO}: the {split} split has no sentences")
        ids, labels = self._align(items, shared["label_map"])
        words = sum(len(s.words) for s in items)
        arrays = {"ids": ids.flat, "offsets": ids.offsets, "labels": labels}
        info = {
            "sentences": len(items),
            "words": words,
            "subwords": len(ids.flat),
            "words_without_subwords": int(words - (labels != IGNORE_INDEX).sum()),
            "truncated": int((ids.lengths > self.block_size - 2).sum()),
        }
        return arrays, info

    def cache_parts(self) -> tuple[object, ...]:
        return (self.columns, self.config_label_map, self.block_size, *self.hf_parts())

    # ---- meta --------------------------------------------------------------------------------
    def meta_fields(self) -> dict[str, Any]:
        t = self.block_size
        label_map = dict(self._info["label_map"])
        return {
            "training_type": "TOKEN_CLASSIFICATION",
            "num_labels": len(label_map),
            "label_map": label_map,
            "label_alignment": "first_subword",
            "ignore_index": IGNORE_INDEX,
            # Stored: narrow ids and tag ids (int8 up to 128 tags, -100 included); the mask
            # follows from [PAD].
            "batch_schema": [
                token_ids("input_ids", [t], self.tok.vocab_size),
                pad_mask("attention_mask", [t], "input_ids", self.tok.id(PAD)),
                labels("labels", [t], len(label_map), ignore=IGNORE_INDEX),
            ],
        }

    # ---- sampling ----------------------------------------------------------------------------
    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        n = len(self.array(split, "offsets")) - 1
        idx = torch.randint(n, (self.batch_size,), generator=rng).numpy()
        layout = self.rows(split, idx)
        return {
            "input_ids": self.input_ids(split, layout),
            "attention_mask": layout.attention_mask(),
            "labels": layout.labels(self.array(split, "labels")),
        }
