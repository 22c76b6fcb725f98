"""Waiting on Ray actors from the event loop, for every kind of actor the server runs (a
split's providers, a curriculum's composers): a call's reply that notices a cluster gone, the
gist of a Ray error, and a placement no node matches named as a config error."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any

from queue_server.production.backend import ProduceFailed
from queue_server.production.ray.ray_probe import listening as head_answers

__all__ = [
    "CLUSTER_CHECK_S",
    "ClusterGone",
    "actor_died",
    "actor_reply",
    "awaitable",
    "check_some_node_matches",
    "gist",
    "head_answers",
    "slots_stall_message",
    "stall_message",
]

# How often a call that waits on an actor checks that the cluster's head still answers.
CLUSTER_CHECK_S = 2.0


class ClusterGone(Exception):
    """The cluster's head stopped answering while a call waited on one of its actors."""


async def actor_reply(ref: Any, gcs_address: str, timeout_s: float | None = None) -> Any:
    """The actor's reply, TimeoutError after timeout_s, or ClusterGone once the head stops
    answering: Ray retries a call whose actor died until the actor is back, and with the
    whole cluster gone that is forever."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    waiting = asyncio.ensure_future(awaitable(ref))
    try:
        while True:
            left = CLUSTER_CHECK_S if deadline is None else deadline - loop.time()
            done, _ = await asyncio.wait({waiting}, timeout=max(0.0, min(left, CLUSTER_CHECK_S)))
            if done:
                return waiting.result()
            if deadline is not None and loop.time() >= deadline:
                raise asyncio.TimeoutError
            if not await asyncio.to_thread(head_answers, gcs_address):
                raise ClusterGone
    finally:
        waiting.cancel()


def actor_died(what: str, node_id: str, pid: int, exc: BaseException | None = None) -> str:
    """One wording for an actor's death, whichever path notices it first: the call in flight,
    or the watch of an idle actor."""
    cause = f": {type(exc).__name__}: {gist(exc)}" if exc is not None else ""
    return f"{what}: its Ray actor died (node {node_id or '?'}, pid {pid or '?'}){cause}"


def stall_message(waited_s: float, cpus: float, placement: str, what: str) -> str:
    """Why nothing is made: a new actor no node has room for yet (Ray waits for one), or
    whose worker process is still starting. An actor that reserves no CPU (ray_address =
    "local") always has room: its wait is the process's start alone."""
    slow_start = (
        "a worker process starts slowly where other processes keep every core busy and Ray "
        "runs its workers below normal priority (RAY_worker_niceness, 15 unless set)"
    )
    if not cpus:
        return (
            f"waiting {waited_s:.0f} s for Ray to start the worker process of the actor of "
            f"{what} (it reserves no CPU, so any node has room); nothing is made for it "
            f"meanwhile: {slow_start}"
        )
    return (
        f"waiting {waited_s:.0f} s for a Ray node with {cpus:g} CPU free (ray_placement = "
        f"{placement!r}) to start the actor of {what}; nothing is made for it meanwhile. "
        "`ray status` shows what the cluster has free; a node that joins with room takes it. "
        f"A node that took it may still be starting it: {slow_start}"
    )


def slots_stall_message(
    label: str, since: Mapping[int, float], now: float, cpus: float, placement: str
) -> str:
    """stall_message for the slots of `label` waiting since the times in `since` ({slot:
    since}): every slot named, and the longest wait."""
    slots = sorted(since)
    which = f"slot {slots[0]}" if len(slots) == 1 else f"slots {', '.join(map(str, slots))}"
    return stall_message(now - min(since.values()), cpus, placement, f"{label} {which}")


def awaitable(ref: Any) -> Awaitable[Any]:
    async def wait() -> Any:
        return await ref

    return wait()


def gist(exc: BaseException) -> str:
    """The first and last lines of a Ray error: what happened, and the underlying error."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} ... {lines[-1]}"


def check_some_node_matches(
    ray: Any, options: Mapping[str, Any], placement: str, address: str
) -> None:
    """A label no node carries is a config error, not a wait for a node that never comes.
    Blocking (it asks the cluster): call it in a thread."""
    wanted = options.get("label_selector")
    if not wanted:
        return
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if not any(all((n.get("Labels") or {}).get(k) == v for k, v in wanted.items()) for n in alive):
        raise ProduceFailed(
            f"ray_placement = {placement!r} matches none of the {len(alive)} alive "
            f"nodes of the Ray cluster at {address!r}; start a node with "
            "`ray start --labels=KEY=VALUE`",
            kind="ConfigError",
        )
