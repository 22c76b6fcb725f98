"""A server whose providers are Ray actors (`backend = "ray"`), with real server processes,
real trainer clients and real Ray clusters: it serves the very batches a local-backend server
serves, and it keeps its accounting through the faults a cluster has. An actor killed in the
middle of a file has that seq made again; a node that leaves moves its work to the others; a
cluster that goes away entirely turns the dataset NOT_SERVING, saying why, and it serves again
when the cluster is back, with no server restart; an address where no cluster answers fails
the start with exit code 2, naming it. The accounting auditor runs after every fault."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from auditor import audit
from grpc_health.v1 import health_pb2
from ray_cluster import SUPPORT, RayCluster, RayHead, free_port

from conftest import ServerFactory, char_config, process_tree, subprocess_env, wait_until
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


def read_batches(
    server: ServerProcess, dataset: str, batches: int, out: Path, resume: Path | None = None
) -> list[tuple[int, int, str]]:
    """`batches` batches read by a trainer process of its own (rank 0 of 1), closed after:
    [(seq, offset, hash of the batch's bytes)]. Its state dict is saved beside `out`; it
    resumes from the one at `resume`, as a trainer restarted from a checkpoint."""
    proc = reader(server, dataset, batches, out, resume)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"the trainer process failed ({proc.returncode}):\n{err}"
    return read_out(out)


def reader(
    server: ServerProcess, dataset: str, batches: int, out: Path, resume: Path | None = None
) -> subprocess.Popen[str]:
    spec = out.with_suffix(".spec.json")
    job = {
        "dataset": dataset,
        "batches": batches,
        "out": str(out),
        "state_in": str(resume) if resume else None,
        "state_out": str(state_of(out)),
    }
    spec.write_text(
        json.dumps({"address": server.address, "rank": 0, "world_size": 1, "jobs": [job]})
    )
    return subprocess.Popen(
        [sys.executable, str(SUPPORT / "rank_client.py"), str(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )


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


def test_a_ray_server_serves_the_batches_of_a_local_server(
    ray_cluster: RayCluster, start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    """Same config, same seqs, same bytes: which backend made a file changes none of it."""
    local = start_server(
        char_config(corpus, extra="workers = 2\nmax_backlog_files = 2"),
        data_root=tmp_path / "local",
    )
    ray = start_server(
        char_config(corpus, extra=ray_keys(ray_cluster.address, workers=2)),
        data_root=tmp_path / "ray",
    )
    assert ray.split_stats("chars")["worker_pids"] == []  # no worker process of its own
    want = read_batches(local, "chars", 4 * BPF, tmp_path / "local.jsonl")
    got = read_batches(ray, "chars", 4 * BPF, tmp_path / "ray.jsonl")
    assert positions(got) == in_order(4)
    assert got == want
    for server in (local, ray):
        audit(server, "chars", consumed_batches={"train": positions(want)})
    # Stats name each actor's node and its pid there.
    workers = ray.split_stats("chars")["workers"]
    assert [(w["role"], int(w["index"]), w["backend"]) for w in workers] == [
        ("provider", 0, "ray"),
        ("provider", 1, "ray"),
    ], workers
    assert all(w["node_id"] in ray_cluster.node_ids and int(w["pid"]) > 0 for w in workers)


def test_an_actor_killed_mid_file_has_its_seq_made_again(
    ray_cluster: RayCluster, start_server: ServerFactory, tmp_path: Path
) -> None:
    """The call in flight fails with the actor's death: the server restarts the slot with a
    new actor from the journal and makes seq 2 again, exactly as a local worker makes it."""
    gate = tmp_path / "gate"
    gate.mkdir()
    ray = start_server(
        gated_config(gate, ray_keys(ray_cluster.address)), data_root=tmp_path / "ray"
    )
    # Each split's actor (train and val) stops in seq 2: both are killed there.
    markers = wait_until(
        lambda: len(found := list(gate.glob("making-2-*"))) == 2 and found,
        60,
        "the actors of train and val to start making seq 2",
    )
    for marker in markers:
        os.kill(int(marker.name.rsplit("-", 1)[1]), signal.SIGKILL)
    (gate / "go-2").touch()
    got = read_batches(ray, "s", 5 * BPF, tmp_path / "ray.jsonl")
    assert positions(got) == in_order(5)
    stats = audit(ray, "s", consumed_batches={"train": positions(got)})
    assert all(s["worker_restarts"] >= 1 for s in stats.values()), stats
    assert "slot 0: its Ray actor died" in ray.log(), ray.log_tail()

    # The reference: a local worker with the gate open from the start.
    local = start_server(gated_config(gate, "max_backlog_files = 2"), data_root=tmp_path / "local")
    assert got == read_batches(local, "s", 5 * BPF, tmp_path / "local.jsonl")


def test_a_removed_node_moves_its_work_to_the_others(
    ray_cluster: RayCluster, start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    import ray

    # Both standing nodes lent out, so the server's actors can only go to the node added next:
    # one per slot of each split (train and val), two slots each.
    held = ray.util.placement_group([{"CPU": 2}, {"CPU": 2}], strategy="STRICT_SPREAD")
    try:
        ray.get(held.ready(), timeout=60)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(held)
        raise AssertionError(
            f"the session cluster has not 2 free CPUs per node: {ray.available_resources()}"
        ) from None
    node = ray_cluster.add_node(num_cpus=4)
    removed = False
    try:
        server = start_server(
            char_config(corpus, extra=ray_keys(ray_cluster.address, workers=2)),
            data_root=tmp_path / "ray",
        )
        server.wait_ready_files("chars", 2)
        before = server.split_stats("chars")["produced_files"]
        ray.util.remove_placement_group(held)
        ray_cluster.remove_node(node)
        removed = True
        got = read_batches(server, "chars", 6 * BPF, tmp_path / "ray.jsonl")
    finally:
        if not removed:
            ray.util.remove_placement_group(held)
            ray_cluster.remove_node(node)
    assert positions(got) == in_order(6)
    stats = audit(server, "chars", consumed_batches={"train": positions(got)})["train"]
    assert stats["produced_files"] > before, "nothing was made after the node left"
    assert health(server, "chars") == SERVING


def test_the_whole_cluster_gone_and_back_without_a_server_restart(
    ray_head: type[RayHead], start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    head = ray_head(free_port(), subprocess_env())
    server = start_server(char_config(corpus, extra=ray_keys(head.address)))
    rows = read_batches(server, "chars", 2 * BPF, tmp_path / "1.jsonl")
    # The backlog full (seqs 2 and 3 on disk), production has nothing to ask the cluster for:
    # the server's watch of the head must notice the cluster gone, not a call for a file.
    server.wait_ready_files("chars", 2)

    head.kill()
    try:
        wait_until(lambda: health(server, "chars") == NOT_SERVING, 60, "chars to turn NOT_SERVING")
    except TimeoutError as exc:  # say what the server was doing meanwhile
        raise AssertionError(
            f"{exc}; stats {server.stats('chars')}\nserver log ends:\n{server.log_tail()}"
        ) from None
    stats = server.stats("chars")
    assert stats["state"] == "unavailable", stats
    assert head.address in stats["last_error"], stats["last_error"]
    assert server.health() == NOT_SERVING  # the whole server, too
    # The files on disk are still served meanwhile.
    rows += read_batches(
        server, "chars", 2 * BPF, tmp_path / "2.jsonl", state_of(tmp_path / "1.jsonl")
    )
    audit(server, "chars", consumed_batches={"train": positions(rows)})

    head.start()
    wait_until(lambda: health(server, "chars") == SERVING, 90, "chars to serve again")
    rows += read_batches(
        server, "chars", 3 * BPF, tmp_path / "3.jsonl", state_of(tmp_path / "2.jsonl")
    )
    assert positions(rows) == in_order(7)
    stats = server.stats("chars")
    assert (stats["state"], stats["last_error"]) == ("serving", "")
    audit(server, "chars", consumed_batches={"train": positions(rows)})
    assert server.proc.poll() is None  # the same server process throughout


@pytest.mark.xdist_group("ray")  # a Ray instance of its own: not beside the session's
def test_a_local_ray_instance_runs_more_actors_than_cores_and_stops_with_the_server(
    start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    """ray_address = "local" is for trying Ray on one machine: every actor the config asks
    for runs (sharing the cores, as worker processes do), not only one per core with the rest
    waiting for good. A SIGTERM stops the server cleanly (exit 0, no stack dump, no gRPC fork
    noise) and the Ray instance with it: none of its processes outlives the server. (Beyond 4
    cores the actors would fit anyway; the test then shows only the clean stop.)"""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'batchqueue[ray]'")
    workers = min(os.cpu_count() or 1, 4) + 1  # train's actors alone outnumber the cores
    server = start_server(char_config(corpus, extra=ray_keys("local", workers=workers)))
    rows = read_batches(server, "chars", 2 * BPF, tmp_path / "read.jsonl")
    assert positions(rows) == in_order(2)

    def running() -> list[dict[str, str]] | None:
        places = server.split_stats("chars")["workers"]
        return places if places and all(int(w["pid"]) for w in places) else None

    places = wait_until(running, 120, f"all {workers} actors of train running")
    assert [(w["backend"], int(w["index"])) for w in places] == [("ray", i) for i in range(workers)]
    assert len({w["node_id"] for w in places}) == 1  # the one node of the local instance
    ray_processes = process_tree(server.pid) - {server.pid}
    assert {int(w["pid"]) for w in places} <= ray_processes

    server.stop()
    assert server.proc.returncode == 0, server.log_tail()
    log = server.log()
    assert "SIGTERM received" not in log and "fork() handlers" not in log, log
    wait_until(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in ray_processes),
        30,
        "every process of the local Ray instance to end with the server",
    )


def test_an_unreachable_ray_address_exits_2_within_15_s_naming_it(
    corpus: Path, tmp_path: Path
) -> None:
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'batchqueue[ray]'")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    began = time.monotonic()
    server = ServerProcess(
        tmp_path / "server",
        data_root=tmp_path / "data",
        config_text=char_config(corpus, extra=ray_keys(address)),
        env=subprocess_env(),
    )
    try:
        code = server.proc.wait(timeout=15)
    finally:
        server.kill()
    took = time.monotonic() - began
    assert code == 2, f"exit code {code}:\n{server.log()}"
    assert took < 15
    assert f"ray_address = {address!r}" in server.log(), server.log()


def worker_pids(server: ServerProcess) -> set[int]:
    return {int(w["pid"]) for w in server.split_stats("chars")["workers"]}


def healthz(server: ServerProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{server.metrics_address}/healthz", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_dead_actors_leave_stats_a_stall_is_reported_and_a_joining_node_ends_it(
    ray_cluster: RayCluster, start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    """The dataset's actors run on a labelled node of the test's own. An actor killed by its
    pid leaves GetStats within seconds and counts as a worker restart. Then the node dies
    (SIGKILL, as a lost machine) and no other node has the label: its actors leave GetStats,
    and the dataset turns NOT_SERVING saying what it waits for and for how long, in GetStats
    and /healthz, for as long as it waits. A node with the label that joins takes the actors,
    and the same server serves on, every seq once."""
    key, value = "batchqueue-test-room", tmp_path.name[-20:]
    placement = f"node:{key}={value}"
    node = ray_cluster.add_node(labels={key: value})
    server = start_server(
        char_config(corpus, extra=ray_keys(ray_cluster.address, placement=placement)),
        data_root=tmp_path / "ray",
    )
    rows = read_batches(server, "chars", 2 * BPF, tmp_path / "1.jsonl")

    [victim] = worker_pids(server)
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: (
            victim not in worker_pids(server)
            and server.split_stats("chars")["worker_restarts"] >= 1
        ),
        15,
        f"the killed actor's pid {victim} to leave GetStats and count as a restart",
    )
    wait_until(lambda: len(worker_pids(server) - {0}) == 1, 60, "a new actor for train")
    server.wait_ready_files("chars", 2)
    restarts = server.split_stats("chars")["worker_restarts"]

    ray_cluster.remove_node(node, graceful=False)
    wait_until(
        lambda: (
            not server.split_stats("chars")["workers"]
            and server.split_stats("chars")["worker_restarts"] > restarts
        ),
        45,
        "the lost node's actors to leave GetStats and count as restarts",
    )
    try:
        reason = wait_until(
            lambda: (
                "chars/train slot 0" in (error := server.stats("chars")["last_error"]) and error
            ),
            30,
            "a stall of train reported",
            poll_s=0.5,
        )
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; stats {server.stats('chars')}\n{server.log_tail()}") from None
    assert health(server, "chars") == NOT_SERVING
    assert "waiting" in reason and "for a Ray node with 1 CPU free" in reason, reason
    assert placement in reason, reason
    status, body = healthz(server)
    assert status == 503 and "for a Ray node with 1 CPU free" in body, (status, body)
    # The wait goes on, and its report says for how long, while nothing is made.
    waited = wait_until(
        lambda: (
            (m := re.search(r"waiting (\d+) s", server.stats("chars")["last_error"]))
            and int(m.group(1)) >= 10
        ),
        30,
        "the stall's report to count its seconds",
    )
    assert waited and server.proc.poll() is None

    node = ray_cluster.add_node(labels={key: value})
    try:
        wait_until(
            lambda: health(server, "chars") == SERVING, 90, "the new node to take the actors"
        )
        rows += read_batches(
            server, "chars", 4 * BPF, tmp_path / "2.jsonl", state_of(tmp_path / "1.jsonl")
        )
        assert positions(rows) == in_order(6)
        stats = server.stats("chars")
        assert (stats["state"], stats["last_error"]) == ("serving", ""), stats
        audit(server, "chars", consumed_batches={"train": positions(rows)})
        places = server.split_stats("chars")["workers"]
        assert {w["node_id"] for w in places} == {node.node_id}, places
    finally:
        server.stop()
        ray_cluster.remove_node(node)


def test_a_head_that_refuses_the_servers_token_is_named_within_15_s(
    ray_head: type[RayHead], start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    """A head with token authentication on. Joining it without the token, or with another
    one, fails within the connect's 15 s (in well under a second) saying the head refused the
    token, which token was sent and where the cluster's must come from (not "no cluster
    answered"); a server without the token exits 2 saying so."""
    token = skip_without_token_auth()
    head = ray_head(free_port(), subprocess_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token))
    join = (
        "import sys, time\n"
        "from queue_server.production.ray_connect import CONNECT_TIMEOUT_S, RayUnavailable, connect\n"
        "began = time.monotonic()\n"
        "try:\n"
        "    connect(sys.argv[1])\n"
        "except RayUnavailable as exc:\n"
        "    print(f'{time.monotonic() - began:.2f} {CONNECT_TIMEOUT_S} {exc}')\n"
        "else:\n"
        "    raise SystemExit('joined without the token')\n"
    )
    for env, says in (
        ({"RAY_AUTH_MODE": "disabled"}, "RAY_AUTH_MODE=disabled, so it sent no token"),
        (
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32},
            "the token from RAY_AUTH_TOKEN is not the cluster's",
        ),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", join, head.address],
            capture_output=True,
            text=True,
            timeout=120,
            env=subprocess_env(**env),
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        took, limit, message = proc.stdout.strip().split(" ", 2)
        assert float(took) < float(limit), proc.stdout
        assert f"ray_address = {head.address!r}" in message and "InvalidAuthToken" in message
        assert "token authentication on" in message and says in message, message

    config = char_config(corpus, extra=ray_keys(head.address))
    server = ServerProcess(
        tmp_path / "refused",
        data_root=tmp_path / "data",
        config_text=config,
        env=subprocess_env(RAY_AUTH_MODE="disabled"),
    )
    try:
        code = server.proc.wait(timeout=120)
    finally:
        server.kill()
    log = server.log()
    assert code == 2, f"exit code {code}:\n{log}"
    assert "InvalidAuthToken" in log and "no Ray cluster answered" not in log, log


@pytest.mark.slow
def test_a_server_with_the_clusters_token_file_serves_as_docs_ray_md_says(
    ray_head: type[RayHead], start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    """docs/ray.md's step 0 on a head with token authentication on: RAY_AUTH_MODE=token and
    the cluster's token in a file named by RAY_AUTH_TOKEN_PATH, and the server serves."""
    token = skip_without_token_auth()
    head = ray_head(free_port(), subprocess_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token))
    token_file = tmp_path / "auth_token"
    token_file.write_text(token)
    server = start_server(
        char_config(corpus, extra=ray_keys(head.address)),
        env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)},
    )
    rows = read_batches(server, "chars", BPF, tmp_path / "read.jsonl")
    assert positions(rows) == in_order(1)


def skip_without_token_auth() -> str:
    """A fresh token; the test skips where this Ray has no token authentication."""
    import ray

    if not hasattr(ray._raylet, "AuthenticationTokenLoader"):
        pytest.skip(f"Ray {ray.__version__} has no token authentication (Ray 2.52 and later)")
    return secrets.token_hex(16)
