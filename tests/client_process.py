"""Trainer processes for the tests, forked from a process that has imported torch already.

A test's trainer is a process of its own, as a real one is: its own pid, its own gRPC
channels, killed with SIGKILL where a test needs it. Started with `python -c` or `python
script.py`, each one imports torch again, a second or more of CPU; the suite starts about two
hundred of them. `ClientProcess` forks them instead from the workers' forkserver of the test
process (queue_server.production.worker_process), which has torch and the providers imported
and is started once per test process. The child sets up its stdio, environment and argv as a
fresh interpreter would have them, runs the script or code as `__main__`, runs its atexit
handlers and exits with the script's exit status.

It answers the part of subprocess.Popen's interface the tests use: pid, returncode, poll,
wait, communicate, send_signal, kill, and text-mode stdin/stdout/stderr pipes.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import runpy
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from multiprocessing import reduction
from pathlib import Path
from typing import IO, Any

SUPPORT = Path(__file__).resolve().parent / "support"
# Environment every trainer of the tests gets beside the test process's own, as
# conftest.subprocess_env gives it.
_DEFAULT_ENV = {"GRPC_VERBOSITY": "ERROR"}


class _InheritedFd:
    """A descriptor handed to the forked child through the forkserver (SCM_RIGHTS)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return int(dup.detach())


def _child(
    stdio: tuple[int, int, int],
    argv: list[str],
    code: str | None,
    env: dict[str, str],
    cwd: str | None,
) -> None:
    """In the forked child: become the trainer process and run its code as `__main__`."""
    for target, fd in zip((0, 1, 2), stdio, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(
        open(2, "wb", closefd=False), encoding="utf-8", line_buffering=True
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the forkserver ignores it; a trainer not
    os.environ.clear()  # the caller's environment now, not the forkserver's at its start
    os.environ.update(env)
    sys.path.insert(0, str(SUPPORT))  # as conftest.subprocess_env's PYTHONPATH has it
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = list(argv)
    try:
        if code is not None:
            sys.path.insert(0, "")
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()


class ClientProcess:
    """`python -c CODE` or `python SCRIPT ARGS...`, forked with torch already imported."""

    def __init__(
        self,
        script: Path | None = None,
        args: list[str] | None = None,
        *,
        code: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        from queue_server.production.forkserver_start import forkserver_context

        assert (script is None) != (code is None), "give a script or code"
        argv = ["-c"] if code is not None else [str(script)]
        argv += list(args or [])
        ends = [os.pipe() for _ in range(3)]
        child_ends = (ends[0][0], ends[1][1], ends[2][1])
        self._proc = forkserver_context().Process(
            target=_child,
            args=(
                tuple(_InheritedFd(fd) for fd in child_ends),
                argv,
                code,
                {**os.environ, **_DEFAULT_ENV, **(env or {})},
                None if cwd is None else os.fspath(cwd),
            ),
            daemon=False,
        )
        try:
            self._proc.start()
        finally:
            for fd in child_ends:
                os.close(fd)
        self.stdin: IO[str] = open(ends[0][1], "w", encoding="utf-8")
        self.stdout: IO[str] = open(ends[1][0], encoding="utf-8")
        self.stderr: IO[str] = open(ends[2][0], encoding="utf-8")
        self.pid = int(self._proc.pid or 0)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"trainer process {self.pid}", timeout or 0.0)
        self.returncode = self._proc.exitcode
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Close stdin, read stdout and stderr to their end, wait for the exit."""
        with contextlib.suppress(OSError):
            self.stdin.close()
        got: dict[str, str] = {}

        def read(name: str, stream: IO[str]) -> None:
            got[name] = stream.read()

        readers = [
            threading.Thread(target=read, args=(name, stream), daemon=True)
            for name, stream in (("out", self.stdout), ("err", self.stderr))
        ]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:  # the child's ends closed with it
            reader.join(30)
        self._close_streams()
        return got.get("out", ""), got.get("err", "")

    def _close_streams(self) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                stream.close()

    def __del__(self) -> None:
        if hasattr(self, "stderr"):
            self._close_streams()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(30)
        self._close_streams()
