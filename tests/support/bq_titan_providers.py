"""A language-model provider whose rows name themselves, for the framework resume tests."""

from __future__ import annotations

from typing import Any

import torch

from queue_client.format.batchfile import EncodedBatchFile
from queue_providers.base import DataProviderBase, ProviderContext

VOCAB = 2048  # torchtitan's debug model


def row_tokens(row: int, width: int) -> list[int]:
    """Row `row` of the split (seq * rows_per_file + its place in the file) as token ids."""
    return [row // VOCAB, row % VOCAB] + [(row + t) % VOCAB for t in range(2, width)]


def row_of(tokens: list[int]) -> int:
    """The row a row's token ids name."""
    return tokens[0] * VOCAB + tokens[1]


class RowIdProvider(DataProviderBase):
    """x: the tokens of the row's own number (row_tokens), y = x + 1 modulo the vocabulary."""

    def __init__(self, context: ProviderContext, *, block_size: int = 16) -> None:
        super().__init__(context)
        self.block_size = block_size

    def build_meta(self) -> dict[str, Any]:
        t = self.block_size
        return {
            "training_type": "LM",
            "vocab_size": VOCAB,
            "block_size": t,
            "batch_schema": [
                {"name": "x", "dtype": "int64", "shape": [t], "role": "input"},
                {"name": "y", "dtype": "int64", "shape": [t], "role": "target"},
            ],
            "split_info": {"train": {}, "val": {}},
        }

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        raise NotImplementedError("make_file writes each file's rows from its seq")

    def make_file(self, split: str, seq: int) -> EncodedBatchFile:
        nb, bs = self.context.batches_per_file, self.batch_size
        first = seq * nb * bs
        rows = [row_tokens(first + i, self.block_size) for i in range(nb * bs)]
        x = torch.tensor(rows, dtype=torch.int64).reshape(nb, bs, self.block_size)
        return self.encode_file(split, seq, {"x": x, "y": (x + 1) % VOCAB})
