"""The progress bar of a prepare run: input bytes done of the total (for the ETA), tokens
written and tokens per second, drawn by rich on stderr; or nothing, when not wanted."""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any


class PrepareProgress:
    def __init__(self, total_bytes: int, done_bytes: int, *, enabled: bool) -> None:
        self.total_bytes = max(total_bytes, 1)
        self.done_bytes = done_bytes
        self.tokens = 0
        self._began = time.monotonic()
        self._progress: Any = None
        self._task: Any = None
        self._enabled = enabled

    def __enter__(self) -> PrepareProgress:
        if not self._enabled:
            return self
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]preparing"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[tokens]} tokens, {task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._progress.__enter__()
        self._task = self._progress.add_task(
            "prepare",
            total=self.total_bytes,
            completed=self.done_bytes,
            tokens="0",
            rate="- tokens/s",
        )
        return self

    def advance(self, input_bytes: int, tokens: int) -> None:
        self.done_bytes += input_bytes
        self.tokens += tokens
        if self._progress is not None:
            self._progress.update(
                self._task,
                advance=input_bytes,
                tokens=f"{self.tokens:,}",
                rate=f"{self.rate() / 1e6:.2f} M tokens/s",
            )

    def rate(self) -> float:
        """Tokens per second of this run so far."""
        return self.tokens / max(time.monotonic() - self._began, 1e-9)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.__exit__(kind, exc, tb)
