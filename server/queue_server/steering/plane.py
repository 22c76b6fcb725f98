"""One split's side of the job's control plane (steering/log.py over steering/store.py).

What it guarantees the split: production makes a seq only below this server's latest claim
(`allows`), so no file is made past a change this server has not read; every change in the
log is applied here in log order, at the seq the log gives it, checked with the code that
applies it; a change made here is in the store before it is acknowledged, and in this
server's journal as well. A server that cannot reach the store serves the files it has and
makes none past its claim: the split is reported unavailable with the reason (health, stats,
the trainer's NoBatchReady), and it carries on by itself once the store answers.

Every store call runs in the plane's own threads (one for reads and appends, in order; one
that blocks waiting for the next record), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

from queue_client import errors
from queue_server.background import BackgroundTasks
from queue_server.curriculum import changes as curriculum_changes
from queue_server.journal.records import AlphaChange, MixtureChange, StepSkip
from queue_server.mixture import changes as mixture_changes
from queue_server.signal import Signal
from queue_server.steering import skips
from queue_server.steering.daemon_thread import DaemonThread
from queue_server.steering.log import (
    ALPHA,
    CHANGES,
    CLAIM,
    MIXTURE,
    SKIP,
    SNAPSHOT_EVERY,
    ControlLog,
    Entry,
)
from queue_server.steering.port import SteeredSplit
from queue_server.steering.store import ControlStore

log = logging.getLogger("queue_server.steering")

# Seconds between tries to reach a store that does not answer (doubling up to the last).
_RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)
# A waiting watcher wakes this often to notice a store gone; a new record wakes it at once.
_WATCH_S = 60.0


class SplitPlane:
    def __init__(
        self,
        split: SteeredSplit,
        connect: Callable[[], ControlStore],
        prefix: str,
        address: str,
        *,
        round_size: Callable[[], int],
        files_per_window: Callable[[], int],
        on_unavailable: Callable[[str | None], None],
        kick: Callable[[], None],
        snapshot_every: int = SNAPSHOT_EVERY,
    ) -> None:
        self.split = split
        self._snapshot_every = snapshot_every
        self.address = address
        self._connect = connect
        self._prefix = prefix
        self._round_size = round_size
        self._files_per_window = files_per_window
        self._on_unavailable = on_unavailable
        self._kick = kick
        self.server_id = uuid.uuid4().hex[:12]
        self.log: ControlLog | None = None
        self._io = DaemonThread("control-log")
        self._watch_io = DaemonThread("control-watch")
        self._lock = asyncio.Lock()
        self.allowed_below = 0  # this server may make seqs below its latest claim
        self._wanted = -1
        self._wake = Signal()
        self.tasks = BackgroundTasks()
        self.error: str | None = "not connected to the control plane yet"
        self.diverged: str | None = None
        # The changes this server journaled before (replayed at open): the log's first
        # changes must be these; any the log lacks are published again.
        self._local = (
            [(MIXTURE, at, w) for at, w in split.mixture_changes]
            + [(ALPHA, at, a) for at, a in split.alpha_overrides]
            + [(SKIP, a, [a, b]) for a, b in split.skips]
        )
        self._local_seen = 0
        self.changes_read = 0
        self._refusals: dict[int, str] = {}  # a record left out: why, for its proposer
        self._reclaim = 0  # a claim to make again once a store started afresh has the changes
        self._stale = False  # the watcher lost the store: the main loop connects again

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._report()
        self.tasks.spawn(self._run())

    async def close(self) -> None:
        await self.tasks.close()
        self._io.shutdown(wait=False, cancel_futures=True)
        self._watch_io.shutdown(wait=False, cancel_futures=True)

    def allows(self, seq: int) -> bool:
        """Whether production may make `seq` now; if not, a claim for it is made."""
        if seq < self.allowed_below and self.diverged is None:
            return True
        if seq > self._wanted:
            self._wanted = seq
            self._wake.notify()
        return False

    def why(self) -> str:
        """Why production waits on the plane ("" when it does not)."""
        reason = self.diverged or self.error
        return f"the control plane at {self.address}: {reason}" if reason else ""

    @property
    def horizon(self) -> int:
        return self.log.horizon if self.log is not None else 0

    # ---- changes ------------------------------------------------------------------------
    async def propose(
        self,
        kind: str,
        value: Any,
        position: int | None,
        rank: int,
        extra: dict[str, Any] | None = None,
    ) -> int:
        """Append a change and apply every record up to it; returns its first seq."""
        if self.log is None or self.error is not None or self.diverged is not None:
            raise errors.ServerUnavailable(
                f"{self.split.where}: {self.why()}; nothing was changed, retry later"
            )
        record = {
            "kind": kind,
            "value": value,
            "position": position,
            "rank": rank,
            "world_size": self._round_size(),
            "files_per_window": self._files_per_window(),
            "by": self.server_id,
            **(extra or {}),
        }
        async with self._lock:
            try:
                read, own = await self._call(self.log.append, record)
            except Exception as exc:
                self._lost(exc)
                raise errors.ServerUnavailable(
                    f"{self.split.where}: the control plane at {self.address} did not take "
                    f"the change ({exc}); nothing was changed, retry later"
                ) from None
            for entry in read:
                await self._apply(entry)
            if not await self._apply(own):
                raise errors.InvalidRequest(
                    self._refusals.pop(own.index, None)
                    or f"{self.split.where}: the change cannot be applied after the changes "
                    "made meanwhile; see the server's log"
                )
        return own.at

    # ---- the plane's loop -----------------------------------------------------------------
    async def _run(self) -> None:
        attempt, connected = 0, False
        while True:
            try:
                if not connected:
                    await self._connect_log()
                    connected = True
                await self._sync()
                await self._republish()
                if self._reclaim:  # what this server may have made before the store restarted
                    await self._claim(self._reclaim)
                    self._reclaim = 0
                self.error = None
                self._report()
                attempt = 0
                await self._claim_when_wanted()
            except asyncio.CancelledError:
                raise
            except _Reconnect:
                connected = False  # the watcher lost the store: connect again, and check it
            except Exception as exc:
                self._lost(exc)
                connected = False  # a store that went away is connected to afresh
                await asyncio.sleep(_RETRY_S[min(attempt, len(_RETRY_S) - 1)])
                attempt += 1

    async def _connect_log(self) -> None:
        """Connect (again). A store that lost the records read already was started afresh:
        its log is read from 0 again, this server's changes are published again, and its
        claim is made again before it makes anything more."""
        store = await self._call(self._connect)
        if self.log is None:
            self.log = ControlLog(store, self._prefix, self._snapshot_every)
            self.tasks.spawn(self._watch())
            return
        self.log.store = store
        if not await self._call(self.log.same_store):
            log.warning(
                "%s: the control plane at %s holds none of the %d records read before: it was "
                "started afresh; publishing this server's changes to it again",
                self.split.where, self.address, self.log.length,
            )  # fmt: skip
            self.log.restart()
            self._local_seen = 0
            self._reclaim, self.allowed_below = self.allowed_below, 0

    async def _claim_when_wanted(self) -> None:
        """Claim the round of each seq production asks for, once it asks."""
        while True:
            if self._stale:
                self._stale = False
                raise _Reconnect
            if self.diverged is None and self._wanted >= self.allowed_below:
                w = max(1, self._round_size())
                await self._claim(w * (self._wanted // w + 1))
                self._kick()
                continue
            await self._wake.wait(None)

    async def _claim(self, horizon: int) -> None:
        """Append a claim below which this server may make seqs, having read every record."""
        assert self.log is not None
        async with self._lock:
            read, own = await self._call(
                self.log.append, {"kind": CLAIM, "horizon": horizon, "by": self.server_id}
            )
            for entry in read:
                await self._apply(entry)
            self.allowed_below = max(self.allowed_below, own.at)

    async def _watch(self) -> None:
        """Read each record as soon as it is appended (stats see a change at once), on a
        connection of its own (connected again after a failure)."""
        store: ControlStore | None = None
        while True:
            assert self.log is not None
            try:
                if store is None:
                    store = await self._call(self._connect, executor=self._watch_io)
                key = self.log.key(self.log.length)
                appended = await self._call(store.wait, key, _WATCH_S, executor=self._watch_io)
                if appended:
                    await self._sync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._lost(exc)
                store = None
                self._stale = True  # the main loop connects again too (the store may be new)
                self._wake.notify()
                await asyncio.sleep(_RETRY_S[-1])

    async def _sync(self) -> None:
        assert self.log is not None
        async with self._lock:
            fresh = not self.log.length
            for entry in await self._call(self.log.read_new):
                await self._apply(entry)
            if fresh and self.log.started_at:
                log.info(
                    "%s: control log read from its snapshot at record %d (%d changes in it)",
                    self.split.where, self.log.started_at, self.log.changes_known,
                )  # fmt: skip

    async def _republish(self) -> None:
        """Changes this server journaled that the log lacks (its store was started afresh):
        appended again with their seqs, in order, before this server claims anything."""
        assert self.log is not None
        while self.diverged is None and self._local_seen < len(self._local):
            kind, at, value = self._local[self._local_seen]
            if at < self.log.horizon:
                log.warning(
                    "%s: the control plane lacks this server's change from seq %d while seqs "
                    "up to %d were claimed: servers that made them did so without it",
                    self.split.where, at, self.log.horizon,
                )  # fmt: skip
            record = {"kind": kind, "value": value, "at": at, "rank": 0, "by": self.server_id}
            async with self._lock:
                read, own = await self._call(self.log.append, record)
                for entry in [*read, own]:
                    await self._apply(entry)

    # ---- applying a record ----------------------------------------------------------------
    async def _apply(self, entry: Entry) -> bool:
        """Apply one record in log order; False for a change left out (named in the log)."""
        if entry.kind == CLAIM or entry.kind not in CHANGES:
            return True
        self.changes_read += 1
        if self._local_seen < len(self._local):
            expected = self._local[self._local_seen]
            kind, at, payload = expected
            same = entry.kind == kind and entry.payload == payload
            if not same or (kind != SKIP and entry.at != at):
                self.diverged = (
                    f"its change #{entry.index} ({entry.kind} from seq {entry.at}: "
                    f"{entry.payload}) differs from this server's journal ({expected[0]} from "
                    f"seq {expected[1]}: {expected[2]}); make no file until the two agree: "
                    "start this server on a fresh data root, or the store afresh"
                )
                self._report()
                return False
            self._local_seen += 1
            return True
        split = self.split
        if entry.kind == MIXTURE:
            refused = await asyncio.to_thread(
                mixture_changes.why_not_applied, split, entry.at, entry.payload
            )
            if refused:
                log.error("%s: control plane record %d: %s", split.where, entry.index, refused)
                return False
            split.mixture_changes.append((entry.at, entry.payload))
            self._journal(MixtureChange(entry.at, entry.payload, entry.rank))
        elif entry.kind == SKIP:
            a, b = (int(x) for x in entry.payload)
            record = entry.record
            earliest = skips.earliest_step(
                entry.at,
                record.get("position"),
                int(record.get("position_step", 0)),
                int(record.get("world_size", 1)),
                int(record.get("batches_per_file", split.config.batches_per_file)),
            )
            if a < earliest and record.get("at") is None:
                self._refusals[entry.index] = skips.too_early(split.where, a, earliest)
                log.error("%s: control plane record %d: %s", split.where, entry.index,
                          self._refusals[entry.index])  # fmt: skip
                return False
            split.skips.append((a, b))
            self._journal(StepSkip(a, b, entry.rank))
        else:
            _, out_of_range = curriculum_changes.replayable(
                [AlphaChange(entry.at, entry.payload, entry.rank)]
            )
            if out_of_range:
                log.error(
                    "%s: control plane record %d: %s", split.where, entry.index, out_of_range[0]
                )
                return False
            split.alpha_overrides.append((entry.at, entry.payload))
            self._journal(AlphaChange(entry.at, entry.payload, entry.rank))
        placed = int(entry.payload[0]) if entry.kind == SKIP else entry.at
        self._local.append((entry.kind, placed, entry.payload))
        self._local_seen += 1
        log.info(
            "%s: %s %s from seq %d on (control plane record %d)",
            split.where, entry.kind, entry.payload, entry.at, entry.index,
        )  # fmt: skip
        return True

    def _journal(self, record: AlphaChange | MixtureChange | StepSkip) -> None:
        """The local copy (a restart replays it, and republishes it to a fresh store)."""
        try:
            self.split.append_record(record)
        except errors.ServerUnavailable as exc:  # the store has it; a restart reads it there
            log.warning("%s: %s", self.split.where, exc)

    # ---- plumbing -----------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any, executor: Any = None) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor or self._io, fn, *args)

    def _lost(self, exc: BaseException) -> None:
        reason = f"cannot reach it ({type(exc).__name__}: {exc})"
        if reason != self.error:
            log.warning("%s: the control plane at %s: %s", self.split.where, self.address, reason)
        self.error = reason
        self._report()

    def _report(self) -> None:
        reason = self.diverged or self.error
        self._on_unavailable(
            None if reason is None else f"the control plane at {self.address}: {reason}"
        )


class _Reconnect(Exception):
    """The watcher lost its connection: the main loop connects again and checks the store."""
