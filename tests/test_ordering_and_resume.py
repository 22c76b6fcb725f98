"""Deterministic per-rank streams, exact resume after SIGKILL, elastic world size.

Each test runs real server and client processes; a batch is identified by its position
(seq, offset) and a hash of its bytes.
"""

from __future__ import annotations

import json
import signal
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from client_process import ClientProcess

from conftest import SUPPORT, ServerFactory, wait_until
from queue_client import NoBatchReady, QueueClient
from queue_client.format.batchfile import scan_queue
from queue_client.wire import batchqueue_pb2 as pb

NB = 5  # batches per file in these tests
BS = 2  # rows per batch: a state's offsets count rows


def tiny_config(*names: str, workers: int = 1, mode: str = "deterministic", extra: str = "") -> str:
    return "[server]\nlease_ttl_s = 30\n" + tiny_tables(
        *names, workers=workers, mode=mode, extra=extra
    )


def tiny_tables(*names: str, workers: int = 1, mode: str = "deterministic", extra: str = "") -> str:
    tables = []
    for name in names:
        tables.append(
            textwrap.dedent(
                f"""
                [datasets.{name}]
                provider = "bq_test_providers:TinyProvider"
                batch_size = {BS}
                batches_per_file = {NB}
                workers = {workers}
                mode = "{mode}"
                {extra}
                """
            )
        )
    return "".join(tables)


class Rank:
    """A rank_client.py process."""

    def __init__(
        self,
        tmp: Path,
        tag: str,
        address: str,
        rank: int,
        world: int,
        jobs: list[dict[str, Any]],
        hold: bool = False,
        fetch_process: bool = False,
    ) -> None:
        self.outs = {}
        for job in jobs:
            job.setdefault("out", str(tmp / f"{tag}-{job['dataset']}-r{rank}.jsonl"))
            self.outs[job["dataset"]] = Path(job["out"])
        spec = tmp / f"{tag}-r{rank}.json"
        spec.write_text(
            json.dumps(
                {
                    "address": address,
                    "rank": rank,
                    "world_size": world,
                    "hold": hold,
                    "fetch_process": fetch_process,
                    "jobs": jobs,
                }
            )
        )
        self.proc = ClientProcess(SUPPORT / "rank_client.py", [str(spec)])
        self.hold = hold

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        assert line.strip() == "READY", f"rank client failed: {line}{self.proc.stderr.read()}"

    def finish(self) -> None:
        _, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=30)

    def batches(self, dataset: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.outs[dataset].read_text().splitlines()]


def _run(
    tmp: Path, tag: str, address: str, world: int, jobs_for: Any, fetch_process: bool = False
) -> list[Rank]:
    ranks = [
        Rank(tmp, tag, address, r, world, jobs_for(r), fetch_process=fetch_process)
        for r in range(world)
    ]
    for rank in ranks:
        rank.finish()
    return ranks


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory):
    """One server for the tests that need no restart, datasets of their own (a server start
    costs about two seconds of CPU: its workers' forkserver imports torch)."""
    config = "[server]\nlease_ttl_s = 30\n" + "".join(
        (
            tiny_tables("cover", workers=3),
            tiny_tables("elastic"),
            tiny_tables("lead", mode="best_effort", extra="max_lead = 2\nmax_backlog_files = 4"),
            tiny_tables("timeout", extra="max_backlog_files = 1"),
            tiny_tables("rewind", "takeback", extra="max_backlog_files = 2"),
        )
    )
    factory = ServerFactory(tmp_path_factory.mktemp("ordering"))
    yield factory(config)
    factory.close()


def test_two_runs_give_bit_identical_streams(start_server, tmp_path: Path) -> None:
    hashes = []
    for run in ("a", "b"):
        server = start_server(tiny_config("d", workers=2), data_root=tmp_path / f"root-{run}")
        ranks = _run(tmp_path, run, server.address, 2, lambda r: [{"dataset": "d", "batches": 12}])
        hashes.append([[b["hash"] for b in rank.batches("d")] for rank in ranks])
        assert [(b["seq"], b["offset"]) for b in ranks[1].batches("d")][:6] == [
            (1, 0),
            (1, 1),
            (1, 2),
            (1, 3),
            (1, 4),
            (3, 0),
        ]
        server.stop()
    assert hashes[0] == hashes[1]
    assert hashes[0][0] != hashes[0][1]


