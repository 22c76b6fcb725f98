"""A curriculum composer as a Ray actor (`backend = "ray"`), as the event loop sees it.

RayComposer has the interface CurriculumBackend uses from a WorkerProcess (label, start,
call, stop, kill, pid, on_exit, init_request) and speaks the same JSON requests, so the lane
does not care which kind runs its composers. The actor (composer_actor.ComposerActor) is
placed like a provider actor (`ray_placement`: spread, or on the nodes carrying a label) and
reserves what a provider actor does (ray_connect.actor_cpus: one CPU on a cluster). Each actor is named after its composer
("DATASET/SPLIT composer [SHARD] ID", in Ray's namespace "batchqueue"), so `ray list actors`
tells them apart.

Failures surface as a worker process's do. An actor that dies, whose node leaves, or that Ray
constructed anew (it lost the composer's state) raises WorkerDied on the call in flight, and
on_exit is called when it dies while idle: the lane then restarts all of the split's composers
from the snapshot. A cluster whose head stops answering is WorkerDied too; the restart that
follows then fails to join it with RayUnavailable (a BackendUnavailable), so the split waits
for the cluster as a provider actor's does. Actors are never restarted by Ray: a composer
that lost its state is of no use, and the lane makes new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from queue_server.curriculum.composer_actor import ComposerActor
from queue_server.production.backend import WorkerPlace
from queue_server.production.ray.ray_calls import (
    ClusterGone,
    actor_died,
    actor_reply,
    check_some_node_matches,
    stall_message,
)
from queue_server.production.ray.ray_connect import (
    LOCAL,
    SPREAD,
    actor_cpus,
    connect,
    import_ray,
    placement_options,
)
from queue_server.production.worker_process import WorkerDied, WorkerError

log = logging.getLogger("queue_server.curriculum")

# How long a new actor may wait for a node before the wait is reported (and again after each).
STALL_REPORT_S = 10.0
# How long stop() waits for Ray to report a killed actor dead, so that no composer of an
# older start can still write when the next one starts.
_STOP_WAIT_S = 5.0
_actor_classes: dict[int, Any] = {}  # connect()'s number -> ray.remote(ComposerActor)


class RayComposer:
    """One composer of a curriculum split as a Ray actor.

    label: names it in every message. init: the worker init request (as for a worker
    process). cwd: the config directory, where relative provider paths are resolved on every
    node. ray_address, placement: the dataset's ray_address and ray_placement. The actor
    waits for a node with room for as long as the cluster answers; a wait longer than
    stall_report_s is told to on_stalled (and None when it ends).
    """

    def __init__(
        self,
        label: str,
        init: Mapping[str, Any],
        cwd: Path,
        *,
        ray_address: str = LOCAL,
        placement: str = SPREAD,
        num_cpus: float | None = None,
        stall_report_s: float = STALL_REPORT_S,
    ) -> None:
        self.label = label
        self.ray_address = ray_address
        self.placement = placement
        self._options = placement_options(placement)
        self._init = dict(init)
        self._cwd = str(cwd)
        self._num_cpus = actor_cpus(ray_address) if num_cpus is None else num_cpus
        self._stall_report_s = stall_report_s
        self._actor: Any = None
        self._gcs_address = ""
        self._incarnation = ""
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False
        self.actor_name = ""
        self.node_id = ""
        self.actor_pid = 0  # the actor's process on its node, maybe another machine
        self.init_reply: dict[str, Any] = {}
        # Called on the event loop when the actor dies by itself (not by stop or kill).
        self.on_exit: Callable[[], None] | None = None
        # Called with why the start waits for a node (see the class's doc), None at its end.
        self.on_stalled: Callable[[str | None], None] | None = None

    @property
    def init_request(self) -> dict[str, Any]:
        return dict(self._init)

    @property
    def pid(self) -> int | None:
        """None: the actor is no process of this machine (see node_id and actor_pid)."""
        return None

    async def start(self) -> dict[str, Any]:
        """Join the cluster, place the actor, build its provider (the init request)."""
        ray = import_ray()
        connection = await asyncio.to_thread(connect, self.ray_address)  # RayUnavailable
        await asyncio.to_thread(
            check_some_node_matches, ray, self._options, self.placement, self.ray_address
        )
        actor_class = _actor_classes.get(connection)
        if actor_class is None:
            actor_class = _actor_classes[connection] = ray.remote(ComposerActor)
        self._gcs_address = ray.get_runtime_context().gcs_address
        self.actor_name = f"{self.label} {uuid.uuid4().hex[:8]}"
        self._actor = actor_class.options(
            name=self.actor_name,  # what `ray list actors` shows; unique per start
            max_restarts=0,
            max_task_retries=0,
            max_concurrency=2,  # a call, and the watch that tells of its death
            num_cpus=self._num_cpus,
            **self._options,
        ).remote(self._cwd)
        try:
            where = await self._placed(self._actor.where.remote())
        except BaseException:
            self.kill()
            raise
        self._incarnation, self.node_id, self.actor_pid = (
            where["incarnation"],
            where["node_id"],
            int(where["pid"]),
        )
        self._watcher = asyncio.ensure_future(self._watch(self._actor))
        self.init_reply = await self.call({"op": "init", **self._init})
        return self.init_reply

    async def _placed(self, ref: Any) -> dict[str, Any]:
        """The actor's where() reply, once a node took it; the wait is reported meanwhile."""
        began = asyncio.get_running_loop().time()
        stalled = False
        try:
            while True:
                try:
                    return dict(await self._get(ref, self._stall_report_s))
                except asyncio.TimeoutError:
                    stalled = True
                    waited = asyncio.get_running_loop().time() - began
                    reason = stall_message(waited, self._num_cpus, self.placement, self.label)
                    log.warning("%s", reason)
                    if self.on_stalled is not None:
                        self.on_stalled(reason)
        finally:
            if stalled and self.on_stalled is not None:
                self.on_stalled(None)

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request, its reply; WorkerError when it failed, WorkerDied when the actor did."""
        actor = self._actor
        if actor is None:
            raise WorkerDied(f"{self.label} is not running")
        try:
            ref = actor.call.remote(json.dumps(request, separators=(",", ":")))
        except Exception as exc:  # a handle of an older join: the cluster was joined again
            raise WorkerDied(f"{self.label}: its Ray actor is unreachable: {exc}") from exc
        line = await self._get(ref)
        reply = json.loads(line)
        if reply.get("incarnation") != self._incarnation:
            raise WorkerDied(
                f"{self.label}: its Ray actor was started again (it ran on node {self.node_id}) "
                "and lost the composer's state"
            )
        if not reply.get("ok"):
            raise WorkerError(
                reply.get("error", "unknown error"), reply.get("errno") or 0, reply.get("kind", "")
            )
        return dict(reply)

    async def _get(self, ref: Any, timeout_s: float | None = None) -> Any:
        ray = import_ray()
        try:
            return await actor_reply(ref, self._gcs_address, timeout_s)
        except ClusterGone:
            raise WorkerDied(
                f"{self.label}: the Ray cluster at {self.ray_address!r} is gone (its head does "
                "not answer)"
            ) from None
        except ray.exceptions.RayTaskError as exc:  # the method raised: the actor lives on
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            raise WorkerError(
                f"{self.label}: {type(cause).__name__}: {cause}", kind=type(cause).__name__
            ) from exc
        except ray.exceptions.RayError as exc:  # the actor, its node or the cluster is gone
            raise WorkerDied(actor_died(self.label, self.node_id, self.actor_pid, exc)) from exc

    async def _watch(self, actor: Any) -> None:
        """Wait on the actor's never-ending watch call; its end is the actor's death. The
        message is the one a call in flight gets (actor_died): which path notices a death
        first is a matter of timing."""
        try:
            await self._get(actor.watch.remote())
            message = actor_died(self.label, self.node_id, self.actor_pid)
        except Exception as exc:
            message = str(exc)  # WorkerDied(actor_died(...)), or the cluster gone
        if not self._stopping and self.on_exit is not None:
            log.warning("%s", message)
            self.on_exit()

    async def stop(self, timeout_s: float = _STOP_WAIT_S) -> None:
        """Kill the actor and wait until Ray reports it gone."""
        watcher, self._watcher = self._watcher, None
        self.kill()
        self._actor = None
        if watcher is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watcher, timeout_s)

    def place(self, role: str, index: int) -> WorkerPlace:
        return WorkerPlace(role, index, "ray", self.actor_pid, self.node_id)

    def kill(self) -> None:
        self._stopping = True
        if self._actor is not None:
            with contextlib.suppress(Exception):  # gone already, or the cluster is
                import_ray().kill(self._actor, no_restart=True)
