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


# Private names of the standard library that are documented for use.
DOCUMENTED_PRIVATE = {"os._exit"}


def private_reaches(source: str) -> list[str]:
    """Each `x._name` (not self's or cls's, not a dunder) and each `from m import _name` or
    import of a `_module` in `source`, as `line: code`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            code = ast.unparse(node)
            if private and owner not in ("self", "cls") and code not in DOCUMENTED_PRIVATE:
                found.append(f"{node.lineno}: {code}")
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [a.name for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            for name in names:
                if any(p.startswith("_") and not p.startswith("__") for p in name.split(".")):
                    found.append(f"{node.lineno}: import of {name}")
    return found


def test_the_benchmarks_use_only_public_names() -> None:
    """The benchmarks measure what users can call: no reaching into a provider's or the
    client's private names (bench row 14 reads a shard through token_shards' shard_tokens,
    not its _reader). The lint itself catches each form it looks for."""
    assert private_reaches("provider._reader('train', 0)\nself._x\nos._exit(0)") == [
        "1: provider._reader"
    ]
    assert private_reaches("from queue_client.streaming.rows import _x\nimport a._b") == [
        "1: import of _x",
        "2: import of a._b",
    ]
    reaches = {
        str(path.relative_to(ROOT)): found
        for path in sorted((ROOT / "bench").rglob("*.py"))
        if (found := private_reaches(path.read_text()))
    }
    assert reaches == {}, reaches
