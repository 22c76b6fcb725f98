"""One split of one dataset: wires its schedule, leases, production and journal together.

The jobs live next door: schedule.py (which seq each rank reads, windows), split/leases.py (who
holds which file, until when), production/ (which seq each slot makes next; the backend that
makes it), journal/ (the records that survive a crash; disk vs journal at start). This class
answers acquire, renew and release; opening.py opens it from disk, removal.py takes files out
of it, and steering changes (SetMixture, SetCurriculum, SkipSteps) work through its port
(steering/port.py). It runs on the event loop and never blocks it: files are made in other
processes, deletes run in a thread, and waiting is on a Signal, not on sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from queue_client import errors
from queue_client.format.layout import DatasetLayout
from queue_server.background import BackgroundTasks
from queue_server.config.served_ranks import EVERY_RANK, ServedRanks
from queue_server.config.server import DatasetConfig
from queue_server.journal.file import Journal
from queue_server.journal.keeper import JournalKeeper
from queue_server.journal.reconcile import remove_unjournaled
from queue_server.journal.records import Record
from queue_server.mixture.config import is_mixture
from queue_server.mixture.stats import MixtureView
from queue_server.production.backend import ProductionBackend, WorkerPlace
from queue_server.production.producer import Production
from queue_server.signal import Signal
from queue_server.split import opening, removal
from queue_server.split.leases import Lease, LeaseDirectory, LeaseTable, ReleaseOutcome
from queue_server.split.schedule import Schedule
from queue_server.split.state import Counters, FileEntry, SplitState
from queue_server.split.stats import SplitSnapshot, snapshot

if TYPE_CHECKING:
    from queue_server.steering.plane import SplitPlane


class SplitQueue:
    def __init__(
        self,
        config: DatasetConfig,
        split: str,
        layout: DatasetLayout,
        lease_ttl_s: float,
        backend: ProductionBackend,
        on_fatal: Callable[[str], None],
        *,
        on_unavailable: Callable[[str, str | None], None] = lambda source, reason: None,
        directory: LeaseDirectory[SplitQueue] | None = None,
        verbose: bool = False,
        candidates: bool = False,
        served: ServedRanks = EVERY_RANK,
        gated: bool = False,
        on_first_acquire: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.split = split
        self.where = f"{config.name}/{split}" + (" candidates" if candidates else "")
        # A curriculum split is produced by a composer backend; its candidates are a
        # SplitQueue of their own (candidates=True) in candidates/<split>.
        self.is_candidates = candidates
        self.curriculum = (
            config.selection == "curriculum"
            and split in config.curriculum.splits
            and not candidates
        )
        self.dir = layout.files_dir(split, candidates)
        self.quarantine = layout.quarantine_dir(split, candidates)
        self.journal = Journal(layout.journal_file(split, candidates))
        self.state = SplitState()
        self._on_unavailable = on_unavailable
        self.keeper = JournalKeeper(
            self.journal,
            self.where,
            self.state,
            self._journal_trouble,
            compact_records=config.journal_compact_records,
            keep_files=config.journal_keep_files,
            slots=lambda: self.production.slots,
            # Only the ranks served here read (and so settle) seqs of this split.
            ranks=lambda w: range(w) if served.all else sorted(served.ranks or ()),
        )
        # Node-local (server.ranks): only these ranks' files are made and leased here.
        self.served = served
        self.schedule = Schedule(
            config.mode,
            config.max_backlog_files,
            config.max_lead,
            world_size=served.world_size or 1,
            served=served,
        )
        self._leases_changed = Signal()
        self.leases = LeaseTable(
            self.where,
            lease_ttl_s,
            clock=lambda: asyncio.get_running_loop().time(),
            on_add=self._lease_added,
            on_remove=self._lease_removed,
        )
        self._directory = directory
        self.changed = Signal()
        # SetCurriculum calls, in call order: (first seq, alpha or None for "the schedule").
        self.alpha_overrides: list[tuple[int, float | None]] = []
        # A mixture's SetMixture calls, in call order: (first seq, weights or None).
        self.mixture = is_mixture(config.provider) and not candidates
        self.mixture_changes: list[tuple[int, dict[str, float] | None]] = []
        self.mixture_view: MixtureView | None = None  # set by the dataset, from its meta
        self.steering_lock = asyncio.Lock()  # SetMixture/SetCurriculum: one at a time
        self.plane: SplitPlane | None = None  # the job's control plane (attach_plane)
        self.skips: list[tuple[int, int]] = []  # SkipSteps: global steps [a, b) left out
        self.production = Production(
            self.where,
            split,
            backend,
            self.state,
            self.schedule,
            self.leases,
            self.keeper,
            self.dir,
            self.changed,
            max_restarts=config.max_worker_restarts,
            on_fatal=on_fatal,
            job_overrides=lambda: tuple(
                self.mixture_changes if self.mixture else self.alpha_overrides  # type: ignore[arg-type]
            ),
            on_unavailable=lambda reason: on_unavailable("production", reason),
            verbose=verbose,
            may_make=lambda seq: self.plane is None or self.plane.allows(seq),
        )
        # A backend that waits for room on its engine (a Ray node) says so, and for how long.
        backend.on_stalled = lambda reason: on_unavailable("placement", reason)
        self.tasks = BackgroundTasks()  # ends with the split: lease reaping, files leaving
        self._failed: str | None = None
        self._closed = False
        # Acquire waits until the dataset checked the inputs (`gated`); a lazy split's
        # production starts on its first acquire (on_first_acquire, dataset.py).
        self.gate = opening.StartGate(gated, on_first_acquire)
        self.reconciled = False  # set once open() read the journal and the directory

    @property
    def files(self) -> dict[int, FileEntry]:
        return self.state.files

    @property
    def counters(self) -> Counters:
        return self.state.counters

    def _lease_added(self, lease_id: str) -> None:
        if self._directory is not None:
            self._directory.add(lease_id, self)
        self._leases_changed.notify()

    def _lease_removed(self, lease_id: str, why: str) -> None:
        if self._directory is not None:
            self._directory.discard(lease_id, why)

    # ---- lifecycle -----------------------------------------------------------------------
    async def open(self, start_production: bool = True) -> None:
        """Reconcile the directory with the journal (compacting a long one) and carry its
        state on (opening.py), then start production (or leave that to start_production)."""
        await opening.restore(self)
        self.tasks.spawn(self._reap_leases())
        if start_production:
            await self.start_production()

    def attach_plane(self, plane: SplitPlane) -> None:
        """Steer through the job's control plane from now on (after open: it compares the
        log with the changes this split's journal replayed)."""
        self.plane = plane
        plane.start()

    async def start_production(self) -> None:
        """Start the split's workers (once): at open, or later for a split started lazily."""
        if self.gate.production_started:
            return
        self.gate.production_started = True
        await self.production.start()

    def allow_serving(self) -> None:
        """The dataset's inputs were checked: acquire may hand out files now."""
        self.gate.allowed.set()
        self.changed.notify()

    async def _wait_allowed(self, deadline: float) -> None:
        """Ask for production once, then wait (up to the deadline) until serving is allowed."""
        self.gate.first_acquire()
        while not self.gate.allowed.is_set():
            self._check_serving()
            if not await self._wait(deadline):
                raise errors.NoBatchReady(
                    f"{self.where} is still checking its inputs against meta; retry shortly"
                )

    async def close(self) -> None:
        self._closed = True
        if self.plane is not None:
            await self.plane.close()
        self.production.stop()
        await self.tasks.close()
        await self.production.close()
        # Its workers are gone, so nothing publishes any more; only with a journal that was
        # read and written without trouble is the state the whole truth about the directory.
        if self.reconciled and not self.state.journal_error and not self.keeper.lost:
            await asyncio.to_thread(remove_unjournaled, self.dir, self.state)
        await self.keeper.close()
        for lease in self.leases.all():
            self.leases.drop(lease, "ended as the server shut down")
        self.journal.close()
        self.changed.notify()

    def fail(self, message: str) -> None:
        self._failed = message
        self.production.kill()
        self.changed.notify()

    def worker_pids(self) -> list[int]:
        return self.production.backend.pids()

    def workers(self) -> list[WorkerPlace]:
        return self.production.backend.workers()

    def _check_serving(self) -> None:
        if self._failed is not None:
            raise errors.ProviderFailed(f"dataset {self.config.name!r} failed: {self._failed}")
        if self._closed:
            raise errors.ServerUnavailable("the server is shutting down")
        if self.state.journal_error:
            raise errors.ServerUnavailable(
                f"{self.where} hands out no file while its journal cannot be written: "
                f"{self.state.journal_error}"
                + ("" if self.keeper.lost else " (it serves again by itself once writes succeed)")
            )

    def _journal_trouble(self, reason: str | None) -> None:
        """The journal cannot be written (reason) or can again (None)."""
        self._on_unavailable("journal", reason)
        self.changed.notify()
        if reason is None:
            self.production.kick()

    # ---- leases ---------------------------------------------------------------------------
    async def acquire(
        self,
        rank: int,
        world_size: int,
        client_id: str,
        seq: int | None,
        wait_s: float,
        carried: bool = False,
        pin: bool = False,
    ) -> tuple[Lease, FileEntry]:
        """Lease file `seq` (the rank's next when None), waiting up to wait_s for it.

        With `pin` (a client taking back a lease lost in a server restart, or the curriculum
        composer's hold on a candidate) the request moves the rank's window only forward:
        fetching an old file again is not a rewind, so nothing after it is made again."""
        self._check_serving()
        if not client_id:
            raise errors.InvalidRequest("client_id is empty: each client process sends its own id")
        world = self.schedule.check(rank, world_size, seq, carried)
        deadline = asyncio.get_running_loop().time() + wait_s
        if not self.gate.passed:
            await self._wait_allowed(deadline)
        self.schedule.adopt(world_size, self.leases.world_sizes(), self.where)
        if not self.schedule.deterministic:
            return await self._acquire_any(rank, world_size, client_id, deadline)
        if seq is None:
            seq = self.schedule.next_for(rank)
        self.schedule.note_request(rank, seq, pin)
        while True:
            self._check_serving()
            entry = self.state.files.get(seq)
            if entry is not None:
                lease = self.leases.grant(seq, rank, world_size, client_id)
                # The request may have moved windows (a new world size, a rank further on):
                # production may run on now, not only at the next release.
                self.production.kick()
                return lease, entry
            self.production.check_can_make(seq)
            self.production.want(seq, explicit=not world.owns(seq))
            if not await self._wait(deadline):
                raise errors.NoBatchReady(
                    f"no file for {self.where} seq {seq} (rank {rank}) became ready within "
                    f"{wait_s:.1f}s{self._window_shut(rank, seq)}{self.why_slow()}"
                )

    async def _acquire_any(
        self, rank: int, world_size: int, client_id: str, deadline: float
    ) -> tuple[Lease, FileEntry]:
        """Best effort: the lowest ready seq, unless this rank is max_lead files ahead."""
        wait_s = deadline - asyncio.get_running_loop().time()
        while True:
            self._check_serving()
            if self.schedule.may_take(rank):
                ready = [s for s in self.state.files if self.leases.holder(s) is None]
                if ready:
                    entry = self.state.files[min(ready)]
                    return self.leases.grant(entry.seq, rank, world_size, client_id), entry
            self.production.kick()
            if not await self._wait(deadline):
                raise errors.NoBatchReady(
                    f"no file for {self.where} (rank {rank}) became ready within "
                    f"{wait_s:.1f}s{self.why_slow()}"
                )

    async def _wait(self, deadline: float) -> bool:
        """Wait for the next change; False once the deadline has passed."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return False
        await self.changed.wait(remaining)
        return True

    def _window_shut(self, rank: int, seq: int) -> str:
        held = [lease.seq for lease in self.leases.all() if lease.rank == rank]
        slots = self.production.plan.next_forward  # each slot's next seq: made in seq order
        return self.schedule.window_shut(rank, seq, held, self.leases.lowest_held(), slots)

    def why_slow(self) -> str:
        backend = self.production.backend.why_slow()
        if backend:
            return f"; {backend}"  # a curriculum's provider workers are the ones stuck
        if self.state.journal_error:
            return f"; {self.state.journal_error}"
        if self.plane is not None and self.plane.why():
            return f"; no file is made past seq {self.plane.allowed_below} while {self.plane.why()}"
        if self.state.last_disk_error:
            return f"; the provider cannot write: {self.state.last_disk_error}"
        if self.state.last_error:
            return f"; the provider's last error: {self.state.last_error}"
        return ""

    def renew(self, lease_id: str, client_id: str) -> bool:
        return self.leases.renew(lease_id, client_id)

    def release(self, lease_id: str, client_id: str, outcome: int, reason: str) -> None:
        lease = self.leases.check_release(lease_id, client_id, outcome)
        entry = self.state.files[lease.seq]
        why = f"released as {ReleaseOutcome(outcome).name}"
        if outcome == ReleaseOutcome.CONSUMED:
            removal.consume(self, lease, entry, why)
        elif outcome == ReleaseOutcome.CORRUPT:
            # Quarantined first: a record that cannot be journaled leaves the lease as it was.
            self.quarantine_file(entry, reason or "reported corrupt by a client")
            self.leases.drop(lease, why)
        else:
            self.leases.drop(lease, why)
        self.changed.notify()
        self.production.kick()

    def note_released(self, lease_id: str, client_id: str) -> None:
        """The server released this lease for its client (a kept release, removal.py): the
        client's own release of it, sent again, is answered as done."""
        if self._directory is not None:
            self._directory.note_released(lease_id, client_id)

    def append_record(self, record: Record) -> None:
        """Journal first, memory after: a record that cannot be written changes nothing."""
        try:
            self.keeper.append(record)
        except OSError as exc:
            raise errors.ServerUnavailable(
                f"{self.where}: {self.state.journal_error or exc}; nothing was changed, retry later"
            ) from None

    def quarantine_file(self, entry: FileEntry, reason: str) -> None:
        """Move a file aside with its reason (removal.py); in deterministic mode its seq is
        produced again."""
        removal.quarantine(self, entry, reason)

    async def _reap_leases(self) -> None:
        """Expire leases whose client stopped renewing; their files go back to the same seq."""
        while True:
            expired = self.leases.expire()
            if expired:
                self.state.counters.leases_expired += len(expired)
                self.changed.notify()
                self.production.kick()
            await self._leases_changed.wait(self.leases.seconds_to_next_expiry())

    # ---- steering (queue_server/steering/port.py: what SetMixture and SetCurriculum use) ----
    def first_unmade(self) -> int:
        return self.production.plan.first_unmade()

    def change_point(self, position: int | None, earliest: int) -> int:
        return earliest if position is None else self.schedule.change_point(position, earliest)

    # ---- stats ----------------------------------------------------------------------------
    def snapshot(self) -> SplitSnapshot:
        return snapshot(self)
