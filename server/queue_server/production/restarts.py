"""A slot that failed, stopped and started again, so a broken provider neither spins nor stalls.

A failing slot restarts at once the first time, then after a delay doubling from 0.5 s to 30 s
while it keeps failing (a worker that dies at start or on every file does not spin); the slot's
next file made ends the run of failures. Past max_restarts failures in a row the split fails.
Each slot counts its own failures: slots that die together (the actors of a lost Ray node) are
as many slots failing once each, not one slot failing again and again. A slot whose engine is
gone (BackendUnavailable: a Ray cluster lost) is no failure of the provider: it is retried with
a backoff of its own, and the split says it is unavailable meanwhile.

It drives the split's production through RestartedProduction, the few parts it reads and
writes, which Production (producer.py) implements: producer.py imports this, not the reverse.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from queue_server.background import BackgroundTasks
from queue_server.production.backend import BackendUnavailable, ProductionBackend
from queue_server.split.state import SplitState

log = logging.getLogger("queue_server.production")

# Restarts of a slot that keeps failing: the first at once, then this, doubling, capped.
WORKER_BACKOFF_S = (0.5, 30.0)
# Retries of a slot whose engine (a Ray cluster) is gone: soon at first, then every few seconds.
_UNAVAILABLE_BACKOFF_S = (0.5, 5.0)


class RestartedProduction(Protocol):
    """The production whose slots are restarted."""

    where: str
    split: str
    backend: ProductionBackend
    state: SplitState  # its error, backoff and restart counter
    stopped: bool
    busy: set[int]  # slots with a job, or down until their restart
    running: set[int]  # slots started
    tasks: BackgroundTasks

    async def start_slot(self, slot: int) -> None:
        """Start the slot (BackendUnavailable when its engine is gone)."""
        ...

    def kick(self) -> None:
        """Give every idle slot its next job."""
        ...


class SlotRestarts:
    """The restarts of one split's slots; production calls it when a slot fails or exits."""

    def __init__(
        self,
        production: RestartedProduction,
        *,
        max_restarts: int,
        on_fatal: Callable[[str], None],
        on_unavailable: Callable[[str | None], None],
    ) -> None:
        self._production = production
        self.max_restarts = max_restarts
        self._on_fatal = on_fatal
        self._on_unavailable = on_unavailable
        self._unavailable_backoff_s = _UNAVAILABLE_BACKOFF_S[0]
        self._unavailable = False
        # Failures in a row, per slot.
        self._failures: dict[int, int] = {}

    def succeeded(self, slot: int) -> None:
        """The slot made a file: its run of failures, and the backoff, end."""
        self._failures.pop(slot, None)
        self._production.state.worker_backoff_s = 0.0

    def exited_idle(self, slot: int) -> None:
        """A slot's process exited on its own. In a call, the call reports it; idle, it is
        restarted now, so stats never show a dead pid and the next file does not wait."""
        p = self._production
        if p.stopped or slot in p.busy or slot not in p.running:
            return
        p.busy.add(slot)  # no job for it meanwhile

        async def restart() -> None:
            p.busy.discard(slot)
            await self.failed(slot, f"{p.where} slot {slot} exited while idle")

        p.tasks.spawn(restart())

    async def failed(self, slot: int, message: str, permanent: bool = False) -> None:
        """Count the failure, then fail the split or restart the slot after its backoff. A
        `permanent` failure (a wrong config, a changed input) fails the split at once."""
        p = self._production
        if p.stopped:
            return
        failures = self._failures[slot] = self._failures.get(slot, 0) + 1
        p.state.last_error = message
        log.error("%s slot %d failed: %s", p.where, slot, message)
        if permanent:
            self._on_fatal(
                f"worker {slot} of split {p.split!r} failed with an error no restart mends: "
                f"{message}"
            )
            return
        if failures > self.max_restarts:
            self._on_fatal(
                f"worker {slot} of split {p.split!r} failed {failures} times in a row; "
                f"last error: {message}"
            )
            return
        p.running.discard(slot)
        p.busy.add(slot)
        await p.backend.stop_slot(slot)
        p.state.counters.worker_restarts += 1
        # The first failure in a row restarts at once; one that keeps failing waits longer.
        delay = 0.0
        if failures > 1:
            low, high = WORKER_BACKOFF_S
            delay = min(high, low * 2 ** (failures - 2))
        p.state.worker_backoff_s = delay
        if delay:
            log.warning(
                "%s slot %d: failure %d in a row; restarting it in %.1fs",
                p.where,
                slot,
                failures,
                delay,
            )
            await asyncio.sleep(delay)  # the backoff itself: the slot stays down meanwhile
            if p.stopped:
                return
        await self._restart(slot)

    async def _restart(self, slot: int) -> None:
        p = self._production
        try:
            await p.start_slot(slot)
        except BackendUnavailable as exc:
            # Not the provider's fault: retry with backoff, NOT_SERVING meanwhile.
            p.state.last_error = str(exc)
            self._unavailable = True
            self._on_unavailable(str(exc))
            delay = self._unavailable_backoff_s
            self._unavailable_backoff_s = min(delay * 2, _UNAVAILABLE_BACKOFF_S[1])
            log.warning("%s slot %d: %s; retrying in %.1fs", p.where, slot, exc, delay)
            asyncio.get_running_loop().call_later(
                delay, lambda: None if p.stopped else p.tasks.spawn(self._restart(slot))
            )
            return
        except Exception as exc:  # a slot that cannot even start counts as another failure
            p.busy.discard(slot)
            await self.failed(slot, f"restart failed: {exc}")
            return
        if self._unavailable:
            self._unavailable = False
            self._unavailable_backoff_s = _UNAVAILABLE_BACKOFF_S[0]
            self._on_unavailable(None)
        p.busy.discard(slot)
        p.kick()
