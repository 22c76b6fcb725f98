"""A stateless provider with text_lm's packed rows, to mix with text_lm sources (imported by
worker processes): char_lm and nanogpt_bin serve x/y rows, which a text_lm mixture refuses."""

from __future__ import annotations

from typing import Any

import torch

from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.compact import packed_lm_schema

EOS = 256  # the byte tokenizer's, as text_lm's meta gives it
IGNORE = -100


class PackedBytesProvider(DataProviderBase):
    """Rows of `micro_batch_size` random windows of `seq_len` bytes of `text` (no document
    end inside): a pure function of the file's seq, like char_lm."""

    def __init__(
        self, context: ProviderContext, *, text: str, seq_len: int, micro_batch_size: int
    ) -> None:
        super().__init__(context)
        self.data = torch.tensor(list(text.encode()), dtype=torch.int32)
        self.seq_len, self.micro = seq_len, micro_batch_size

    def build_meta(self) -> dict[str, Any]:
        t = self.seq_len
        return {
            "training_type": "LM",
            "vocab_size": 257,
            "block_size": t,
            "eos_id": EOS,
            "batch_schema": packed_lm_schema(
                [self.micro, t], 257, eos_id=EOS, ignore=IGNORE, padded=False
            ),
            "split_info": {"train": {}, "val": {}},
        }

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        shape = (self.batch_size, self.micro)
        starts = torch.randint(len(self.data) - self.seq_len - 1, shape, generator=rng)
        windows = self.data[starts.unsqueeze(-1) + torch.arange(self.seq_len + 1)]
        return {
            "input_ids": windows[..., :-1],
            "labels": windows[..., 1:],
            "attention_mask": torch.ones((*shape, self.seq_len), dtype=torch.bool),
            "segment_ids": torch.ones((*shape, self.seq_len), dtype=torch.int32),
        }
