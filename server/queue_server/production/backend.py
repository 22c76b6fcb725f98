"""The seam between deciding what to make and making it.

Production (production.py) decides which seq each slot makes next, journals what was made and
publishes it to the split; a backend only makes files. A batch file is a pure function of
(dataset config, split, seq, journaled stream state), so which slot, process or machine makes
seq N does not change a byte of it. Backends: worker processes on this machine
(process_pool.py), a curriculum composer (curriculum/lane.py), and Ray actors (ray_backend.py).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerPlace:
    """Where one process that makes a split's files runs, as GetStats shows it (workers).

    role: "provider", "composer" or "candidates" (a curriculum split's candidate provider).
    backend: "local" (a process of this machine) or "ray" (an actor on node node_id).
    pid: on its own node, 0 while not running. restarts: how often the slot's actor was made
    again (after a death, a lost node, a cluster gone).
    """

    role: str
    index: int
    backend: str = "local"
    pid: int = 0
    node_id: str = ""
    restarts: int = 0


@dataclass(frozen=True)
class ProduceJob:
    """Make file `seq` of `split`.

    state: None to go on with the slot's own forward stream; a journaled stream state to make
    an old seq again (a rewind, a quarantine, a lost file), after which the slot's forward
    stream must be as it was. world_size and overrides matter to a curriculum composer only.

    publish: False to "advance": make the file's batches, so the forward stream moves past
    seq exactly as if it had been made, but write nothing, and return the states with name ""
    and size 0. A streaming provider on a node-local server passes other ranks' seqs this
    way. Only sent to slots whose provider streams (start_slot returned True); a curriculum
    stream composes the seq (its picks are journaled) and writes nothing.
    """

    split: str
    seq: int
    state: dict[str, Any] | None = None
    world_size: int = 1
    overrides: tuple[tuple[int, float | None], ...] = ()
    publish: bool = True


@dataclass(frozen=True)
class ProducedFile:
    """A file the backend published into the split's directory, and the stream state before
    and after it (journaled, so the same file can be made again). For a job with publish
    False, name is "" and size_bytes and crc32 are 0."""

    seq: int
    name: str
    size_bytes: int
    crc32: int
    state_before: dict[str, Any] = field(default_factory=dict)
    state_after: dict[str, Any] = field(default_factory=dict)


class ProduceFailed(Exception):
    """The provider raised while making a file; the slot is still usable.

    errno is set for OS errors (ENOSPC and friends mean a disk problem, not a broken provider);
    kind is the exception's class name (ConfigError means the config is wrong)."""

    def __init__(self, message: str, errno: int = 0, kind: str = "") -> None:
        super().__init__(message)
        self.errno = errno
        self.kind = kind


class SlotDied(Exception):
    """The slot's process or actor is gone; production restarts it with the journaled state."""


class BackendUnavailable(Exception):
    """The engine behind a backend (a Ray cluster) cannot be reached now. Production does not
    count it as a provider failure: it retries with backoff, and the dataset reports
    NOT_SERVING with the reason until a slot starts again."""


class ProductionBackend(abc.ABC):
    """Makes the files of one split. Slot i of `slots` is one producer with its own stream."""

    #: How many files can be in production at once.
    slots: int = 1
    #: Called on the event loop with a slot's index when it dies while idle.
    on_slot_exit: Callable[[int], None] | None = None
    #: Called on the event loop with why production waits for its engine (a Ray actor that no
    #: node has room for, and for how long), again as the wait goes on, and None when it ends.
    on_stalled: Callable[[str | None], None] | None = None

    @abc.abstractmethod
    async def start_slot(self, slot: int, state: dict[str, Any] | None) -> bool:
        """Start (or restart) one slot whose forward stream continues from `state` (None: from
        the beginning). Returns whether the provider streams (journals a state per file)."""

    @abc.abstractmethod
    async def produce(self, slot: int, job: ProduceJob) -> ProducedFile:
        """Make one file. Raises ProduceFailed or SlotDied."""

    @abc.abstractmethod
    async def stop_slot(self, slot: int) -> None:
        """Stop one slot (before a restart); a no-op if it is not running."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop every slot; files in flight are finished or removed."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop every slot now (the dataset failed)."""

    def pids(self) -> list[int]:
        """Process ids of this machine's producer processes, for stats."""
        return []

    def workers(self) -> list[WorkerPlace]:
        """Every producer process or actor and where it runs, for stats."""
        return [WorkerPlace("provider", i, pid=pid) for i, pid in enumerate(self.pids())]

    def stats(self) -> dict[str, Any] | None:
        """Backend-specific stats (a curriculum composer's), or None."""
        return None

    def why_slow(self) -> str:
        """A hint for a timeout message when the backend knows why files are late."""
        return ""
