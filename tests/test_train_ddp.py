"""examples/train_ddp.py under torchrun: 2 ranks on CPU (gloo), each on its own stream of the
queue, and the loss falls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, char_config, subprocess_env


def test_torchrun_two_ranks_read_disjoint_streams_and_learn(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus, batch_size=8, block_size=32, batches_per_file=10))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "examples" / "train_ddp.py"), "--address", server.address, "--dataset", "chars",
        "--steps", "30", "--expect-loss-drop", "0.5",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, env=subprocess_env(), cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 30: loss" in proc.stdout
    # The example's own check: no batch was read by both ranks.
    assert "2 ranks read 60 batches; batches read by more than one rank: 0" in proc.stdout
    # The server's view: the split is read at world size 2, and each rank consumed the files
    # of its own stream, 3 files of 10 batches each: seqs 0, 2, 4 and 1, 3, 5.
    train = server.split_stats("chars")
    assert train["world_size"] == 2
    assert [(int(r["rank"]), int(r["last_consumed_seq"])) for r in train["ranks"]] == [
        (0, 4),
        (1, 5),
    ]
    assert train["consumed_files"] == 6 and train["leased_files"] == 0
