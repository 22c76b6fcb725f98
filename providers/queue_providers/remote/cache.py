"""The input cache: blocks and whole copies of remote objects, at most max_bytes together.

Recency is the file's mtime (touched on every hit), so the worker processes of a dataset
share one cache without a lock: each insert scans the directory and evicts the oldest until
the total with it fits, renames the entry into place whole (never seen half-written), and
scans again for what other processes put meanwhile. So a process killed between the two
(a worker stopped mid-fetch) leaves the cache within its bytes.

A whole copy that a reader has open (a memory-mapped .bin) is *in use*: its process holds a
shared flock on it (`pin`), and eviction takes an exclusive one without waiting before it
deletes a file, so a file in use, in this process or any other, is never deleted. The cache
may then stay above max_bytes until the pin is dropped; RemoteStore refuses, with the sizes,
a set of copies that cannot fit at once (see RemoteStore.local_copy).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from queue_client.format.layout import (
    input_cache_file,
    is_temp_name,
    process_alive,
    temp_owner_pid,
    temp_path,
)


class BlockCache:
    """Files in one directory, at most max_bytes together (pinned files aside), least recently
    used evicted."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes

    def get(self, name: str, size: int) -> bytes | None:
        path = input_cache_file(self.directory, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        if len(data) != size:  # cut short by a power cut (entries are not fsynced): fetch again
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        return data

    def put(self, name: str, data: bytes) -> None:
        """Keep `data` as entry `name`: written under a temp name and renamed, so readers see
        it whole or not at all. Not fsynced: an entry lost to a power cut is fetched again,
        and one cut short is refused by get()'s length check."""
        if len(data) > self.max_bytes:
            return
        path = input_cache_file(self.directory, name)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Room first: a process killed right after the rename (a worker stopped mid-fetch)
        # leaves the cache within max_bytes. The second pass takes out what other processes
        # put meanwhile.
        self.evict(room=len(data))
        tmp = temp_path(path)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.evict(keep=path)

    def evict(self, keep: Path | None = None, room: int = 0) -> None:
        """Delete the least recently used files not in use (but `keep`) until the rest fit in
        max_bytes less `room`; also the temp files of processes that died while writing here."""
        entries = []
        try:
            scan = list(os.scandir(self.directory))
        except FileNotFoundError:
            return
        for entry in scan:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if is_temp_name(entry.name):
                pid = temp_owner_pid(entry.name)
                if pid is not None and not process_alive(pid):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                continue
            entries.append((st.st_mtime_ns, entry.path, st.st_size))
        total = sum(size for _, _, size in entries)
        for _, path, size in sorted(entries):
            if total + room <= self.max_bytes:
                break
            if keep is not None and path == str(keep):
                continue
            if _delete_unless_in_use(path):
                total -= size

    def total_bytes(self) -> int:
        try:
            return sum(
                e.stat().st_size for e in os.scandir(self.directory) if not is_temp_name(e.name)
            )
        except FileNotFoundError:
            return 0


def pin(path: Path) -> int | None:
    """A descriptor holding a shared lock on `path`, which keeps it from eviction while open;
    None when the file is gone (evicted before it could be pinned: fetch it again)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        if os.fstat(fd).st_ino == os.stat(path).st_ino:
            return fd
    except FileNotFoundError:
        pass
    os.close(fd)  # locked a file just deleted or replaced
    return None


def _delete_unless_in_use(path: str) -> bool:
    """Delete `path` unless some process holds a pin on it; whether it was deleted."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        with contextlib.suppress(OSError):
            os.unlink(path)
            return True
        return False
    finally:
        os.close(fd)
