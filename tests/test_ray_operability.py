"""Operating a Ray-backed server: what an operator sees when things go wrong, and that it
is the truth. A head with token authentication that refuses the server's token is named as
such at once; an actor that dies, by its pid or with its node, leaves GetStats at once and
counts as a worker restart; a new actor that no node has room for makes the dataset
NOT_SERVING, saying what it waits for and for how long, until a node that joins takes it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from auditor import audit
from ray_cluster import RayCluster, RayHead, free_port
from ray_serving import (
    ACTOR_START_S,
    BPF,
    NOT_SERVING,
    SERVING,
    health,
    healthz,
    in_order,
    positions,
    ray_keys,
    read_batches,
    skip_without_token_auth,
    state_of,
    worker_pids,
)

from conftest import ServerFactory, char_config, subprocess_env, wait_until
from queue_server.testing import ServerProcess


# Seven actors start here (2, 1 again, 2 again, 2 on the new node), each a Ray worker process
# importing torch: seconds of CPU each, tens of seconds on a busy 2-core machine (one start
# took 90 s while two busy loops and the rest of the suite shared the cores); Ray also takes
# ~10 s to declare the lost node dead. Each wait below is on a condition; this bounds the sum.
@pytest.mark.timeout(900)
def test_dead_actors_leave_stats_a_stall_is_reported_and_a_joining_node_ends_it(
    ray_cluster: RayCluster, start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    """The dataset's actors run on a labelled node of the test's own. An actor killed by its
    pid leaves GetStats within seconds and counts as a worker restart. Then the node dies
    (SIGKILL, as a lost machine) and no other node has the label: its actors leave GetStats,
    and the dataset turns NOT_SERVING saying what it waits for and for how long, in GetStats
    and /healthz, for as long as it waits. A node with the label that joins takes the actors,
    and the same server serves on, every seq once. Train's two actors dying with their node
    are two slots failing once each: max_worker_restarts = 1 does not fail the dataset."""
    key, value = "batchqueue-test-room", tmp_path.name[-20:]
    placement = f"node:{key}={value}"
    node = ray_cluster.add_node(num_cpus=3, labels={key: value})  # train's 2 actors, val's 1
    keys = ray_keys(ray_cluster.address, workers=2, placement=placement)
    server = start_server(
        char_config(corpus, extra=f"{keys}\nmax_worker_restarts = 1"), data_root=tmp_path / "ray"
    )
    rows = read_batches(server, "chars", 2 * BPF, tmp_path / "1.jsonl")

    victim = min(worker_pids(server))
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: (
            victim not in worker_pids(server)
            and server.split_stats("chars")["worker_restarts"] >= 1
        ),
        30,
        f"the killed actor's pid {victim} to leave GetStats and count as a restart",
    )
    wait_until(lambda: len(worker_pids(server) - {0}) == 2, ACTOR_START_S, "a new actor for train")
    # Four more files read, and two more made (two seqs in a row, one per slot): the new
    # actor has made one, which ends its slot's failures in a row.
    made = server.split_stats("chars")["produced_files"]
    rows += read_batches(
        server, "chars", 4 * BPF, tmp_path / "2.jsonl", state_of(tmp_path / "1.jsonl")
    )
    wait_until(
        lambda: server.split_stats("chars")["produced_files"] >= made + 2,
        ACTOR_START_S,
        "two more files made",
        poll_s=0.2,
    )
    restarts = server.split_stats("chars")["worker_restarts"]

    lost = node.node_id
    ray_cluster.remove_node(node, graceful=False)

    def gone() -> bool:
        stats = server.split_stats("chars")
        running = [w for w in stats["workers"] if w["node_id"] == lost or int(w["pid"])]
        return not running and stats["worker_restarts"] >= restarts + 2

    try:
        wait_until(gone, 60, "the lost node's actors to leave GetStats as restarts", poll_s=0.2)
        reason = wait_until(
            lambda: (
                "chars/train slots 0, 1" in (error := server.stats("chars")["last_error"]) and error
            ),
            60,
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

    node = ray_cluster.add_node(num_cpus=3, labels={key: value})
    replaced = 0

    def serving() -> bool:
        """SERVING; a joining node that the head declares dead (its raylet missed the
        health checks on starved cores: Ray's, not the server's) is replaced, twice at most,
        as an operator would add another machine."""
        nonlocal node, replaced
        if health(server, "chars") == SERVING:
            return True
        if replaced < 2 and ray_cluster.is_dead(node):
            ray_cluster.remove_node(node, graceful=False)
            node = ray_cluster.add_node(num_cpus=3, labels={key: value})
            replaced += 1
        return False

    try:
        wait_until(serving, ACTOR_START_S, "the new node to take the actors")
        rows += read_batches(
            server, "chars", 2 * BPF, tmp_path / "3.jsonl", state_of(tmp_path / "2.jsonl")
        )
        assert positions(rows) == in_order(8)
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
        "from queue_server.production.ray.ray_connect import CONNECT_TIMEOUT_S, RayUnavailable, connect\n"
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
