"""One provider worker process as the server's event loop sees it: start, one request at a
time, stop. (The code that runs inside it is worker_main.py; the pool of them is process_pool.py.)

Workers come from a multiprocessing forkserver that preloads torch and the providers, so
starting or restarting one costs a fork, not a fresh interpreter. Each talks JSON lines over a
socketpair read by asyncio, so waiting on a worker never blocks the loop; a worker that dies
(SIGKILL, OOM, os._exit) shows up as WorkerDied on the call in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from queue_server.production.backend import WorkerPlace
from queue_server.production.forkserver_start import forkserver_context

log = logging.getLogger("queue_server.worker_process")

# Stream states (a text provider's packer buffer) can be large; one line must fit.
_LINE_LIMIT = 256 * 1024 * 1024


def _run_worker(sock: socket.socket, cwd: str) -> None:
    """The worker's entry point, named here so that the server never imports worker_main:
    that imports torch and the providers (seconds of CPU), which only the forkserver and
    its children need."""
    from queue_server.production.worker_main import run_over_socket

    run_over_socket(sock, cwd)


def _start_then_close(proc: multiprocessing.process.BaseProcess, child: socket.socket) -> None:
    """Start the process, then close the parent's copy of the worker's socket end. Closed
    here, in the starting thread, and not by the awaiting task: a task cancelled mid-start
    (a server stopping) used to close it while start was still sending it to the forkserver,
    which then read EOF, printed a traceback and exited, so no worker could start again."""
    try:
        proc.start()
    finally:
        child.close()


def _kill_if_started(proc: multiprocessing.process.BaseProcess, done: asyncio.Future[None]) -> None:
    if done.cancelled() or done.exception() is not None:
        return
    with contextlib.suppress(Exception):
        proc.kill()


class WorkerDied(Exception):
    """The worker process exited; its exit code is in the message."""


class WorkerError(Exception):
    """The provider raised; the worker process is still alive."""

    def __init__(self, message: str, errno: int = 0, kind: str = "") -> None:
        super().__init__(message)
        self.errno = errno
        self.kind = kind


class WorkerProcess:
    def __init__(self, label: str, init: dict[str, Any], cwd: Path) -> None:
        self.label = label
        self._init = init
        self._cwd = cwd
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._watched: int | None = None
        self.init_reply: dict[str, Any] = {}
        # Called on the event loop when the process exits by itself (not by stop or kill), so
        # a worker that dies while idle is restarted at once, not when next asked for a file.
        self.on_exit: Callable[[], None] | None = None

    @property
    def init_request(self) -> dict[str, Any]:
        return dict(self._init)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> dict[str, Any]:
        parent, child = socket.socketpair()
        proc = forkserver_context().Process(
            target=_run_worker, args=(child, str(self._cwd)), name=self.label, daemon=True
        )
        starting = asyncio.ensure_future(asyncio.to_thread(_start_then_close, proc, child))
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # The thread runs on (a thread cannot be stopped); the process it starts, if any,
            # is nobody's, so it is killed once started.
            parent.close()
            starting.add_done_callback(lambda done: _kill_if_started(proc, done))
            raise
        except BaseException:
            parent.close()
            raise
        self._proc = proc
        self._watch(proc.sentinel)
        self._reader, self._writer = await asyncio.open_unix_connection(
            sock=parent, limit=_LINE_LIMIT
        )
        self.init_reply = await self.call({"op": "init", **self._init})
        return self.init_reply

    def _watch(self, sentinel: int) -> None:
        """Be told when the process exits: its sentinel becomes readable."""
        loop = asyncio.get_running_loop()
        self._watched = sentinel
        loop.add_reader(sentinel, self._exited)

    def _unwatch(self) -> None:
        if self._watched is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._watched)
            self._watched = None

    def _exited(self) -> None:
        self._unwatch()
        if self.on_exit is not None:
            self.on_exit()

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        reader, writer = self._reader, self._writer
        if reader is None or writer is None:
            raise WorkerDied(f"{self.label} is not running")
        try:
            writer.write(json.dumps(request, separators=(",", ":")).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if not line:
            code = await self._exit_code()
            raise WorkerDied(f"{self.label} (pid {self.pid}) exited with code {code}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise WorkerError(
                reply.get("error", "unknown error"), reply.get("errno") or 0, reply.get("kind", "")
            )
        return reply

    async def _exit_code(self) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        await asyncio.to_thread(proc.join, 5.0)
        return proc.exitcode

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Close the socket (the worker's loop ends), then make sure the process is gone."""
        self._unwatch()
        proc, writer = self._proc, self._writer
        self._proc = self._reader = self._writer = None
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        if proc is None:
            return
        await asyncio.to_thread(proc.join, timeout_s)
        if proc.exitcode is None:
            proc.kill()
            await asyncio.to_thread(proc.join, timeout_s)

    def place(self, role: str, index: int) -> WorkerPlace:
        return WorkerPlace(role, index, pid=self.pid or 0)

    def kill(self) -> None:
        self._unwatch()
        if self._proc is not None and self._proc.exitcode is None:
            with contextlib.suppress(Exception):
                self._proc.kill()
