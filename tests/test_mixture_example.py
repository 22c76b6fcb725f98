"""examples/train_mixture.py against a real server: per-source loss, exponentiated-gradient
reweighting through SetMixture, a checkpoint mid-run and a resume from it, also after a
SIGKILL between two checkpoints."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, subprocess_env


def write_sources(tmp: Path) -> dict[str, Path]:
    """ "easy": a short pattern repeated (learnt at once); "hard": uniform noise."""
    rng = np.random.default_rng(0)
    data = {
        "easy": np.tile(np.arange(0, 10, dtype=np.uint16), 400),
        "hard": rng.integers(100, 200, size=4000).astype(np.uint16),
    }
    dirs = {}
    for name, ids in data.items():
        d = tmp / name
        d.mkdir()
        for split in ("train", "val"):
            ids.tofile(d / f"{split}.bin")
        dirs[name] = d
    return dirs


def mixture_config(dirs: dict[str, Path]) -> str:
    config = "[datasets.mix]\nbatch_size = 8\nbatches_per_file = 5\n"
    for name in dirs:
        config += textwrap.dedent(
            f"""
            [datasets.mix.sources.{name}]
            provider = "nanogpt_bin"
            weight = 0.5
            [datasets.mix.sources.{name}.args]
            data_dir = "{dirs[name].as_posix()}"
            block_size = 16
            vocab_size = 200
            """
        )
    return config


def command(server_address: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "examples" / "train_mixture.py"), "--address", server_address, "--dataset", "mix", "--steps", "80", "--reweight-every", "20", "--lr", "2", "--eta", "4", *args]  # fmt: skip


# One torch thread: each run's sums are then made in the same order, bit for bit.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run(server_address: str, *args: str) -> str:
    proc = subprocess.run(
        command(server_address, *args), capture_output=True, text=True, timeout=300,
        env=subprocess_env(**ONE_THREAD),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_example_reweights_toward_the_hard_source_and_resumes(
    start_server, tmp_path: Path
) -> None:
    dirs = write_sources(tmp_path)
    server = start_server(mixture_config(dirs))
    ckpt = tmp_path / "ckpt.pt"
    first = run(server.address, "--checkpoint", str(ckpt), "--stop-at", "40")
    assert "saved at step 40" in first and ckpt.is_file()
    second = run(server.address, "--checkpoint", str(ckpt), "--resume")
    assert "resumed at step 40" in second and "done at step 80" in second
    lines = re.findall(
        r"step (\d+): easy loss \S+ weight (\S+), hard loss \S+ weight (\S+)", first + second
    )
    assert [int(s) for s, _, _ in lines] == [20, 40, 60, 80]
    easy, hard = float(lines[-1][1]), float(lines[-1][2])
    # Toward the source whose loss stays high; the floor keeps the easy one alive.
    assert hard > 0.7 and easy >= 0.05, (easy, hard)
    mix = server.split_stats("mix")["mixture"]
    assert [h["origin"] for h in mix["history"]] == ["config"] + ["SetMixture"] * 4


@pytest.mark.timeout(600)  # three runs of the example on a loaded machine
def test_a_run_killed_between_checkpoints_resumes_and_steps_on_exactly(
    start_server, tmp_path: Path
) -> None:
    """--checkpoint-every 10: a run SIGKILLed after its save at step 30 (somewhere before
    step 40, or just after) resumes from its last checkpoint with the same command and ends
    with the very model, optimizer, weights and data position of an uninterrupted run on a
    twin server (the same config and corpus): every step after the checkpoint read the same
    rows again and stepped the same. Both runs print the same reweighting lines."""
    dirs = write_sources(tmp_path)
    twin = start_server(mixture_config(dirs), data_root=tmp_path / "twin")
    server = start_server(mixture_config(dirs), data_root=tmp_path / "data")
    whole = tmp_path / "whole.pt"
    reference = run(twin.address, "--checkpoint", str(whole), "--checkpoint-every", "10")
    ckpt = tmp_path / "ckpt.pt"
    args = ("--checkpoint", str(ckpt), "--checkpoint-every", "10", "--resume")
    proc = subprocess.Popen(
        command(server.address, *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=subprocess_env(**ONE_THREAD),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        printed = []
        for line in proc.stdout:  # ends at the process's exit if it never saves at step 30
            printed.append(line)
            if line.startswith("saved at step 30"):
                proc.send_signal(signal.SIGKILL)
                break
        assert proc.wait(timeout=300) == -signal.SIGKILL, "".join(printed)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    resumed = run(server.address, *args)
    at = int(re.search(r"resumed at step (\d+)", resumed)[1])  # type: ignore[index]
    assert 30 <= at < 80 and "done at step 80" in resumed, resumed
    assert not ckpt.with_name(ckpt.name + ".tmp").exists()  # each save renamed into place
    ours, theirs = torch.load(ckpt, weights_only=True), torch.load(whole, weights_only=True)
    assert ours["step"] == theirs["step"] == 80
    assert ours["data"] == theirs["data"]
    for key in ("weights", "seen"):
        assert torch.equal(ours[key], theirs[key]), key
    for name, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][name], tensor), name
    assert str(ours["opt"]) == str(theirs["opt"])
    lines = re.findall(r"step \d+: .*", resumed)
    assert lines and all(line in reference for line in lines), (lines, reference)
