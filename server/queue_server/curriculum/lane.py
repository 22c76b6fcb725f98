"""A curriculum split's producer, as its SplitQueue sees it: one "worker" whose produce
composes served file seq from candidates, in seq order.

Behind it: a SplitQueue of candidate files (the provider's own workers, with backpressure,
journal, crash restarts and reproduction, exactly as for a plain split) and one composer
process. The lane pins each candidate file the composer's buffer holds (a lease that never
expires), hands their paths to the composer, and releases a candidate as consumed once the
composer retires it, which deletes it. The candidate queue's window runs from the oldest
pinned file, so candidates on disk stay bounded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from queue_client import errors
from queue_server.split_queue import CONSUMED, SplitQueue
from queue_server.workers import WorkerError, WorkerProcess

log = logging.getLogger("queue_server.curriculum")

COMPOSER_CLIENT = "curriculum-composer"
_PIN_WAIT_S = 3600.0


class CurriculumLane:
    def __init__(
        self,
        label: str,
        composer: WorkerProcess,
        candidates: SplitQueue,
        init: dict[str, Any],
    ) -> None:
        self.label = label
        self._composer = composer
        self._candidates = candidates
        self._init = init  # curriculum_init request, less the snapshot
        self._pins: dict[int, str] = {}  # candidate seq -> lease id
        self._needed: list[int] = []
        self.stats: dict[str, Any] = {}
        self.init_reply: dict[str, Any] = {}

    @property
    def pid(self) -> int | None:
        return self._composer.pid

    @property
    def on_exit(self) -> Callable[[], None] | None:
        return self._composer.on_exit

    @on_exit.setter
    def on_exit(self, callback: Callable[[], None] | None) -> None:
        self._composer.on_exit = callback

    @property
    def candidates(self) -> SplitQueue:
        return self._candidates

    async def start(self) -> dict[str, Any]:
        await self._candidates.open()
        await self._composer.start()
        self.init_reply = {"ok": True, "stateful": True}
        return self.init_reply

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        try:
            if op == "set_meta":
                return await self._set_meta(request)
            if op == "produce":
                if request.get("state") is not None:  # a journaled seq, made again
                    return await self._materialize(request)
                return await self._compose(request)
        except errors.BatchQueueError as exc:  # the candidate queue failed or is closing
            raise WorkerError(str(exc), kind=type(exc).__name__) from None
        raise WorkerError(f"unknown op {op!r}")

    async def _set_meta(self, request: dict[str, Any]) -> dict[str, Any]:
        await self._composer.call({**request, "state": None})
        state = request.get("state") or {}
        reply = await self._composer.call(
            {**self._init, "op": "curriculum_init", "snapshot": state.get("snapshot")}
        )
        self._take(reply)
        await asyncio.gather(*(self._pin(c) for c in reply["held"]))
        return {"ok": True}

    def _take(self, reply: dict[str, Any]) -> None:
        self._needed = list(reply["needed"])
        self.stats = dict(reply["stats"])

    async def _pin(self, seq: int) -> str:
        """The path of candidate `seq`, leased until released; produced (again) if need be."""
        lease, entry = await self._candidates.acquire(
            0, 1, COMPOSER_CLIENT, seq, _PIN_WAIT_S, carried=True, pin=True
        )
        self._pins[seq] = lease.lease_id
        return str(self._candidates.dir / entry.name)

    def _unpin(self, seq: int) -> None:
        lease_id = self._pins.pop(seq, None)
        if lease_id is not None:
            with_lease = self._candidates.leases.get(lease_id)
            if with_lease is not None:
                self._candidates.release(lease_id, COMPOSER_CLIENT, CONSUMED, "")

    async def _paths(self, seqs: list[int]) -> dict[str, str]:
        paths = await asyncio.gather(*(self._pin(c) for c in seqs))
        return {str(c): p for c, p in zip(seqs, paths, strict=True)}

    async def _compose(self, request: dict[str, Any]) -> dict[str, Any]:
        held = sorted(self._pins)
        paths = await self._paths(sorted(set(held) | set(self._needed)))
        reply = await self._composer.call(
            {
                "op": "compose",
                "seq": request["seq"],
                "world_size": request.get("world_size", 1),
                "overrides": request.get("overrides", []),
                "paths": paths,
            }
        )
        for c in reply["retired"]:
            self._unpin(c)
        self._take(reply)
        return reply

    async def _materialize(self, request: dict[str, Any]) -> dict[str, Any]:
        """Make an old served file again from its journaled picks (a rewind, a quarantine)."""
        state = request["state"]
        if "picks" not in state:
            raise WorkerError(
                f"served seq {request['seq']} has no journaled picks: it cannot be made again"
            )
        wanted = sorted({int(c) for c, _ in state["picks"]})
        extra = [c for c in wanted if c not in self._pins]
        try:
            paths = await self._paths(wanted)
            return await self._composer.call(
                {
                    "op": "materialize",
                    "seq": request["seq"],
                    "picks": state["picks"],
                    "alphas": state["alphas"],
                    "paths": paths,
                }
            )
        finally:
            for c in extra:  # retired before: retire again
                self._unpin(c)

    async def stop(self, timeout_s: float = 5.0) -> None:
        await self._composer.stop(timeout_s)
        await self._candidates.close()

    def kill(self) -> None:
        self._composer.kill()
        self._candidates.fail("the curriculum composer was stopped")
