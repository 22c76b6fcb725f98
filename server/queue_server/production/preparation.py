"""Progress lines while a worker prepares a dataset: meta, tokenizer, indexes, input hashes.

A first build of a large dataset runs for minutes inside one worker process (hashing the
inputs, building a tokenizer, tokenizing into cached arrays), and without a word the server
looks hung. `Preparation` says what the worker is doing and how far it got, at most one line
every PROGRESS_INTERVAL_S, through the worker's logging (the server's stderr, the server's
line format): the time so far and the bytes the process has read (Linux's /proc/self/io),
beside the size of the inputs when it is known.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

log = logging.getLogger("queue_server.prepare")

PROGRESS_INTERVAL_S = 5.0
_PROC_IO = Path("/proc/self/io")


def bytes_read() -> int | None:
    """Bytes this process has read so far (every read call, page cache included), or None
    where the platform does not say."""
    try:
        with open(_PROC_IO, "rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def input_bytes(inputs: Iterable[object]) -> int | None:
    """The total size of a provider's inputs (local paths, or objects with a `size`), or None
    when none can be sized; an input that cannot be sized is left out, never an error here."""
    total, known = 0, False
    for item in inputs:
        size = getattr(item, "size", None)
        if not isinstance(size, int):
            try:
                size = os.stat(item).st_size if isinstance(item, (str, Path)) else None
            except OSError:
                size = None
        if isinstance(size, int):
            total, known = total + size, True
    return total if known else None


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class Preparation:
    """`with Preparation("dataset web: building meta") as prep:` around a long step.

    `announce` logs a first line at once (for a step that runs once per dataset build);
    otherwise the first line comes after PROGRESS_INTERVAL_S, so a quick step says nothing.
    Set `stage` as the step moves on; the next progress line names it. A step that needed a
    progress line ends with one saying how long it took. `quiet` says nothing at all (the
    other workers of a split, whose first worker speaks for them).
    """

    def __init__(
        self,
        what: str,
        *,
        announce: bool = False,
        quiet: bool = False,
        total_bytes: int | None = None,
        interval_s: float = PROGRESS_INTERVAL_S,
    ) -> None:
        self.what = what
        self.stage = ""
        self.total_bytes = total_bytes
        self._announce = announce and not quiet
        self._quiet = quiet
        self._interval_s = interval_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._began = 0.0
        self._read_at_start: int | None = None
        self._lines = 0

    def __enter__(self) -> Preparation:
        self._began = time.monotonic()
        self._read_at_start = bytes_read()
        if self._announce:
            inputs = (
                "" if self.total_bytes is None else f" (inputs: {human_bytes(self.total_bytes)})"
            )
            log.info("%s%s", self.what, inputs)
        if self._quiet:
            return self
        self._thread = threading.Thread(target=self._report, name="prepare-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self._lines and kind is None:
            log.info("%s: done in %.0f s", self.what, time.monotonic() - self._began)

    def _report(self) -> None:
        while not self._done.wait(self._interval_s):
            log.info("%s", self.line())
            self._lines += 1

    def line(self) -> str:
        """What the step is doing and how far it got."""
        parts = [f"{time.monotonic() - self._began:.0f} s so far"]
        now = bytes_read()
        if now is not None and self._read_at_start is not None:
            read = f"{human_bytes(now - self._read_at_start)} read"
            if self.total_bytes is not None:
                read += f" (inputs: {human_bytes(self.total_bytes)})"
            parts.append(read)
        stage = f": {self.stage}" if self.stage else ""
        return f"{self.what}{stage}, {', '.join(parts)}"
