"""Production of one split: giving each slot its next job, and publishing what was made.

Which seq each slot makes next (forward, reproduce, windows, node-local advances) is the
planner's business (planner.py). Here: a release or an acquire calls kick(), which gives every
idle slot its next job at once (backpressure without polling); what comes back is journaled,
then published to the split; failures back off (a full disk) or restart the slot (restarts.py:
at once the first time, then after a growing delay while it keeps failing). Nothing is made
while the split's journal cannot be written (journal/keeper.py).

Which backend makes the file (worker processes here, Ray actors elsewhere, a curriculum
composer) is the backend's business; nothing here depends on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from queue_client import errors
from queue_server.background import BackgroundTasks
from queue_server.journal.file import StaleOffset
from queue_server.journal.keeper import JournalKeeper
from queue_server.journal.records import Advanced, Produced
from queue_server.production.backend import (
    ProducedFile,
    ProduceFailed,
    ProduceJob,
    ProductionBackend,
    SlotDied,
)
from queue_server.production.planner import Job, Planner
from queue_server.production.restarts import SlotRestarts
from queue_server.signal import Signal
from queue_server.split.leases import LeaseTable
from queue_server.split.schedule import Schedule
from queue_server.split.state import FileEntry, SplitState

log = logging.getLogger("queue_server.production")

# Errors that mean "the disk is full or read-only", not "the provider is broken": production
# backs off and retries instead of counting a crash.
DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM}
_DISK_BACKOFF_S = (0.2, 5.0)


# Errors no restart mends: the config is wrong, or an input changed under the dataset (its
# files would mix two versions). The split fails at once instead of after every retry.
PERMANENT_KINDS = frozenset({"ConfigError", "ObjectChanged"})


class Production:
    def __init__(
        self,
        where: str,
        split: str,
        backend: ProductionBackend,
        state: SplitState,
        schedule: Schedule,
        leases: LeaseTable,
        keeper: JournalKeeper,
        files_dir: Path,
        changed: Signal,
        *,
        max_restarts: int,
        on_fatal: Callable[[str], None],
        job_overrides: Callable[[], tuple[tuple[int, float | None], ...]] = tuple,
        on_unavailable: Callable[[str | None], None] = lambda reason: None,
        verbose: bool = False,
        can_advance: bool = True,
        may_make: Callable[[int], bool] = lambda seq: True,
    ) -> None:
        self.where = where
        self.split = split
        self.backend = backend
        self.state = state
        self.schedule = schedule
        self.leases = leases
        self.keeper = keeper
        self.journal = keeper.journal
        self.files_dir = files_dir
        self.changed = changed
        self._job_overrides = job_overrides
        # The job's control plane lets a seq be made (steering/plane.py); one it holds back
        # is asked for there, and production is kicked once it may be made.
        self._may_make = may_make
        self.verbose = verbose
        self.slots = backend.slots
        self.plan = Planner(self.slots, schedule, state, can_advance=can_advance)
        # Forward seq -> the states before and after it, when its journal line could not be
        # written: the slot's stream is past it, so it is made again from the state before,
        # and journaled with the state after of the production that moved the stream (a
        # composer makes it again from its picks and has no state after to give).
        self._unjournaled: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        self.busy: set[int] = set()  # slots with a job, or down until their restart
        self.running: set[int] = set()  # slots started
        self._disk_backoff_until = 0.0
        self._disk_backoff_s = _DISK_BACKOFF_S[0]
        self._retry_armed = False
        self.stopped = False
        self.tasks = BackgroundTasks()
        self.restarts = SlotRestarts(
            self, max_restarts=max_restarts, on_fatal=on_fatal, on_unavailable=on_unavailable
        )
        backend.on_slot_exit = self.restarts.exited_idle

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def stateful(self) -> bool:
        return self.plan.stateful

    def resume(self, last_forward: dict[int, tuple[int, int]]) -> None:
        """Carry each slot's forward stream on after the last seq it journaled."""
        self.plan.resume(last_forward)

    async def start(self) -> None:
        """Start every slot at once: each worker's provider loads in its own process, and
        each makes its first file as soon as it has loaded, not once the slowest has."""

        async def start_then_make(slot: int) -> None:
            try:
                await self.start_slot(slot)
            except SlotDied as exc:
                # The slot's Ray actor died while it started (its node was removed, it was
                # killed): no error of the provider's, so not the dataset's failure either.
                # Restarted as a death while making a file is, within max_worker_restarts.
                self.busy.add(slot)  # no job for it meanwhile; failed() restarts it
                self.tasks.spawn(self.restarts.failed(slot, f"start: {exc}"))
                return
            self.kick()

        await asyncio.gather(*(start_then_make(slot) for slot in range(self.slots)))

    async def start_slot(self, slot: int) -> None:
        """Start a slot whose stream carries on after its last journaled forward file."""
        nxt = self.plan.next_forward[slot]
        s = self.state
        last = max(
            (
                seq
                for seq in itertools.chain(s.offsets, s.advanced, s.states_only)
                if seq % self.slots == slot and seq < nxt
            ),
            default=None,
        )
        state = None
        if last is not None:
            _, state = await self._read_states(last)
        self.plan.stateful = await self.backend.start_slot(slot, state or None)
        self.running.add(slot)

    async def _read_states(self, seq: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The journaled states around seq; a compaction may move its record meanwhile."""
        for _ in range(5):
            offset = self.state.state_offset(seq)
            if offset is None:
                return {}, {}
            try:
                return await asyncio.to_thread(self.journal.read_states, offset, seq)
            except StaleOffset:
                continue
        raise StaleOffset(f"{self.where}: seq {seq}'s journal record kept moving")

    def stop(self) -> None:
        """Make nothing more (the split closes or failed)."""
        self.stopped = True

    async def close(self) -> None:
        self.stopped = True
        await self.tasks.close()
        await self.backend.close()

    def kill(self) -> None:
        self.stopped = True
        self.backend.kill()

    # ---- what to make -------------------------------------------------------------------
    def want(self, seq: int, explicit: bool = False) -> None:
        """Make sure seq will be on disk (Planner.want)."""
        self.plan.want(seq, explicit)
        self.kick()

    def check_can_make(self, seq: int) -> None:
        """Refuse a seq a streaming provider can no longer make: read long ago, its state
        compacted out of the journal (only journal_keep_files files per rank are kept)."""
        if (
            not self.stateful
            or seq >= self.state.floor
            or seq in self.state.files
            or seq in self.plan.in_production
            or self.state.state_offset(seq) is not None
            or seq >= self.plan.next_forward[seq % self.slots]
        ):
            return
        raise errors.InvalidRequest(
            f"{self.where} seq {seq} can no longer be made: it was read long ago and its "
            "stream state was compacted out of the journal (the datasets.NAME."
            "journal_keep_files setting keeps that many files per rank behind the slowest "
            "rank); resume from a later checkpoint, or raise journal_keep_files"
        )

    def make_again(self, seq: int) -> None:
        """A quarantined seq: make it again from its journaled state."""
        self.plan.make_again(seq)

    def next_seq(self) -> int:
        return self.plan.next_seq()

    def kick(self) -> None:
        """Give every idle slot its next job, if any is due."""
        if self.stopped or self.state.leaving or not self.keeper.healthy:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._disk_backoff_until:
            # The timer that ends a backoff may fire a hair early (loops round to ms): re-arm.
            self._arm_retry(self._disk_backoff_until - loop.time())
            return
        held: dict[int, int] | None = None
        for slot in range(self.slots):
            if slot in self.busy or slot not in self.running:
                continue
            if held is None:
                held = self.leases.lowest_held()
            unleased = len(self.state.files) - len(self.leases)
            job = self.plan.next_job(slot, held, unleased)
            if job is not None and not self._may_make(job.seq):
                self.plan.put_back(job)
                continue
            if job is not None:
                self.busy.add(slot)
                self.plan.started(job)
                self.tasks.spawn(self._produce(slot, job))

    # ---- making it ----------------------------------------------------------------------
    async def _produce(self, slot: int, job: Job) -> None:
        seq = job.seq
        try:
            state = self._unjournaled[seq][0] if seq in self._unjournaled else None
            if job.again:
                state = {}
                if self.stateful:
                    state, _ = await self._read_states(seq)
            made = await self.backend.produce(
                slot,
                ProduceJob(
                    self.split,
                    seq,
                    state,
                    self.schedule.world_size,
                    self._job_overrides(),
                    publish=job.publish,
                ),
            )
        except (ProduceFailed, SlotDied) as exc:
            self.plan.finished(job, slot, journaled=False)
            self.busy.discard(slot)
            if isinstance(exc, ProduceFailed) and exc.errno in DISK_ERRNOS:
                self._disk_trouble(seq, str(exc))
            else:
                permanent = isinstance(exc, ProduceFailed) and exc.kind in PERMANENT_KINDS
                await self.restarts.failed(slot, f"seq {seq}: {exc}", permanent=permanent)
            return
        self.busy.discard(slot)
        if not job.publish and made.name:
            # A backend that ignores publish=False wrote the file: no rank here reads it.
            await asyncio.to_thread((self.files_dir / made.name).unlink, missing_ok=True)
        try:
            offset = self.keeper.append(self._record(slot, job, made))
        except OSError:
            # Journal first, memory after: an unjournaled file is removed and made again
            # once the journal can be written (the keeper probes it and kicks production).
            if made.name:
                await asyncio.to_thread((self.files_dir / made.name).unlink, missing_ok=True)
            if not job.again:
                self._unjournaled.setdefault(seq, (made.state_before, made.state_after))
            self.plan.finished(job, slot, journaled=False)
            return
        self.plan.finished(job, slot, journaled=True)
        self._unjournaled.pop(seq, None)
        self.restarts.succeeded(slot)
        self._disk_backoff_s = _DISK_BACKOFF_S[0]
        self.state.last_disk_error = ""
        if not job.again:
            prev = self.state.last_forward.get(slot)
            if prev is None or seq > prev[0]:
                self.state.last_forward[slot] = (seq, offset)
        if job.publish:
            self._publish(seq, offset, made)
        else:
            self.state.advanced[seq] = offset
        self.kick()

    def _record(self, slot: int, job: Job, made: ProducedFile) -> Produced | Advanced:
        if not job.again and job.seq in self._unjournaled:
            before, after = self._unjournaled[job.seq]
            made = dataclasses.replace(made, state_before=before, state_after=after)
        if not job.publish:
            return Advanced(job.seq, slot, made.state_before, made.state_after)
        return Produced(
            job.seq,
            made.name,
            made.size_bytes,
            made.crc32,
            slot,
            not job.again,
            made.state_before,
            made.state_after,
        )

    def _publish(self, seq: int, offset: int, made: ProducedFile) -> None:
        """A journaled file joins the split."""
        counters = self.state.counters
        if seq in self.state.offsets or seq < self.state.floor:
            counters.reproduced_files += 1
        else:
            counters.produced_files += 1
        counters.produced_bytes += made.size_bytes
        self.state.offsets[seq] = offset
        self.state.consumed.discard(seq)
        self.state.quarantined.discard(seq)
        self.state.files[seq] = FileEntry(seq, made.name, made.size_bytes, made.crc32)
        if self.verbose:
            log.info(
                "%s produced seq %d (%s, %d bytes)", self.where, seq, made.name, made.size_bytes
            )
        self.changed.notify()

    # ---- trouble ------------------------------------------------------------------------
    def _disk_trouble(self, seq: int, message: str) -> None:
        self.state.counters.disk_errors += 1
        delay = self._disk_backoff_s
        self._disk_backoff_s = min(self._disk_backoff_s * 2, _DISK_BACKOFF_S[1])
        self._disk_backoff_until = asyncio.get_running_loop().time() + delay
        self.state.last_disk_error = message
        log.warning(
            "%s: cannot write seq %d (%s); retrying in %.1fs", self.where, seq, message, delay
        )
        self._arm_retry(delay)

    def _arm_retry(self, delay: float) -> None:
        if not self._retry_armed:
            self._retry_armed = True
            asyncio.get_running_loop().call_later(max(0.0, delay) + 0.002, self._retry)

    def _retry(self) -> None:
        self._retry_armed = False
        self.kick()
