"""queue-prepare on a full disk: one line on stderr naming the output folder and the error,
exit code 2, no temp file left, and the shards written before it kept, so the same command
goes on from them once there is room, to the very bytes of a run that never stopped.

The disk is real: a 2 MiB tmpfs mounted under tmp_path (root only; skipped with the reason
where mounting is not permitted), grown by a remount once the first run has failed."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.small_disk import small_tmpfs

from conftest import subprocess_env
from queue_client.format.layout import is_temp_name
from queue_providers.prepare.layout import MANIFEST_FILE, PROGRESS_FILE

WORDS = [f"w{i}" for i in range(500)]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs under tmp_path, unmounted at the end."""
    with small_tmpfs(tmp_path / "disk", "2m") as mount:
        yield mount


def write_corpus(folder: Path) -> Path:
    """About 1.8 MB of blank-line separated documents in two files: 3.5 MB of uint16 shards,
    200 KB each, of which the 2 MiB disk holds about nine."""
    rnd = random.Random(3)
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        docs = (" ".join(rnd.choices(WORDS, k=rnd.randint(20, 200))) for _ in range(1500))
        (folder / name).write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return folder


def run_prepare(corpus: Path, out: Path) -> subprocess.CompletedProcess[str]:
    args = ["--input", str(corpus), "--separator", "", "--out", str(out), "--no-progress"]
    return subprocess.run(
        [sys.executable, "-m", "queue_providers.prepare", *args, "--shard-tokens", "100000"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_full_disk_is_one_line_and_the_same_command_goes_on(
    tmp_path: Path, small_disk: Path
) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    reference = tmp_path / "reference"
    done = run_prepare(corpus, reference)
    assert done.returncode == 0, done.stderr

    out = small_disk / "out"
    full = run_prepare(corpus, out)
    assert full.returncode == 2, full.stderr
    said = full.stderr.strip()
    assert "\n" not in said and "Traceback" not in said, said
    assert said.startswith("queue-prepare: error: ") and str(out) in said, said
    assert "No space left on device" in said and "run the same command again" in said, said
    left = sorted(p.name for p in out.iterdir())
    assert PROGRESS_FILE in left and MANIFEST_FILE not in left, left
    assert not [name for name in left if is_temp_name(name)], left
    kept = [name for name in left if name.endswith(".npy") and not name.endswith(".docs.npy")]
    assert kept, left  # some shards fit before the disk filled

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    resumed = run_prepare(corpus, out)
    assert resumed.returncode == 0, resumed.stderr
    assert "kept from an earlier run" in resumed.stdout, resumed.stdout
    assert contents(out) == contents(reference)
