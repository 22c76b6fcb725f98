"""A curriculum split's production backend: slot k is curriculum stream k of `streams`
(streams.py), which composes the served seqs k, k+S, ... from candidates, in seq order.

Behind it: a SplitQueue of candidate files (the provider's own workers, with backpressure,
journal, crash restarts and reproduction, exactly as for a plain split) and its composer
processes (`composer_workers`, default 1). The backend pins each candidate file the buffer
holds (a lease that never expires), hands their paths to the composers, and releases a
candidate as consumed once they retire it, which deletes it. The candidate queue's window runs
from the oldest pinned file, so candidates on disk stay bounded.

The streams share one candidate queue (a candidate's "rank" is its stream) and one group of
composers, each of which holds every stream started here; requests go to the group one
composition at a time. A stream that fails restarts alone from its last journaled snapshot;
a composer that dies restarts the group, and every stream from its own snapshot. A stream may
pass over a seq (publish False: composed, not written): another node's seq in a stream shared
with it, or one its rank has read already.

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
from queue_server.curriculum.streams import candidate_rank
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
        self._init = init  # curriculum_init request
        self._meta_json = meta_json
        self._count = int(init["settings"].get("composers", 1))
        self._per_file = int(init["settings"]["batches_per_file"])
        self.slots = self._streams = int(init["settings"].get("streams", 1))
        self._composers: list[ComposerWorker] = []
        self._candidates: SplitQueue | None = None
        self._pins: dict[int, str] = {}  # candidate seq -> lease id
        self._started: set[int] = set()  # streams the running composers hold
        self._held: dict[int, list[int]] = {}  # per stream: its buffer's candidates
        self._needed: dict[int, list[int]] = {}  # per stream: what its next file ingests
        self._stats: dict[str, Any] = {}
        self._stalls: dict[int, str] = {}  # composer shard -> why it waits for a node
        self._turn = asyncio.Lock()  # one composition (or start, or stop) at a time
        self._broken = False  # a composer died: its group restarts at the next stop

    async def start_slot(self, slot: int, state: dict[str, Any] | None) -> bool:
        """Start stream `slot` from its journaled snapshot (None: anew), and the composers
        and the candidate queue first if they are not running. A group start that fails stops
        what it started: production may retry it without a stop (a Ray cluster not back)."""
        async with self._turn:
            if not self._composers:
                try:
                    await self._start_group()
                except Exception:
                    await self._stop_group(locked=True)
                    raise
            snapshot = (state or {}).get("snapshot")
            request = {"op": "curriculum_stream", "stream": slot, "snapshot": snapshot}
            reply = (await _every(c.call(request) for c in self._composers))[0]
            self._started.add(slot)
            self._take(slot, reply)
        keep = set(reply["held"]) | set(reply["needed"])
        for c in [c for c in self._pins if c % self._streams == slot and c not in keep]:
            self._unpin(c)  # pinned for a composition that failed
        await asyncio.gather(*(self._pin(c) for c in reply["held"]))
        return True

    async def _start_group(self) -> None:
        """A fresh candidate queue and composers, every stream to be started anew."""
        candidates = self._make_candidates()
        self._candidates, self._pins, self._started = candidates, {}, set()
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
        await _every([candidates.open(), self._start_composers(composers)])

    def _composer_stalled(self, shard: int, reason: str | None) -> None:
        if reason is None:
            self._stalls.pop(shard, None)
        else:
            self._stalls[shard] = reason
        if self.on_stalled is not None:
            self.on_stalled("; ".join(r for _, r in sorted(self._stalls.items())) or None)

    async def _start_composers(self, composers: list[ComposerWorker]) -> None:
        await _every(c.start() for c in composers)
        meta = {"op": "set_meta", "meta_json": self._meta_json, "split": self.split, "state": None}
        await _every(c.call(meta) for c in composers)
        init = {**self._init, "op": "curriculum_init"}
        # Composer 0 first: it estimates the corpus distribution if none is cached yet.
        await composers[0].call({**init, "shard": 0, "shards": self._count})
        await _every(
            c.call({**init, "shard": shard, "shards": self._count})
            for shard, c in enumerate(composers)
            if shard > 0
        )

    def _exited(self, composer: ComposerWorker) -> None:
        """A composer died: every stream it held restarts (from its snapshot), the group first."""
        if composer in self._composers:
            self._broken = True
            if self.on_slot_exit is not None:
                for stream in sorted(self._started):
                    self.on_slot_exit(stream)

    async def produce(self, slot: int, job: ProduceJob) -> ProducedFile:
        try:
            if job.state is not None:  # a journaled seq, made again
                reply = await self._materialize(job)
            else:
                reply = await self._compose(slot, job)
        except errors.BatchQueueError as exc:  # the candidate queue failed or is closing
            self._broken = True  # the restart makes a new one
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

    def _running(self, slot: int) -> list[ComposerWorker]:
        if not self._composers or slot not in self._started:
            raise SlotDied(f"{self.label} stream {slot} is not running")
        return self._composers

    def _take(self, slot: int, reply: dict[str, Any]) -> None:
        self._held[slot] = list(reply["held"])
        self._needed[slot] = list(reply["needed"])
        self._stats = dict(reply["stats"])

    async def _pin(self, seq: int) -> str:
        """The path of candidate `seq`, leased until released; produced (again) if need be."""
        candidates = self._candidates
        if candidates is None:
            raise SlotDied(f"{self.label} is not running")
        rank = candidate_rank(seq, self._streams, candidates.served)
        lease, entry = await candidates.acquire(
            rank, self._streams, COMPOSER_CLIENT, seq, _PIN_WAIT_S, carried=True, pin=True
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

    async def _compose(self, slot: int, job: ProduceJob) -> dict[str, Any]:
        """Compose (or pass over) seq with stream `slot`: its candidates pinned first, then
        the composers' turn."""
        self._running(slot)
        paths = await self._paths(sorted(set(self._held[slot]) | set(self._needed[slot])))
        request = {
            "op": "compose",
            "seq": job.seq,
            "world_size": job.world_size,
            "overrides": [list(o) for o in job.overrides],
            "paths": paths,
            "publish": job.publish,
        }
        async with self._turn:
            composers = self._running(slot)  # the group may have restarted meanwhile
            if len(composers) == 1:
                reply = await composers[0].call(request)
            else:
                reply = await self._compose_shared(composers, request)
        for c in reply["retired"]:
            self._unpin(c)
        self._take(slot, reply)
        return reply

    async def _compose_shared(
        self, composers: list[ComposerWorker], request: dict[str, Any]
    ) -> dict[str, Any]:
        """Compose with several composers, step by step (host.py); composer 0 publishes."""

        async def everyone(request: dict[str, Any]) -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(c.call(request) for c in composers)))

        replies = await everyone({**request, "step": "begin"})
        for _ in range(self._per_file):
            position = best_of([r["proposal"] for r in replies])
            replies = await everyone({"op": "compose", "step": "accept", "position": position})
        scored = [s for r in replies for s in r["scored"]]
        return (await everyone({"op": "compose", "step": "finish", "scored": scored}))[0]

    async def _materialize(self, job: ProduceJob) -> dict[str, Any]:
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
            async with self._turn:
                if not self._composers:
                    raise SlotDied(f"{self.label} is not running")
                return await self._composers[0].call(
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
        """Forget stream `slot` (its start restores its snapshot); after a composer died, stop
        the group: the next start makes a new one."""
        self._started.discard(slot)
        if self._broken:
            await self._stop_group()

    async def _stop_group(self, locked: bool = False) -> None:
        composers, self._composers = self._composers, []
        candidates, self._candidates = self._candidates, None
        self._started, self._pins, self._broken = set(), {}, False
        for composer in composers:
            composer.kill()  # a composition in flight ends at once, and frees the turn
        if locked:
            await self._stopped(composers, candidates)
        else:
            async with self._turn:  # no new group starts before this one is gone
                await self._stopped(composers, candidates)

    async def _stopped(
        self, composers: list[ComposerWorker], candidates: SplitQueue | None
    ) -> None:
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
