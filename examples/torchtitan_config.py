"""A torchtitan config that trains its llama3 debug model from a batchqueue dataset.

torchtitan configs are Python functions returning a Trainer.Config (a "config registry");
batchqueue_debugmodel() is torchtitan's llama3_debugmodel() with three things changed:

- the data loader is BatchQueueDataLoader, reading `dataset` from the server at `address`;
- the tokenizer is ServedTokenIds: the batches arrive as token ids, so nothing is tokenized
  and no tokenizer files are needed (torchtitan builds a tokenizer whatever the loader);
- checkpoints are on, every `interval` steps, so a killed run resumes from the last one.

examples/train_torchtitan.py runs it (also on a machine without an accelerator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from queue_client.integrations.torchtitan import BatchQueueDataLoader


class ServedTokenIds(BaseTokenizer):
    """The tokenizer of a trainer whose batches arrive as token ids: it encodes nothing."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, **_unused: Any) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("batchqueue serves token ids: there is no text to encode")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("ServedTokenIds keeps no vocabulary to decode with")

    def get_vocab_size(self) -> int:
        return self.vocab_size


def batchqueue_debugmodel(
    address: str = "127.0.0.1:50051",
    dataset: str = "stdlib_char",
    *,
    seq_len: int = 256,
    local_batch_size: int = 8,
    steps: int = 20,
    interval: int = 5,
    dump_folder: str = "./outputs",
) -> Trainer.Config:
    """torchtitan's debug model on `dataset`; seq_len must be the dataset's block_size."""
    config = llama3_debugmodel()
    config.dataloader = BatchQueueDataLoader.Config(address=address, dataset=dataset)
    config.tokenizer = ServedTokenIds.Config()
    config.training.seq_len = seq_len
    config.training.local_batch_size = local_batch_size
    config.training.steps = steps
    config.checkpoint.enable = True
    config.checkpoint.interval = interval
    config.validator.enable = False  # its loader would be torchtitan's own, on its own data
    config.dump_folder = dump_folder
    return config
