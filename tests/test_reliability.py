"""Faults survived with nothing lost: each test injects one fault into a real server (or its
workers, or a client process) and ends with the accounting auditor (tests/auditor.py).

Most tests share one module server whose datasets each carry one fault, so the faults cannot
disturb each other: `slow` (SlowProvider, big files: a worker can be killed mid-write), `full`
(DiskFullProvider, full from the start), `crash` (CrashingProvider) and `tiny` (healthy).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from auditor import audit
from grpc_health.v1 import health_pb2

from conftest import ServerFactory, ServerProcess, subprocess_env, wait_until
from queue_client import QueueClient, errors
from queue_client.format.batchfile import TMP_PREFIX, BatchFileName, load_batch_file, scan_queue
from queue_client.format.layout import is_temp_of
from queue_client.wire import batchqueue_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CONSUMER = "reliability-consumer"


def module_config(fault_file: Path) -> str:
    return textwrap.dedent(
        f"""
        [server]
        lease_ttl_s = 1.5

        [datasets.slow]
        provider = "bq_test_providers:SlowProvider"
        batch_size = 2
        batches_per_file = 10
        max_backlog_files = 1
        [datasets.slow.args]
        delay_s = 0.02
        width = 20000

        [datasets.full]
        provider = "bq_test_providers:DiskFullProvider"
        batch_size = 2
        batches_per_file = 2
        [datasets.full.args]
        fault_file = "{fault_file.as_posix()}"

        [datasets.crash]
        provider = "bq_test_providers:CrashingProvider"
        batch_size = 2
        batches_per_file = 2
        max_worker_restarts = 1

        [datasets.tiny]
        provider = "bq_test_providers:TinyProvider"
        batch_size = 2
        batches_per_file = 3

        [datasets.order]
        provider = "bq_test_providers:TinyProvider"
        batch_size = 2
        batches_per_file = 2
        """
    )


@dataclass
class Faults:
    server: ServerProcess
    fault_file: Path  # while it exists, dataset `full` cannot write
    started: float  # time.monotonic() once the server was up


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faults]:
    """The shared server, and the file whose presence makes `full`'s disk full."""
    tmp = tmp_path_factory.mktemp("reliability")
    fault_file = tmp / "disk-full"
    fault_file.touch()
    factory = ServerFactory(tmp)
    server = factory(module_config(fault_file), wait_serving=False, args=("--keep-serving",))
    for name in ("slow", "full", "tiny", "order"):
        wait_until(
            lambda name=name: server.health(health_name(name)) == SERVING, 60, f"{name} SERVING"
        )
    yield Faults(server, fault_file, time.monotonic())
    factory.close()


def health_name(dataset: str) -> str:
    return f"batchqueue.v1.BatchQueue/{dataset}"


def consume_next(server: ServerProcess, dataset: str, split: str = "train") -> int:
    """Lease rank 0's next file and release it CONSUMED; returns its seq."""
    lease = server.stub.AcquireLease(
        pb.AcquireLeaseRequest(dataset=dataset, split=split, client_id=CONSUMER, wait_ms=10_000),
        timeout=30,
    )
    server.stub.ReleaseLease(
        pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id=CONSUMER, outcome=pb.CONSUMED),
        timeout=30,
    )
    return lease.seq


def journaled_sizes(data_root: Path, dataset: str, split: str) -> dict[str, int]:
    """Published name -> size in bytes, from the journal's "produced" records (FORMAT.md)."""
    lines = (data_root / dataset / "journal" / f"{split}.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["name"]: r["bytes"] for r in records if r.get("e") == "p"}


class QueueWatcher(threading.Thread):
    """Records the size of every published file each time it sees it in a queue dir."""

    def __init__(self, qdir: Path) -> None:
        super().__init__(daemon=True)
        self.qdir = qdir
        self.seen: dict[str, set[int]] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.001):  # the sampling period of the watcher, not a sync
            with os.scandir(self.qdir) as entries:
                for entry in entries:
                    if BatchFileName.parse(entry.name) is None:
                        continue
                    try:
                        size = entry.stat().st_size
                    except FileNotFoundError:
                        continue  # consumed between listing and stat: nothing was seen
                    self.seen.setdefault(entry.name, set()).add(size)

    def stop(self) -> dict[str, set[int]]:
        self._stop_event.set()
        self.join(timeout=10)
        return self.seen


def kill_worker_mid_write(qdir: Path, pid: int, full_size: int, deadline: float) -> str | None:
    """SIGKILL `pid` while its temp file is still growing; returns that temp name, or None
    if no write was caught before the deadline. A temp smaller than a whole file means the
    write (let alone the fsync and the rename) is unfinished when the signal lands."""
    while time.monotonic() < deadline:
        for name in os.listdir(qdir):
            if is_temp_of(name, pid):
                try:
                    size = os.stat(qdir / name).st_size
                except FileNotFoundError:
                    continue
                if size < full_size * 0.9:
                    os.kill(pid, signal.SIGKILL)
                    return name
    return None