def test_four_ranks_cover_every_seq_exactly_once_with_three_workers(shared, tmp_path: Path) -> None:
    server = shared
    ranks = _run(
        tmp_path, "cover", server.address, 4, lambda r: [{"dataset": "cover", "batches": 3 * NB}]
    )
    seen = {
        r: {(b["seq"], b["offset"]) for b in rank.batches("cover")} for r, rank in enumerate(ranks)
    }
    for r in range(4):
        assert {s for s, _ in seen[r]} == {r, r + 4, r + 8}  # seq = rank (mod 4)
        for q in range(r + 1, 4):
            assert not seen[r] & seen[q]
    union = set().union(*seen.values())
    assert union == {(s, i) for s in range(12) for i in range(NB)}
    hashes = [b["hash"] for rank in ranks for b in rank.batches("cover")]
    assert len(set(hashes)) == len(hashes)  # no batch served twice, not even by content


def test_prefix_property_after_sigkill_of_server_and_clients(start_server, tmp_path: Path) -> None:
    total = 13
    splits = {"k3": 3, "k5": 5, "k9": 9}  # mid-file, at a file's end, into the second file
    root = tmp_path / "root"
    server = start_server(tiny_config("ref", *splits), data_root=root)
    # The uninterrupted reference, and the first part of each interrupted run.
    ranks = []
    for r in range(2):
        jobs = [{"dataset": "ref", "batches": total}]
        jobs += [
            {"dataset": d, "batches": k, "state_out": str(tmp_path / f"{d}-r{r}.state")}
            for d, k in splits.items()
        ]
        ranks.append(Rank(tmp_path, "first", server.address, r, 2, jobs, hold=True))
    for rank in ranks:
        rank.wait_ready()
    server.kill(signal.SIGKILL)
    for rank in ranks:
        rank.kill()
    server = start_server(tiny_config("ref", *splits), data_root=root)
    resumed = _run(
        tmp_path,
        "second",
        server.address,
        2,
        lambda r: [
            {"dataset": d, "batches": total - k, "state_in": str(tmp_path / f"{d}-r{r}.state")}
            for d, k in splits.items()
        ],
    )
    for r in range(2):
        reference = ranks[r].batches("ref")
        for d in splits:
            stitched = ranks[r].batches(d) + resumed[r].batches(d)
            assert stitched == reference, f"rank {r}, split point {d}"


def test_elastic_resume_from_four_ranks_to_two_is_exactly_once(shared, tmp_path: Path) -> None:
    server = shared
    # Four ranks read 7 batches each: one whole file and two batches of the next.
    old = _run(
        tmp_path,
        "old",
        server.address,
        4,
        lambda r: [
            {"dataset": "elastic", "batches": 7, "state_out": str(tmp_path / f"old-r{r}.state")}
        ],
    )
    states = [json.loads((tmp_path / f"old-r{r}.state").read_text()) for r in range(4)]
    (tmp_path / "all.state").write_text(json.dumps(states))
    # Two ranks take over: carried files 4..11 split between them, then 12, 14, ... and 13, 15, ...
    new = _run(
        tmp_path,
        "new",
        server.address,
        2,
        lambda r: [{"dataset": "elastic", "batches": 26, "state_in": str(tmp_path / "all.state")}],
    )
    consumed = [(b["seq"], b["offset"]) for rank in old + new for b in rank.batches("elastic")]
    counts = Counter(consumed)
    assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1]
    assert {k for k in counts if k[0] < 16} == {(s, i) for s in range(16) for i in range(NB)}
    assert {b["seq"] for b in new[0].batches("elastic")} == {4, 6, 8, 10, 12, 14}
    # A single rank's state is enough when ranks stepped in lockstep: the same plan comes out.
    with QueueClient(server.address, "elastic", rank=1, world_size=2) as client:
        client.load_state_dict(states[2])
        assert client.state_dict()["splits"]["train"] == {
            "seq": 5,
            "offset": 2 * BS,
            "next_seq": 13,
            "pending": [[7, 2 * BS], [9, 0], [11, 0]],
            "step": states[2]["splits"]["train"]["step"],  # its get_batch calls, carried on
        }


