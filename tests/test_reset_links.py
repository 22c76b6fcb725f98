"""`queue-server reset` of a dataset dir that is a symbolic link (its data on another disk):
refused before anything changes, naming the link and where it points, with and without
--delete; nothing behind the link is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env
from queue_client.errors import InvalidRequest
from queue_server.reset import reset_dataset


def _linked_dataset(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    root, elsewhere = tmp_path / "root", tmp_path / "disk2" / "chars"
    (elsewhere / "journal").mkdir(parents=True)
    files = {"meta.pkl": b"meta", "journal/train.jsonl": b"{}\n"}
    for name, data in files.items():
        (elsewhere / name).write_bytes(data)
    root.mkdir()
    (root / "chars").symlink_to(elsewhere)
    return root, elsewhere, files


def _unchanged(root: Path, elsewhere: Path, files: dict[str, bytes]) -> None:
    assert os.readlink(root / "chars") == str(elsewhere)
    assert {n: (elsewhere / n).read_bytes() for n in files} == files
    assert not [p for p in root.iterdir() if p.name.startswith("chars.reset-")]


@pytest.mark.parametrize("delete", [False, True])
def test_a_linked_dataset_dir_is_refused_and_left_as_it_was(tmp_path: Path, delete: bool) -> None:
    root, elsewhere, files = _linked_dataset(tmp_path)
    with pytest.raises(InvalidRequest) as refused:
        reset_dataset(root, "chars", delete=delete)
    message = str(refused.value)
    assert f"{root / 'chars'} is a symbolic link to {elsewhere}" in message
    assert "nothing was changed" in message
    _unchanged(root, elsewhere, files)


def test_the_command_says_why_and_exits_1(tmp_path: Path) -> None:
    root, elsewhere, files = _linked_dataset(tmp_path)
    command = ["reset", "chars", "--data-root", str(root), "--delete"]
    done = subprocess.run(
        [sys.executable, "-m", "queue_server", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert done.returncode == 1, done.stderr
    assert f"is a symbolic link to {elsewhere}" in done.stderr
    assert "Traceback" not in done.stderr
    _unchanged(root, elsewhere, files)


def test_a_dangling_link_is_refused_too(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "chars").symlink_to(tmp_path / "gone")
    with pytest.raises(InvalidRequest, match="which does not exist"):
        reset_dataset(root, "chars", delete=True)
    assert (root / "chars").is_symlink()