def restarted(server: ServerProcess, restarts: int, old_pid: int) -> dict | None:
    """slow/train's stats once its worker was restarted `restarts` times with a new pid."""
    stats = server.split_stats("slow")
    pids = [int(p) for p in stats["worker_pids"]]
    return stats if stats["worker_restarts"] == restarts and pids and old_pid not in pids else None


def test_worker_sigkill_mid_write_shows_no_partial_file_and_restarts(faults) -> None:
    """A worker killed while writing a batch file: no partial file is ever visible under a
    published name, its temp file is removed, the restart is counted, production goes on."""
    server = faults.server
    qdir = server.data_root / "slow" / "queue" / "train"
    first = wait_until(lambda: scan_queue(qdir), 60, "slow's first file")
    full_size = (qdir / str(first[0])).stat().st_size
    before = server.split_stats("slow")
    pid = int(before["worker_pids"][0])
    watcher = QueueWatcher(qdir)
    watcher.start()
    consumed: list[int] = []
    try:
        killed = None
        for _ in range(10):  # each consumed file makes the worker write one more
            consumed.append(consume_next(server, "slow"))
            killed = kill_worker_mid_write(qdir, pid, full_size, time.monotonic() + 5)
            if killed:
                break
        assert killed, "never caught the worker writing a file"
        stats = wait_until(
            lambda: restarted(server, before["worker_restarts"] + 1, pid),
            30,
            "the worker to restart",
        )
        wait_until(
            lambda: not (qdir / killed).exists(),
            10,
            f"the dead worker's temp file {killed} to be removed",
        )
        # Production goes on with the new worker: two more files consumed, two more made.
        consumed += [consume_next(server, "slow"), consume_next(server, "slow")]
        wait_until(
            lambda: server.split_stats("slow")["produced_files"] >= stats["produced_files"] + 2,
            30,
            "production to go on",
        )
    finally:
        seen = watcher.stop()
    assert seen, "the watcher saw no published file"
    journal = journaled_sizes(server.data_root, "slow", "train")
    partial = {name: sizes for name, sizes in seen.items() if sizes != {journal.get(name)}}
    assert not partial, f"published names seen with sizes other than the journaled one: {partial}"
    assert server.health(health_name("slow")) == SERVING
    audit(server, "slow", consumed_seqs={"train": consumed})


def test_repeated_crashes_fail_only_that_dataset(faults) -> None:
    """A provider that kills its worker on every file is restarted max_worker_restarts times,
    then its dataset is failed with the last error and NOT_SERVING; the others keep serving."""
    server = faults.server
    wait_until(lambda: server.stats("crash")["state"] == "failed", 60, "crash to fail")
    stats = server.stats("crash")
    assert "exited with code 17" in stats["last_error"]
    assert max(server.split_stats("crash", s)["worker_restarts"] for s in ("train", "val")) == 1
    assert server.health(health_name("crash")) == NOT_SERVING
    assert server.health() == NOT_SERVING  # the server as a whole is not all right
    assert server.health(health_name("tiny")) == SERVING
    with pytest.raises(grpc.RpcError) as err:
        server.stub.AcquireLease(
            pb.AcquireLeaseRequest(dataset="crash", split="train", client_id="c", wait_ms=100),
            timeout=10,
        )
    assert (
        err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "exited with code 17" in err.value.details()
    )
    assert not list((server.data_root / "crash" / "queue" / "train").iterdir())
    audit(server, "crash")


