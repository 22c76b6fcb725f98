"""A server whose providers are Ray actors (`backend = "ray"`), with real server processes,
real trainer clients and real Ray clusters: it serves the very batches a local-backend server
serves, and it keeps its accounting through the faults a cluster has. An actor killed in the
middle of a file has that seq made again; a node that leaves moves its work to the others; a
cluster that goes away entirely turns the dataset NOT_SERVING, saying why, and it serves again
when the cluster is back, with no server restart; an address where no cluster answers fails
the start with exit code 2, naming it. The accounting auditor runs after every fault."""

from __future__ import annotations

import os
import signal
from datetime import datetime
from pathlib import Path

import pytest
from auditor import audit
from ray_cluster import RayCluster, RayHead, free_port
from ray_serving import (
    ACTOR_START_S,
    BPF,
    NOT_SERVING,
    SERVING,
    gated_config,
    health,
    in_order,
    positions,
    ray_keys,
    read_batches,
    state_of,
)

from conftest import ServerFactory, char_config, process_tree, subprocess_env, wait_until
from queue_server.production.ray.ray_connect import CONNECT_TIMEOUT_S
from queue_server.testing import ServerProcess

# A Ray worker that imports torch takes a minute and more to make a first file on a loaded
# 2-core machine; each wait below is on a condition, and this only bounds a hung test.
pytestmark = pytest.mark.timeout(600)


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
    # Train's actor stops in seq 2 and is killed there (val's starts on its first lease, and
    # nothing reads val here).
    markers = wait_until(
        lambda: list(gate.glob("making-2-*")), 240, "train's actor to start making seq 2"
    )
    for marker in markers:
        os.kill(int(marker.name.rsplit("-", 1)[1]), signal.SIGKILL)
    (gate / "go-2").touch()
    got = read_batches(ray, "s", 5 * BPF, tmp_path / "ray.jsonl")
    assert positions(got) == in_order(5)
    stats = audit(ray, "s", consumed_batches={"train": positions(got)})
    assert stats["train"]["worker_restarts"] >= 1, stats
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


def test_an_actor_that_dies_while_it_starts_is_started_again(
    ray_cluster: RayCluster, start_server: ServerFactory, tmp_path: Path
) -> None:
    """An actor that dies in its first call, before its slot has made anything (killed, or its
    node removed while the provider loads), is no provider's error: the slot starts again
    with a new actor, and the dataset serves. It used to fail the whole dataset."""
    gate = tmp_path / "gate"
    gate.mkdir()
    config = (
        "[server]\nlease_ttl_s = 30\n[datasets.s]\n"
        f'provider = "bq_ray_providers:StartGatedProvider"\nbatch_size = 2\n'
        f"batches_per_file = {BPF}\n{ray_keys(ray_cluster.address)}\n"
        f'[datasets.s.args]\ngate_dir = "{gate.as_posix()}"\n'
    )
    server = start_server(config, data_root=tmp_path / "ray")
    (marker,) = wait_until(
        lambda: list(gate.glob("starting-*")), ACTOR_START_S, "train's actor to start"
    )
    os.kill(int(marker.name.rsplit("-", 1)[1]), signal.SIGKILL)
    (gate / "go-start").touch()
    got = read_batches(server, "s", 3 * BPF, tmp_path / "ray.jsonl")
    assert positions(got) == in_order(3)
    stats = audit(server, "s", consumed_batches={"train": positions(got)})["train"]
    assert stats["worker_restarts"] >= 1, stats
    assert "its Ray actor died" in server.log(), server.log_tail()
    assert health(server, "s") == SERVING


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
    wait_until(lambda: health(server, "chars") == SERVING, ACTOR_START_S, "chars to serve again")
    rows += read_batches(
        server, "chars", 3 * BPF, tmp_path / "3.jsonl", state_of(tmp_path / "2.jsonl")
    )
    assert positions(rows) == in_order(7)
    stats = server.stats("chars")
    assert (stats["state"], stats["last_error"]) == ("serving", "")
    audit(server, "chars", consumed_batches={"train": positions(rows)})
    assert server.proc.poll() is None  # the same server process throughout


@pytest.mark.slow
def test_a_head_started_again_at_once_is_joined_as_a_new_cluster_without_a_server_restart(
    ray_head: type[RayHead], start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    """docs/ray.md, "The head started again": killed and started again at the same address
    at once, so the server may never see the cluster gone, only a head answering with a
    cluster id of its own. The server drops its connection to the old cluster, joins the new
    one with new actors (on the new head's node), and serves on from where it was: the same
    server process throughout, every batch once, in order."""
    head = ray_head(free_port(), subprocess_env())
    server = start_server(char_config(corpus, extra=ray_keys(head.address)))
    rows = read_batches(server, "chars", 2 * BPF, tmp_path / "1.jsonl")
    old_nodes = {w["node_id"] for w in server.split_stats("chars")["workers"]}
    assert old_nodes and "" not in old_nodes, old_nodes

    head.kill()
    head.start()

    def on_the_new_cluster() -> bool:
        nodes = {w["node_id"] for w in server.split_stats("chars")["workers"]}
        return bool(nodes) and not nodes & old_nodes

    try:
        wait_until(on_the_new_cluster, ACTOR_START_S, "the train actor on the new cluster's node")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; stats {server.stats('chars')}\n{server.log_tail()}") from None
    # More files than the backlog held: the new cluster's actor made them.
    rows += read_batches(
        server, "chars", 5 * BPF, tmp_path / "2.jsonl", state_of(tmp_path / "1.jsonl")
    )
    assert positions(rows) == in_order(7)
    stats = server.stats("chars")
    assert (stats["state"], stats["last_error"]) == ("serving", ""), stats
    audit(server, "chars", consumed_batches={"train": positions(rows)})
    assert server.proc.poll() is None


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
    server = ServerProcess(
        tmp_path / "server",
        data_root=tmp_path / "data",
        config_text=char_config(corpus, extra=ray_keys(address)),
        env=subprocess_env(),
    )
    try:  # the process's own start (imports, meta) is slow on a busy machine: not timed here
        code = server.proc.wait(timeout=120)
    finally:
        server.kill()
    log = server.log()
    assert code == 2, f"exit code {code}:\n{log}"
    assert f"ray_address = {address!r}" in log, log
    # Timed by the server's own clock: from the dataset serving (its slots start and join the
    # cluster) to the join's failure.
    serving, failed = (
        next(_logged_at(line) for line in log.splitlines() if says in line)
        for says in ("dataset chars serving on", "dataset chars failed: ray_address")
    )
    assert failed - serving < CONNECT_TIMEOUT_S, log


def _logged_at(line: str) -> float:
    """The time of a server log line ("2026-01-02 03:04:05,678 LEVEL ..."), in seconds."""
    stamp = datetime.strptime(" ".join(line.split(" ", 2)[:2]), "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()
