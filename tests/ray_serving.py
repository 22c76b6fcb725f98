"""What the Ray server tests share: the config keys of a Ray dataset, trainer processes that
read a dataset and save their state, and the server's health, stats and /healthz as seen from
outside."""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from client_process import ClientProcess
from grpc_health.v1 import health_pb2
from ray_cluster import SUPPORT

from queue_server.app import health_name
from queue_server.testing import ServerProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BPF = 5  # batches per file in every config here
GATED = "bq_ray_providers:GatedStreamProvider"


def ray_keys(address: str, workers: int = 1, placement: str = "spread") -> str:
    return (
        f'backend = "ray"\nray_address = "{address}"\nray_placement = "{placement}"\n'
        f"workers = {workers}\nmax_backlog_files = 2"
    )


def gated_config(gate: Path, extra: str) -> str:
    """A streaming provider that stops in the middle of seq 2 until the test opens its gate."""
    return (
        "[server]\nlease_ttl_s = 30\n[datasets.s]\n"
        f'provider = "{GATED}"\nbatch_size = 2\nbatches_per_file = {BPF}\n{extra}\n'
        f'[datasets.s.args]\ngate_dir = "{gate.as_posix()}"\ngate_seq = 2\n'
    )


# How long a trainer waits for a batch: a Ray worker that imports torch took 60 s and more
# to make its first file on 2 cores at load 7-10 (the suite's 3 processes beside 2 busy ones).
READ_TIMEOUT_S = 240
# How long a new Ray actor may take to start and serve: the same worker start (one took 90 s
# while two busy loops and the rest of the suite shared the 2 cores).
ACTOR_START_S = 240


def read_batches(
    server: ServerProcess, dataset: str, batches: int, out: Path, resume: Path | None = None
) -> list[tuple[int, int, str]]:
    """`batches` batches read by a trainer process of its own (rank 0 of 1), closed after:
    [(seq, offset, hash of the batch's bytes)]. Its state dict is saved beside `out`; it
    resumes from the one at `resume`, as a trainer restarted from a checkpoint."""
    proc = reader(server, dataset, batches, out, resume)
    _, err = proc.communicate(timeout=2 * READ_TIMEOUT_S)
    assert proc.returncode == 0, f"the trainer process failed ({proc.returncode}):\n{err}"
    return read_out(out)


def reader(
    server: ServerProcess, dataset: str, batches: int, out: Path, resume: Path | None = None
) -> ClientProcess:
    spec = out.with_suffix(".spec.json")
    job = {
        "dataset": dataset,
        "batches": batches,
        "out": str(out),
        "state_in": str(resume) if resume else None,
        "state_out": str(state_of(out)),
    }
    spec.write_text(
        json.dumps(
            {
                "address": server.address,
                "rank": 0,
                "world_size": 1,
                "jobs": [job],
                "timeout_s": READ_TIMEOUT_S,
            }
        )
    )
    return ClientProcess(SUPPORT / "rank_client.py", [str(spec)])


def state_of(out: Path) -> Path:
    return out.with_suffix(".state.json")


def read_out(out: Path) -> list[tuple[int, int, str]]:
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [(r["seq"], r["offset"], r["hash"]) for r in rows]


def positions(rows: list[tuple[int, int, str]]) -> list[tuple[int, int]]:
    return [(seq, offset) for seq, offset, _ in rows]


def in_order(files: int) -> list[tuple[int, int]]:
    """Every batch of seqs 0..files-1 once, in order: nothing lost, nothing repeated."""
    return [(seq, offset) for seq in range(files) for offset in range(BPF)]


def health(server: ServerProcess, dataset: str) -> int:
    return server.health(health_name(dataset))


def worker_pids(server: ServerProcess) -> set[int]:
    return {int(w["pid"]) for w in server.split_stats("chars")["workers"]}


def healthz(server: ServerProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{server.metrics_address}/healthz", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def skip_without_token_auth() -> str:
    """A fresh token; the test skips where this Ray has no token authentication."""
    import ray

    if not hasattr(ray._raylet, "AuthenticationTokenLoader"):
        pytest.skip(f"Ray {ray.__version__} has no token authentication (Ray 2.52 and later)")
    return secrets.token_hex(16)
