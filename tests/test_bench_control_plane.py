"""bench.control_plane runs end to end (a store, two node-local servers, one alone) and reports
the figures docs/multi-node.md quotes; its numbers are measured by hand, never asserted here
beyond what must hold: claims were made, each change is in the store once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env


def test_the_control_plane_bench_runs_and_counts_what_the_store_holds(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.control_plane", "--files", "3", "--changes", "2",
         "--join-records", "250", "--snapshot-every", "16", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=subprocess_env(),
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["changes"] == 2, figures
    assert figures["claims"] >= 2 and figures["files_made"] > 0, figures
    assert figures["bytes_per_claim"] > 0 and figures["store_mb_per_day_1000_gpus"] > 0
    # A late joiner gets the same changes either way, in fewer reads from the snapshots.
    assert figures["join_changes_snapshot"] == figures["join_changes_whole"] == 2
    assert figures["join_reads_snapshot"] < figures["join_reads_whole"] / 5
