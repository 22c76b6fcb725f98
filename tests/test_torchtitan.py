"""torchtitan's own trainer and DCP checkpoints reading a batchqueue split through
BatchQueueDataLoader (queue_client/integrations/torchtitan.py), killed with SIGKILL mid-run and
resumed from its checkpoint: on the same number of ranks it trains on exactly the rows an
uninterrupted run would, and from 2 ranks to 4 and from 4 to 2 on every remaining row once.

Each job is examples/train_torchtitan.py on CPU ranks over gloo (tests/support/titan_ranks.py
forks them), torchtitan's debug model cut to one layer; the provider's rows name themselves
(bq_titan_providers.py), and each rank writes down the rows of every step it trains on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from pathlib import Path

import pytest

from conftest import SUPPORT, ServerFactory, subprocess_env, wait_until

# Looked up, not imported: the jobs import it, in processes of their own.
MISSING = [name for name in ("torchtitan", "triton") if importlib.util.find_spec(name) is None]
if MISSING:
    pytest.skip(
        f"{' and '.join(MISSING)} not installed (pip install 'batchqueue[torchtitan]')",
        allow_module_level=True,
    )

ROWS_PER_FILE = 4  # batch_size 2 x batches_per_file 2
ROWS_PER_STEP = 2  # local_batch_size: a checkpoint falls mid-file every other step
INTERVAL = 3  # steps between checkpoints
CONFIG = textwrap.dedent(
    """
    [server]
    lease_ttl_s = 5
    [datasets.rows]
    provider = "bq_titan_providers:RowIdProvider"
    batch_size = 2
    batches_per_file = 2
    [datasets.rows.args]
    block_size = 16
    """
)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

Rows = dict[int, dict[int, list[int]]]  # rank -> step -> the rows of its batch


def uninterrupted(rank: int, world: int, step: int) -> list[int]:
    """The rows rank `rank` of `world` trains on at `step` (from 1) in a run never stopped:
    its stream is files rank, rank + world, ... (docs/ordering.md), ROWS_PER_STEP a step."""
    out = []
    for k in range((step - 1) * ROWS_PER_STEP, step * ROWS_PER_STEP):
        seq = rank + (k // ROWS_PER_FILE) * world
        out.append(seq * ROWS_PER_FILE + k % ROWS_PER_FILE)
    return out


def checkpoints(dump: Path) -> list[int]:
    """The steps of the complete checkpoints (DCP writes .metadata last)."""
    folder = dump / "checkpoint"
    if not folder.is_dir():
        return []
    return sorted(
        int(p.name.removeprefix("step-"))
        for p in folder.glob("step-*")
        if (p / ".metadata").exists()
    )


def loader_states(dump: Path, step: int) -> list[dict]:
    """The client states the loader's entry of checkpoint `step` holds, read back with DCP."""
    import torch.distributed.checkpoint as dcp

    state = {"dataloader": {"batchqueue": ""}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(dump / "checkpoint" / f"step-{step}"), no_dist=True)
    return json.loads(state["dataloader"]["batchqueue"])["states"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """One torchtitan job of `world` CPU ranks, in a process group of its own."""

    def __init__(self, tmp: Path, tag: str, address: str, world: int, steps: int) -> None:
        self.world = world
        self.rows_dir = tmp / tag
        self.rows_dir.mkdir()
        self.dump = tmp / "titan"  # every job of a test shares it: a resume finds the last
        argv = [
            "--address", address, "--dataset", "rows", "--seq-len", "16",
            "--local-batch-size", str(ROWS_PER_STEP), "--steps", str(steps),
            "--interval", str(INTERVAL), "--n-layers", "1", "--dump-folder", str(self.dump),
        ]  # fmt: skip
        spec = {
            "world_size": world,
            "master_port": free_port(),
            "rows_dir": str(self.rows_dir),
            "argv": argv,
        }
        spec_path = tmp / f"{tag}.json"
        spec_path.write_text(json.dumps(spec))
        self.log = tmp / f"{tag}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(SUPPORT / "titan_ranks.py"), str(spec_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=subprocess_env(**ONE_THREAD),
                cwd=tmp,
                start_new_session=True,
            )

    def rows(self) -> Rows:
        out: Rows = {}
        for rank in range(self.world):
            path = self.rows_dir / f"rank-{rank}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            out[rank] = {}
            for line in lines:
                if line.endswith("}"):  # a line cut by the kill is no step begun
                    entry = json.loads(line)
                    out[rank][entry["step"]] = entry["rows"]
        return out

    def kill_after_checkpoint(self, after: int) -> int:
        """SIGKILL every rank once a checkpoint past step `after` is complete and every rank
        has begun a step past it; the step of the last complete checkpoint then."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended ({self.proc.returncode}): {self.output()}")
            done = [s for s in checkpoints(self.dump) if s > after]
            rows = self.rows()
            return bool(done) and all(max(r, default=0) > done[-1] for r in rows.values())

        wait_until(ready, 300, f"a checkpoint past step {after} and a step past it")
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        return checkpoints(self.dump)[-1]

    def finish(self) -> None:
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        assert self.proc.returncode == 0, self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


def kept(rows: Rows, upto: int | None = None) -> list[int]:
    """The rows trained on at the steps a checkpoint of step `upto` keeps (all: None)."""
    return [
        r
        for steps in rows.values()
        for s, rs in steps.items()
        if upto is None or s <= upto
        for r in rs
    ]


def leases_gone(server: ServerFactory) -> None:
    """A killed job's leases expire (lease_ttl_s) before the next job starts: a split is served
    at one world size at a time."""
    wait_until(
        lambda: server.split_stats("rows")["leased_files"] == 0, 60, "the killed job's leases"
    )


@pytest.mark.timeout(900)  # four jobs of 2 to 4 ranks: 60 to 115 s (about 40 s of CPU) on 2 cores
def test_killed_and_resumed_at_the_same_and_at_another_dp_degree(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    server = start_server(CONFIG)
    address = server.address
    trained: list[int] = []

    # Two ranks from the start, killed after a checkpoint: the rows of an uninterrupted run,
    # and the checkpoint holds both ranks' states in the loader's one entry.
    first = Job(tmp_path, "first", address, 2, steps=1000)
    c1 = first.kill_after_checkpoint(after=0)
    rows = first.rows()
    assert {r: sorted(s) for r, s in rows.items()} == {
        r: list(range(1, len(s) + 1)) for r, s in rows.items()
    }
    for rank, steps in rows.items():
        assert steps == {s: uninterrupted(rank, 2, s) for s in steps}, f"rank {rank}"
    assert [(s["rank"], s["world_size"]) for s in loader_states(first.dump, c1)] == [(0, 2), (1, 2)]
    trained += kept(rows, c1)

    # Resumed on two ranks: it trains again from the step after the checkpoint, on exactly
    # the rows the uninterrupted run trains on at those steps.
    leases_gone(server)
    same = Job(tmp_path, "same", address, 2, steps=1000)
    c2 = same.kill_after_checkpoint(after=c1)
    rows = same.rows()
    for rank, steps in rows.items():
        assert min(steps) == c1 + 1, f"rank {rank} began at step {min(steps)}"
        assert steps == {s: uninterrupted(rank, 2, s) for s in steps}, f"rank {rank}"
    trained += kept(rows, c2)

    # From 2 ranks to 4, killed again after a checkpoint of four states; then from 4 to 2,
    # run to its end.
    leases_gone(server)
    grown = Job(tmp_path, "grown", address, 4, steps=1000)
    c3 = grown.kill_after_checkpoint(after=c2)
    rows = grown.rows()
    assert all(min(steps) == c2 + 1 for steps in rows.values()), rows
    assert [s["rank"] for s in loader_states(grown.dump, c3)] == [0, 1, 2, 3]
    trained += kept(rows, c3)
    reached = max(trained)

    leases_gone(server)
    shrunk = Job(tmp_path, "shrunk", address, 2, steps=c3 + 16)
    shrunk.finish()
    rows = shrunk.rows()
    assert all(sorted(steps) == list(range(c3 + 1, c3 + 17)) for steps in rows.values()), rows
    trained += kept(rows)

    # Every row was trained on once over the four jobs (the steps each kill cut short were
    # trained again from the checkpoint, on the same rows), none below the furthest row the
    # first three reached was skipped, and each rank is back on its own files (seq = rank
    # mod 2) by the end.
    twice = sorted(r for r, n in Counter(trained).items() if n > 1)
    assert not twice, f"rows trained on twice: {twice}"
    skipped = sorted(set(range(reached + 1)) - set(trained))
    assert not skipped, f"rows never trained on: {skipped}"
    for rank, steps in rows.items():
        assert all(r // ROWS_PER_FILE % 2 == rank for r in steps[c3 + 16]), (rank, steps[c3 + 16])


def test_what_a_config_or_a_checkpoint_gets_wrong_is_refused_by_name(
    start_server: ServerFactory,
) -> None:
    """Each mistake is one InvalidRequest naming the setting or the checkpoint entry and what
    to do, before any row is read."""
    from queue_client import InvalidRequest
    from queue_client.integrations.torchtitan import BatchQueueDataLoader, checkpoint_entry

    server = start_server(CONFIG)
    shape = {"dp_rank": 0, "dp_world_size": 1, "local_batch_size": 2}

    def loader(seq_len: int = 16, **config: object) -> BatchQueueDataLoader:
        config.setdefault("dataset", "rows")
        built = BatchQueueDataLoader.Config(address=server.address, **config)  # type: ignore[arg-type]
        return BatchQueueDataLoader(built, seq_len=seq_len, **shape)

    with pytest.raises(InvalidRequest, match=r"dataloader\.dataset is empty"):
        loader(dataset="")
    with pytest.raises(InvalidRequest, match=r"dataloader\.dataset_path is ./data.*leave it unset"):
        loader(dataset_path="/data")
    # Ranks that are not all data-parallel ranks (tensor, context or pipeline parallel ones
    # share a dp rank): here one process claims a dp degree of 2.
    with pytest.raises(InvalidRequest, match=r"data-parallel degree 2 but 1 ranks.*pipeline"):
        BatchQueueDataLoader(
            BatchQueueDataLoader.Config(address=server.address, dataset="rows"),
            seq_len=16,
            **{**shape, "dp_world_size": 2},
        )
    wrong = loader(seq_len=8)
    with pytest.raises(InvalidRequest, match=r"'x' .* \[2, 16\].*\[2, 8\].*training.seq_len"):
        next(iter(wrong))
    wrong.close()
    wrong = loader(input_field="tokens")
    with pytest.raises(InvalidRequest, match=r"no field\(s\) \['tokens'\].*dataloader.input_field"):
        next(iter(wrong))
    wrong.close()

    where = "the checkpoint's dataloader.batchqueue"
    for entry, message in [
        ({"dp_rank_0": b""}, "is missing .*'dp_rank_0'.*not saved by BatchQueueDataLoader"),
        ({"batchqueue": "{"}, "is not JSON"),
        ({"batchqueue": '{"version": 9, "states": []}'}, "version 1, got 9"),
        ({"batchqueue": '{"version": 1, "states": []}'}, "non-empty list of client states"),
    ]:
        with pytest.raises(InvalidRequest, match=f"{where}.*{message}"):
            checkpoint_entry(entry)
