"""Providers that misbehave on purpose, for the server's fault tests (imported by worker processes)."""

from __future__ import annotations

import os
from typing import Any

import torch

from queue_providers.base import DataProviderBase, ProviderContext


class TinyProvider(DataProviderBase):
    """x: [B, 4] random ids, y = x + 1; cheap to produce."""

    def __init__(self, context: ProviderContext, *, width: int = 4) -> None:
        super().__init__(context)
        self.width = width

    def build_meta(self) -> dict[str, Any]:
        w = self.width
        return {
            "training_type": "LM",
            "vocab_size": 1000,
            "block_size": w,
            "batch_schema": [
                {"name": "x", "dtype": "int64", "shape": [w], "role": "input"},
                {"name": "y", "dtype": "int64", "shape": [w], "role": "target"},
            ],
            "split_info": {"train": {}, "val": {}},
        }

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 999, (self.batch_size, self.width), generator=rng)
        return {"x": x, "y": x + 1}


class FailingProvider(TinyProvider):
    """Raises on every batch: the dataset must end up failed, with this message."""

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        raise RuntimeError("boom from FailingProvider")


class CrashingProvider(TinyProvider):
    """Kills its own process on every batch: a worker dying mid-write, every time."""

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        os._exit(17)


class MissingMetaProvider(TinyProvider):
    def build_meta(self) -> dict[str, Any]:
        meta = super().build_meta()
        del meta["split_info"], meta["vocab_size"]
        return meta


class DictProvider(TinyProvider):
    """A non x/y schema: input_ids, attention_mask, labels."""

    def build_meta(self) -> dict[str, Any]:
        meta = super().build_meta()
        w = self.width
        meta["batch_schema"] = [
            {"name": "input_ids", "dtype": "int64", "shape": [w], "role": "input"},
            {"name": "attention_mask", "dtype": "bool", "shape": [w], "role": "mask"},
            {"name": "labels", "dtype": "int64", "shape": [w], "role": "target"},
        ]
        return meta

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 999, (self.batch_size, self.width), generator=rng)
        return {"input_ids": x, "attention_mask": torch.ones_like(x, dtype=torch.bool), "labels": x}


class OutOfVocabProvider(TinyProvider):
    """Puts id vocab_size (1000) into y of every batch: the write-time check must refuse
    every file, naming y, the id and vocab_size."""

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        b = super().sample_batch(split, rng)
        b["y"][0, 0] = 1000
        return b


class WrongSchemaProvider(TinyProvider):
    """Returns y with the wrong dtype: the worker must refuse it, naming the field."""

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        b = super().sample_batch(split, rng)
        return {"x": b["x"], "y": b["y"].float()}


class DiskFullProvider(TinyProvider):
    """Fails every write with ENOSPC while the file named by `fault_file` exists: an injected
    writer fault, so the test never fills a real disk."""

    def __init__(self, context: ProviderContext, *, fault_file: str, width: int = 4) -> None:
        super().__init__(context, width=width)
        self.fault_file = fault_file

    def produce_file(self, split: str, seq: int, directory: Any) -> Any:
        import errno

        if os.path.exists(self.fault_file):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super().produce_file(split, seq, directory)


class SlowProvider(TinyProvider):
    """Takes `delay_s` per batch, so a test can kill the worker in the middle of a file."""

    def __init__(self, context: ProviderContext, *, delay_s: float = 0.2, width: int = 4) -> None:
        super().__init__(context, width=width)
        self.delay_s = delay_s

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        import time

        time.sleep(self.delay_s)  # stands for real work; not synchronisation
        return super().sample_batch(split, rng)


class StreamProvider(TinyProvider):
    """A streaming provider: batch values continue a counter that is its only state, so a
    file's content depends on every file this worker made before it, exactly like a text
    stream's cursor. Workers take disjoint counter ranges (offset by worker index)."""

    def __init__(self, context: ProviderContext, *, width: int = 4) -> None:
        super().__init__(context, width=width)
        self.cursor: dict[str, int] = {}

    def _start(self) -> int:
        return self.context.worker_index * 1_000_000

    def build_meta(self) -> dict[str, Any]:
        meta = super().build_meta()
        meta["vocab_size"] = 1 << 31  # the counter is the id: every value a test reaches
        return meta

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        n = self.batch_size * self.width
        start = self.cursor.get(split, self._start())
        self.cursor[split] = start + n
        x = torch.arange(start, start + n, dtype=torch.int64).view(self.batch_size, self.width)
        return {"x": x, "y": x + 1}

    def state_dict(self, split: str) -> dict[str, Any]:
        return {"cursor": self.cursor.get(split, self._start())}

    def load_state_dict(self, split: str, state: Any) -> None:
        self.cursor[split] = int(state["cursor"])


class GradAccumProvider(TinyProvider):
    """An [A, B, T] layout: each batch is one optimizer step of A = batch_size micro-batches
    of 2 rows (meta's grad_accum says so), as text_lm's are."""

    def build_meta(self) -> dict[str, Any]:
        meta = super().build_meta()
        w = self.width
        meta["grad_accum"] = self.batch_size
        meta["batch_schema"] = [
            {"name": "x", "dtype": "int64", "shape": [2, w], "role": "input"},
            {"name": "y", "dtype": "int64", "shape": [2, w], "role": "target"},
        ]
        return meta

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 999, (self.batch_size, 2, self.width), generator=rng)
        return {"x": x, "y": x + 1}


class EnvironProvider(TinyProvider):
    """Fails its meta build with what its worker process sees of its server's environment
    and import path (tests/test_warm_forkserver.py)."""

    def build_meta(self) -> dict[str, Any]:
        import sys

        probe = os.environ.get("BQ_WARM_PROBE")
        raise RuntimeError(f"worker sees BQ_WARM_PROBE={probe!r} and sys.path {sys.path}")
