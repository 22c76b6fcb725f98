"""One server per data root: two would append to the same journals and delete each other's
files.

The lock is an flock on the data root directory itself, held through a read-only descriptor
for the server's life. Nothing can delete it: removing the pid file beside it (or any other
file) leaves the lock in place, and the kernel drops it when the process dies, SIGKILL
included, so a crash never leaves it stale. `<data_root>/.batchqueue.lock` only says which
pid holds the root, for people and for the refusal message; when it is gone, the holder's
pid is read from /proc/locks.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from queue_client.errors import ConfigError
from queue_client.format.layout import atomic_write, root_lock_file


class DataRootLock:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = root_lock_file(self.root)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ConfigError naming the data root and the holder's pid."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no lock, as before
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_pid(fd, self.path)
            os.close(fd)
            raise ConfigError(
                f"data root {self.root} is in use by another queue-server (pid {holder}); "
                "stop it, or give this server another --data-root"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        atomic_write(self.path, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        """Drop the lock; the pid file stays, naming the last holder."""
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _holder_pid(fd: int, pid_file: Path) -> str:
    """The pid holding the flock on `fd`'s directory: from /proc/locks, which the holder
    cannot remove, else from the pid file, else "unknown"."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError):
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; waiters have "->".
                parts = line.split()
                if "->" not in parts and len(parts) >= 6 and parts[1] == "FLOCK":
                    if parts[5] == inode and parts[4].isdigit() and parts[4] != "0":
                        return parts[4]
    with contextlib.suppress(OSError):
        text = pid_file.read_text(encoding="ascii", errors="replace").strip()
        if text.isdigit():
            return text
    return "unknown"
