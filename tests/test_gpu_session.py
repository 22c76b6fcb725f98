"""bench/gpu_session.py's plumbing, on the CPU: the dry run starts its servers, runs every
part in a process of its own (row 7 per shape, the five training feeds of both models, the
gpu-marked tests, which skip here) and writes the JSON, the tables and the log; a part that
fails is recorded with its error and the session goes on. The figures need a GPU
(docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_session
from conftest import ROOT, subprocess_env


@pytest.mark.timeout(300)
def test_the_cpu_dry_run_runs_every_part_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_session", "--cpu-dry-run", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280, env=subprocess_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu_session.json").read_text())
    parts = report["parts"]
    assert list(parts) == list(gpu_session.PARTS)
    assert all(p["status"] == "ok" for p in parts.values()), parts
    assert report["environment"]["dry_run"] and report["environment"]["missing"] == []
    shapes = parts["h2d"]["figures"]["shapes"]
    assert [s["shape"] for s in shapes] == ["B=4 T=32", "B=8 T=16"]
    assert all(s["get_batch_us"] > 0 and s["reference_us"] > 0 and s["ratio"] > 0 for s in shapes)
    for name in ("train_gpt2_small", "train_char_gpt"):
        feeds = parts[name]["figures"]["feeds"]
        assert list(feeds) == [
            "synthetic", "nanogpt", "batchqueue", "batchqueue_fetch_process",
            "batchqueue_mixture",
        ]  # fmt: skip
        assert all(f["tokens_per_s"] > 0 and 0 <= f["data_wait_share"] <= 1 for f in feeds.values())
    tests = parts["cuda_tests"]["figures"]["outcomes"]
    assert "tests/test_cuda.py::test_a_call_never_waits_for_the_gpu" in tests
    assert set(tests.values()) == {"SKIPPED"}  # no GPU here
    text = (out / "gpu_session.md").read_text()
    assert (
        "get_batch to the GPU vs a pinned int64 copy" in text and "| batchqueue get_batch |" in text
    )
    assert "===== h2d" in (out / "gpu_session.log").read_text()


def test_a_part_that_fails_is_recorded_with_its_error(tmp_path: Path) -> None:
    with open(tmp_path / "log", "w", encoding="utf-8") as log:
        entry = gpu_session._part("no_such_part", tmp_path, True, 120.0, log)
    assert entry["status"] == "failed"
    assert "unknown part 'no_such_part'" in entry["error"]
