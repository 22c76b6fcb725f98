"""Joining a Ray cluster from the server: the install hint, placement options, and a
connect that fails within CONNECT_TIMEOUT_S naming the address (ray.init alone may wait
minutes on an address where no cluster answers), and names a refused token as such."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from queue_client.errors import ConfigError
from queue_server.config.server import parse_ray_placement
from queue_server.production.backend import BackendUnavailable
from queue_server.production.ray.ray_probe import (
    HeadRefused,
    cluster_id,
    host_port,
    listening,
    refused_message,
)

LOCAL = "local"
SPREAD = "spread"
NAMESPACE = "batchqueue"
# ray.init can wait minutes on an address where no cluster answers; this bounds the start.
CONNECT_TIMEOUT_S = 15.0
INSTALL_HINT = "pip install 'batchqueue[ray]'"
# The niceness Ray's raylet gives the worker processes it starts (15 unless set).
WORKER_NICENESS = "RAY_worker_niceness"


class RayUnavailable(ConfigError, BackendUnavailable):
    """Ray is not installed, or no Ray cluster answered at ray_address in time. A ConfigError:
    a dataset that can never be served fails the server's start."""


def import_ray() -> Any:
    """The ray module, or RayUnavailable saying how to install it."""
    # Never start a cluster behind our back: an actor made while the connection is being
    # renewed must fail (and be made again), not start a local Ray inside the server.
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    # The server owns SIGTERM and SIGINT (a clean stop, exit code 0). Ray's handler for
    # failure signals would print a stack dump on SIGTERM. (Read when ray is imported.)
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray
    except ImportError:
        raise RayUnavailable(
            f'backend = "ray" needs Ray, which is not installed here: {INSTALL_HINT}'
        ) from None
    return ray


def placement_options(placement: str) -> dict[str, Any]:
    """Ray actor options for a `ray_placement`: "spread" over the cluster's nodes, or
    "node:KEY=VALUE" for only the nodes started with that label (`ray start --labels`; Ray's
    label_selector, 2.49 and later)."""
    labels = parse_ray_placement(placement)
    if labels is None:
        raise ConfigError(
            f'ray_placement = {placement!r} is invalid: expected "spread" or "node:KEY=VALUE" '
            "(a node label, such as node:batchqueue=producer)"
        )
    return {"label_selector": labels} if labels else {"scheduling_strategy": "SPREAD"}


_connect_lock = threading.Lock()
_connected_to: str | None = None
_joined_cluster: bytes | None = None  # the head's cluster id at the join (None: "local")
_connections = 0  # how many times this process joined a cluster


def actor_cpus(address: str) -> float:
    """The logical CPUs each actor reserves. On a cluster one (a provider or composer is one
    busy thread), which spreads them over nodes by their cores. An instance started with
    "local" is one node with as many CPUs as the machine: reserving one each would leave the
    actors past that count waiting for good (a 2-core laptop could not run train's 2 actors
    beside val's), so there they reserve none and share the cores, as worker processes do."""
    return 0.0 if address == LOCAL else 1.0


