"""A child process that ends with its parent, however the parent ends (SIGKILL included).

The parent opens a pipe and keeps its write end; the child inherits only the read end and
watches it in a thread. The kernel closes the write end when the parent dies, so the child's
read returns end-of-file, and the child stops itself cleanly. A pipe rather than Linux's
parent-death signal: that signal fires when the *thread* that started the child ends (a
thread of `asyncio.to_thread`, say), not the process, and it exists on Linux alone.

The write end must live in the parent alone: a process forked from the parent (a fork
DataLoader worker, say) that kept a copy would hold the pipe open after the parent died. So
every write end is closed in a forked child (os.register_at_fork), and it is never inherited
across an exec (os.pipe's descriptors are not inheritable).
"""

from __future__ import annotations

import os
import signal
import stat
import threading
from collections.abc import Callable

# How long a process whose parent is gone gets for its graceful stop before it exits at once.
ORPHAN_STOP_S = 60.0

# Write ends held by this process: closed in a child forked from it.
_write_ends: set[int] = set()


def _close_in_forked_child() -> None:
    for fd in list(_write_ends):
        try:
            os.close(fd)
        except OSError:
            pass
    _write_ends.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


class ParentPipe:
    """The parent's side: `read_fd` goes to the child (pass_fds), then `child_started()`;
    `close()` once the child is stopped (closing it earlier also stops the child)."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        _write_ends.add(self._write_fd)

    def child_started(self) -> None:
        """The child has its copy of the read end now: drop ours."""
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1

    def close(self) -> None:
        self.child_started()
        if self._write_fd >= 0:
            # Out of the set before the close, so that a fork in between never closes a
            # descriptor number that another open already reused.
            _write_ends.discard(self._write_fd)
            os.close(self._write_fd)
            self._write_fd = -1


def watch_parent(read_fd: int, on_parent_gone: Callable[[], None]) -> threading.Thread:
    """The child's side: call `on_parent_gone` (in a daemon thread) once the parent's write
    end is closed, that is once the parent has ended or closed it."""

    def watch() -> None:
        try:
            while os.read(read_fd, 4096):  # the parent never writes; data would be ignored
                pass
        except OSError:
            pass  # a pipe that cannot be read any more is a parent gone, too
        finally:
            try:
                os.close(read_fd)
            except OSError:
                pass
        on_parent_gone()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def check_parent_pipe(read_fd: int) -> None:
    """ValueError naming `read_fd` unless it is an open pipe: any other descriptor would read
    as a parent already gone, and stop the process at once with nothing said."""
    try:
        mode = os.fstat(read_fd).st_mode
    except (OSError, OverflowError):
        raise ValueError(f"--parent-pipe {read_fd}: not an open descriptor") from None
    if not stat.S_ISFIFO(mode):
        raise ValueError(f"--parent-pipe {read_fd}: not a pipe (the read end of one is needed)")


def stop_with_parent(read_fd: int, *, grace_s: float = ORPHAN_STOP_S) -> threading.Event:
    """Once the parent is gone, send this process SIGTERM (its graceful stop), and past
    `grace_s` exit at once: a stop that hangs is a bug, but no orphan may keep a port and a
    data-root lock for it (workers end with the server's end of their sockets, and the kernel
    drops the lock). The event returned is set when the parent is gone."""
    gone = threading.Event()

    def on_parent_gone() -> None:
        gone.set()
        os.kill(os.getpid(), signal.SIGTERM)
        watchdog = threading.Timer(grace_s, os._exit, args=(1,))
        watchdog.daemon = True
        watchdog.start()

    watch_parent(read_fd, on_parent_gone)
    return gone


__all__ = [
    "ORPHAN_STOP_S",
    "ParentPipe",
    "check_parent_pipe",
    "stop_with_parent",
    "watch_parent",
]
