"""Ray Core actors as a split's producers (`backend = "ray"` in a dataset's config).

Slot i of a split is one actor (ray_actor.ProviderActor) holding the provider a worker process
would hold, placed anywhere on the cluster or on the nodes that carry a label. An actor returns
the encoded file; this process publishes it into the split's directory with the same atomic
write as every backend, and production journals it as usual. A file is a pure function of
(dataset config, split, seq, stream state), so it is byte for byte the file a worker process
makes, whichever node made it.

Failures. Ray never restarts these actors (max_restarts=0): a restarted actor would have lost
its forward stream, and Ray would place it where and when it can, out of the server's sight.
An actor that dies (killed, out of memory, its node gone) raises SlotDied on the call in
flight; while idle, its death ends a `watch` call that each actor holds open, and the slot is
reported exited (on_slot_exit). Either way production restarts the slot from the journaled
state (a worker restart in GetStats), with a new actor. A new actor waits for a node with room
for as long as the cluster answers: after STALL_REPORT_S the backend reports the stall
(on_stalled: "waiting N s for a Ray node with 1 CPU ...", refreshed every STALL_REPORT_S), so
the dataset is NOT_SERVING saying why, and serves again once a node takes the actor. The wait is
the slot's: an actor made again (one placed on a node that was going away) does not restart its
clock, so a lost node's stall is reported STALL_REPORT_S after the loss is noticed. A cluster
that goes away while no call is in flight (every slot idle behind a full backlog) is noticed
by a watch that asks the head every CLUSTER_CHECK_S: the idle slots are reported exited, and
their restart finds the cluster gone, so the dataset turns NOT_SERVING then, not when the next
file is wanted. The provider's own errors raise ProduceFailed.

Requirements: provider inputs (args' paths, relative to the config directory) and the data
root's dataset directory must be at the same paths on every node that may run an actor, and
the nodes must have batchqueue installed. This process must be able to join the cluster as a
Ray driver: a `ray_address` of HOST:PORT needs this machine to be a node of that cluster
(`ray start --address=HOST:PORT`), which is how Ray drivers connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_client.format.batchfile import publish_batch_file
from queue_client.format.layout import DatasetLayout
from queue_server.mixture.epochs import record_epoch_starts
from queue_server.production.backend import (
    ProducedFile,
    ProduceFailed,
    ProduceJob,
    ProductionBackend,
    SlotDied,
    WorkerPlace,
)
from queue_server.production.ray.ray_actor import Failed, Made, ProviderActor, Started
from queue_server.production.ray.ray_calls import (
    CLUSTER_CHECK_S,
    ClusterGone,
    actor_died,
    actor_reply,
    awaitable,
    check_some_node_matches,
    head_answers,
    slots_stall_message,
)
from queue_server.production.ray.ray_connect import (
    LOCAL,
    SPREAD,
    actor_cpus,
    connect,
    import_ray,
    placement_options,
)

log = logging.getLogger("queue_server.production")

# How long a new actor may wait for a node before the wait is reported, and how often the
# report's "waiting N s" is brought up to date.
STALL_REPORT_S = 10.0


@dataclass
class _Slot:
    actor: Any
    incarnation: str = ""
    node_id: str = ""
    pid: int = 0
    gone: bool = False  # stopped or killed by the server, or found dead
    watch: asyncio.Task[None] | None = None


class RayBackend(ProductionBackend):
    """One split's producers as Ray actors, one per slot.

    split, directory: the split's name, and where its files are published (the queue
        directory, or the candidates directory of a curriculum split).
    init: the worker init request (the dict DatasetRuntime builds for a worker process);
        worker_index and num_workers are set per slot from `slots`.
    meta_json: the settled meta, sent to every provider before its first file.
    cwd: the config directory, where relative provider paths are resolved on every node.
    ray_address, placement: the dataset's ray_address and ray_placement.
    num_cpus: the logical CPUs each actor reserves on its node (default: actor_cpus).
    stall_report_s: how long a new actor waits for a node before on_stalled is told.
    """

    def __init__(
        self,
        *,
        split: str,
        directory: Path,
        init: Mapping[str, Any],
        meta_json: str,
        cwd: Path,
        slots: int,
        ray_address: str = LOCAL,
        placement: str = SPREAD,
        num_cpus: float | None = None,
        stall_report_s: float = STALL_REPORT_S,
    ) -> None:
        self.split = split
        self.slots = slots
        self.directory = Path(directory)
        self.ray_address = ray_address
        self.placement = placement
        self._options = placement_options(placement)
        self._init = dict(init)
        self._meta_json = meta_json
        self._cwd = str(cwd)
        self._num_cpus = actor_cpus(ray_address) if num_cpus is None else num_cpus
        self._stall_report_s = stall_report_s
        self._label = f"{self._init.get('dataset', '?')}/{split}"
        self._slots: dict[int, _Slot] = {}
        self._restarts: dict[int, int] = {}  # slot -> actors made again for it
        self._stalled: dict[int, float] = {}  # slot -> when its actor began to wait for a node
        self._made: set[int] = set()  # slots that had an actor
        self._stateful = False
        self._actor_class: Any = None
        self._connection = 0  # connect()'s number when _actor_class was made
        self._watch: asyncio.Task[None] | None = None

    # ---- ProductionBackend ------------------------------------------------------------------
    async def start_slot(self, slot: int, state: dict[str, Any] | None) -> bool:
        await self._connect()
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._watch_cluster())
        current = self._slots.get(slot)
        if current is None or current.gone:
            if slot in self._made:
                self._restarts[slot] = self._restarts.get(slot, 0) + 1
            self._made.add(slot)
            current = await self._placed(slot)
        reply = await self._call(slot, current.actor.start.remote(self.split, state))
        if isinstance(reply, Failed):
            raise ProduceFailed(reply.message, reply.errno, reply.kind)
        assert isinstance(reply, Started)
        current.incarnation = reply.incarnation
        self._stateful = reply.stateful
        return reply.stateful

    async def produce(self, slot: int, job: ProduceJob) -> ProducedFile:
        current = self._slots.get(slot)
        if current is None or current.gone or not current.incarnation:
            raise SlotDied(f"{self._label}: slot {slot} is not started (or its actor died)")
        try:
            overrides = [list(o) for o in job.overrides]  # a mixture's SetMixture calls
            ref = current.actor.produce.remote(job.split, job.seq, job.state, overrides)
        except Exception as exc:  # a handle of an older join: another split joined again
            raise SlotDied(f"{self._label}: slot {slot}'s actor is unreachable: {exc}") from exc
        reply = await self._call(slot, ref)
        if reply.incarnation != current.incarnation:  # never, as Ray restarts no actor
            raise SlotDied(
                f"{self._label}: the Ray actor of slot {slot} was constructed again (it ran on "
                f"node {current.node_id}) and lost its stream; the slot restarts from the journal"
            )
        if isinstance(reply, Failed):
            raise ProduceFailed(reply.message, reply.errno, reply.kind)
        assert isinstance(reply, Made)
        encoded, starts = reply.encoded(), reply.epoch_starts
        if starts:  # recorded here, on the data root's machine, advance or not
            where = DatasetLayout(Path(self._init["data_root"]), self._init["dataset"])
            await asyncio.to_thread(record_epoch_starts, where, self.split, reply.seq, starts)
        if not job.publish:  # an advance: the stream moved past seq; nothing is written
            return ProducedFile(job.seq, "", 0, 0, reply.before, reply.after)
        try:
            published = await asyncio.to_thread(publish_batch_file, self.directory, encoded)
        except OSError as exc:  # a disk problem here, not a broken provider
            raise ProduceFailed(
                f"{self._label}: cannot publish seq {job.seq}: {exc}", exc.errno or 0, "OSError"
            ) from exc
        return ProducedFile(
            seq=job.seq,
            name=str(published.name),
            size_bytes=published.size_bytes,
            crc32=published.crc32,
            state_before=reply.before,
            state_after=reply.after,
        )

    async def stop_slot(self, slot: int) -> None:
        current = self._slots.pop(slot, None)
        if current is None:
            return
        self._retire(current)
        ray = import_ray()
        with contextlib.suppress(Exception):  # dead already, or slow to stop: killed anyway
            await asyncio.wait_for(awaitable(current.actor.stop.remote()), 5.0)
        with contextlib.suppress(Exception):
            ray.kill(current.actor, no_restart=True)

    async def close(self) -> None:
        self._stop_watch()
        await asyncio.gather(*(self.stop_slot(slot) for slot in list(self._slots)))

    def kill(self) -> None:
        self._stop_watch()
        for slot in list(self._slots):
            self._forget(slot)
        self._stalled.clear()

    async def _watch_cluster(self) -> None:
        """Report every slot exited once the head stops answering (see the module's doc)."""
        ray = import_ray()
        while True:
            await asyncio.sleep(CLUSTER_CHECK_S)  # the period of the check
            if not self._slots or self.on_slot_exit is None:
                continue
            try:
                address = ray.get_runtime_context().gcs_address
                if await asyncio.to_thread(head_answers, address):
                    continue
            except Exception:  # between joins (no connection): the restarts are under way
                continue
            for slot in list(self._slots):
                self.on_slot_exit(slot)  # production ignores the slots that are in a call

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def pids(self) -> list[int]:
        """Empty: actors are processes of Ray nodes, maybe of other machines (see stats())."""
        return []

    def workers(self) -> list[WorkerPlace]:
        return [
            WorkerPlace("provider", slot, "ray", s.pid, s.node_id, self._restarts.get(slot, 0))
            for slot, s in sorted(self._slots.items())
            if not s.gone
        ]

    def stats(self) -> dict[str, Any] | None:
        """Where each slot's actor runs, and how often it was made again."""
        return {
            "backend": "ray",
            "ray_address": self.ray_address,
            "placement": self.placement,
            "slots": [
                {"slot": w.index, "node_id": w.node_id, "pid": w.pid, "restarts": w.restarts}
                for w in self.workers()
            ],
        }

    def why_slow(self) -> str:
        return (
            f"files of {self._label} are made by Ray actors on the cluster at "
            f"{self.ray_address!r}; `ray status` shows whether they are placed and busy"
        )

    # ---- internals --------------------------------------------------------------------------
    async def _connect(self) -> None:
        connection = await asyncio.to_thread(connect, self.ray_address)
        if connection == self._connection:
            return
        ray = import_ray()
        for current in self._slots.values():  # handles of an older join are dead
            self._retire(current)
        self._slots.clear()  # every slot gets a new actor
        await asyncio.to_thread(
            check_some_node_matches, ray, self._options, self.placement, self.ray_address
        )
        self._actor_class = ray.remote(ProviderActor)
        self._connection = connection

    def _create(self, slot: int) -> _Slot:
        init = {**self._init, "worker_index": slot, "num_workers": self.slots}
        actor = self._actor_class.options(
            max_restarts=0,  # a new actor is the server's to make: see the module's doc
            max_task_retries=0,
            max_concurrency=2,  # a call, and the watch that tells of its death
            num_cpus=self._num_cpus,
            **self._options,
        ).remote(init, self._meta_json, self._cwd)
        self._slots[slot] = created = _Slot(actor)
        created.watch = asyncio.ensure_future(self._watch_actor(slot, created))
        return created

    async def _placed(self, slot: int) -> _Slot:
        """A new actor for the slot, once a node has taken it. It waits while the cluster
        answers; a wait longer than stall_report_s is reported (on_stalled) until it ends.
        An actor that dies before it answers (placed on a node that was going away, before
        the head knew) is no provider's failure: another one is made, and the wait goes on."""
        ray = import_ray()
        loop = asyncio.get_running_loop()
        began = loop.time()
        # The wait is the slot's, not one actor's: an actor made again does not reset it.
        report_at = began + self._stall_report_s
        try:
            while True:
                current = self._create(slot)
                ref = current.actor.where.remote()
                try:
                    while True:
                        try:
                            where = await self._call(slot, ref, max(0.0, report_at - loop.time()))
                            current.node_id, current.pid = where
                            return current
                        except asyncio.TimeoutError:
                            report_at = loop.time() + self._stall_report_s
                            self._stalled.setdefault(slot, began)
                            self._report_stall()
                except SlotDied as exc:
                    if not isinstance(exc.__cause__, ray.exceptions.RayActorError):
                        raise  # the cluster is gone
                    log.warning("%s; making another", exc)
                    self._forget(slot)
                    await asyncio.sleep(CLUSTER_CHECK_S)  # the head learns of the lost node
        except BaseException:
            self._forget(slot)
            raise
        finally:
            if self._stalled.pop(slot, None) is not None:
                self._report_stall()

    def _report_stall(self) -> None:
        if self.on_stalled is None:
            return
        if not self._stalled:
            self.on_stalled(None)
            return
        now = asyncio.get_running_loop().time()
        reason = slots_stall_message(
            self._label, self._stalled, now, self._num_cpus, self.placement
        )
        log.warning("%s", reason)
        self.on_stalled(reason)

    async def _watch_actor(self, slot: int, current: _Slot) -> None:
        """Wait on the actor's never-ending watch call: its end is the actor's death. An idle
        slot is then reported exited, so stats drop it and production makes a new actor."""
        died: BaseException | None = None
        try:
            await awaitable(current.actor.watch.remote())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            died = exc
        if current.gone or self._slots.get(slot) is not current:
            return
        current.gone = True
        log.warning(
            "%s", actor_died(f"{self._label} slot {slot}", current.node_id, current.pid, died)
        )
        if self.on_slot_exit is not None:
            self.on_slot_exit(slot)

    def _retire(self, current: _Slot) -> None:
        current.gone = True
        if current.watch is not None:
            current.watch.cancel()

    def _forget(self, slot: int) -> None:
        current = self._slots.pop(slot, None)
        if current is not None:
            self._retire(current)
            with contextlib.suppress(Exception):
                import_ray().kill(current.actor, no_restart=True)

    async def _call(self, slot: int, ref: Any, timeout_s: float | None = None) -> Any:
        """The reply to one actor call; Ray's failures become SlotDied or ProduceFailed, and
        a timeout (for a placement, which may take long) TimeoutError."""
        ray = import_ray()
        try:
            return await actor_reply(ref, ray.get_runtime_context().gcs_address, timeout_s)
        except ClusterGone:
            raise SlotDied(
                f"{self._label}: the Ray cluster at {self.ray_address!r} is gone (its head does "
                f"not answer) while slot {slot} waited for its actor"
            ) from None
        except ray.exceptions.RayTaskError as exc:  # the actor's method itself raised
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            raise ProduceFailed(
                f"{self._label}: slot {slot}: {type(cause).__name__}: {cause}",
                kind=type(cause).__name__,
            ) from exc
        except ray.exceptions.RayError as exc:  # the actor, its node or the cluster is gone
            current = self._slots.get(slot)
            if current is not None:
                current.gone = True  # out of stats at once; production restarts the slot
            node, pid = (current.node_id, current.pid) if current else ("", 0)
            raise SlotDied(actor_died(f"{self._label} slot {slot}", node, pid, exc)) from exc
