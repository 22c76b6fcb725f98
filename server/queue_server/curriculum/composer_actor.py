"""The code that runs inside a curriculum composer's Ray actor (`backend = "ray"`).

The actor holds what a composer worker process holds, and answers the same JSON requests with
the same code (worker_main.WorkerSession): init builds the provider (which estimates the
corpus distribution), set_meta, then ComposerHost's curriculum_init, compose and materialize.
It reads candidate files and writes served files and snapshots by path, as the worker process
does: the data root must be at the same path on every node that may run it.

Every reply carries the actor's incarnation, drawn anew whenever Ray constructs it, so the
server never mistakes a restarted actor, which has lost the composer's state, for the one it
started. `watch` never returns: the server keeps one call of it in flight (the actor runs two
threads), and that call failing tells it the actor died while idle. This module imports no Ray at import
time, nor torch: ray_composer.py wraps the class with `ray.remote` in the server process.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from typing import Any


class ComposerActor:
    """One composer of a curriculum split. `call` never raises: errors are error replies."""

    def __init__(self, cwd: str) -> None:
        # Nothing here may fail: an error in a constructor kills the actor for good. The
        # first call checks the config directory and builds the session instead.
        self._cwd = cwd
        self._session: Any = None
        self.incarnation = uuid.uuid4().hex

    def call(self, line: str) -> str:
        """One request line in, one reply line out, as over a worker process's socket."""
        try:
            reply = self._ready().answer(json.loads(line))
        except Exception as exc:  # a missing config directory, a bad line
            from queue_server.production.worker_main import error_reply

            reply = error_reply(exc)
        if not reply.get("ok") and "error" in reply:
            reply["error"] = f"{reply['error']} (on Ray node {node_id()})"
        reply["incarnation"] = self.incarnation
        return json.dumps(reply, separators=(",", ":"))

    def where(self) -> dict[str, Any]:
        """Which node and process this incarnation runs in."""
        return {"incarnation": self.incarnation, "node_id": node_id(), "pid": os.getpid()}

    def watch(self) -> None:
        """Never returns: the call fails when the actor dies, which is what it is for."""
        threading.Event().wait()

    def _ready(self) -> Any:
        if self._session is None:
            import torch

            from queue_server.logs import configure_logging
            from queue_server.production.worker_main import WorkerSession

            # As in a worker process: batchqueue's log lines (Ray passes them to the server's
            # output), and one thread, since parallelism comes from composer_workers.
            configure_logging()
            torch.set_num_threads(1)
            if not os.path.isdir(self._cwd):
                raise FileNotFoundError(
                    f"the config directory {self._cwd} does not exist on Ray node "
                    f"{node_id()}: provider inputs and the data root must be at the same "
                    "paths on every node"
                )
            os.chdir(self._cwd)  # relative paths in provider args are relative to the config
            self._session = WorkerSession(whole_process=False)
        return self._session


def node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())
