"""A provider worker process as seen from the event loop: spawn, one request at a time, stop.

Replies arrive through asyncio's pipe reader, so waiting on a worker never blocks the loop;
a worker that dies (SIGKILL, OOM) shows up as WorkerDied on the call in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("queue_server.workers")

# Stream states (a text provider's packer buffer) can be large; one line must fit.
_LINE_LIMIT = 256 * 1024 * 1024


class WorkerDied(Exception):
    """The worker process exited; its exit code is in the message."""


class WorkerError(Exception):
    """The provider raised; the worker process is still alive."""

    def __init__(self, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.errno = errno


class WorkerProcess:
    def __init__(self, label: str, init: dict[str, Any], cwd: Path) -> None:
        self.label = label
        self._init = init
        self._cwd = cwd
        self._proc: asyncio.subprocess.Process | None = None
        self.init_reply: dict[str, Any] = {}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> dict[str, Any]:
        env = dict(os.environ)
        # Import the packages this server runs from, also when they are not installed.
        paths = [str(Path(p).resolve()) for p in sys.path if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "queue_server.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=self._cwd,
            env=env,
            limit=_LINE_LIMIT,
        )
        self.init_reply = await self.call({"op": "init", **self._init})
        return self.init_reply

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise WorkerDied(f"{self.label} is not running")
        try:
            proc.stdin.write(json.dumps(request, separators=(",", ":")).encode() + b"\n")
            await proc.stdin.drain()
            line = await proc.stdout.readline()
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if not line:
            code = await proc.wait()
            raise WorkerDied(f"{self.label} (pid {proc.pid}) exited with code {code}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise WorkerError(reply.get("error", "unknown error"), reply.get("errno") or 0)
        return reply

    async def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(Exception):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()

    def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
