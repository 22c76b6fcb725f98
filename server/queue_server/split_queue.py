"""One split of one dataset: its files on disk, its leases, and which seq each worker makes next.

Everything here runs on the event loop and never blocks it: workers produce in other
processes, file deletes go to a thread, and waiting is on a Signal, not on sleeps.

Ordering (deterministic mode): rank r of world size W reads seqs r, r+W, r+2W, ... Worker w
of N produces seqs w, w+N, ... in order ("forward"), and any seq again on demand from the
journaled state ("reproduce"): after a resume rewind, a quarantine, or a lost file.

Backpressure: each rank holds at most two leased files (the one it reads and the prefetched
next) and may have `max_backlog_files` more ready ahead of them. A worker whose next seq falls
outside its rank's window waits; a release or an acquire moves the window and wakes it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from queue_client import errors
from queue_client.batchfile import (
    candidates_dir,
    quarantine_dir,
    queue_dir,
    remove_temp_files,
    scan_queue,
)
from queue_server.config import DatasetConfig
from queue_server.journal import Journal, JournalSummary
from queue_server.signal import Signal
from queue_server.workers import WorkerDied, WorkerError, WorkerProcess

log = logging.getLogger("queue_server.split")

# Errors that mean "the disk is full or read-only", not "the provider is broken": production
# backs off and retries instead of counting a crash.
_DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES}
_DISK_BACKOFF_S = (0.2, 5.0)

CONSUMED, RETURNED, CORRUPT = 1, 2, 3
# The largest world size accepted: far beyond real jobs, small enough that per-rank work stays cheap.
MAX_WORLD_SIZE = 65536


@dataclass
class Lease:
    lease_id: str
    client_id: str
    seq: int
    rank: int
    world_size: int
    expires_at: float


@dataclass
class FileEntry:
    seq: int
    name: str
    size_bytes: int
    crc32: int
    lease: Lease | None = None


@dataclass
class Counters:
    produced_files: int = 0
    reproduced_files: int = 0
    consumed_files: int = 0
    quarantined_files: int = 0
    produced_bytes: int = 0
    leases_expired: int = 0
    worker_restarts: int = 0
    orphans_removed: int = 0
    disk_errors: int = 0


@dataclass
class RankView:
    rank: int
    last_consumed_seq: int
    files_leased: int
    lag_files: int


@dataclass
class SplitSnapshot:
    split: str
    counters: Counters
    ready_files: int
    leased_files: int
    max_backlog_files: int
    world_size: int
    next_seq: int
    ranks: list[RankView] = field(default_factory=list)
    worker_pids: list[int] = field(default_factory=list)
    last_disk_error: str = ""
    curriculum: dict[str, Any] | None = None
    seqs_produced: int = 0
    seqs_consumed: int = 0
    seqs_quarantined: int = 0
    seqs_missing: int = 0


class SplitQueue:
    def __init__(
        self,
        config: DatasetConfig,
        split: str,
        data_root: Path,
        lease_ttl_s: float,
        make_worker: Callable[[int], WorkerProcess],
        meta_json: str,
        on_fatal: Callable[[str], None],
        verbose: bool = False,
        candidates: bool = False,
    ) -> None:
        self.verbose = verbose
        self.last_error = ""
        self.last_disk_error = ""
        self.config = config
        self.split = split
        # A curriculum split is served by one composer "worker" (a CurriculumLane); its
        # candidates are a SplitQueue of their own (candidates=True) in candidates/<split>.
        self.is_candidates = candidates
        self.curriculum = (
            config.selection == "curriculum"
            and split in config.curriculum_splits
            and not candidates
        )
        if candidates:
            self.dir = candidates_dir(data_root, config.name, split)
            self.quarantine = quarantine_dir(data_root, config.name, split) / "candidates"
            journal = data_root / config.name / "journal" / f"{split}.candidates.jsonl"
        else:
            self.dir = queue_dir(data_root, config.name, split)
            self.quarantine = quarantine_dir(data_root, config.name, split)
            journal = data_root / config.name / "journal" / f"{split}.jsonl"
        self.lease_ttl_s = lease_ttl_s
        self._make_worker = make_worker
        self._meta_json = meta_json
        self._on_fatal = on_fatal
        self.journal = Journal(journal)
        self.counters = Counters()
        self.files: dict[int, FileEntry] = {}
        self.leases: dict[str, Lease] = {}
        self.world_size = 1
        self._n = 1 if self.curriculum else config.workers
        # SetCurriculum calls, in call order: [first seq, alpha or None for "the schedule"].
        self.alpha_overrides: list[list[Any]] = []
        self._next_forward = list(range(self._n))
        self._offsets: dict[int, int] = {}  # seq -> journal offset of its latest produced record
        self._consumed: set[int] = set()
        self._quarantined: set[int] = set()
        self._reproduce: set[int] = set()
        self._in_production: set[int] = set()
        self._last_acquired: dict[int, int] = {}
        self._last_consumed: dict[int, int] = {}
        self._consumed_by_rank: dict[int, int] = {}
        self._workers: list[Any] = [None] * self._n  # WorkerProcess, or a CurriculumLane
        self._busy: set[int] = set()
        self._stateful = False
        self._failures = 0
        self._disk_backoff_until = 0.0
        self._disk_backoff_s = _DISK_BACKOFF_S[0]
        self._retry_armed = False
        self._leaving: set[int] = set()  # seqs whose file is being deleted or quarantined
        self._failed: str | None = None
        self._closed = False
        self.changed = Signal()
        self._leases_changed = Signal()
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- lifecycle -----------------------------------------------------------------------
    async def open(self) -> None:
        """Reconcile the directory with the journal, then start the workers."""
        await asyncio.to_thread(self._reconcile)
        for w in range(self._n):
            await self._start_worker(w)
        self._spawn(self._reap_leases())
        self._kick()

    def _reconcile(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.quarantine.mkdir(parents=True, exist_ok=True)
        remove_temp_files(self.dir)
        summary: JournalSummary = self.journal.replay()
        c = self.counters
        c.produced_files, c.reproduced_files = summary.produced_count, summary.reproduced_count
        c.consumed_files, c.quarantined_files = summary.consumed_count, summary.quarantined_count
        c.produced_bytes = summary.produced_bytes
        self._offsets = dict(summary.offsets)
        self._consumed = set(summary.consumed)
        self._quarantined = set(summary.quarantined)
        self.world_size = summary.world_size
        self._last_consumed = dict(summary.last_consumed)
        self.alpha_overrides = [list(o) for o in summary.alpha_overrides]
        for w, (seq, _) in summary.last_forward.items():
            if w < self._n:
                self._next_forward[w] = seq + self._n
        for name in scan_queue(self.dir):
            rec = summary.produced.get(name.seq)
            if rec is not None and rec.name == str(name) and name.seq not in self.files:
                self.files[name.seq] = FileEntry(name.seq, rec.name, rec.size_bytes, rec.crc32)
            else:
                # Published but never journaled (the server died in between), or superseded:
                # it is produced again identically if anyone asks, so removing it loses nothing.
                (self.dir / str(name)).unlink(missing_ok=True)
                c.orphans_removed += 1

    async def _start_worker(self, w: int) -> None:
        worker = self._make_worker(w)
        worker.on_exit = lambda: self._exited_idle(w, worker)
        reply = await worker.start()
        self._stateful = bool(reply.get("stateful", False))
        state = None
        last = max(
            (s for s in self._offsets if s % self._n == w and s < self._next_forward[w]),
            default=None,
        )
        if self._stateful and last is not None:
            _, state = await asyncio.to_thread(self.journal.read_states, self._offsets[last])
        await worker.call(
            {"op": "set_meta", "meta_json": self._meta_json, "split": self.split, "state": state}
        )
        self._workers[w] = worker

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for worker in self._workers:
            if worker is not None:
                await worker.stop()
        self.journal.close()
        self.changed.notify()

    def fail(self, message: str) -> None:
        self._failed = message
        for worker in self._workers:
            if worker is not None:
                worker.kill()
        self.changed.notify()

    def worker_pids(self) -> list[int]:
        pids = [w.pid for w in self._workers if w is not None and w.pid is not None]
        for w in self._workers:
            candidates = getattr(w, "candidates", None)  # a curriculum lane's provider workers
            if candidates is not None:
                pids += candidates.worker_pids()
        return pids

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- leases ---------------------------------------------------------------------------
    def _check_serving(self) -> None:
        if self._failed is not None:
            raise errors.ProviderFailed(f"dataset {self.config.name!r} failed: {self._failed}")
        if self._closed:
            raise errors.ServerUnavailable("the server is shutting down")

    def _adopt_world(self, world_size: int) -> None:
        if world_size == self.world_size:
            return
        holders = {lease.world_size for lease in self.leases.values()}
        if holders and holders != {world_size}:
            raise errors.LeaseConflict(
                f"world_size {world_size} conflicts with the live leases of {self.config.name}/{self.split}, "
                f"held at world_size {sorted(holders)}; stop those ranks or wait for their leases to expire"
            )
        # An elastic change: ranks and windows are reckoned anew under the new world size.
        self.world_size = world_size
        self._last_acquired.clear()
        self._last_consumed.clear()

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
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise errors.InvalidRequest(f"world_size {world_size} is outside [1, {MAX_WORLD_SIZE}]")
        if not 0 <= rank < world_size:
            raise errors.InvalidRequest(f"rank {rank} is outside [0, world_size={world_size})")
        if not client_id:
            raise errors.InvalidRequest("client_id is empty: each client process sends its own id")
        if seq is not None and seq < 0:
            raise errors.InvalidRequest(f"seq {seq} is negative")
        self._adopt_world(world_size)
        if self.config.mode == "best_effort":
            return await self._acquire_any(rank, client_id, wait_s)
        if seq is None:
            seq = self._next_for(rank)
        elif seq % world_size != rank and not carried:
            raise errors.InvalidRequest(
                f"seq {seq} belongs to rank {seq % world_size} of world_size {world_size}, not to rank {rank}"
            )
        if seq % world_size == rank:
            prev = self._last_acquired.get(rank)
            forward = prev is None or seq > prev
            if forward or (seq < prev - world_size and not pin):
                self._last_acquired[rank] = seq
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            self._check_serving()
            entry = self.files.get(seq)
            if entry is not None:
                if entry.lease is not None and entry.lease.client_id != client_id:
                    # The same rank from a new client process: a restart after a crash. The
                    # newest claimant owns the rank's stream; the old lease is revoked.
                    log.warning(
                        "%s/%s seq %d: lease of client %s taken over by %s",
                        self.config.name,
                        self.split,
                        seq,
                        entry.lease.client_id,
                        client_id,
                    )
                    self._drop_lease(entry.lease)
                return self._grant(entry, rank, client_id), entry
            self._want(seq)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise errors.NoBatchReady(
                    f"no file for {self.config.name}/{self.split} seq {seq} (rank {rank}) became ready within {wait_s:.1f}s{self._why_slow()}"
                )
            await self.changed.wait(remaining)

    async def _acquire_any(
        self, rank: int, client_id: str, wait_s: float
    ) -> tuple[Lease, FileEntry]:
        """Best effort: the lowest ready seq, unless this rank is max_lead files ahead."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        self._consumed_by_rank.setdefault(rank, 0)
        while True:
            self._check_serving()
            slowest = min(self._consumed_by_rank.get(r, 0) for r in range(self.world_size))
            if self._consumed_by_rank[rank] - slowest < self.config.max_lead:
                ready = [e for e in self.files.values() if e.lease is None]
                if ready:
                    entry = min(ready, key=lambda e: e.seq)
                    return self._grant(entry, rank, client_id), entry
            self._kick()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise errors.NoBatchReady(
                    f"no file for {self.config.name}/{self.split} (rank {rank}) became ready within {wait_s:.1f}s{self._why_slow()}"
                )
            await self.changed.wait(remaining)

    def _why_slow(self) -> str:
        candidates = self._candidates()
        if candidates is not None and candidates._why_slow():
            return candidates._why_slow()  # a curriculum's provider workers are the ones stuck
        if self.last_disk_error:
            return f"; the provider cannot write: {self.last_disk_error}"
        if self.last_error:
            return f"; the provider's last error: {self.last_error}"
        return ""

    def _grant(self, entry: FileEntry, rank: int, client_id: str) -> Lease:
        expires = asyncio.get_running_loop().time() + self.lease_ttl_s
        if entry.lease is not None:  # the same client asking again: the same lease, renewed
            entry.lease.expires_at = expires
            return entry.lease
        lease = Lease(uuid.uuid4().hex, client_id, entry.seq, rank, self.world_size, expires)
        entry.lease = lease
        self.leases[lease.lease_id] = lease
        self._leases_changed.notify()
        return lease

    def _drop_lease(self, lease: Lease) -> None:
        self.leases.pop(lease.lease_id, None)
        entry = self.files.get(lease.seq)
        if entry is not None and entry.lease is lease:
            entry.lease = None

    def renew(self, lease_id: str, client_id: str) -> bool:
        lease = self.leases.get(lease_id)
        if lease is None or lease.client_id != client_id:
            return False
        lease.expires_at = asyncio.get_running_loop().time() + self.lease_ttl_s
        return True

    def release(self, lease_id: str, client_id: str, outcome: int, reason: str) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise errors.UnknownLease(
                f"lease {lease_id!r} of {self.config.name}/{self.split} is not held (expired, released, or the server restarted)"
            )
        if lease.client_id != client_id:
            raise errors.LeaseConflict(
                f"lease {lease_id!r} belongs to another client, not to {client_id!r}"
            )
        if outcome not in (CONSUMED, RETURNED, CORRUPT):
            raise errors.InvalidRequest(
                f"release outcome {outcome} is not CONSUMED, RETURNED or CORRUPT"
            )
        self._drop_lease(lease)
        entry = self.files[lease.seq]
        if outcome == CONSUMED:
            del self.files[lease.seq]
            self._consumed.add(lease.seq)
            self.counters.consumed_files += 1
            self._last_consumed[lease.rank] = max(
                lease.seq, self._last_consumed.get(lease.rank, -1)
            )
            self._consumed_by_rank[lease.rank] = self._consumed_by_rank.get(lease.rank, 0) + 1
            self.journal.append({"e": "c", "seq": lease.seq, "ws": lease.world_size})
            self._off_disk(entry.seq, lambda: (self.dir / entry.name).unlink(missing_ok=True))
        elif outcome == CORRUPT:
            self.quarantine_file(entry, reason or "reported corrupt by a client")
        self.changed.notify()
        self._kick()

    def quarantine_file(self, entry: FileEntry, reason: str) -> None:
        """Move a file aside with its reason; in deterministic mode its seq is produced again."""
        self.files.pop(entry.seq, None)
        self._quarantined.add(entry.seq)
        self.counters.quarantined_files += 1
        self.journal.append({"e": "q", "seq": entry.seq, "why": reason[:500]})
        src, dst = self.dir / entry.name, self.quarantine / entry.name

        def move() -> None:
            with contextlib.suppress(FileNotFoundError):
                shutil.move(src, dst)
                dst.with_name(dst.name + ".reason.txt").write_text(reason + "\n", encoding="utf-8")

        self._off_disk(entry.seq, move)
        if self.config.mode == "deterministic":
            self._reproduce.add(entry.seq)
        log.warning("%s/%s seq %d quarantined: %s", self.config.name, self.split, entry.seq, reason)

    def _off_disk(self, seq: int, remove: Callable[[], None]) -> None:
        """Remove a file from the queue dir in a thread. Production waits until it is gone, so
        the files on disk never exceed the windows, not even for a moment."""
        self._leaving.add(seq)

        async def run() -> None:
            try:
                await asyncio.to_thread(remove)
            finally:
                self._leaving.discard(seq)
                self._kick()

        self._spawn(run())

    async def _reap_leases(self) -> None:
        """Expire leases whose client stopped renewing; their files go back to the same seq."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            expired = [lease for lease in self.leases.values() if lease.expires_at <= now]
            for lease in expired:
                self._drop_lease(lease)
                self.counters.leases_expired += 1
                log.info(
                    "%s/%s seq %d: lease of client %s expired",
                    self.config.name,
                    self.split,
                    lease.seq,
                    lease.client_id,
                )
            if expired:
                self.changed.notify()
                self._kick()
            soonest = min((lease.expires_at for lease in self.leases.values()), default=None)
            await self._leases_changed.wait(None if soonest is None else max(0.0, soonest - now))

    # ---- production -----------------------------------------------------------------------
    def _next_for(self, rank: int) -> int:
        last = self._last_acquired.get(rank)
        if last is not None:
            return last + self.world_size
        last = self._last_consumed.get(rank)
        return rank if last is None else last + self.world_size

    def _frontier(self, rank: int) -> int:
        """The lowest seq this rank still needs: the file it reads now, or its next one."""
        held = [lease.seq for lease in self.leases.values() if lease.rank == rank]
        return min(held) if held else self._next_for(rank)

    def _in_window(self, seq: int) -> bool:
        if self.config.mode == "best_effort":
            return (
                sum(1 for e in self.files.values() if e.lease is None) + len(self._in_production)
                < self.config.max_backlog_files * self.world_size
            )
        w = self.world_size
        return seq < self._frontier(seq % w) + w * (self.config.max_backlog_files + 2)

    def _want(self, seq: int) -> None:
        """Make sure seq will be on disk: forward production reaches it, or it is reproduced."""
        if seq in self.files or seq in self._in_production:
            return
        if seq < self._next_forward[seq % self._n]:
            self._reproduce.add(seq)
        self._kick()

    def _kick(self) -> None:
        """Give every idle worker its next job, if any is due."""
        if self._failed is not None or self._closed or self._leaving:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._disk_backoff_until:
            # The timer that ends a backoff may fire a hair early (loops round to ms): re-arm.
            self._arm_retry(self._disk_backoff_until - loop.time())
            return
        for w in range(self._n):
            if w in self._busy or self._workers[w] is None:
                continue
            job = self._next_job(w)
            if job is not None:
                seq, reproduce = job
                self._busy.add(w)
                self._in_production.add(seq)
                self._spawn(self._produce(w, seq, reproduce))

    def _next_job(self, w: int) -> tuple[int, bool] | None:
        mine = sorted(s for s in self._reproduce if s % self._n == w)
        if mine:
            self._reproduce.discard(mine[0])
            return mine[0], True
        missing = self._missing_in_windows(w)
        if missing is not None:
            return missing, True
        if self.config.mode == "deterministic" and not self._stateful:
            # Every rank is past the seqs below the lowest frontier: jump over them at once
            # (a rank may ask for a seq far ahead; skipping one by one would stall the loop).
            held: dict[int, int] = {}
            for lease in self.leases.values():  # one pass, not one per rank
                if lease.seq < held.get(lease.rank, lease.seq + 1):
                    held[lease.rank] = lease.seq
            floor = min(held.get(r, self._next_for(r)) for r in self._active_ranks())
            if self._next_forward[w] < floor:
                self._next_forward[w] = floor + (w - floor) % self._n
        while True:
            seq = self._next_forward[w]
            if not self._in_window(seq):
                return None
            if (
                self.config.mode == "deterministic"
                and not self._stateful
                and seq < self._frontier(seq % self.world_size)
            ):
                # Every rank is past this seq (a resume further on): a stateless provider can
                # make it later if asked, so skip it rather than fill the disk.
                self._next_forward[w] += self._n
                continue
            return seq, False

    def _active_ranks(self) -> range | list[int]:
        """Ranks whose windows matter: all of them for small worlds, else those seen."""
        if self.world_size <= 1024:
            return range(self.world_size)
        seen = set(self._last_acquired) | {lease.rank for lease in self.leases.values()}
        return sorted(seen) or [0]

    def _missing_in_windows(self, w: int) -> int | None:
        """A seq of worker w inside an active rank's window that was produced before but is not
        on disk (a rank rewound to a checkpoint): produce it again ahead of demand."""
        if self.config.mode != "deterministic":
            return None
        ws = self.world_size
        for rank, asked in self._last_acquired.items():
            # Only seqs after the rank's latest request: those before it were read already
            # (consumed out of order, say) and must not come back unasked.
            end = self._frontier(rank) + ws * (self.config.max_backlog_files + 2)
            for seq in range(asked + ws, end, ws):
                if seq >= self._next_forward[seq % self._n]:
                    break
                if seq % self._n == w and seq not in self.files and seq not in self._in_production:
                    return seq
        return None

    async def _produce(self, w: int, seq: int, reproduce: bool) -> None:
        worker = self._workers[w]
        try:
            state = None
            if reproduce:
                offset = self._offsets.get(seq)
                state = {}
                if offset is not None and self._stateful:
                    state, _ = await asyncio.to_thread(self.journal.read_states, offset)
            assert worker is not None
            request: dict[str, Any] = {
                "op": "produce",
                "split": self.split,
                "seq": seq,
                "state": state,
            }
            if self.is_candidates:
                request["into"] = "candidates"
            if self.curriculum:
                request["world_size"] = self.world_size
                request["overrides"] = self.alpha_overrides
            reply = await worker.call(request)
        except WorkerError as exc:
            self._in_production.discard(seq)
            if reproduce:
                self._reproduce.add(seq)
            self._busy.discard(w)
            if exc.errno in _DISK_ERRNOS:
                self._disk_trouble(seq, str(exc))
            else:
                await self._worker_failed(w, f"seq {seq}: {exc}", restart=True)
            return
        except WorkerDied as exc:
            self._in_production.discard(seq)
            if reproduce:
                self._reproduce.add(seq)
            await asyncio.to_thread(self._remove_temps_of, worker.pid if worker else None)
            self._busy.discard(w)
            await self._worker_failed(w, str(exc), restart=True)
            return
        except asyncio.CancelledError:
            raise
        self._failures = 0
        self._disk_backoff_s = _DISK_BACKOFF_S[0]
        self.last_disk_error = ""
        self._in_production.discard(seq)
        self._busy.discard(w)
        if not reproduce:
            self._next_forward[w] = max(self._next_forward[w], seq + self._n)
        was_known = seq in self._offsets
        record = {
            "e": "p",
            "seq": seq,
            "name": reply["name"],
            "bytes": reply["bytes"],
            "crc": reply["crc"],
            "w": w,
            "fwd": not reproduce,
            "before": reply.get("before") or {},
            "after": reply.get("after") or {},
        }
        self._offsets[seq] = self.journal.append(record)
        if was_known or reproduce:
            self.counters.reproduced_files += 1
        else:
            self.counters.produced_files += 1
        self.counters.produced_bytes += reply["bytes"]
        self._consumed.discard(seq)
        self._quarantined.discard(seq)
        self.files[seq] = FileEntry(seq, reply["name"], reply["bytes"], reply["crc"])
        if self.verbose:
            log.info(
                "%s/%s produced seq %d (%s, %d bytes)",
                self.config.name,
                self.split,
                seq,
                reply["name"],
                reply["bytes"],
            )
        self.changed.notify()
        self._kick()

    def _exited_idle(self, w: int, worker: Any) -> None:
        """A worker's process exited on its own. In a call, the call reports it; idle, it is
        restarted now, so stats never show a dead pid and the next file does not wait."""
        if self._closed or self._failed is not None or self._workers[w] is not worker:
            return
        if w in self._busy:
            return  # its call in flight fails with WorkerDied and restarts it
        self._busy.add(w)  # no job for it meanwhile

        async def restart() -> None:
            self._busy.discard(w)
            await self._worker_failed(
                w, f"{worker.label} (pid {worker.pid}) exited while idle", True
            )

        self._spawn(restart())

    def _remove_temps_of(self, pid: int | None) -> None:
        """A worker killed mid-write leaves a temp file named after its pid: remove it now."""
        if pid is None:
            return
        for entry in os.scandir(self.dir):
            if entry.name.startswith(".tmp-") and entry.name.endswith(f"-{pid}.pt"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def _disk_trouble(self, seq: int, message: str) -> None:
        self.counters.disk_errors += 1
        delay = self._disk_backoff_s
        self._disk_backoff_s = min(self._disk_backoff_s * 2, _DISK_BACKOFF_S[1])
        loop = asyncio.get_running_loop()
        self._disk_backoff_until = loop.time() + delay
        self.last_disk_error = message
        log.warning(
            "%s/%s: cannot write seq %d (%s); retrying in %.1fs",
            self.config.name,
            self.split,
            seq,
            message,
            delay,
        )
        self._arm_retry(delay)

    def _arm_retry(self, delay: float) -> None:
        if not self._retry_armed:
            self._retry_armed = True
            asyncio.get_running_loop().call_later(
                max(0.0, delay) + 0.002, self._retry_after_backoff
            )

    def _retry_after_backoff(self) -> None:
        self._retry_armed = False
        self._kick()

    async def _worker_failed(self, w: int, message: str, restart: bool) -> None:
        self._failures += 1
        self.last_error = message
        log.error("%s/%s worker %d failed: %s", self.config.name, self.split, w, message)
        if self._failures > self.config.max_worker_restarts:
            self._on_fatal(
                f"worker {w} of split {self.split!r} failed {self._failures} times in a row; last error: {message}"
            )
            return
        old = self._workers[w]
        self._workers[w] = None
        if old is not None:
            old.kill()
            await old.stop()
        self.counters.worker_restarts += 1
        self._busy.add(w)
        try:
            await self._start_worker(w)
        except Exception as exc:  # a worker that cannot even start counts as another failure
            self._busy.discard(w)
            await self._worker_failed(w, f"restart failed: {exc}", restart=True)
            return
        self._busy.discard(w)
        self._kick()

    # ---- curriculum -----------------------------------------------------------------------
    def set_curriculum(self, alpha: float | None, position: int | None, rank: int) -> int:
        """Change alpha (None: back to the config schedule) from a seq on; returns that seq.

        With the caller's position (the seq of the file it reads), the change starts at the
        first round of W files past any that can be composed already, so the same calls at
        the same steps give the same batches whatever the timing: within
        (max_backlog_files + 3) files of the caller's stream. Without one it starts at the next
        file not yet composed: sooner, but timing-dependent.
        """
        where = f"{self.config.name}/{self.split}"
        if not self.curriculum:
            raise errors.InvalidRequest(
                f'{where} does not use selection = "curriculum" (it is {self.config.selection!r}): '
                "set it in the dataset's config to use SetCurriculum"
            )
        if alpha is not None and not (isinstance(alpha, float) and 0.0 <= alpha <= 1.0):
            raise errors.InvalidRequest(f"alpha {alpha!r} for {where} is outside [0, 1]")
        if position is not None and position < 0:
            raise errors.InvalidRequest(f"position seq {position} for {where} is negative")
        nxt = self._next_forward[0]
        earliest = nxt + 1 if nxt in self._in_production else nxt
        at = earliest
        if position is not None:
            w = self.world_size
            at = max(earliest, w * (position // w + self.config.max_backlog_files + 3))
        self.alpha_overrides.append([at, alpha])
        self.journal.append({"e": "alpha", "at": at, "alpha": alpha, "rank": rank})
        log.info("%s: alpha %s from seq %d on", where, "schedule" if alpha is None else alpha, at)
        return at

    def _candidates(self) -> SplitQueue | None:
        """A curriculum split's queue of candidate files (None otherwise, or mid-restart)."""
        return getattr(self._workers[0], "candidates", None) if self.curriculum else None

    def curriculum_stats(self) -> dict[str, Any] | None:
        if not self.curriculum:
            return None
        stats = dict(getattr(self._workers[0], "stats", {}) or {})
        candidates = self._candidates()
        stats["candidate_files"] = len(candidates.files) if candidates is not None else 0
        stats["overrides"] = len(self.alpha_overrides)
        return stats

    # ---- stats ----------------------------------------------------------------------------
    def snapshot(self) -> SplitSnapshot:
        w = self.world_size
        ranks = []
        for r in range(w):
            ranks.append(
                RankView(
                    rank=r,
                    last_consumed_seq=self._last_consumed.get(r, -1),
                    files_leased=sum(1 for lease in self.leases.values() if lease.rank == r),
                    lag_files=sum(1 for s in self.files if s % w == r),
                )
            )
        counters = self.counters
        candidates = self._candidates()
        if candidates is not None:  # a curriculum split's provider workers are its own too
            counters = dataclasses.replace(
                counters,
                worker_restarts=counters.worker_restarts + candidates.counters.worker_restarts,
                disk_errors=counters.disk_errors + candidates.counters.disk_errors,
            )
        return SplitSnapshot(
            split=self.split,
            counters=counters,
            ready_files=sum(1 for e in self.files.values() if e.lease is None),
            leased_files=len(self.leases),
            max_backlog_files=self.config.max_backlog_files,
            world_size=w,
            next_seq=min(self._next_forward),
            ranks=ranks,
            worker_pids=self.worker_pids(),
            last_disk_error=self.last_disk_error
            or (candidates.last_disk_error if candidates is not None else ""),
            curriculum=self.curriculum_stats(),
            **self._accounting(),
        )

    def _accounting(self) -> dict[str, int]:
        produced = set(self._offsets)
        consumed = (self._consumed & produced) - set(self.files)
        quarantined = (self._quarantined & produced) - set(self.files) - consumed
        missing = produced - set(self.files) - consumed - quarantined
        return {
            "seqs_produced": len(produced),
            "seqs_consumed": len(consumed),
            "seqs_quarantined": len(quarantined),
            "seqs_missing": len(missing),
        }
