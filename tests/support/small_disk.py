"""A small real filesystem for tests of a full disk: a tmpfs mounted under the test's folder
(root only; the test is skipped saying why where mounting is not permitted)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (as mount's -o size=, e.g. "2m") at `mount`, unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("filling a real filesystem needs a small tmpfs, and mounting one needs root")
    mount.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(
            f"mount -t tmpfs is not permitted here: {proc.stderr.strip() or proc.returncode}"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