def test_restarted_server_carries_on_from_the_journal(start_server, tmp_path: Path) -> None:
    root = tmp_path / "root"
    server = start_server(tiny_config("d"), data_root=root)
    with QueueClient(server.address, "d") as client:
        for _ in range(2 * NB):
            client.get_batch("train")
        state = client.state_dict()
    before = server.split_stats("d")
    assert before["ranks"][0]["last_consumed_seq"] == "1"
    server.kill(signal.SIGKILL)
    qdir = root / "d" / "queue" / "train"
    planted = qdir / ".tmp-1-0000000099-1.pt"
    planted.write_bytes(b"half a file")
    server = start_server(tiny_config("d"), data_root=root)
    assert not planted.exists()  # the new server's own workers may be writing temps by now
    after = server.split_stats("d")
    assert after["produced_files"] >= before["produced_files"] and after["consumed_files"] == 2
    assert after["reproduced_files"] == 0  # nothing made twice: seq carried on from the journal
    assert min(n.seq for n in scan_queue(qdir)) == 2
    with QueueClient(server.address, "d") as client:
        client.load_state_dict(state)
        client.get_batch("train")
        assert client.state_dict()["splits"]["train"]["seq"] == 2


def test_client_survives_a_server_restart(start_server, tmp_path: Path) -> None:
    sock = tmp_path / "bq.sock"
    root = tmp_path / "root"
    server = start_server(tiny_config("d"), data_root=root, listen=f"unix:{sock}")
    with QueueClient(server.address, "d", reconnect_timeout_s=60) as client:
        seen = [client.get_batch("train")[0].clone() for _ in range(3)]
        server.kill(signal.SIGKILL)
        server = start_server(tiny_config("d"), data_root=root, listen=f"unix:{sock}")
        seen += [client.get_batch("train")[0].clone() for _ in range(3 * NB)]
        state = client.state_dict()["splits"]["train"]
    assert state == {"seq": 3, "offset": 3 * BS, "next_seq": 4, "pending": [], "step": 3 + 3 * NB}
    # The same stream as a client that never saw a restart.
    with QueueClient(server.address, "d") as fresh:
        for expected in seen:
            assert (fresh.get_batch("train")[0] == expected).all()


def test_best_effort_bounds_the_lead_over_the_slowest_rank(shared) -> None:
    server = shared
    stub = server.stub

    def take(rank: int) -> pb.Lease:
        lease = stub.AcquireLease(
            pb.AcquireLeaseRequest(
                dataset="lead",
                split="train",
                rank=rank,
                world_size=2,
                client_id=f"c{rank}",
                wait_ms=300,
            ),
            timeout=10,
        )
        stub.ReleaseLease(
            pb.ReleaseLeaseRequest(
                lease_id=lease.lease_id, client_id=f"c{rank}", outcome=pb.CONSUMED
            ),
            timeout=10,
        )
        return lease

    wait_until(lambda: server.split_stats("lead")["ready_files"] >= 4, what="a backlog")
    seqs = [take(0).seq, take(0).seq]
    with pytest.raises(grpc.RpcError) as err:
        take(0)  # two files ahead of rank 1, which has read nothing
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    seqs.append(take(1).seq)
    seqs.append(take(0).seq)  # rank 1 moved, so rank 0 may go on
    assert len(set(seqs)) == 4


