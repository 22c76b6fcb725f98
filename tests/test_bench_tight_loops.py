"""`python -m bench.tight_loops`: rows 1d and 1e over many loops. Never a timed test: the
loops run for real and each says what it measured; nothing here asserts a speed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tight_loops import FILES_PER_LOOP, summary
from conftest import ROOT, subprocess_env


def _loop(p99_us: float, switch_max_us: float, calls: int = 0) -> dict:
    kinds = {"calls": calls, "own CPU": 0, "a core": calls, "the GIL or a lock": 0}
    return {"p99_us": p99_us, "switch_max_us": switch_max_us, "slow_calls": kinds}


def test_the_summary_counts_each_goal_at_its_bound() -> None:
    s = summary([_loop(100, 2000), _loop(100.5, 1000, 4), _loop(20, 2000.5, 2)])
    assert (s["loops"], s["1e_met"], s["1d_met"], s["both_met"]) == (3, 2, 2, 1)
    assert s["p99_median_ms"] == pytest.approx(0.1)
    assert s["slow_calls_per_loop"] == pytest.approx(2.0)
    assert s["slow_calls_by_kind_per_loop"]["a core"] == pytest.approx(2.0)


@pytest.mark.timeout(240)
def test_loops_run_on_a_real_server_and_report_each_one(tmp_path: Path) -> None:
    out = tmp_path / "loops.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.tight_loops", "--loops", "2", "--json", str(out),
         "--workdir", str(tmp_path)],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=200)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a server it left running, or all of it
        proc.wait()
    assert proc.returncode == 0, f"bench.tight_loops failed:\n{stdout}\n{stderr[-5000:]}"
    report = json.loads(out.read_text())
    assert len(report["loops"]) == 2 and report["summary"]["loops"] == 2
    for loop in report["loops"]:
        # Each loop reads FILES_PER_LOOP whole files: as many switches, every one timed.
        assert loop["switches"] == FILES_PER_LOOP, loop
        assert loop["switch_max_us"] > 0 and loop["p99_us"] > 0
    assert "loop   1  p99 " in stdout
    assert " of 2 loops" in stdout


def test_loops_must_be_at_least_one(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.tight_loops import main

    with pytest.raises(SystemExit):
        main(["--loops", "0"])
    assert "--loops must be >= 1, got 0" in capsys.readouterr().err
