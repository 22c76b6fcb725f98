"""One server per data root: two would append to the same journals and delete each other's
files. An advisory lock on `<data_root>/.batchqueue.lock` is held for the server's life; the
kernel drops it when the process dies, SIGKILL included, so a crash never leaves it stale.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO

from queue_client.errors import ConfigError

LOCK_NAME = ".batchqueue.lock"


class DataRootLock:
    def __init__(self, root: Path) -> None:
        self.path = Path(root) / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ConfigError naming the data root and the holder's pid."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no lock, as before
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise ConfigError(
                f"data root {self.path.parent} is in use by another queue-server (pid {holder}); "
                "stop it, or give this server another --data-root"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the file drops the lock
            self._file = None