def connect(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> int:
    """Connect this process to Ray, or check it still is: "local" starts a cluster in this
    process; any other address is joined, and joined again after the whole cluster went away.
    Returns a number that changes with every join (actor handles of an older one are dead).
    Raises RayUnavailable naming the address when no cluster answers within timeout_s, or
    naming token authentication when the head refuses this process's token.
    Every backend of a process must name the same address."""
    global _connected_to, _connections, _joined_cluster
    ray = import_ray()
    with _connect_lock:
        if _connected_to is not None and ray.is_initialized():
            if address != _connected_to:
                raise ConfigError(
                    f"ray_address = {address!r}, but this server is connected to Ray at "
                    f"{_connected_to!r} already: one server uses one Ray cluster"
                )
            if address == LOCAL or _same_cluster(ray.get_runtime_context().gcs_address):
                return _connections
            # The whole cluster is gone, or its head was started again (a new cluster at the
            # same address). A driver cannot follow its head to a new cluster, so drop this
            # connection and join afresh, which fails until the cluster is back.
            ray.shutdown()
            _connected_to = None
        # Ray ends a driver whose cluster head is gone for 60 s. The server must outlive its
        # cluster: the split fails its slots, and comes back when the cluster does.
        os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(10**9))
        deadline = time.monotonic() + timeout_s
        kwargs: dict[str, Any] = {"namespace": NAMESPACE, "ignore_reinit_error": True}
        if address == LOCAL:
            kwargs["include_dashboard"] = False
            # Ray starts its worker processes at niceness 15: where other processes keep every
            # core busy, a new actor's process (one replacing a dead actor) gets about 1% of a
            # core and takes minutes to start. The instance started here is the server's own:
            # its actors run at normal priority, as the local backend's workers do. The
            # raylet started below reads it from the environment; a value set already stays.
            os.environ.setdefault(WORKER_NICENESS, "0")
        else:
            _probe(address, timeout_s)
        try:
            if address == LOCAL:
                # In this thread: Ray ties the processes of a cluster it starts to the thread
                # that started it (they die when it ends), and starting one does not hang.
                ray.init(address=address, **kwargs)
            else:
                _run_with_deadline(
                    lambda: ray.init(address=address, **kwargs), deadline - time.monotonic()
                )
        except TimeoutError:
            raise RayUnavailable(
                f"ray_address = {address!r}: no Ray cluster answered within {timeout_s:.0f} s. "
                "Give the address `ray start --head` printed, on a machine that is itself a "
                'node of that cluster (`ray start --address=...`), or "local"'
            ) from None
        except Exception as exc:
            raise RayUnavailable(
                f"ray_address = {address!r}: cannot join the Ray cluster: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        _connected_to = address
        _connections += 1
        _joined_cluster = None
        if address != LOCAL:
            try:
                _joined_cluster = cluster_id(ray.get_runtime_context().gcs_address)
            except HeadRefused:
                _joined_cluster = None
        return _connections


def disconnect() -> None:
    """Leave Ray at the server's stop. An instance started with "local" stops with it: its
    processes (the head, the raylet and their agents) would outlive the server otherwise.
    A no-op where this process never joined a cluster (Ray is not even imported)."""
    global _connected_to
    with _connect_lock:
        if _connected_to is None:
            return
        _connected_to = None
        import_ray().shutdown()


def _same_cluster(gcs_address: str) -> bool:
    """Whether the head at gcs_address still answers as the cluster this process joined."""
    try:
        now = cluster_id(gcs_address)
    except HeadRefused:
        return False
    if now is None:  # no answer in time: a head busy on a loaded machine is not a gone one
        return listening(gcs_address)
    return _joined_cluster is None or now == _joined_cluster


def _probe(address: str, timeout_s: float) -> None:
    """Fail fast where nothing listens, or where the head refuses our token: ray.init
    itself would retry for minutes, saying why only in Ray's log."""
    where = host_port(address)
    if where is None:  # "auto" and friends: ray.init finds the cluster itself
        return
    try:
        socket.create_connection(where, timeout=timeout_s).close()
    except OSError as exc:
        raise RayUnavailable(
            f"ray_address = {address!r}: cannot reach a Ray cluster there "
            f'({exc.strerror or exc}); start one with `ray start --head`, or use "local"'
        ) from None
    try:
        cluster_id(address, min(timeout_s, 5.0))
    except HeadRefused as exc:
        raise RayUnavailable(refused_message(address, str(exc))) from None


def _run_with_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn() in a daemon thread: its result, its exception, or TimeoutError after timeout_s.

    FIXME: a late fn goes on in its thread. The caller fails the dataset and the server exits,
    so nothing waits for it, and as a daemon thread it never holds the process up.
    """
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:
            outcome.append((False, exc))
        done.set()

    threading.Thread(target=run, name="ray-connect", daemon=True).start()
    if not done.wait(max(timeout_s, 0.0)):
        raise TimeoutError
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
