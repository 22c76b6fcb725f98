"""A curriculum split's production backend: one slot whose produce composes served file seq
from candidates, in seq order.

Behind it: a SplitQueue of candidate files (the provider's own workers, with backpressure,
journal, crash restarts and reproduction, exactly as for a plain split) and its composer
processes (`composer_workers`, default 1). The backend pins each candidate file the buffer
holds (a lease that never expires), hands their paths to the composers, and releases a
candidate as consumed once they retire it, which deletes it. The candidate queue's window runs
from the oldest pinned file, so candidates on disk stay bounded.

One composer composes a served file in one call. Several share the buffer (shards.py): each
step goes to all of them at once, and the event loop only passes their answers on (the best
of their proposals, their cull scores); composer 0 writes the served file and the snapshot.

A composer is a worker process of the server, or a Ray actor (ray_composer.py) with
`backend = "ray"`: both speak the same requests and fail the same way (WorkerDied, on_exit),
so nothing here depends on which.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from queue_client import errors
from queue_server.curriculum.shards import best_of
from queue_server.production.backend import (
    ProducedFile,
    ProduceFailed,
    ProduceJob,
    ProductionBackend,
    SlotDied,
    WorkerPlace,
)
from queue_server.production.worker_process import WorkerDied, WorkerError
from queue_server.split.leases import ReleaseOutcome

if TYPE_CHECKING:
    from queue_server.split.queue import SplitQueue

log = logging.getLogger("queue_server.curriculum")

COMPOSER_CLIENT = "curriculum-composer"
_PIN_WAIT_S = 3600.0


class ComposerWorker(Protocol):
    """What the lane needs of one composer: a WorkerProcess, or a RayComposer."""

    label: str
    on_exit: Callable[[], None] | None

    @property
    def pid(self) -> int | None:
        """Its process id on this machine, or None (an actor of a Ray node)."""

    async def start(self) -> dict[str, Any]: ...

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """The reply; WorkerError when the request failed, WorkerDied when the composer did."""

    async def stop(self) -> None: ...

    def kill(self) -> None: ...

    def place(self, role: str, index: int) -> WorkerPlace:
        """Where it runs, for stats."""


class CurriculumBackend(ProductionBackend):
    slots = 1

    def __init__(
        self,
        label: str,
        split: str,
        make_composer: Callable[[], ComposerWorker],
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
        self._count = int(init["settings"].get("composers", 1))
        self._per_file = int(init["settings"]["batches_per_file"])
        self._composers: list[ComposerWorker] = []
        self._candidates: SplitQueue | None = None
        self._pins: dict[int, str] = {}  # candidate seq -> lease id
        self._needed: list[int] = []
        self._stats: dict[str, Any] = {}
        self._stalls: dict[int, str] = {}  # composer shard -> why it waits for a node

    async def start_slot(self, slot: int, state: dict[str, Any] | None) -> bool:
        """Open a fresh candidate queue and composers; they restore the snapshot. A start
        that fails stops what it started: production may retry it without a stop (a Ray
        cluster that is not back yet)."""
        try:
            return await self._start(state)
        except Exception:
            await self.stop_slot(slot)
            raise

    async def _start(self, state: dict[str, Any] | None) -> bool:
        candidates = self._make_candidates()
        self._candidates, self._pins = candidates, {}
        composers = [self._make_composer() for _ in range(self._count)]
        for shard, composer in enumerate(composers):
            if self._count > 1:
                composer.label = f"{composer.label} {shard}"
            composer.on_exit = lambda c=composer: self._exited(c)
            if hasattr(composer, "on_stalled"):  # a Ray actor waits for a node with room
                setattr(composer, "on_stalled", partial(self._composer_stalled, shard))  # noqa: B010
        self._composers = composers
        # Independent until the first pin: the candidate providers and the composers start
        # together (each may be a new process or actor that imports torch and its provider).
        _, reply = await _every([candidates.open(), self._start_composers(composers, state)])
        self._take(reply)
        await asyncio.gather(*(self._pin(c) for c in reply["held"]))
        return True

    def _composer_stalled(self, shard: int, reason: str | None) -> None:
        if reason is None:
            self._stalls.pop(shard, None)
        else:
            self._stalls[shard] = reason
        if self.on_stalled is not None:
            self.on_stalled("; ".join(r for _, r in sorted(self._stalls.items())) or None)

    async def _start_composers(
        self, composers: list[ComposerWorker], state: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Start them and restore the snapshot; composer 0's reply (held, needed, stats)."""
        await _every(c.start() for c in composers)
        meta = {"op": "set_meta", "meta_json": self._meta_json, "split": self.split, "state": None}
        await _every(c.call(meta) for c in composers)
        init = {**self._init, "op": "curriculum_init", "snapshot": (state or {}).get("snapshot")}
        # Composer 0 first: it estimates the corpus distribution if none is cached yet.
        reply = await composers[0].call({**init, "shard": 0, "shards": self._count})
        await _every(
            c.call({**init, "shard": shard, "shards": self._count})
            for shard, c in enumerate(composers)
            if shard > 0
        )
        return reply

    def _exited(self, composer: ComposerWorker) -> None:
        if composer in self._composers and self.on_slot_exit is not None:
            self.on_slot_exit(0)

    async def produce(self, slot: int, job: ProduceJob) -> ProducedFile:
        composers = self._composers
        if not composers or self._candidates is None:
            raise SlotDied(f"{self.label} is not running")
        try:
            if job.state is not None:  # a journaled seq, made again
                reply = await self._materialize(composers[0], job)
            elif len(composers) == 1:
                reply = await self._compose(composers[0], job)
            else:
                reply = await self._compose_shared(composers, job)
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

    async def _compose(self, composer: ComposerWorker, job: ProduceJob) -> dict[str, Any]:
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

    async def _compose_shared(
        self, composers: list[ComposerWorker], job: ProduceJob
    ) -> dict[str, Any]:
        """Compose with several composers, step by step (host.py); composer 0 publishes."""
        held = sorted(self._pins)
        paths = await self._paths(sorted(set(held) | set(self._needed)))

        async def everyone(request: dict[str, Any]) -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(c.call(request) for c in composers)))

        replies = await everyone(
            {
                "op": "compose",
                "step": "begin",
                "seq": job.seq,
                "world_size": job.world_size,
                "overrides": [list(o) for o in job.overrides],
                "paths": paths,
            }
        )
        for _ in range(self._per_file):
            position = best_of([r["proposal"] for r in replies])
            replies = await everyone({"op": "compose", "step": "accept", "position": position})
        scored = [s for r in replies for s in r["scored"]]
        reply = (await everyone({"op": "compose", "step": "finish", "scored": scored}))[0]
        for c in reply["retired"]:
            self._unpin(c)
        self._take(reply)
        return reply

    async def _materialize(self, composer: ComposerWorker, job: ProduceJob) -> dict[str, Any]:
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
        composers, self._composers = self._composers, []
        candidates, self._candidates = self._candidates, None
        for composer in composers:
            composer.kill()
        await asyncio.gather(*(c.stop() for c in composers))
        if candidates is not None:
            await candidates.close()

    async def close(self) -> None:
        composers, self._composers = self._composers, []
        candidates, self._candidates = self._candidates, None
        await asyncio.gather(*(c.stop() for c in composers))
        if candidates is not None:
            await candidates.close()

    def kill(self) -> None:
        for composer in self._composers:
            composer.kill()
        if self._candidates is not None:
            self._candidates.fail("the curriculum composer was stopped")

    def pids(self) -> list[int]:
        """The composers' pids (composer 0 first), then the candidate providers'; processes
        of this machine only (none for Ray actors)."""
        pids = [c.pid for c in self._composers if c.pid]
        if self._candidates is not None:
            pids += self._candidates.worker_pids()
        return pids

    def workers(self) -> list[WorkerPlace]:
        """The composers (composer 0 first), then the candidate providers."""
        places = [c.place("composer", i) for i, c in enumerate(self._composers)]
        if self._candidates is not None:
            places += [replace(w, role="candidates") for w in self._candidates.workers()]
        return places

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


async def _every(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Every call's result, after all of them ended: the first error is raised only then, so
    that none is still starting while a failed start is being cleaned up."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
