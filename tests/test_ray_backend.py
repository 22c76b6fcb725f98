"""The Ray backend on a real two-node cluster: its files are byte for byte the local ones (a
stateless and a streaming provider, a reproduce from a journaled state included), placement
spreads or pins, an actor killed mid-file never yields a wrong file, and a missing Ray or an
unreachable cluster fails fast with a message that says what to do."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ray_cluster import PINNED_LABEL, SUPPORT, RayCluster

from conftest import subprocess_env, tiny_corpus
from queue_client.errors import ConfigError
from queue_client.format.meta import meta_from_json, meta_to_json
from queue_server.config.server import DatasetConfig
from queue_server.production.backend import ProducedFile, ProduceFailed, ProduceJob, SlotDied
from queue_server.production.provider_init import build_provider
from queue_server.production.ray.ray_backend import RayBackend

# A Ray worker that imports torch takes a minute and more to make a first file on a loaded
# 2-core machine; each wait below is on a condition, and this only bounds a hung test.
pytestmark = pytest.mark.timeout(600)


def worker_init(
    root: Path, provider: str, args: dict[str, Any], *, batch_size: int = 4, bpf: int = 3
) -> dict[str, Any]:
    """The init request a server sends a worker, for dataset "ds"."""
    return {
        "data_root": str(root / "data"),
        "dataset": "ds",
        "provider": provider,
        "args": args,
        "batch_size": batch_size,
        "batches_per_file": bpf,
        "seed": 7,
        "worker_index": 0,
        "num_workers": 1,
        "verbose": False,
        "extra_meta": {"provider": provider, "config_fingerprint": "0123456789abcdef"},
        "histogram_field": "",
    }


def settled_meta(init: dict[str, Any]) -> str:
    """The meta a server settles on (built once, by worker 0), as it sends it to workers."""
    return meta_to_json(build_provider(init).complete_meta())


def local_provider(init: dict[str, Any], meta_json: str, slot: int, slots: int) -> Any:
    """Slot `slot`'s provider as a local worker process holds it."""
    provider = build_provider({**init, "worker_index": slot, "num_workers": slots})
    provider.set_meta(meta_from_json(meta_json))
    return provider


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_published(made: ProducedFile, directory: Path) -> str:
    """The published file's sha256, after checking it is what the backend reported."""
    data = (directory / made.name).read_bytes()
    assert (len(data), zlib.crc32(data)) == (made.size_bytes, made.crc32)
    return hashlib.sha256(data).hexdigest()


def ray_backend(
    cluster: RayCluster,
    tmp_path: Path,
    init: dict[str, Any],
    meta_json: str,
    slots: int,
    placement: str,
) -> RayBackend:
    for name in ("ray", "local"):  # the split directories a server creates at start
        (tmp_path / name).mkdir(exist_ok=True)
    return RayBackend(
        split="train",
        directory=tmp_path / "ray",
        init=init,
        meta_json=meta_json,
        cwd=tmp_path,
        slots=slots,
        ray_address=cluster.address,
        placement=placement,
    )


async def wait_for(find: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := find()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)
    return found


def thread_policies(pid: int) -> set[int]:
    """The scheduling policies of the threads of `pid` (a local cluster's actor process)."""
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


