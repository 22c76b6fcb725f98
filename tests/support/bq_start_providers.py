"""Providers whose workers start only when the test says so (a FIFO the test owns)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bq_test_providers import TinyProvider
from queue_providers.base import ProviderContext


class GatedStartProvider(TinyProvider):
    """set_meta (a worker's last step before it makes files; never the meta build's) waits
    until the test opens the FIFO `gate` for writing and closes it; with `per_worker`, the
    FIFO `gate`.N of worker index N, so that a test starts the workers one by one."""

    def __init__(
        self, context: ProviderContext, *, gate: str, per_worker: bool = False, width: int = 4
    ) -> None:
        super().__init__(context, width=width)
        self.gate = f"{gate}.{context.worker_index}" if per_worker else gate

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        super().set_meta(meta)
        with open(self.gate, "rb") as f:  # blocks until a writer opens the FIFO
            f.read()  # returns once the writer closes it
