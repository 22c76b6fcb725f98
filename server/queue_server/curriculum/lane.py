"""A curriculum split's production backend: one slot whose produce composes served file seq
from candidates, in seq order.

Behind it: a SplitQueue of candidate files (the provider's own workers, with backpressure,
journal, crash restarts and reproduction, exactly as for a plain split) and one composer
process. The backend pins each candidate file the composer's buffer holds (a lease that never
expires), hands their paths to the composer, and releases a candidate as consumed once the
composer retires it, which deletes it. The candidate queue's window runs from the oldest
pinned file, so candidates on disk stay bounded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from queue_client import errors
from queue_server.leases import ReleaseOutcome
from queue_server.production.backend import (
    ProducedFile,
    ProduceFailed,
    ProduceJob,
    ProductionBackend,
    SlotDied,
)
from queue_server.production.worker_process import WorkerDied, WorkerError, WorkerProcess

if TYPE_CHECKING:
    from queue_server.split_queue import SplitQueue

log = logging.getLogger("queue_server.curriculum")

COMPOSER_CLIENT = "curriculum-composer"
_PIN_WAIT_S = 3600.0


class CurriculumBackend(ProductionBackend):
    slots = 1

    def __init__(
        self,
        label: str,
        split: str,
        make_composer: Callable[[], WorkerProcess],
        make_candidates: Callable[[], SplitQueue],
        init: dict[str, Any],
        meta_json: str,
    ) -> None:
        self.label = label
        self.split = split
        self._make_composer = make_composer
        self._make_candidates = make_candidates
        self._init = init  # curriculum_init request, less the snapshot
        self._meta_json = meta_json
        self._composer: WorkerProcess | None = None
        self._candidates: SplitQueue | None = None
        self._pins: dict[int, str] = {}  # candidate seq -> lease id
        self._needed: list[int] = []
        self._stats: dict[str, Any] = {}

    async def start_slot(self, slot: int, state: dict[str, Any] | None) -> bool:
        """Open a fresh candidate queue and composer; the composer restores its snapshot."""
        candidates = self._make_candidates()
        self._candidates, self._pins = candidates, {}
        await candidates.open()
        composer = self._make_composer()
        composer.on_exit = lambda: self._exited(composer)
        self._composer = composer
        await composer.start()
        await composer.call(
            {"op": "set_meta", "meta_json": self._meta_json, "split": self.split, "state": None}
        )
        reply = await composer.call(
            {**self._init, "op": "curriculum_init", "snapshot": (state or {}).get("snapshot")}
        )
        self._take(reply)
        await asyncio.gather(*(self._pin(c) for c in reply["held"]))
        return True

    def _exited(self, composer: WorkerProcess) -> None:
        if self._composer is composer and self.on_slot_exit is not None:
            self.on_slot_exit(0)

    async def produce(self, slot: int, job: ProduceJob) -> ProducedFile:
        composer = self._composer
        if composer is None or self._candidates is None:
            raise SlotDied(f"{self.label} is not running")
        try:
            if job.state is not None:  # a journaled seq, made again
                reply = await self._materialize(composer, job)
            else:
                reply = await self._compose(composer, job)
        except errors.BatchQueueError as exc:  # the candidate queue failed or is closing
            raise ProduceFailed(str(exc), kind=type(exc).__name__) from None
        except WorkerError as exc:
            raise ProduceFailed(str(exc), exc.errno, exc.kind) from None
        except WorkerDied as exc:
            raise SlotDied(str(exc)) from None
        return ProducedFile(
            job.seq,
            reply["name"],
            reply["bytes"],
            reply["crc"],
            reply.get("before") or {},
            reply.get("after") or {},
        )

    def _take(self, reply: dict[str, Any]) -> None:
        self._needed = list(reply["needed"])
        self._stats = dict(reply["stats"])

    async def _pin(self, seq: int) -> str:
        """The path of candidate `seq`, leased until released; produced (again) if need be."""
        candidates = self._candidates
        assert candidates is not None
        lease, entry = await candidates.acquire(
            0, 1, COMPOSER_CLIENT, seq, _PIN_WAIT_S, carried=True, pin=True
        )
        self._pins[seq] = lease.lease_id
        return str(candidates.dir / entry.name)

    def _unpin(self, seq: int) -> None:
        lease_id = self._pins.pop(seq, None)
        candidates = self._candidates
        if lease_id is not None and candidates is not None and lease_id in candidates.leases:
            candidates.release(lease_id, COMPOSER_CLIENT, ReleaseOutcome.CONSUMED, "")

    async def _paths(self, seqs: list[int]) -> dict[str, str]:
        paths = await asyncio.gather(*(self._pin(c) for c in seqs))
        return {str(c): p for c, p in zip(seqs, paths, strict=True)}

    async def _compose(self, composer: WorkerProcess, job: ProduceJob) -> dict[str, Any]:
        held = sorted(self._pins)
        paths = await self._paths(sorted(set(held) | set(self._needed)))
        reply = await composer.call(
            {
                "op": "compose",
                "seq": job.seq,
                "world_size": job.world_size,
                "overrides": [list(o) for o in job.overrides],
                "paths": paths,
            }
        )
        for c in reply["retired"]:
            self._unpin(c)
        self._take(reply)
        return reply

    async def _materialize(self, composer: WorkerProcess, job: ProduceJob) -> dict[str, Any]:
        """Make an old served file again from its journaled picks (a rewind, a quarantine)."""
        state = job.state or {}
        if "picks" not in state:
            raise ProduceFailed(
                f"served seq {job.seq} has no journaled picks: it cannot be made again"
            )
        wanted = sorted({int(c) for c, _ in state["picks"]})
        extra = [c for c in wanted if c not in self._pins]
        try:
            paths = await self._paths(wanted)
            return await composer.call(
                {
                    "op": "materialize",
                    "seq": job.seq,
                    "picks": state["picks"],
                    "alphas": state["alphas"],
                    "paths": paths,
                }
            )
        finally:
            for c in extra:  # retired before: retire again
                self._unpin(c)

    async def stop_slot(self, slot: int) -> None:
        composer, self._composer = self._composer, None
        candidates, self._candidates = self._candidates, None
        if composer is not None:
            composer.kill()
            await composer.stop()
        if candidates is not None:
            await candidates.close()

    async def close(self) -> None:
        composer, self._composer = self._composer, None
        candidates, self._candidates = self._candidates, None
        if composer is not None:
            await composer.stop()
        if candidates is not None:
            await candidates.close()

    def kill(self) -> None:
        if self._composer is not None:
            self._composer.kill()
        if self._candidates is not None:
            self._candidates.fail("the curriculum composer was stopped")

    def pids(self) -> list[int]:
        pids = [self._composer.pid] if self._composer and self._composer.pid else []
        if self._candidates is not None:
            pids += self._candidates.worker_pids()
        return pids

    def stats(self) -> dict[str, Any]:
        """The composer's figures; its candidate providers' restarts and disk errors count
        as the split's own."""
        candidates = self._candidates
        stats: dict[str, Any] = {"curriculum": dict(self._stats)}
        stats["curriculum"]["candidate_files"] = len(candidates.files) if candidates else 0
        if candidates is not None:
            stats["worker_restarts"] = candidates.counters.worker_restarts
            stats["disk_errors"] = candidates.counters.disk_errors
            stats["last_disk_error"] = candidates.state.last_disk_error
        return stats

    def why_slow(self) -> str:
        return self._candidates.why_slow() if self._candidates is not None else ""
