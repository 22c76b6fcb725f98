"""The local backend: a pool of provider worker processes on this machine, one per slot.

Each slot is a forkserver worker (worker_process.py) that publishes its files into the split's
directory itself. A worker that dies mid-file leaves a temp file named after its pid, removed
here before the slot is restarted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from queue_client.format.layout import remove_temp_files
from queue_server.production.backend import (
    ProducedFile,
    ProduceFailed,
    ProduceJob,
    ProductionBackend,
    SlotDied,
    WorkerPlace,
)
from queue_server.production.worker_process import WorkerDied, WorkerError, WorkerProcess


class ProcessPoolBackend(ProductionBackend):
    def __init__(
        self,
        split: str,
        slots: int,
        make_worker: Callable[[int], WorkerProcess],
        meta_json: str,
        files_dir: Path,
        into_candidates: bool = False,
    ) -> None:
        self.split = split
        self.slots = slots
        self._make_worker = make_worker
        self._meta_json = meta_json
        self._files_dir = files_dir
        self._into_candidates = into_candidates
        self._workers: list[WorkerProcess | None] = [None] * slots

    async def start_slot(self, slot: int, state: dict[str, Any] | None) -> bool:
        worker = self._make_worker(slot)
        worker.on_exit = lambda: self._exited(slot, worker)
        self._workers[slot] = worker
        reply = await worker.start()
        await worker.call(
            {"op": "set_meta", "meta_json": self._meta_json, "split": self.split, "state": state}
        )
        return bool(reply.get("stateful", False))

    def _exited(self, slot: int, worker: WorkerProcess) -> None:
        if self._workers[slot] is worker and self.on_slot_exit is not None:
            self.on_slot_exit(slot)

    async def produce(self, slot: int, job: ProduceJob) -> ProducedFile:
        worker = self._workers[slot]
        if worker is None:
            raise SlotDied(f"slot {slot} is not running")
        request: dict[str, Any] = {
            "op": "produce",
            "split": job.split,
            "seq": job.seq,
            "state": job.state,
        }
        if self._into_candidates:
            request["into"] = "candidates"
        if not job.publish:
            request["publish"] = False
        if job.overrides:  # a mixture's SetMixture calls (queue_server/mixture)
            request["overrides"] = [list(o) for o in job.overrides]
        try:
            reply = await worker.call(request)
        except WorkerError as exc:
            raise ProduceFailed(str(exc), exc.errno, exc.kind) from None
        except WorkerDied as exc:
            await asyncio.to_thread(remove_temp_files, self._files_dir, worker.pid)
            raise SlotDied(str(exc)) from None
        return ProducedFile(
            job.seq,
            reply["name"],
            reply["bytes"],
            reply["crc"],
            reply.get("before") or {},
            reply.get("after") or {},
        )

    async def stop_slot(self, slot: int) -> None:
        worker, self._workers[slot] = self._workers[slot], None
        if worker is not None:
            worker.kill()
            await worker.stop()

    async def close(self) -> None:
        for slot in range(self.slots):
            worker, self._workers[slot] = self._workers[slot], None
            if worker is not None:
                await worker.stop()

    def kill(self) -> None:
        for worker in self._workers:
            if worker is not None:
                worker.kill()

    def pids(self) -> list[int]:
        return [w.pid for w in self._workers if w is not None and w.pid is not None]

    def workers(self) -> list[WorkerPlace]:
        return [
            WorkerPlace("provider", slot, pid=(w.pid or 0) if w is not None else 0)
            for slot, w in enumerate(self._workers)
        ]
