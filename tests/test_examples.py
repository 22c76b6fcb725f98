"""The example training script learns from the queue: its loss falls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, char_config, subprocess_env

# One torch thread: on a loaded 2-core machine torch's default pool (one thread per core,
# spinning while it waits) made each step of this tiny model 10 to 20 times slower (250-370
# ms against about 20), and 200 steps ran past the test's timeout. 60 steps of 6-batch files
# still read 10 files, and the loss of this small corpus falls by more than 2 in them.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.mark.timeout(300)  # a deadline for a loaded machine; it takes some 20 s on a quiet one
def test_train_example_loss_falls(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus, batch_size=8, block_size=32, batches_per_file=6))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--address", server.address, "--dataset", "chars", "--steps", "60", "--eval-every", "30", "--device", "cpu", "--expect-loss-drop", "1.0"],
        capture_output=True, text=True, timeout=240, env=subprocess_env(**ONE_THREAD),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 30: train loss" in proc.stdout and "step 60: train loss" in proc.stdout
    assert "val loss" in proc.stdout
    assert server.split_stats("chars")["consumed_files"] >= 9


def test_notebook_quickstart_serves_in_process_and_the_loss_falls(
    corpus: Path, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "notebook_quickstart.py"), "--input", str(corpus), "--data-root", str(tmp_path / "data"), "--steps", "40", "--expect-loss-drop", "0.5"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(**ONE_THREAD),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 39: loss" in proc.stdout and "now stopped" in proc.stdout
    assert (tmp_path / "data" / "chars" / "meta.pkl").is_file()
