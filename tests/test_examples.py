"""The example training script learns from the queue: its loss falls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, char_config, subprocess_env


def test_train_example_loss_falls(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus, batch_size=8, block_size=32, batches_per_file=20))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--address", server.address, "--dataset", "chars", "--steps", "200", "--device", "cpu", "--expect-loss-drop", "1.0"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "val loss" in proc.stdout
    assert server.split_stats("chars")["consumed_files"] >= 9


def test_notebook_quickstart_serves_in_process_and_the_loss_falls(
    corpus: Path, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "notebook_quickstart.py"), "--input", str(corpus), "--data-root", str(tmp_path / "data"), "--steps", "40", "--expect-loss-drop", "0.5"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 39: loss" in proc.stdout and "now stopped" in proc.stdout
    assert (tmp_path / "data" / "chars" / "meta.pkl").is_file()
