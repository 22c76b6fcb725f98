"""Providers for the operability tests (imported by worker processes)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from bq_test_providers import TinyProvider
from queue_client.format.batchfile import BatchFileName, PublishedFile
from queue_client.format.layout import atomic_write
from queue_providers.base import ProviderContext


class HalfWrittenProvider(TinyProvider):
    """Publishes each file through a temp file that it leaves half written for `hold_s`:
    a worker caught in the middle of a file, with its temp file on disk."""

    def __init__(self, context: ProviderContext, *, hold_s: float = 60.0, width: int = 4) -> None:
        super().__init__(context, width=width)
        self.hold_s = hold_s

    def produce_file(self, split: str, seq: int, directory: Any) -> PublishedFile:
        encoded = self.make_file(split, seq)
        name = BatchFileName(int(time.time() * 1000), encoded.seq, encoded.num_batches)
        half = len(encoded.data) // 2

        def write(f: Any) -> None:
            f.write(encoded.data[:half])
            f.flush()
            threading.Event().wait(self.hold_s)  # stands for a slow disk; never set
            f.write(encoded.data[half:])

        atomic_write(Path(directory) / str(name), write)
        return PublishedFile(name, len(encoded.data), encoded.crc32)


class GatedMetaProvider(TinyProvider):
    """build_meta waits until the test opens the FIFO `gate` for writing and closes it: a
    meta build that lasts exactly as long as the test needs, with no clock in it."""

    def __init__(self, context: ProviderContext, *, gate: str, width: int = 4) -> None:
        super().__init__(context, width=width)
        self.gate = gate

    def build_meta(self) -> dict[str, Any]:
        with open(self.gate, "rb") as f:  # blocks until a writer opens the FIFO
            f.read()  # returns once the writer closes it
        return super().build_meta()


class BrokenMetaProvider(TinyProvider):
    """Cannot build its meta: a provider that fails to prepare, with a data error (not a
    config error)."""

    def build_meta(self) -> dict[str, Any]:
        raise RuntimeError("the index of BrokenMetaProvider is corrupt")
