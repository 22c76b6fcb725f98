"""A provider for the Ray backend's tests, imported by Ray actors on every test node."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bq_test_providers import StreamProvider
from queue_client.format.batchfile import EncodedBatchFile
from queue_providers.base import ProviderContext


class GatedStreamProvider(StreamProvider):
    """A streaming provider that, making file `gate_seq`, announces itself in `gate_dir`
    ("making-SEQ-PID") and waits there until the test creates "go-SEQ": so a test can kill
    the actor while it is certainly in the middle of that file."""

    def __init__(
        self, context: ProviderContext, *, gate_dir: str, gate_seq: int = -1, width: int = 4
    ) -> None:
        super().__init__(context, width=width)
        self.gate_dir = Path(gate_dir)
        self.gate_seq = gate_seq

    def make_file(self, split: str, seq: int) -> EncodedBatchFile:
        if seq == self.gate_seq:
            (self.gate_dir / f"making-{seq}-{os.getpid()}").touch()
            go, deadline = self.gate_dir / f"go-{seq}", time.monotonic() + 60
            while not go.exists():  # the test opens the gate; never waits past the deadline
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{go} did not appear within 60 s")
                time.sleep(0.01)
        return super().make_file(split, seq)


class StartGatedProvider(StreamProvider):
    """An actor that, starting (set_meta, the last step of an actor's first call), announces
    itself in `gate_dir` ("starting-PID") and waits there until the test creates "go-start":
    so a test can kill it while it certainly has not started yet."""

    def __init__(self, context: ProviderContext, *, gate_dir: str, width: int = 4) -> None:
        super().__init__(context, width=width)
        self.gate_dir = Path(gate_dir)

    def set_meta(self, meta: Any) -> None:
        super().set_meta(meta)
        (self.gate_dir / f"starting-{os.getpid()}").touch()
        go, deadline = self.gate_dir / "go-start", time.monotonic() + 60
        while not go.exists():  # the test opens the gate; never waits past the deadline
            if time.monotonic() > deadline:
                raise TimeoutError(f"{go} did not appear within 60 s")
            time.sleep(0.01)
