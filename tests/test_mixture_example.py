"""examples/train_mixture.py against a real server: per-source loss, exponentiated-gradient
reweighting through SetMixture, a checkpoint mid-run and a resume from it."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

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


def run(server_address: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_mixture.py"), "--address", server_address, "--dataset", "mix", "--steps", "80", "--reweight-every", "20", "--lr", "2", "--eta", "4", *args],
        capture_output=True, text=True, timeout=300, env=subprocess_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_example_reweights_toward_the_hard_source_and_resumes(
    start_server, tmp_path: Path
) -> None:
    dirs = write_sources(tmp_path)
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
    server = start_server(config)
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
