"""Providers whose workers die while a marker file exists, for the restart-backoff tests
(imported by worker processes)."""

from __future__ import annotations

import os

import torch

from bq_test_providers import TinyProvider
from queue_providers.base import ProviderContext


class CrashAtStartProvider(TinyProvider):
    """Its worker process dies while starting (exit code 19) as long as `marker` exists: a
    worker that cannot even come up. Without the marker it is TinyProvider."""

    def __init__(self, context: ProviderContext, *, marker: str, width: int = 4) -> None:
        super().__init__(context, width=width)
        self.marker = marker

    def on_start(self) -> None:
        if os.path.exists(self.marker):
            os._exit(19)
        super().on_start()


class CrashWhileMarkedProvider(TinyProvider):
    """Its worker process dies on every batch (exit code 23) as long as `marker` exists."""

    def __init__(self, context: ProviderContext, *, marker: str, width: int = 4) -> None:
        super().__init__(context, width=width)
        self.marker = marker

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        if os.path.exists(self.marker):
            os._exit(23)
        return super().sample_batch(split, rng)
