"""The code that runs inside a Ray actor: one slot's provider, making files on any node.

The actor is built exactly as a worker process builds its provider (the same init request),
but it never writes into the queue: `produce` returns the encoded file, and the server
publishes it with the same atomic write and journal as the worker backend. A batch file is a
pure function of (dataset config, split, seq, stream state), so its bytes do not depend on
the node that made it.

Every reply carries the actor's incarnation, drawn anew each time Ray constructs it. Ray never
restarts these actors (the server makes a new one, from the journaled state), so a reply of
another incarnation would be a file of a lost stream: the server never publishes one.
This module imports no Ray: ray_backend.py wraps the class with `ray.remote`.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from queue_client.format.batchfile import EncodedBatchFile
from queue_client.format.meta import meta_from_json
from queue_providers import DataProviderBase
from queue_server.production.priority import apply_worker_priority
from queue_server.production.provider_init import (
    build_provider,
    check_own_inputs,
    one_torch_thread,
    set_weight_changes,
)


@dataclass(frozen=True)
class Started:
    """The slot's provider is ready and its forward stream is at the state it was given."""

    incarnation: str
    stateful: bool
    node_id: str
    pid: int


@dataclass(frozen=True)
class Made:
    """One encoded file, and the stream state before and after it."""

    incarnation: str
    seq: int
    num_batches: int
    data: bytes
    crc32: int
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    # A mixture's source epochs that start in the file: the server records them, since
    # this node may not share its filesystem (EncodedBatchFile.epoch_starts).
    epoch_starts: tuple[tuple[str, int, int], ...] = ()

    def encoded(self) -> EncodedBatchFile:
        """The file as the publishing side takes it."""
        return EncodedBatchFile(
            self.seq, self.num_batches, self.data, self.crc32, self.epoch_starts
        )


@dataclass(frozen=True)
class Failed:
    """The provider raised; the actor still runs. kind is the exception's class name."""

    incarnation: str
    message: str
    errno: int = 0
    kind: str = ""


class ProviderActor:
    """One slot's provider. Methods never raise: a provider error comes back as Failed."""

    def __init__(self, init: Mapping[str, Any], meta_json: str, cwd: str) -> None:
        # Nothing here may fail: Ray reruns the constructor on every restart, and an error
        # would kill the actor for good. The provider is built by the first call instead.
        self._init = dict(init)
        self._meta_json = meta_json
        self._cwd = cwd
        self._provider: DataProviderBase | None = None
        self.incarnation = uuid.uuid4().hex

    def where(self) -> tuple[str, int]:
        """(node id, pid): answers as soon as a node has taken the actor."""
        return _node_id(), os.getpid()

    def watch(self) -> None:
        """Never returns: the call ends when the actor does, which is how the server learns
        of a death while the slot is idle (the actor runs two calls at once for it)."""
        threading.Event().wait()

    def start(self, split: str, state: Mapping[str, Any] | None) -> Started | Failed:
        """Build the provider if need be and move the split's forward stream to `state`."""
        try:
            provider = self._built()
            if state:
                provider.load_state_dict(split, state)
            stateful = provider.streams
            return Started(self.incarnation, stateful, _node_id(), os.getpid())
        except Exception as exc:  # reported to the server, which decides to retry or fail
            return self._failed(exc)

    def produce(
        self,
        split: str,
        seq: int,
        state: Mapping[str, Any] | None,
        overrides: list[Any] | None = None,
    ) -> Made | Failed:
        """Make file `seq`: from the forward stream, or from a journaled `state`, after which
        the forward stream is restored, so re-making an old seq never disturbs the next one.
        `overrides`: a mixture's SetMixture calls."""
        try:
            provider = self._built()
            set_weight_changes(provider, split, overrides)
            forward = None
            if state is not None:
                forward = provider.state_dict(split)
                provider.load_state_dict(split, state)
            try:
                before = provider.state_dict(split)
                encoded = provider.make_file(split, seq)
                after = provider.state_dict(split)
            finally:
                if forward is not None:
                    provider.load_state_dict(split, forward)
            return Made(
                self.incarnation,
                seq,
                encoded.num_batches,
                encoded.data,
                encoded.crc32,
                before,
                after,
                encoded.epoch_starts,
            )
        except Exception as exc:
            return self._failed(exc)

    def stop(self) -> None:
        """The provider's on_stop, before the actor is killed."""
        if self._provider is not None:
            self._provider.on_stop()

    def _built(self) -> DataProviderBase:
        if self._provider is None:
            if not os.path.isdir(self._cwd):
                raise FileNotFoundError(
                    f"the config directory {self._cwd} does not exist on Ray node "
                    f"{_node_id()}: provider inputs must be at the same paths on every node"
                )
            os.chdir(self._cwd)  # relative paths in provider args are relative to the config
            apply_worker_priority(self._init.get("priority", "normal"), this_thread_only=True)
            provider = build_provider(self._init)
            provider.on_start()
            check_own_inputs(provider, self._init)
            provider.set_meta(meta_from_json(self._meta_json))
            self._provider = provider
        # One thread per actor, as in a worker process, once torch is there: char_lm's
        # actors never import it.
        one_torch_thread()
        return self._provider

    def _failed(self, exc: Exception) -> Failed:
        return Failed(
            self.incarnation,
            f"{type(exc).__name__}: {exc} (on Ray node {_node_id()})",
            getattr(exc, "errno", None) or 0,
            type(exc).__name__,
        )


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
