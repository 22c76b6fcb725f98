"""Load: 64 coroutine clients, one rank each, lease and release against one server process.

Each client is rank r of 64 in deterministic mode: it leases its seqs r, r+64, ... in order
and releases most as CONSUMED; every third lease it gives back (RETURNED) and leases the same
seq again, so both outcomes and the re-lease of a returned file are under load. A sampler
checks the accounting invariant in GetStats all along; at the end the auditor checks that no
seq was consumed twice and none was skipped. Leases/s and latency percentiles are printed,
never asserted: the CI machine is shared.

    pytest -m slow tests/test_load.py -s      # the 60 s soak (BATCHQUEUE_SOAK_S overrides)
"""

from __future__ import annotations

import asyncio
import os
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from auditor import audit, check_counts, split_ints
from google.protobuf.json_format import MessageToDict

from conftest import ServerProcess
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire import batchqueue_pb2_grpc as pb_grpc

CLIENTS = 64
DATASET = "load"


def load_config(backlog: int) -> str:
    return textwrap.dedent(
        f"""
        [server]
        lease_ttl_s = 30
        [datasets.{DATASET}]
        provider = "bq_test_providers:TinyProvider"
        batch_size = 2
        batches_per_file = 2
        workers = 2
        max_backlog_files = {backlog}
        """
    )


@dataclass
class ClientLog:
    rank: int
    consumed: list[int] = field(default_factory=list)
    acquire_s: list[float] = field(default_factory=list)
    release_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Sampler:
    samples: int = 0
    problems: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_client(
    stub: pb_grpc.BatchQueueStub, data_root: Path, log: ClientLog, stop_at: float
) -> None:
    """Lease this rank's seqs in order until stop_at; every third lease is returned, then taken again."""
    loop = asyncio.get_running_loop()
    client_id = f"load-{log.rank}"
    seq, k = log.rank, 0
    while loop.time() < stop_at:
        t0 = time.perf_counter()
        request = pb.AcquireLeaseRequest(
            dataset=DATASET,
            split="train",
            rank=log.rank,
            world_size=CLIENTS,
            client_id=client_id,
            seq=seq,
            wait_ms=10_000,
        )
        try:
            lease = await stub.AcquireLease(request, timeout=30)
        except grpc.aio.AioRpcError as err:
            log.errors.append(f"rank {log.rank} seq {seq}: {err.code().name} {err.details()}")
            return
        log.acquire_s.append(time.perf_counter() - t0)
        if lease.seq != seq or os.stat(data_root / lease.path).st_size != lease.size_bytes:
            log.errors.append(
                f"rank {log.rank}: asked for seq {seq}, got {lease.seq} at {lease.path}"
            )
            return
        outcome = pb.RETURNED if k % 3 == 2 else pb.CONSUMED
        t1 = time.perf_counter()
        await stub.ReleaseLease(
            pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id=client_id, outcome=outcome),
            timeout=30,
        )
        log.release_s.append(time.perf_counter() - t1)
        if outcome == pb.CONSUMED:
            log.consumed.append(seq)
            seq += CLIENTS
        k += 1


async def sample_invariant(
    stub: pb_grpc.BatchQueueStub, sampler: Sampler, stop: asyncio.Event
) -> None:
    """GetStats every 20 ms while the clients run: the counts must add up in every reply."""
    while not stop.is_set():
        reply = await stub.GetStats(pb.GetStatsRequest(dataset=DATASET), timeout=30)
        stats = MessageToDict(
            reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        for split in stats["splits"]:
            sampler.problems += check_counts(split)
        sampler.samples += 1
        try:
            await asyncio.wait_for(stop.wait(), 0.02)  # the sampling period
        except asyncio.TimeoutError:
            pass


async def warm_up(stub: pb_grpc.BatchQueueStub) -> None:
    """Every rank takes its first file and gives it back: the server now knows world size 64."""

    async def first(rank: int) -> None:
        cid = f"load-{rank}"
        request = pb.AcquireLeaseRequest(
            dataset=DATASET,
            split="train",
            rank=rank,
            world_size=CLIENTS,
            client_id=cid,
            seq=rank,
            wait_ms=10_000,
        )
        lease = await stub.AcquireLease(request, timeout=60)
        await stub.ReleaseLease(
            pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id=cid, outcome=pb.RETURNED),
            timeout=30,
        )

    await asyncio.gather(*(first(r) for r in range(CLIENTS)))


async def drive(server: ServerProcess, duration_s: float) -> tuple[list[ClientLog], Sampler, float]:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.BatchQueueStub(channel)
        await warm_up(stub)
        loop = asyncio.get_running_loop()
        logs = [ClientLog(rank) for rank in range(CLIENTS)]
        sampler, stop = Sampler(), asyncio.Event()
        sampling = loop.create_task(sample_invariant(stub, sampler, stop))
        began = loop.time()
        await asyncio.gather(
            *(one_client(stub, server.data_root, log, began + duration_s) for log in logs)
        )
        elapsed = loop.time() - began
        stop.set()
        await sampling
    return logs, sampler, elapsed


def run_load(server: ServerProcess, duration_s: float) -> dict[str, float]:
    """Drive the clients, then assert nothing was lost or duplicated; returns the figures."""
    logs, sampler, elapsed = asyncio.run(drive(server, duration_s))
    errors = [e for log in logs for e in log.errors]
    assert not errors, errors[:10]
    assert sampler.samples > 0 and not sampler.problems, sampler.problems[:10]
    for log in logs:  # each rank consumed its own seqs, in order, none skipped
        assert log.consumed == [log.rank + i * CLIENTS for i in range(len(log.consumed))], (
            f"rank {log.rank}: {log.consumed}"
        )
    consumed = [seq for log in logs for seq in log.consumed]
    stats = audit(server, DATASET, consumed_seqs={"train": consumed})["train"]
    assert stats["leased_files"] == 0 and stats["seqs_consumed"] == len(consumed)
    acquires = [s for log in logs for s in log.acquire_s]
    releases = [s for log in logs for s in log.release_s]
    figures = {
        "clients": CLIENTS,
        "seconds": round(elapsed, 2),
        "leases": len(acquires),
        "leases_per_s": round(len(acquires) / elapsed, 1),
        "files_consumed": len(consumed),
        "acquire_p50_ms": round(percentile(acquires, 0.50) * 1000, 2),
        "acquire_p99_ms": round(percentile(acquires, 0.99) * 1000, 2),
        "release_p99_ms": round(percentile(releases, 0.99) * 1000, 2),
        "invariant_samples": sampler.samples,
    }
    print("\nload:", figures)
    return figures


def test_64_clients_lease_and_release_with_nothing_lost(start_server) -> None:
    """64 concurrent clients for a few seconds: every lease is of the seq asked for, the
    accounting adds up in every GetStats sample, and no seq is consumed twice or skipped."""
    server = start_server(load_config(backlog=4))
    figures = run_load(server, duration_s=3.0)
    assert figures["files_consumed"] >= CLIENTS  # every rank got somewhere


SOAK_S = float(os.environ.get("BATCHQUEUE_SOAK_S", "60"))


@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 180)
def test_soak_64_clients(start_server) -> None:
    """The soak: the same load for BATCHQUEUE_SOAK_S seconds (60 by default)."""
    server = start_server(load_config(backlog=4))
    figures = run_load(server, duration_s=SOAK_S)
    stats = split_ints(server.split_stats(DATASET))
    assert stats["worker_restarts"] == 0 and stats["disk_errors"] == 0
    assert figures["files_consumed"] >= CLIENTS
