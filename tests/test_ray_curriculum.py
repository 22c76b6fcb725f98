"""A curriculum split on Ray (`backend = "ray"`), on the session's two-node cluster, with real
server processes and a real client: its composers are Ray actors (composer_workers of them)
and its candidate providers too. Two composer actors serve the very bytes one local composer
process serves; a composer actor killed while the trainer reads restarts with the other from
the snapshot, and the trainer sees every seq once, with the same bytes. The accounting auditor
runs after the fault."""

from __future__ import annotations

import asyncio
import hashlib
import re
import textwrap
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
from auditor import audit
from grpc_health.v1 import health_pb2
from ray_cluster import PINNED_LABEL, RayCluster, RayHead, free_port
from ray_serving import ACTOR_START_S

from conftest import ServerFactory, process_tree, skewed_corpus, subprocess_env, wait_until
from queue_client import QueueClient
from queue_server.app import health_name
from queue_server.curriculum.ray_composer import RayComposer
from queue_server.production.backend import ProduceFailed
from queue_server.production.worker_process import WorkerDied, WorkerError
from queue_server.testing import ServerProcess

# A Ray worker that imports torch takes a minute and more to make a first file on a loaded
# 2-core machine; each wait below is on a condition, and this only bounds a hung test.
pytestmark = pytest.mark.timeout(600)

NB = 8  # batches per file
FILES = 6  # served files each trainer reads
DATASET = "cur"
COMPOSER = f"{DATASET}/train composer"  # the label each composer actor's name starts with

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

Rows = list[tuple[int, int, str]]


def config(corpus: Path, composers: int, extra: str = "") -> str:
    return textwrap.dedent(
        f"""
        [server]
        lease_ttl_s = 30
        [datasets.{DATASET}]
        provider = "char_lm"
        batch_size = 4
        batches_per_file = {NB}
        max_backlog_files = 1
        selection = "curriculum"
        candidate_buffer = 24
        curriculum_schedule = [[0, 1.0], [24, 0.0]]
        starting_estimation_token_count = 20000
        composer_workers = {composers}
        {extra}
        [datasets.{DATASET}.args]
        input = "{corpus.as_posix()}"
        block_size = 32
        """
    )


def on_ray(address: str) -> str:
    return f'backend = "ray"\nray_address = "{address}"\nray_placement = "spread"'