@pytest.mark.asyncio
async def test_spread_actors_run_on_both_nodes_and_make_the_local_files(
    ray_cluster: RayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # as a worker's: provider paths are relative to the config
    corpus = tiny_corpus(tmp_path / "corpus.txt")
    init = worker_init(tmp_path, "char_lm", {"input": corpus.name, "block_size": 16})
    meta_json = settled_meta(init)
    # worker_priority = "idle": the actor's method thread only, Ray's own threads as they were.
    backend = ray_backend(
        ray_cluster, tmp_path, {**init, "priority": "idle"}, meta_json, 2, "spread"
    )
    try:
        assert await asyncio.gather(backend.start_slot(0, None), backend.start_slot(1, None)) == [
            False,
            False,
        ]
        made = [await backend.produce(seq % 2, ProduceJob("train", seq)) for seq in range(4)]
        again = await backend.produce(1, ProduceJob("train", 2, {}))  # any slot, any seq
        with pytest.raises(ProduceFailed, match="split 'test' is not in meta") as failed:
            await backend.produce(0, ProduceJob("test", 9))  # the provider raises; slot lives
        made.append(await backend.produce(0, ProduceJob("train", 4)))
        stats = backend.stats()
        policies = [thread_policies(place.pid) for place in backend.workers()]
    finally:
        await backend.close()
    assert len(policies) == 2
    assert all({os.SCHED_IDLE, os.SCHED_OTHER} <= found for found in policies), policies
    assert failed.value.kind == "MetaError"
    assert stats is not None
    assert {s["node_id"] for s in stats["slots"]} == ray_cluster.node_ids

    expected = {}
    for seq in range(5):
        provider = local_provider(init, meta_json, seq % 2, 2)
        published = provider.produce_file("train", seq, tmp_path / "local")
        expected[seq] = sha256(tmp_path / "local" / str(published.name))
    got = {m.seq: check_published(m, tmp_path / "ray") for m in made}
    assert got == expected
    assert check_published(again, tmp_path / "ray") == expected[2]


@pytest.mark.asyncio
async def test_pinned_streaming_actors_match_local_files_and_states(
    ray_cluster: RayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    docs = [f"D{i:04d} " + " ".join(["amber", "birch", "cedar"][: 1 + i % 3]) for i in range(80)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    args = {"source": "corpus.txt", "separator": "", "seq_len": 16, "micro_batch_size": 2}
    init = worker_init(tmp_path, "text_lm", {**args, "eval_take": 10, "shuffle_buffer": 8})
    key, value = PINNED_LABEL

    meta_json = settled_meta(init)
    nowhere = ray_backend(ray_cluster, tmp_path, init, meta_json, 1, f"node:{key}=elsewhere")
    with pytest.raises(ProduceFailed, match="matches none of the 2 alive nodes") as info:
        await nowhere.start_slot(0, None)
    assert info.value.kind == "ConfigError"

    backend = ray_backend(ray_cluster, tmp_path, init, meta_json, 2, f"node:{key}={value}")
    order = [0, 1, 2, 3]  # slot = seq % 2: each slot streams its own shard of the documents
    try:
        assert await asyncio.gather(backend.start_slot(0, None), backend.start_slot(1, None)) == [
            True,
            True,
        ]
        made = {seq: await backend.produce(seq % 2, ProduceJob("train", seq)) for seq in order}
        # seq 0 again from its journaled state; slot 0's forward stream must not move.
        again = await backend.produce(0, ProduceJob("train", 0, made[0].state_before))
        made[4] = await backend.produce(0, ProduceJob("train", 4))
        stats = backend.stats()
    finally:
        await backend.close()
    assert stats is not None
    assert {s["node_id"] for s in stats["slots"]} == {ray_cluster.pinned_node_id}

    local = [local_provider(init, meta_json, slot, 2) for slot in (0, 1)]
    for seq in [*order, 4]:
        provider = local[seq % 2]
        before = provider.state_dict("train")
        published = provider.produce_file("train", seq, tmp_path / "local")
        assert (made[seq].state_before, made[seq].state_after) == (
            before,
            provider.state_dict("train"),
        ), f"seq {seq}"
        want = sha256(tmp_path / "local" / str(published.name))
        assert check_published(made[seq], tmp_path / "ray") == want, f"seq {seq}"
    assert (again.state_before, again.state_after) == (made[0].state_before, made[0].state_after)
    assert check_published(again, tmp_path / "ray") == check_published(made[0], tmp_path / "ray")


@pytest.mark.asyncio
async def test_an_actor_killed_mid_file_never_yields_a_wrong_file(
    ray_cluster: RayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actor dies in the middle of seq 2: the call raises SlotDied naming the actor's
    death (Ray never restarts it: a new actor would have lost the stream), nothing is
    published, and a restart from the journaled state makes exactly the file a local worker
    makes. An actor killed while idle is reported exited (on_slot_exit) and leaves the
    backend's workers at once."""
    gate = tmp_path / "gate"
    gate.mkdir()
    provider = "bq_ray_providers:GatedStreamProvider"
    init = worker_init(tmp_path, provider, {"gate_dir": str(gate), "gate_seq": 2})
    monkeypatch.syspath_prepend(str(SUPPORT))  # the test providers, for the local side
    meta_json = settled_meta(init)
    backend = ray_backend(ray_cluster, tmp_path, init, meta_json, 1, "spread")
    try:
        assert await backend.start_slot(0, None) is True
        made = [await backend.produce(0, ProduceJob("train", seq)) for seq in (0, 1)]
        in_flight = asyncio.ensure_future(backend.produce(0, ProduceJob("train", 2)))
        marker = await wait_for(
            lambda: next(gate.glob("making-2-*"), None), "the actor to start seq 2"
        )
        os.kill(int(marker.name.rsplit("-", 1)[1]), signal.SIGKILL)
        (gate / "go-2").touch()
        with pytest.raises(SlotDied, match="slot 0: its Ray actor died"):
            await in_flight
        assert len(files_in(tmp_path / "ray")) == 2  # nothing published for seq 2
        assert backend.workers() == []  # the dead actor is not shown as running

        # What production does next: stop the slot, start it from the journaled state.
        await backend.stop_slot(0)
        assert await backend.start_slot(0, made[1].state_after) is True
        made += [await backend.produce(0, ProduceJob("train", seq)) for seq in (2, 3)]

        [place] = backend.workers()
        assert place.restarts == 1 and place.pid > 0
        exited: list[int] = []
        backend.on_slot_exit = exited.append
        os.kill(place.pid, signal.SIGKILL)  # idle: no call tells of it, the watch does
        await wait_for(lambda: exited == [0] and not backend.workers(), "the exit reported", 30)
        with pytest.raises(SlotDied):
            await backend.produce(0, ProduceJob("train", 4))
    finally:
        await backend.close()

    local = local_provider({**init, "args": {"gate_dir": str(gate)}}, meta_json, 0, 1)
    for seq, m in enumerate(made):
        published = local.produce_file("train", seq, tmp_path / "local")
        want = sha256(tmp_path / "local" / str(published.name))
        assert check_published(m, tmp_path / "ray") == want, f"seq {seq}"


def run_python(code: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=subprocess_env(),
    )


def test_an_unreachable_ray_address_fails_fast_naming_it() -> None:
    """A port nobody listens on fails at once; a listener that is not Ray, at the deadline."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'batchqueue[ray]'")
    proc = run_python(
        """
        import socket, time
        from queue_server.production.ray.ray_connect import (
            CONNECT_TIMEOUT_S, RayUnavailable, connect, import_ray
        )

        import_ray()  # seconds on a busy machine: not part of the connect's time
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
        closed.close()
        silent = socket.socket()  # accepts connections, never speaks Ray
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        print("timeout", CONNECT_TIMEOUT_S)
        for address, timeout_s in (
            (f"127.0.0.1:{closed_port}", CONNECT_TIMEOUT_S),
            (f"127.0.0.1:{silent.getsockname()[1]}", 2.0),
        ):
            start = time.monotonic()
            try:
                connect(address, timeout_s)
            except RayUnavailable as exc:
                print(f"{time.monotonic() - start:.1f}", exc, flush=True)
            else:
                raise SystemExit(f"connected to {address}")
        """
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "timeout 15.0"
    refused, silent = (line.split(" ", 1) for line in lines[1:3])
    assert float(refused[0]) < 2.0 and "127.0.0.1:" in refused[1] and "ray start" in refused[1]
    assert float(silent[0]) < 6.0 and "no Ray cluster answered within 2 s" in silent[1]


def test_without_ray_the_backend_says_how_to_install_it(tmp_path: Path) -> None:
    proc = run_python(
        f"""
        import asyncio, sys
        sys.modules["ray"] = None  # as if Ray were not installed
        from queue_client.errors import ConfigError
        from queue_server.production.ray.ray_backend import RayBackend

        backend = RayBackend(split="train", directory={str(tmp_path)!r}, init={{}},
                             meta_json="{{}}", cwd={str(tmp_path)!r}, slots=1)
        try:
            asyncio.run(backend.start_slot(0, None))
        except ConfigError as exc:
            print(exc)
        """
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pip install 'batchqueue[ray]'" in proc.stdout


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("backend", "kubernetes", "one of ('local', 'ray')"),
        ("ray_address", "", "HOST:PORT"),
        ("ray_placement", "everywhere", "node:KEY=VALUE"),
        ("ray_placement", "node:zone", "node:KEY=VALUE"),
    ],
)
def test_backend_keys_are_validated(key: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"datasets.d.{key} = ") as info:
        DatasetConfig(name="d", provider="char_lm", batch_size=4, **{key: value})
    assert expected in str(info.value)