def test_disk_full_backs_off_reports_and_resumes(faults) -> None:
    """ENOSPC (an injected writer fault): the dataset stays SERVING, stats count the errors
    and name the last one, a lease request says why it waits; once space returns production
    resumes and the error is cleared."""
    server, fault_file = faults.server, faults.fault_file
    stats = wait_until(
        lambda: (s := server.split_stats("full"))["disk_errors"] >= 2 and s, 30, "disk errors"
    )
    assert "No space left on device" in stats["last_disk_error"]
    assert stats["produced_files"] == 0 and stats["worker_restarts"] == 0
    # Backing off: a retry after 0.2 s, doubling up to 5 s, not a tight loop of failed writes.
    assert stats["disk_errors"] <= 10 + (time.monotonic() - faults.started)
    assert server.stats("full")["state"] == "serving"
    assert server.health(health_name("full")) == SERVING
    with pytest.raises(grpc.RpcError) as err:
        server.stub.AcquireLease(
            pb.AcquireLeaseRequest(dataset="full", split="train", client_id="c", wait_ms=300),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot write" in err.value.details() and "No space left" in err.value.details()
    fault_file.unlink()
    # A trainer waiting for the file: its lease requests also wake production, which matters
    # because the backoff timer alone can be lost (see the report in docs/guarantees.md).
    with QueueClient(server.address, "full", timeout_s=60) as client:
        x, y = client.get_batch("train")
        assert (y == x + 1).all()
    stats = server.split_stats("full")
    assert stats["last_disk_error"] == "" and stats["produced_files"] >= 1
    audit(server, "full")


def test_corrupted_published_file_is_quarantined_and_produced_again(faults) -> None:
    """A file truncated after publication is quarantined with a reason and counted; the rank
    reads the same seq, produced again, so no batch is lost."""
    server = faults.server
    qdir = server.data_root / "tiny" / "queue" / "train"
    wait_until(lambda: {0, 1} <= {n.seq for n in scan_queue(qdir)}, 30, "seqs 0 and 1")
    files = {n.seq: qdir / str(n) for n in scan_queue(qdir)}
    expected = {seq: load_batch_file(files[seq]).tensors["x"].clone() for seq in (0, 1)}
    victim = files[0]
    victim.write_bytes(victim.read_bytes()[:100])
    read = []
    with QueueClient(server.address, "tiny", timeout_s=30) as client:
        for _ in range(6):  # two whole files
            pos = client.state_dict()["splits"].get("train", {"seq": 0, "offset": 0})
            offset = pos["offset"] // client.file_batch_size  # the state counts rows
            read.append((pos["seq"], offset))
            x, _ = client.get_batch("train")
            assert (x == expected[pos["seq"]][offset]).all()
    assert read == [(s, o) for s in (0, 1) for o in range(3)]
    stats = audit(
        server, "tiny", consumed_batches={"train": read}, consumed_seqs={"train": [0, 1]}
    )["train"]
    assert stats["quarantined_files"] == 1 and stats["reproduced_files"] >= 1
    reason = (
        server.data_root / "tiny" / "quarantine" / "train" / f"{victim.name}.reason.txt"
    ).read_text()
    assert "bytes" in reason


def test_killed_client_leases_come_back_and_the_books_balance(faults) -> None:
    """A client process SIGKILLed while holding two leases: after the TTL its files return to
    its rank's stream, the restarted rank reads the same first batch, and the audit holds."""
    server = faults.server
    script = f"""
        import sys
        from queue_client import QueueClient
        c = QueueClient("{server.address}", "tiny", prefetch_files=1)
        x, _ = c.get_batch("val")
        print(x[0].tolist(), flush=True)
        sys.stdin.read()
    """
    before = server.split_stats("tiny", "val")["leases_expired"]
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    ) as proc:
        try:
            first_row = proc.stdout.readline().strip()
            wait_until(
                lambda: server.split_stats("tiny", "val")["leased_files"] == 2, 30, "two leases"
            )
            audit(server, "tiny")  # leased files are accounted for while their holder lives
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    wait_until(
        lambda: server.split_stats("tiny", "val")["leased_files"] == 0, 30, "leases to expire"
    )
    stats = server.split_stats("tiny", "val")
    assert stats["leases_expired"] == before + 2 and stats["consumed_files"] == 0
    audit(server, "tiny")
    with QueueClient(server.address, "tiny") as client:
        x, _ = client.get_batch("val")
        assert str(x[0].tolist()) == first_row


def lease(server: ServerProcess, dataset: str, seq: int, client_id: str = CONSUMER) -> pb.Lease:
    request = pb.AcquireLeaseRequest(
        dataset=dataset, split="train", client_id=client_id, seq=seq, wait_ms=10_000
    )
    return server.stub.AcquireLease(request, timeout=30)


def end(server: ServerProcess, lease_: pb.Lease, outcome: int, client_id: str = CONSUMER) -> None:
    request = pb.ReleaseLeaseRequest(lease_id=lease_.lease_id, client_id=client_id, outcome=outcome)
    server.stub.ReleaseLease(request, timeout=30)


def test_retaking_an_older_lease_does_not_bring_back_consumed_seqs(faults) -> None:
    """Rank 0 consumes seq 1, then holds seq 0 while the queue moves: seq 1 stays consumed."""
    server = faults.server
    wait_until(lambda: server.split_stats("order")["ready_files"] >= 4, 30, "the first window")
    end(server, lease(server, "order", 1), pb.CONSUMED)
    wait_until(lambda: server.split_stats("order")["ready_files"] >= 5, 30, "the window to refill")
    held = lease(server, "order", 0)
    end(server, lease(server, "order", 2), pb.RETURNED)  # any release moves the scheduler
    end(server, held, pb.CONSUMED)
    # Seq 6 comes from the one worker after anything it was given before: by the time it is
    # leased, a re-production of seq 1, if one was scheduled, is on disk.
    end(server, lease(server, "order", 6), pb.RETURNED)
    audit(server, "order", consumed_seqs={"train": [0, 1]}, timeout_s=3)