def read(client: QueueClient, batches: int) -> Rows:
    """The next `batches` train batches of `client`: [(seq, offset, hash of its bytes)]."""
    rows = []
    for _ in range(batches):
        at = client.state_dict()["splits"].get("train") or {"seq": 0, "offset": 0}
        x, y = client.get_batch("train")
        digest = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
        rows.append((at["seq"], at["offset"] // client.file_batch_size, digest))
    return rows


def trainer(server: ServerProcess) -> QueueClient:
    # A get_batch may wait for composer actors to start again (see the test's timeout).
    return QueueClient(server.address, DATASET, timeout_s=150)


def positions(rows: Rows) -> list[tuple[int, int]]:
    return [(seq, offset) for seq, offset, _ in rows]


def in_order(files: int) -> list[tuple[int, int]]:
    """Every batch of seqs 0..files-1 once, in order: nothing lost, nothing repeated."""
    return [(seq, offset) for seq in range(files) for offset in range(NB)]


def health(server: ServerProcess) -> int:
    return server.health(health_name(DATASET))


def composer_actors() -> dict[str, Any]:
    """The live composer actors of the dataset, by name ("cur/train composer SHARD ID")."""
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(COMPOSER)
    ]
    return {name: ray.get_actor(name, namespace="batchqueue") for name in names}


def wait_composers(count: int, not_in: Collection[str] = ()) -> dict[str, Any]:
    """Exactly `count` live composer actors, none named in `not_in` (those of an earlier
    server, or killed, are dying)."""
    return wait_until(
        lambda: (
            found
            if len(found := composer_actors()) == count and not set(found) & set(not_in)
            else None
        ),
        60,
        f"{count} new composer actors",
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return skewed_corpus(tmp_path_factory.mktemp("corpus") / "skewed.txt", segments=60, seed=5)


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Rows:
    """What one local composer process serves: the stream every Ray run must match."""
    tmp = tmp_path_factory.mktemp("local")
    factory = ServerFactory(tmp)
    try:
        server = factory(config(corpus, composers=1), data_root=tmp / "data")
        with trainer(server) as client:
            rows = read(client, FILES * NB)
    finally:
        factory.close()
    assert positions(rows) == in_order(FILES)
    return rows


# Two composer actors and a candidate provider start, then start again after the kill: each a
# Ray worker process importing torch, tens of seconds on a busy 2-core machine.
@pytest.mark.timeout(300)
@pytest.mark.cold_forkserver  # no composer among the server's descendants
def test_composer_actors_serve_the_local_bytes_and_a_killed_one_changes_none(
    ray_cluster: RayCluster,
    start_server: ServerFactory,
    corpus: Path,
    reference: Rows,
    tmp_path: Path,
) -> None:
    """Two composer actors serve what one local composer process serves. ray.kill of
    composer 1 while a trainer reads, with served files composed ahead: both composers restart
    from the snapshot of the last journaled file, and the trainer reads on and sees every seq
    once, with the bytes of the uninterrupted local run. (One server for both: each Ray start costs
    the actors' imports, seconds per actor on a small machine.)"""
    import ray

    server = start_server(config(corpus, 2, on_ray(ray_cluster.address)), data_root=tmp_path / "r")
    client = trainer(server)
    rows = read(client, 2 * NB)

    # The composers are two Ray actors of the cluster's nodes, no process of the server's.
    before = wait_composers(2)
    assert sorted(name.split()[-2] for name in before) == ["0", "1"]  # their shards
    where = ray.get([a.where.remote() for a in before.values()], timeout=30)
    assert {w["node_id"] for w in where} <= ray_cluster.node_ids
    assert not {w["pid"] for w in where} & process_tree(server.pid)
    assert server.split_stats(DATASET)["worker_pids"] == []  # nor are its candidate providers
    # Stats say where each composer and candidate provider runs: the actors' nodes and pids.
    workers = server.split_stats(DATASET)["workers"]
    composers = [w for w in workers if w["role"] == "composer"]
    assert {(int(w["index"]), w["backend"]) for w in composers} == {(0, "ray"), (1, "ray")}
    assert {(w["node_id"], int(w["pid"])) for w in composers} == {
        (w["node_id"], w["pid"]) for w in where
    }
    candidates = [w for w in workers if w["role"] == "candidates"]
    assert candidates and all(w["backend"] == "ray" for w in candidates), workers
    assert all(w["node_id"] in ray_cluster.node_ids for w in candidates), workers

    [victim] = [name for name in before if name.split()[-2] == "1"]
    ray.kill(before[victim], no_restart=True)
    wait_until(
        lambda: server.split_stats(DATASET)["worker_restarts"] >= 1,
        60,
        "the split's composers to restart",
    )
    wait_composers(2, not_in=before)  # both new actors: composer 0 restarted with 1
    assert "cur/train composer 1: its Ray actor died" in server.log(), server.log_tail()

    rows += read(client, (FILES - 2) * NB)  # the same trainer reads on
    client.close()
    assert positions(rows) == in_order(FILES)
    assert rows == reference
    stats = audit(server, DATASET, consumed_batches={"train": positions(rows)})
    assert stats["train"]["worker_restarts"] >= 1


@pytest.mark.asyncio
async def test_a_composer_actor_fails_as_a_worker_process_does(
    ray_cluster: RayCluster, corpus: Path, tmp_path: Path
) -> None:
    """What the lane relies on: a placement no node matches is a config error; a failed
    request is a WorkerError and the actor lives on; an actor killed while idle calls
    on_exit, and the next call raises WorkerDied."""
    import ray

    init = {
        "data_root": str(tmp_path / "data"),
        "dataset": "d",
        "provider": "char_lm",
        "args": {"input": str(corpus), "block_size": 32},
        "batch_size": 4,
        "batches_per_file": NB,
        "seed": 7,
    }
    key, value = PINNED_LABEL

    def composer(placement: str) -> RayComposer:
        return RayComposer(
            "d/train composer", init, tmp_path, ray_address=ray_cluster.address, placement=placement
        )

    with pytest.raises(ProduceFailed, match="matches none of the 2 alive nodes") as info:
        await composer(f"node:{key}=elsewhere").start()
    assert info.value.kind == "ConfigError"

    pinned = composer(f"node:{key}={value}")
    exited = asyncio.Event()
    pinned.on_exit = exited.set
    try:
        assert (await pinned.start())["stateful"] is False
        assert (pinned.node_id, pinned.pid) == (ray_cluster.pinned_node_id, None)
        with pytest.raises(WorkerError, match=r"curriculum_init first .*on Ray node") as failed:
            await pinned.call({"op": "compose", "seq": 0})
        assert failed.value.kind == "AssertionError"
        assert (await pinned.call({"op": "stop"}))["ok"] is True  # it lives on

        ray.kill(ray.get_actor(pinned.actor_name, namespace="batchqueue"), no_restart=True)
        await asyncio.wait_for(exited.wait(), 60)
        with pytest.raises(WorkerDied, match=r"its Ray actor died \(node .*ActorDiedError"):
            await pinned.call({"op": "stop"})
    finally:
        await pinned.stop()


@pytest.mark.asyncio
async def test_a_composer_actor_no_node_has_room_for_reports_its_wait(
    ray_cluster: RayCluster, corpus: Path, tmp_path: Path
) -> None:
    """A composer whose actor asks for more CPUs than any node has waits, for as long as the
    cluster answers, and says so (on_stalled, "waiting N s for a Ray node ..."), N growing;
    no fixed time fails it. Its stop ends the wait and the report."""
    init = {"data_root": str(tmp_path / "data"), "dataset": "d", "provider": "char_lm"}
    composer = RayComposer(
        "d/train composer",
        init,
        tmp_path,
        ray_address=ray_cluster.address,
        num_cpus=64,  # more than any node of the test cluster has
        stall_report_s=0.5,
    )
    reports: list[str | None] = []
    composer.on_stalled = reports.append
    starting = asyncio.ensure_future(composer.start())
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while not any(r and int(re.search(r"waiting (\d+) s", r)[1]) >= 2 for r in reports):
            assert not starting.done(), starting.exception()
            assert asyncio.get_running_loop().time() < deadline, reports
            await asyncio.sleep(0.1)
        reason = next(r for r in reports if r)
        assert "for a Ray node with 64 CPU free (ray_placement = 'spread')" in reason, reason
        assert "to start the actor of d/train composer" in reason, reason
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await composer.stop()
    assert reports[-1] is None, reports[-3:]  # the wait's end is reported too


@pytest.mark.slow
def test_the_whole_cluster_gone_and_back_the_curriculum_serves_on(
    ray_head: type[RayHead],
    start_server: ServerFactory,
    corpus: Path,
    reference: Rows,
    tmp_path: Path,
) -> None:
    """The composers notice the cluster's head gone while idle: the dataset turns
    NOT_SERVING naming the address, and serves the same stream again once the cluster is
    back, with no server restart. (A cluster of its own: this one is killed.)"""
    head = ray_head(free_port(), subprocess_env(), num_cpus=4)  # 2 composers, 2 providers
    server = start_server(config(corpus, 2, on_ray(head.address)), data_root=tmp_path / "r")
    client = trainer(server)
    rows = read(client, 2 * NB)

    head.kill()
    wait_until(lambda: health(server) == NOT_SERVING, 60, "the dataset to turn NOT_SERVING")
    stats = server.stats(DATASET)
    assert stats["state"] == "unavailable", stats
    assert head.address in stats["last_error"], stats["last_error"]
    audit(server, DATASET, consumed_batches={"train": positions(rows)})

    head.start()
    wait_until(lambda: health(server) == SERVING, ACTOR_START_S, "the dataset to serve again")
    rows += read(client, (FILES - 2) * NB)  # the same trainer reads on
    client.close()
    assert positions(rows) == in_order(FILES)
    assert rows == reference
    stats = server.stats(DATASET)
    assert (stats["state"], stats["last_error"]) == ("serving", ""), stats
    audit(server, DATASET, consumed_batches={"train": positions(rows)})
    assert server.proc.poll() is None  # the same server process throughout
