"""Signal: wake every waiter on the next change, with an optional timeout; no polling."""

from __future__ import annotations

import asyncio


class Signal:
    """Waiters check their condition, then `await wait()`; `notify()` wakes them all.

    Everything runs on one event loop, so no notify can slip between a waiter's check and
    its wait: there is no await in between.
    """

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None

    def notify(self) -> None:
        future, self._future = self._future, None
        if future is not None and not future.done():
            future.set_result(None)

    async def wait(self, timeout: float | None) -> bool:
        """True when notified, False when the timeout passed first."""
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._future), timeout)
        except asyncio.TimeoutError:
            return False
        return True
