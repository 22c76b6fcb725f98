"""A split's rate window reaches its file however consumption and saving interleave."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from queue_server.split.throughput import Throughput


def saved_files(path: Path) -> int:
    try:
        return sum(files for _, files in json.loads(path.read_bytes())["buckets"])
    except FileNotFoundError:
        return 0


@pytest.mark.asyncio
async def test_a_file_consumed_while_the_window_is_written_is_saved_next(tmp_path: Path) -> None:
    """The second file is consumed while the first save's write runs in its thread: a later
    save must carry it (it used to be dropped until the next consumption)."""
    path = tmp_path / "train.throughput.json"
    rates = Throughput(path)
    await rates.load()
    rates.consumed()  # starts a save task
    await asyncio.sleep(0)  # the task runs up to its write in a thread
    rates.consumed()  # during that write
    deadline = asyncio.get_running_loop().time() + 30
    while saved_files(path) < 2:
        assert asyncio.get_running_loop().time() < deadline, "the second file never saved"
        await asyncio.sleep(0.05)
