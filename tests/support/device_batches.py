"""What the device-path tests share: datasets of every codec kind on one server (a char_lm
window, text_lm's derived fields, a mixture of three token_shards sources with its source
field), batches read back as plain CPU tensors, and a staging ring of CPU buffers."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from queue_client import QueueClient
from queue_client.streaming.staging_ring import StagingRing

DATASETS = ("chars", "web", "mix")


def datasets_config(tmp: Path, corpus: Path) -> str:
    """A server config of the three datasets, their inputs written under `tmp`."""
    docs = tmp / "docs.txt"
    docs.write_text("\n\n".join(f"doc {i} " + "word " * (i % 37 + 1) for i in range(200)) + "\n")
    text = textwrap.dedent(
        f"""
        [server]
        lease_ttl_s = 30
        [datasets.chars]
        provider = "char_lm"
        batch_size = 4
        batches_per_file = 4
        [datasets.chars.args]
        input = "{corpus.as_posix()}"
        block_size = 16
        [datasets.web]
        provider = "text_lm"
        batch_size = 2
        batches_per_file = 4
        [datasets.web.args]
        source = "{docs.as_posix()}"
        separator = ""
        seq_len = 32
        micro_batch_size = 2
        eval_take = 4
        packing = "bin"
        [datasets.mix]
        batch_size = 4
        batches_per_file = 4
        """
    )
    for i, (name, weight) in enumerate((("a", 0.5), ("b", 0.3), ("c", 0.2))):
        path = tmp / f"shard_{name}.bin"
        ids = np.random.default_rng(i).integers(i * 100, i * 100 + 100, size=5000)
        ids.astype(np.uint16).tofile(path)
        text += textwrap.dedent(
            f"""
            [datasets.mix.sources.{name}]
            provider = "token_shards"
            weight = {weight}
            [datasets.mix.sources.{name}.args]
            inputs = ["{path.as_posix()}"]
            block_size = 16
            vocab_size = 300
            """
        )
    return text


def cpu_copy(batch: Any) -> Any:
    """A batch (tuple or dict) as CPU tensors of its own memory."""
    if isinstance(batch, tuple):
        return tuple(t.detach().to("cpu", copy=True) for t in batch)
    return {k: v.detach().to("cpu", copy=True) for k, v in batch.items()}


def fields(batch: Any) -> list[torch.Tensor]:
    return list(batch) if isinstance(batch, tuple) else [batch[k] for k in sorted(batch)]


def read(client: QueueClient, n: int, split: str = "train") -> list[Any]:
    return [cpu_copy(client.get_batch(split)) for _ in range(n)]


class PassedFence:
    """A fence on the CPU: the work it guards is done when it is recorded."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def cpu_ring() -> StagingRing:
    def alloc(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8)

    return StagingRing(alloc, alloc, PassedFence)
