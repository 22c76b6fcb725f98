"""A curriculum file whose journal line could not be written (its journal on a full disk) is
made again once the disk frees, from the composer's picks, and journaled with the composer's
snapshot after it: a server killed then resumes the stream from that snapshot and serves what
an untroubled run serves.

The served split's journal alone lies on a small tmpfs (bind-mounted over the file), so its
first append fails while the candidates' journal and every file are written as usual.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from support.small_disk import small_tmpfs
from test_curriculum_server import NB, curriculum, dataset, reference_run, take

from conftest import skewed_corpus, wait_until
from queue_client import QueueClient


def fill(folder: Path) -> None:
    """Write into `folder` until its filesystem has no room left."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def test_a_file_remade_after_its_journal_line_failed_resumes_from_its_snapshot(
    start_server, tmp_path: Path
) -> None:
    corpus = skewed_corpus(tmp_path / "corpus.txt", segments=400, seed=7)
    config = dataset("d", corpus, curriculum(1.0))
    reference = reference_run(start_server, config, tmp_path / "ref", 3 * NB)

    root = tmp_path / "root"
    journal = root / "d" / "journal" / "train.jsonl"
    journal.parent.mkdir(parents=True)
    journal.touch()
    with small_tmpfs(tmp_path / "small", "64k") as small:
        (small / "train.jsonl").touch()
        bound = subprocess.run(
            ["mount", "--bind", str(small / "train.jsonl"), str(journal)],
            capture_output=True,
            text=True,
        )
        if bound.returncode != 0:
            pytest.skip(f"mount --bind of a file is not permitted here: {bound.stderr.strip()}")
        try:
            fill(small)
            # The train split starts making files at once (no client yet): seq 0's journal
            # line fails; once the disk frees it is made again, and with a backlog of one
            # file nothing is made past it. The server is killed there.
            server = start_server(config, data_root=root)
            wait_until(
                lambda: "cannot append to the journal" in server.log(),
                120,
                "the served split's journal to fail",
            )
            assert server.split_stats("d")["produced_files"] == 0
            (small / "filler").unlink()
            wait_until(
                lambda: server.split_stats("d")["produced_files"] >= 1, 120, "seq 0 made again"
            )
            server.kill(signal.SIGKILL)
            # The journal says seq 0 was made with the composer's snapshot after it.
            server = start_server(config, data_root=root)
            with QueueClient(server.address, "d") as client:
                assert torch.equal(take(client, 3 * NB), reference)
        finally:
            subprocess.run(["umount", "-l", str(journal)], capture_output=True)