# ---- the server itself killed --------------------------------------------------------------

NB = 5
READER = """
import json, sys, time
from queue_client import QueueClient
address, total = sys.argv[1], int(sys.argv[2])
with QueueClient(address, "d", reconnect_timeout_s=90, timeout_s=120) as client:
    for _ in range(total):
        pos = client.state_dict()["splits"].get("train", {"seq": 0, "offset": 0})
        client.get_batch("train")
        print(json.dumps([pos["seq"], pos["offset"] // client.file_batch_size]), flush=True)
        time.sleep(0.01)  # a training step: the reader is slower than the provider
"""


def restart_config() -> str:
    return textwrap.dedent(
        f"""
        [server]
        lease_ttl_s = 30
        [datasets.d]
        provider = "bq_test_providers:SlowProvider"
        batch_size = 2
        batches_per_file = {NB}
        [datasets.d.args]
        delay_s = 0.004
        """
    )


def test_a_client_closed_after_a_server_restart_gives_its_files_back(
    start_server, tmp_path: Path
) -> None:
    """The server restarts while a client holds a file it has read to its end (and two
    prefetched ones): the leases are unknown to the new server. Closed now, the client takes
    them again to give them back: the read file counts as consumed and leaves the disk, and
    no lease stays out. (A closing client used to refuse to take a lease back, so a read file
    stayed on disk, counted as unconsumed.)"""
    sock, root = tmp_path / "bq.sock", tmp_path / "root"
    server = start_server(restart_config(), data_root=root, listen=f"unix:{sock}")
    client = QueueClient(server.address, "d", reconnect_timeout_s=60)
    try:
        read = []
        for _ in range(NB):  # seq 0 to its end; its release waits for the next call or close
            client.get_batch("train")
            split = client.state_dict()["splits"]["train"]
            read.append((split["seq"], split["offset"]))
        server.kill(signal.SIGKILL)
        server = start_server(restart_config(), data_root=root, listen=f"unix:{sock}")
    finally:
        client.close()
    assert read[-1] == (1, 0)  # the position after seq 0's last batch
    stats = audit(server, "d", consumed_seqs={"train": {0}})["train"]
    assert stats["leased_files"] == 0 and stats["consumed_files"] == 1, stats


def test_server_sigkill_with_leases_out_then_restart(start_server, tmp_path: Path) -> None:
    """The server SIGKILLed while a client process holds leases and keeps reading: the restart
    removes temp files and forgets the old leases, the client reconnects by itself and reads
    every batch exactly once. Then a server that never comes back gives the client
    ServerUnavailable naming the address within its reconnect timeout."""
    sock, root = tmp_path / "bq.sock", tmp_path / "root"
    server = start_server(restart_config(), data_root=root, listen=f"unix:{sock}")
    files = 30
    err_path = tmp_path / "reader.err"
    with open(err_path, "w") as err_file:
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, server.address, str(files * NB)],
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
            env=subprocess_env(),
        )
    try:
        read = [tuple(json.loads(reader.stdout.readline())) for _ in range(4 * NB)]
        wait_until(
            lambda: server.split_stats("d")["leased_files"] >= 1, 30, "the reader to hold leases"
        )
        server.kill(signal.SIGKILL)
        qdir = root / "d" / "queue" / "train"
        stray = qdir / f"{TMP_PREFIX}1-0000000099-1.pt"
        stray.write_bytes(b"half a file")
        server = start_server(restart_config(), data_root=root, listen=f"unix:{sock}")
        assert not stray.exists()
        read += [tuple(json.loads(line)) for line in reader.stdout]  # until the reader exits
        reader.wait(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(timeout=30)
        reader.stdout.close()
    assert reader.returncode == 0, err_path.read_text()
    assert read == [(s, o) for s in range(files) for o in range(NB)]
    # The exact consumed seqs too: releases that reach the restarted server out of order
    # must not bring a consumed seq back.
    stats = audit(
        server, "d", consumed_batches={"train": read}, consumed_seqs={"train": set(range(files))}
    )["train"]
    assert stats["leased_files"] == 0
    # The server dies for good: the client retries with backoff, then gives up, naming it.
    client = QueueClient(server.address, "d", reconnect_timeout_s=2, timeout_s=30)
    try:
        client.get_batch("train")
        server.kill(signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(errors.ServerUnavailable, match=re.escape(str(sock))):
            for _ in range(3 * NB):
                client.get_batch("train")
        assert time.monotonic() - began < 2 + 8
    finally:
        client.close()
