"""Consumption rates over a sliding window that survives a server restart.

Why: a trainer's tokens/s is what an operator watches. Counting consumed files between two
GetStats calls shows 0/s for as long as a restarted server regenerates its files, although
the trainer ran at full speed a moment before. So each split keeps the files consumed per
wall-clock second over the last WINDOW_S seconds, and writes them (atomic_write, in a thread,
at most every SAVE_EVERY_S) to `<dataset>/stats/<split>.throughput.json`: a restarted server
reads them back and its rates go on from where they were, falling off only as the window
slides past the downtime.

`ThroughputWindow` is the pure arithmetic (time is passed in); `Throughput` binds one to its
file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from queue_client.format.layout import atomic_write, temp_owner_pid

log = logging.getLogger("queue_server.throughput")

WINDOW_S = 60.0
SAVE_EVERY_S = 1.0
_FORMAT = 1
# A rate is never taken over less than this: one file in the first millisecond is not 1000/s.
_MIN_SPAN_S = 1.0


@dataclass
class ThroughputWindow:
    """Files consumed per whole wall-clock second, over the last `window_s` seconds."""

    window_s: float = WINDOW_S
    # Wall time of the first consumption ever recorded: a young window is not diluted.
    since: float | None = None
    buckets: dict[int, int] = field(default_factory=dict)

    def add(self, now: float, files: int = 1) -> None:
        if self.since is None or self.since > now:
            self.since = now
        second = math.floor(now)
        self.buckets[second] = self.buckets.get(second, 0) + files
        self._prune(now)

    def _prune(self, now: float) -> None:
        start = now - self.window_s
        stale = [s for s in self.buckets if s + 1 <= start or s > now + self.window_s]
        for s in stale:  # at most window_s + 1 buckets: no per-file loop
            del self.buckets[s]

    def rate(self, now: float) -> tuple[float, float]:
        """(files per second, the seconds that rate covers); (0, 0) before any consumption."""
        if self.since is None:
            return 0.0, 0.0
        start = now - self.window_s
        files = sum(n for s, n in self.buckets.items() if start < s + 1 and s <= now)
        span = max(now - max(start, self.since), _MIN_SPAN_S)
        return files / span, span

    def to_json(self) -> bytes:
        doc = {
            "format": _FORMAT,
            "window_s": self.window_s,
            "since": self.since,
            "buckets": sorted(self.buckets.items()),
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, window_s: float = WINDOW_S) -> ThroughputWindow:
        """The window a file holds; ValueError for anything but this module's own format."""
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError("not a throughput record of this version")
        since = doc.get("since")
        if since is not None and not (isinstance(since, (int, float)) and math.isfinite(since)):
            raise ValueError(f"since is {since!r}")
        buckets: dict[int, int] = {}
        for item in doc.get("buckets", []):
            if not (
                isinstance(item, list)
                and len(item) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
                and item[1] >= 0
            ):
                raise ValueError(f"bucket {item!r} is not [second, files]")
            buckets[item[0]] = item[1]
        return cls(window_s, None if since is None else float(since), buckets)


class Throughput:
    """One split's window and its file: loaded once, saved off the event loop."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.window = ThroughputWindow()
        self._clock = clock
        self._loaded = False
        self._load_lock = asyncio.Lock()
        self._dirty = False
        self._saving: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._saved_at = -SAVE_EVERY_S

    async def load(self) -> None:
        """Read the window the last server left; a missing or unreadable file starts empty."""
        async with self._load_lock:
            if self._loaded:
                return
            try:
                data = await asyncio.to_thread(_read_and_tidy, self.path)
                loaded = None if data is None else ThroughputWindow.from_json(data)
            except (OSError, ValueError) as exc:
                log.warning("%s cannot be read (%s): its rates start afresh", self.path, exc)
                loaded = None
            if loaded is not None:
                # What was consumed while it loaded stays counted.
                for second, files in self.window.buckets.items():
                    loaded.buckets[second] = loaded.buckets.get(second, 0) + files
                if self.window.since is not None:
                    loaded.since = min(loaded.since or self.window.since, self.window.since)
                self.window = loaded
            self._loaded = True
            if self._dirty:
                self._save_soon()

    def consumed(self, files: int = 1) -> None:
        self.window.add(self._clock(), files)
        self._dirty = True
        self._save_soon()

    def rate(self) -> tuple[float, float]:
        """(files per second, the seconds it covers), as of now."""
        return self.window.rate(self._clock())

    def _save_soon(self) -> None:
        """Save now, or once SAVE_EVERY_S has passed since the last save: at most one write
        a second however fast files are consumed, and never on the event loop."""
        if not self._loaded or self._timer is not None:
            return
        if self._saving is not None and not self._saving.done():
            return  # it saves again when it ends, if anything changed meanwhile
        loop = asyncio.get_running_loop()
        wait = self._saved_at + SAVE_EVERY_S - loop.time()
        if wait > 0:
            self._timer = loop.call_later(wait, self._timer_fired)
            return
        self._saving = loop.create_task(self._save())

    def _timer_fired(self) -> None:
        self._timer = None
        self._save_soon()

    async def _save(self) -> None:
        self._dirty = False
        try:
            await asyncio.to_thread(_write, self.path, self.window.to_json())
        except OSError as exc:
            log.warning("cannot save %s (rates start afresh after a restart): %s", self.path, exc)
        self._saved_at = asyncio.get_running_loop().time()
        # This task is over as far as _save_soon is concerned: a file consumed during the write
        # must schedule the next save, not be taken for "a save is running, it will see it".
        self._saving = None
        if self._dirty:
            self._save_soon()


def _read_and_tidy(path: Path) -> bytes | None:
    """The file's bytes (None when absent), after removing temp files that a save cut short
    by a crash left: those of other processes; this one's may be being written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(path.parent):
        owner = temp_owner_pid(entry.name)
        if owner is not None and owner != os.getpid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)


__all__ = ["SAVE_EVERY_S", "WINDOW_S", "Throughput", "ThroughputWindow"]
