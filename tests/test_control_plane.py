"""The job's control plane: node-local servers share every steering change through the job's
store (a torch.distributed TCPStore, hosted here by `queue-server control-store` as torchrun
would host one), so one call from one rank reaches every server at the same row.

Real servers (two node-local ones for ranks 0-1 and 2-3 of 4), a real store process and real
clients; the rows of every rank are held against a one-server run of the same steps.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import torch
from support.control_store import ControlStore
from test_mixture_server import NB, mixture, read, write_sources

from conftest import ServerFactory, subprocess_env, wait_until
from queue_client import NoBatchReady, QueueClient
from queue_client.wire import batchqueue_pb2 as pb

W = 4
NEW = {"web": 0.1, "code": 0.1, "math": 0.8}


def node_args(ranks: str, store: ControlStore | str) -> tuple[str, ...]:
    url = store if isinstance(store, str) else store.url
    return ("--ranks", ranks, "--world-size", str(W), "--control-plane", url)


def lockstep(
    clients: list[QueueClient], steps: range, call_at: int | None, then: Any = None
) -> tuple[list, int]:
    """Every rank reads one batch per step, in rank order; rank 0 alone calls set_mixture
    after its batch of step call_at (and `then(step)` after every step, when given). Returns
    each rank's batches and the call's seq."""
    rows: list[list[dict[str, Any]]] = [[] for _ in clients]
    at = -1
    for step in steps:
        for r, c in enumerate(clients):
            rows[r] += read(c, 1)
            if step == call_at and r == 0:
                at = c.set_mixture(NEW)
        if then is not None:
            then(step)
    return rows, at


def same_rows(got: list[list[dict]], want: list[list[dict]]) -> None:
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g) == len(w)
        for i, (a, b) in enumerate(zip(g, w, strict=True)):
            where = f"rank {r} batch {i} (seq {a['seq']}, offset {a['offset']})"
            assert (a["seq"], a["offset"]) == (b["seq"], b["offset"]), where
            assert a["source"].tolist() == b["source"].tolist(), where
            assert torch.equal(a["x"], b["x"]), where


def one_server_run(tmp: Path, dirs: dict, steps: int, call_at: int) -> tuple[list, int]:
    factory = ServerFactory(tmp / "one")
    try:
        server = factory(mixture("mix", dirs), data_root=tmp / "one" / "root")
        clients = [QueueClient(server.address, "mix", rank=r, world_size=W) for r in range(W)]
        try:
            return lockstep(clients, range(steps), call_at)
        finally:
            for c in clients:
                c.close()
    finally:
        factory.close()


def test_one_call_from_rank_0_reaches_every_server_at_the_same_row(
    start_server, tmp_path: Path
) -> None:
    """Without a plane, server B never learned of rank 0's call (its ranks drew the old
    weights to the end, and rows were served twice across ranks). With one, every rank's rows
    are the one-server run's, and both servers' stats show the change."""
    dirs = write_sources(tmp_path)
    steps, call_at = 8 * NB, 2 * NB + 1
    want, want_at = one_server_run(tmp_path, dirs, steps, call_at)
    store = ControlStore(tmp_path / "store", subprocess_env())
    try:
        a = start_server(
            mixture("mix", dirs), data_root=tmp_path / "a", args=node_args("0,1", store)
        )
        b = start_server(
            mixture("mix", dirs), data_root=tmp_path / "b", args=node_args("2,3", store)
        )
        addresses = [a.address, a.address, b.address, b.address]
        clients = [QueueClient(addresses[r], "mix", rank=r, world_size=W) for r in range(W)]
        got, at = lockstep(clients, range(steps), call_at)
        for c in clients:
            c.close()
        assert at == want_at
        same_rows(got, want)
        for server in (a, b):
            history = server.split_stats("mix")["mixture"]["history"]
            assert [int(h["effective_seq"]) for h in history] == [0, at], history
            assert "control plane record" in server.log()
    finally:
        store.kill()


def test_a_fresh_server_that_replaces_a_lost_one_serves_the_changed_rows(
    start_server, tmp_path: Path
) -> None:
    """After the change, server B is SIGKILLed and replaced by a fresh one on an empty data
    root; ranks 2 and 3 resume from their checkpoint there and read exactly the rows of the
    one-server run, the change included (the fresh server read it from the plane, starting
    at the log's latest snapshot: one every 4 records here)."""
    dirs = write_sources(tmp_path)
    steps, call_at, kill_at = 10 * NB, 2 * NB + 1, 6 * NB
    want, _ = one_server_run(tmp_path, dirs, steps, call_at)
    store = ControlStore(tmp_path / "store", subprocess_env())
    try:
        config = "[server]\ncontrol_snapshot_records = 4\n" + mixture("mix", dirs)
        a = start_server(config, data_root=tmp_path / "a", args=node_args("0,1", store))
        b = start_server(config, data_root=tmp_path / "b", args=node_args("2,3", store))
        addresses = [a.address, a.address, b.address, b.address]
        # The trainers of node B die with it: they give up on it within 2 s when closed.
        clients = [
            QueueClient(addresses[r], "mix", rank=r, world_size=W, reconnect_timeout_s=2)
            for r in range(W)
        ]
        got, _ = lockstep(clients, range(kill_at), call_at)
        states = [c.state_dict() for c in clients]
        b.kill(signal.SIGKILL)  # the node is lost
        for c in clients[2:]:
            c.close()  # nothing is left retrying in the background of later tests
        fresh = start_server(config, data_root=tmp_path / "fresh", args=node_args("2,3", store))
        clients[2:] = [QueueClient(fresh.address, "mix", rank=r, world_size=W) for r in (2, 3)]
        for c in clients[2:]:
            c.load_state_dict(states)
        more, _ = lockstep(clients, range(kill_at, steps), None)
        for c in clients:
            c.close()
        same_rows([g + m for g, m in zip(got, more, strict=True)], want)
        assert "control log read from its snapshot at record" in fresh.log()
    finally:
        store.kill()


def test_a_server_that_cannot_reach_the_plane_makes_nothing_and_says_why(
    start_server, tmp_path: Path
) -> None:
    """No store at the address: the dataset is NOT_SERVING naming the plane, a trainer's
    NoBatchReady names it, and once a store listens there the server serves by itself."""
    dirs = write_sources(tmp_path)
    probe = ControlStore(tmp_path / "probe", subprocess_env())
    address = probe.address  # a free port: taken by a store, then let go
    probe.kill()
    server = start_server(
        mixture("mix", dirs),
        data_root=tmp_path / "a",
        args=node_args("0,1", f"tcpstore://{address}"),
        wait_serving=False,
    )
    stats = wait_until(
        lambda: "control plane" in (s := server.stats("mix")).get("last_error", "") and s,
        60,
        "the dataset to name the control plane",
    )
    assert f"tcpstore://{address}" in stats["last_error"], stats
    assert server.health("mix") != 1  # NOT_SERVING
    with QueueClient(server.address, "mix", rank=0, world_size=W, timeout_s=5) as client:
        try:
            client.get_batch("train")
        except NoBatchReady as exc:
            assert "control plane" in str(exc), exc
        else:
            raise AssertionError("a batch was served without the control plane")
    store = ControlStore(tmp_path / "store", subprocess_env(), listen=address)
    try:
        server.wait_serving(90)
        with QueueClient(server.address, "mix", rank=0, world_size=W) as client:
            assert len(read(client, NB + 1)) == NB + 1
        reply = server.stub.GetStats(pb.GetStatsRequest(dataset="mix"), timeout=30)
        assert reply is not None
    finally:
        store.kill()


def test_a_store_started_afresh_gets_every_change_back_from_the_servers(
    start_server, tmp_path: Path
) -> None:
    """The store is SIGKILLed after rank 0's change and started again, empty, at the same
    address: each server publishes the changes its journal holds again, claims again, and
    carries on; a second change from rank 0 then reaches both, and every rank's rows are the
    one-server run's with both changes."""
    dirs = write_sources(tmp_path)
    steps, call_at, restart_at, second_at = 10 * NB, 2 * NB + 1, 4 * NB, 5 * NB + 2
    SECOND = {"web": 1.0, "code": 0.0, "math": 0.0}

    def second_call(clients: list[QueueClient]) -> Any:
        return lambda step: clients[0].set_mixture(SECOND) if step == second_at else None

    factory = ServerFactory(tmp_path / "one")
    try:
        one = factory(mixture("mix", dirs), data_root=tmp_path / "one" / "root")
        ref = [QueueClient(one.address, "mix", rank=r, world_size=W) for r in range(W)]
        want, _ = lockstep(ref, range(steps), call_at, second_call(ref))
        for c in ref:
            c.close()
    finally:
        factory.close()
    store = ControlStore(tmp_path / "store", subprocess_env())
    stores = [store]
    try:
        config = mixture("mix", dirs)
        a = start_server(config, data_root=tmp_path / "a", args=node_args("0,1", store))
        b = start_server(config, data_root=tmp_path / "b", args=node_args("2,3", store))
        addresses = [a.address, a.address, b.address, b.address]
        clients = [QueueClient(addresses[r], "mix", rank=r, world_size=W) for r in range(W)]

        def restart(step: int) -> None:
            if step == restart_at:
                stores[0].kill()
                stores[0] = ControlStore(tmp_path / "store2", subprocess_env(), store.address)
                for server in (a, b):
                    try:
                        wait_until(
                            lambda s=server: "started afresh" in s.log() and s.health("mix") == 1,
                            90,
                            "the server to publish its changes to the new store",
                        )
                    except TimeoutError as exc:
                        said = [x for x in server.log().splitlines() if "queue_server" in x]
                        raise AssertionError(f"{exc}: {said[-12:]}") from None
            second_call(clients)(step)

        got, _ = lockstep(clients, range(steps), call_at, restart)
        for c in clients:
            c.close()
        same_rows(got, want)
        for server in (a, b):
            history = server.split_stats("mix")["mixture"]["history"]
            assert len(history) == 3, history  # the config's, and both calls
    finally:
        stores[0].kill()


def test_a_server_on_a_plane_stops_at_once_on_sigterm(start_server, tmp_path: Path) -> None:
    """Its watcher waits up to a minute for the next record; a SIGTERM'd server still exits at
    once (it used to linger until that wait ended, after logging that it stopped)."""
    dirs = write_sources(tmp_path)
    store = ControlStore(tmp_path / "store", subprocess_env())
    try:
        server = start_server(
            mixture("mix", dirs), data_root=tmp_path / "a", args=node_args("0,1", store)
        )
        with QueueClient(server.address, "mix", rank=0, world_size=W) as client:
            read(client, 1)  # the plane is connected and its watcher waits
        server.stop(timeout_s=20)  # TimeoutError if it lingers
        assert "stopped (exit code 0)" in server.log()
    finally:
        store.kill()
