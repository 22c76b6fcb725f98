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
