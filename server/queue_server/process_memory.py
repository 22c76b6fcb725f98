"""Resident memory of a process, from /proc: a worker that leaks shows in the stats.

Read from /proc/<pid>/status (VmRSS), so no dependency is needed; 0 where there is no /proc
(macOS) or the process is gone. Each read is one small file of a virtual filesystem; callers
on the event loop still run it in a thread.
"""

from __future__ import annotations

from collections.abc import Iterable


def rss_bytes(pid: int) -> int:
    """The resident set size of `pid` in bytes; 0 when it cannot be read."""
    if pid <= 0:
        return 0
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmRSS:"):
                    fields = line.split()
                    unit = fields[2].lower() if len(fields) > 2 else b"kb"
                    scale = {b"kb": 1024, b"mb": 1 << 20, b"gb": 1 << 30}.get(unit, 1024)
                    return int(fields[1]) * scale
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def rss_of(pids: Iterable[int]) -> dict[int, int]:
    """pid -> resident bytes (0 when unreadable), for every pid given."""
    return {pid: rss_bytes(pid) for pid in pids}
