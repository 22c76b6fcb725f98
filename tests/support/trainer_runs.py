"""A framework's training script as the tests run it: a process group of its own (a launcher
and its ranks), killed whole with SIGKILL, and the rows each rank recorded step by step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class TrainerRun:
    """`command` started in `folder` with stdout and stderr in files there; `record` is the
    folder where the script writes rank<r>.jsonl, one line per step."""

    def __init__(
        self, folder: Path, command: Sequence[str], env: dict[str, str], record: Path
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.record = folder, record
        self.log = folder / "output.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                list(command), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder,
                start_new_session=True,  # the launcher and every rank it starts, killed at once
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def finish(self, timeout_s: float) -> str:
        """Wait for a clean exit; its output."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            tail = self.output()[-6000:]
            raise AssertionError(f"still running after {timeout_s:g}s:\n{tail}") from None
        assert self.proc.returncode == 0, self.output()[-6000:]
        return self.output()

    def kill(self) -> None:
        """SIGKILL to the whole group: the launcher and its ranks."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)

    def steps(self, rank: int) -> list[dict[str, Any]]:
        path = self.record / f"rank{rank}.jsonl"
        if not path.exists():
            return []
        # A line cut off by SIGKILL is no step.
        return [
            json.loads(line)
            for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n")
        ]

    def reached(self, ranks: int, step: int) -> bool:
        """Every rank recorded `step` (fails at once if the run ended meanwhile)."""
        if self.proc.poll() is not None:
            raise AssertionError(
                f"the run ended ({self.proc.returncode}):\n{self.output()[-6000:]}"
            )
        return all(any(s["step"] >= step for s in self.steps(r)) for r in range(ranks))


def rows(steps: list[dict[str, Any]], first: int, last: int) -> list[Any]:
    """The recorded batches of steps first..last (inclusive), each {"x", "source"?}, in order;
    every step must be there once."""
    by_step = {}
    for s in steps:
        assert s["step"] not in by_step, f"step {s['step']} recorded twice"
        by_step[s["step"]] = {k: v for k, v in s.items() if k != "step"}
    missing = [n for n in range(first, last + 1) if n not in by_step]
    assert not missing, f"steps {missing} were not recorded"
    return [by_step[n] for n in range(first, last + 1)]