def test_get_batch_after_a_timeout_skips_nothing(shared) -> None:
    server = shared
    # Rank 0 of 2 reads one batch and stops (it is heard from, at seq 0); rank 1 reads on
    # alone: once its window is used up, production waits for rank 0.
    rank0 = QueueClient(server.address, "timeout", rank=0, world_size=2, timeout_s=60)
    rank0.get_batch("train")
    with QueueClient(server.address, "timeout", rank=1, world_size=2, timeout_s=1.0) as rank1:
        got = []
        with pytest.raises(NoBatchReady):
            while True:
                rank1.get_batch("train")
                got.append(rank1.state_dict()["splits"]["train"]["seq"])
        stuck = rank1.state_dict()["splits"]["train"]
        for _ in range(6 * NB - 1):  # the rest of seqs 0 .. 10
            rank0.get_batch("train")
        rank1.get_batch("train")  # production moved on: the retry succeeds
        # rank 0's prefetch now waits on rank 1's window; close() must not wait out timeout_s.
        began = time.monotonic()
        rank0.close()
        assert time.monotonic() - began < 30
        after = rank1.state_dict()["splits"]["train"]
    assert stuck["offset"] == 0 and after == {
        **stuck,
        "offset": BS,
        "step": stuck["step"] + 1,
    }  # the same file, its first batch (the call that timed out served no step)


def test_streaming_provider_reproduces_old_seqs_from_the_journal(
    start_server, tmp_path: Path
) -> None:
    """A stateful provider: seq s is made again from the state journaled before it, and the
    forward stream (also across a server restart) carries on where it stopped."""
    config = """
[datasets.s]
provider = "bq_test_providers:StreamProvider"
batch_size = 2
batches_per_file = 2
workers = 2
"""
    root = tmp_path / "root"
    server = start_server(config, data_root=root)

    def read(client: QueueClient, n: int) -> list[list[int]]:
        return [client.get_batch("train")[0][:, 0].tolist() for _ in range(n)]

    with QueueClient(server.address, "s") as client:
        first = read(client, 8)  # seqs 0..3: workers 0 and 1 alternate
    assert first[0] == [0, 4] and first[2] == [1_000_000, 1_000_004] and first[4] == [16, 20]
    server.kill(signal.SIGKILL)
    server = start_server(config, data_root=root)
    with QueueClient(server.address, "s") as client:
        again = read(client, 12)  # seqs 0..3 again (consumed, so produced again), then 4, 5
    assert again[:8] == first
    assert again[8] == [32, 36] and again[10] == [1_000_032, 1_000_036]
    assert server.split_stats("s")["reproduced_files"] >= 4


def test_taking_back_a_lost_lease_is_not_a_rewind(shared) -> None:
    """A client whose release met a restarted server takes the lease again to release it,
    perhaps after reading further: that must not rewind the rank's stream and make the files
    after it again. A plain request for an old seq is a rewind (a checkpoint load), and does."""
    server = shared
    stub = server.stub

    def acquire(dataset: str, seq: int, again: bool = False) -> pb.Lease:
        request = pb.AcquireLeaseRequest(
            dataset=dataset, split="train", client_id="c", seq=seq, wait_ms=10_000, reacquire=again
        )
        return stub.AcquireLease(request)

    def consume(lease: pb.Lease) -> None:
        stub.ReleaseLease(
            pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id="c", outcome=pb.CONSUMED)
        )

    for dataset, again in (("rewind", False), ("takeback", True)):
        for seq in range(4):
            consume(acquire(dataset, seq))
        consume(acquire(dataset, 0, again))  # seq 0 is made again either way: it was asked for
    # The rewind also brings back 1, 2 and 3 (its window); taking a lease back brings nothing.
    for dataset, reproduced in (("rewind", 4), ("takeback", 1)):
        wait_until(
            lambda d=dataset, r=reproduced: server.split_stats(d)["reproduced_files"] >= r,
            30,
            f"reproductions of {dataset}",
        )
        wait_until(lambda d=dataset: server.split_stats(d)["ready_files"] >= 2, 30, "a backlog")
        assert server.split_stats(dataset)["reproduced_files"] == reproduced
