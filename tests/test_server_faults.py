"""Faults the core service survives: failing providers, corrupt files, dead clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from grpc_health.v1 import health_pb2

from conftest import (
    NO_METRICS_LISTEN,
    ServerFactory,
    char_config,
    process_gone,
    subprocess_env,
    tiny_corpus,
    wait_until,
)
from queue_client import QueueClient, errors
from queue_client.format.batchfile import load_batch_file, scan_queue

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A failed dataset stops the server (exit 2) unless told to keep serving the others.
KEEP_SERVING = ("--keep-serving",)


def _test_provider_config(provider: str, name: str = "bad", restarts: int = 1) -> str:
    return textwrap.dedent(
        f"""
        [datasets.{name}]
        provider = "bq_test_providers:{provider}"
        batch_size = 2
        batches_per_file = 3
        max_worker_restarts = {restarts}
        """
    )


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory):
    """One server for the tests that need no restart, a dataset each (a server start costs
    about two seconds of CPU: its workers' forkserver imports torch)."""
    tmp = tmp_path_factory.mktemp("server_faults")
    corpus = tiny_corpus(tmp / "corpus.txt")
    config = "[server]\nlease_ttl_s = 30\n" + "".join(
        char_config(corpus, name=name, extra=extra, server=None)
        for name, extra in (("corrupt", ""), ("crc", ""), ("idle", "max_backlog_files = 1"))
    )
    factory = ServerFactory(tmp)
    yield factory(config)
    factory.close()


def test_failing_provider_marks_dataset_failed(start_server) -> None:
    server = start_server(
        _test_provider_config("FailingProvider"), wait_serving=False, args=KEEP_SERVING
    )
    wait_until(lambda: server.stats("bad")["state"] == "failed", what="the dataset to fail")
    stats = server.stats("bad")
    assert "boom from FailingProvider" in stats["last_error"]
    assert server.health() == NOT_SERVING
    assert server.health("batchqueue.v1.BatchQueue/bad") == NOT_SERVING
    with pytest.raises(errors.ProviderFailed, match="boom from FailingProvider"):
        QueueClient(server.address, "bad")


def test_crashing_worker_is_restarted_and_leaves_no_partial_file(start_server) -> None:
    server = start_server(
        _test_provider_config("CrashingProvider", restarts=2),
        wait_serving=False,
        args=KEEP_SERVING,
    )
    wait_until(lambda: server.stats("bad")["state"] == "failed", what="the dataset to fail")
    restarts = [server.split_stats("bad", split)["worker_restarts"] for split in ("train", "val")]
    assert (
        max(restarts) == 2
    )  # the split that failed first restarted its worker twice, then gave up
    assert "exited with code 17" in server.stats("bad")["last_error"]
    qdir = server.data_root / "bad" / "queue" / "train"
    assert list(qdir.iterdir()) == []  # nothing published, no temp file left behind


def test_missing_meta_keys_are_named(start_server) -> None:
    server = start_server(
        _test_provider_config("MissingMetaProvider"), wait_serving=False, args=KEEP_SERVING
    )
    wait_until(lambda: server.stats("bad")["state"] == "failed", what="the dataset to fail")
    error = server.stats("bad")["last_error"]
    assert "split_info" in error and "vocab_size" in error


def test_schema_violation_names_the_field(start_server) -> None:
    server = start_server(
        _test_provider_config("WrongSchemaProvider"), wait_serving=False, args=KEEP_SERVING
    )
    wait_until(lambda: server.stats("bad")["state"] == "failed", what="the dataset to fail")
    error = server.stats("bad")["last_error"]
    assert "'y'" in error and "float32" in error


def test_corrupt_file_is_quarantined_and_its_seq_served_again(shared) -> None:
    server = shared
    qdir = server.data_root / "corrupt" / "queue" / "train"
    wait_until(lambda: any(n.seq == 0 for n in scan_queue(qdir)), what="seq 0")
    first = next(n for n in scan_queue(qdir) if n.seq == 0)
    path = qdir / str(first)
    expected_x = load_batch_file(path).tensors["x"][0].clone()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated after publication
    with QueueClient(server.address, "corrupt") as client:
        x, _ = client.get_batch("train")
        assert torch.equal(x, expected_x)  # the same seq, produced again: nothing lost
    stats = server.split_stats("corrupt")
    assert stats["quarantined_files"] == 1 and stats["reproduced_files"] >= 1
    quarantined = list((server.data_root / "corrupt" / "quarantine" / "train").iterdir())
    assert {p.name for p in quarantined} == {first.__str__(), f"{first}.reason.txt"}
    assert (
        "bytes"
        in (
            server.data_root / "corrupt" / "quarantine" / "train" / f"{first}.reason.txt"
        ).read_text()
    )


def test_crc_mismatch_is_detected(shared) -> None:
    server = shared
    qdir = server.data_root / "crc" / "queue" / "train"
    wait_until(lambda: any(n.seq == 0 for n in scan_queue(qdir)), what="seq 0")
    path = qdir / str(next(n for n in scan_queue(qdir) if n.seq == 0))
    expected = load_batch_file(path).tensors["y"][0].clone()
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF  # one flipped byte, same size
    path.write_bytes(bytes(data))
    with QueueClient(server.address, "crc") as client:
        _, y = client.get_batch("train")
        assert torch.equal(y, expected)
    assert server.split_stats("crc")["quarantined_files"] == 1
    reason = server.data_root / "crc" / "quarantine" / "train" / f"{path.name}.reason.txt"
    assert "has crc32" in reason.read_text()


def test_dataset_dir_built_from_another_config_is_refused_not_deleted(
    start_server, corpus: Path, tmp_path: Path
) -> None:
    server = start_server(char_config(corpus, batch_size=4))
    server.stop()
    meta = server.data_root / "chars" / "meta.pkl"
    before = meta.read_bytes()
    # batches_per_file changes the files (a batch_size change alone would not: char_lm's rows
    # are independent, so its files keep their unit; tests/test_batch_size.py shows that).
    server2 = start_server(
        char_config(corpus, batches_per_file=3), wait_serving=False, args=KEEP_SERVING
    )
    wait_until(lambda: server2.stats("chars")["state"] == "failed", what="the dataset to fail")
    error = server2.stats("chars")["last_error"]
    assert "another config" in error and "nothing is deleted" in error
    assert meta.read_bytes() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_a_killed_server_even_mid_file(start_server) -> None:
    """A SIGKILLed server takes its busy workers with it, so none can publish a file or leave a
    temp file behind after a restarted server has swept the queue directory."""
    config = textwrap.dedent(
        """
        [datasets.slow]
        provider = "bq_test_providers:SlowProvider"
        batch_size = 2
        batches_per_file = 4
        [datasets.slow.args]
        delay_s = 30.0
        """
    )
    server = start_server(config, wait_serving=False)
    pids = wait_until(
        lambda: [int(p) for s in server.stats("slow")["splits"] for p in s["worker_pids"]],
        60,
        "the slow workers to start",
    )
    server.kill(signal.SIGKILL)
    # Each worker is inside a 120 s file; left alone it would live on and publish it.
    wait_until(lambda: all(process_gone(p) for p in pids), 20, "the workers to exit")


def test_a_worker_that_dies_while_idle_is_restarted_at_once(shared) -> None:
    """No file is asked for (the backlog is full), yet the dead worker is replaced: stats
    never show a dead pid, and the next file does not wait for a restart."""
    server = shared
    wait_until(lambda: server.split_stats("idle")["ready_files"] >= 3, 30, "a full backlog")
    (pid,) = server.split_stats("idle")["worker_pids"]
    os.kill(int(pid), signal.SIGKILL)
    stats = wait_until(
        lambda: (
            (s := server.split_stats("idle"))["worker_restarts"] == 1
            and s["worker_pids"]
            and int(s["worker_pids"][0]) != int(pid)
            and s
        ),
        30,
        "the idle worker's restart",
    )
    assert "exited while idle" in server.stats("idle")["last_error"] or stats
    with QueueClient(server.address, "idle") as client:
        for _ in range(5 * 4):
            client.get_batch("train")


def test_a_second_server_on_the_same_data_root_is_refused(start_server, corpus: Path) -> None:
    """Two servers on one data root would append to the same journals and delete each other's
    files: the second exits naming the root and the first's pid. The lock dies with its
    holder, so after a SIGKILL the root is free again."""
    root = start_server(char_config(corpus)).data_root
    first = start_server.servers[-1]
    second = subprocess.run(
        [sys.executable, "-m", "queue_server", "--data-root", str(root), *NO_METRICS_LISTEN],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )
    assert second.returncode == 2
    assert f"data root {root} is in use by another queue-server (pid {first.proc.pid})" in (
        second.stderr
    )
    first.kill(signal.SIGKILL)
    start_server(char_config(corpus), data_root=root)  # serves: the lock went with its holder
