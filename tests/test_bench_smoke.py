"""The benchmark suite's smoke version: `python -m bench --quick` runs every row end to end and
each row produces a number. Never a timed test: nothing here asserts a speed."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, subprocess_env

# Row 11 (Ray actors) starts a Ray instance of its own, which on a loaded 2-core machine can
# time out beside the test session's Ray cluster; the Ray backend's own tests cover that code.
ROWS = ("1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "12", "13", "14", "15", "16")


@pytest.mark.timeout(300)
def test_quick_suite_gives_every_row_a_number(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    # Its own process group: a bench that overruns is killed with the servers it started,
    # which would otherwise live on beside the rest of the suite.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--repeats",  # one round: the smoke run shows each row gives a number, no timing
            "1",
            "--only",
            ",".join(ROWS),
            "--json",
            str(out),
            "--workdir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what it left running, or all of it
        proc.wait()
    assert proc.returncode == 0, f"python -m bench --quick failed:\n{stdout}\n{stderr[-5000:]}"
    results = json.loads(out.read_text())["results"]
    assert {r["row"] for r in results} == set(ROWS)
    for r in results:
        if r["skipped"] and r["row"] == "14":  # the Grain peer, without the peers extra
            assert importlib.util.find_spec("grain") is None and "grain" in r["note"], r
            continue
        if r["skipped"]:
            assert r["row"] == "7" and not torch.cuda.is_available(), r
            assert "no CUDA device" in r["note"]
            continue
        assert isinstance(r["value"], (int, float)) and math.isfinite(r["value"]), r
        if r["ref_value"] is not None:
            assert math.isfinite(r["ref_value"]) and r["ratio"] is not None, r
    for row in ROWS:  # the printed table names every row
        assert f"\n{row}a " in stdout
