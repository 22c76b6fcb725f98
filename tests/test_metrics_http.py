"""HTTP /metrics and /healthz from a real server, parsed with prometheus_client's parser."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ServerFactory, char_config, tiny_corpus, wait_until
from queue_client import QueueClient
from queue_server.testing import ServerProcess


def _get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _samples(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = _get(address, "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def shared_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_corpus(tmp_path_factory.mktemp("metrics_corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, shared_corpus: Path):
    """One server for the tests that need no restart, a dataset each (a server start costs
    about two seconds of CPU: its workers' forkserver imports torch)."""
    config = "[server]\nlease_ttl_s = 30\n" + "".join(
        char_config(shared_corpus, name=name, extra=extra, server=None)
        for name, extra in (("follow", ""), ("tokens", "workers = 2"))
    )
    factory = ServerFactory(tmp_path_factory.mktemp("metrics_http"))
    yield factory(config)
    factory.close()


def test_metrics_follow_the_queue(shared) -> None:
    server = shared
    assert server.metrics_address
    assert _get(server.metrics_address, "/healthz") == (200, "SERVING\n")
    key = (("dataset", "follow"), ("split", "train"))
    wait_until(
        lambda: _samples(server.metrics_address)[("batchqueue_files_produced_total", key)] >= 4,
        what="production in /metrics",
    )
    with QueueClient(server.address, "follow") as client:
        for _ in range(5 * 3):
            client.get_batch("train")
        wait_until(
            lambda: _samples(server.metrics_address)[("batchqueue_files_consumed_total", key)] >= 2,
            what="consumption in /metrics",
        )
        samples = _samples(server.metrics_address)
    assert samples[("batchqueue_dataset_up", (("dataset", "follow"),))] == 1.0
    assert samples[("batchqueue_produced_bytes_total", key)] > 0
    assert ("batchqueue_backlog_files", key) in samples and (
        "batchqueue_leases_expired_total",
        key,
    ) in samples
    assert samples[("batchqueue_get_batch_wait_seconds_count", key)] >= 2  # reported by the client
    assert samples[("batchqueue_quarantined_files_total", key)] == 0
    assert _get(server.metrics_address, "/nope")[0] == 404


def test_healthz_is_503_when_a_dataset_failed(start_server) -> None:
    config = """
[datasets.bad]
provider = "bq_test_providers:FailingProvider"
batch_size = 2
batches_per_file = 2
max_worker_restarts = 0
"""
    server = start_server(config, wait_serving=False, args=("--keep-serving",))
    assert _get(server.metrics_address, "/healthz")[0] == 503  # starting or failed: not up
    wait_until(
        lambda: "(failed)" in _get(server.metrics_address, "/healthz")[1],
        what="healthz to report the failure",
    )
    assert _get(server.metrics_address, "/healthz")[0] == 503
    # The probe says which dataset, in what state, and why, so the operator need not dig.
    body = _get(server.metrics_address, "/healthz")[1]
    assert body.startswith("NOT_SERVING bad (failed): ")
    assert "boom from FailingProvider" in body
    samples = _samples(server.metrics_address)
    assert samples[("batchqueue_dataset_up", (("dataset", "bad"),))] == 0.0


def test_metrics_count_tokens_and_worker_memory_without_bogus_series(
    shared,
) -> None:
    """A token counter and each worker's resident memory; no `_created` series (they only
    restate the start time) and no le="0.0" bucket in the wait histogram."""
    server = shared
    key = (("dataset", "tokens"), ("split", "train"))
    with QueueClient(server.address, "tokens") as client:
        for _ in range(5 * 3):
            client.get_batch("train")
        wait_until(
            lambda: server.split_stats("tokens")["consumed_files"] >= 2, what="files consumed"
        )
        consumed = server.split_stats("tokens")["consumed_files"]
        samples = _samples(server.metrics_address)
    # char_config: batch_size 4, block_size 16, batches_per_file 5.
    assert samples[("batchqueue_tokens_served_total", key)] == consumed * 5 * 4 * 16
    pids = {s: server.split_stats("tokens", s)["worker_pids"] for s in ("train", "val")}
    for split, split_pids in pids.items():
        for worker in range(len(split_pids)):
            labels = (("dataset", "tokens"), ("split", split), ("worker", str(worker)))
            assert samples[("batchqueue_worker_rss_bytes", labels)] > 20 << 20
    assert not any(name.endswith("_created") for name, _ in samples)
    status, text = _get(server.metrics_address, "/metrics")
    assert status == 200 and "_created" not in text
    buckets = [dict(labels)["le"] for name, labels in samples if name.endswith("_bucket")]
    assert buckets and "0.0" not in buckets and "+Inf" in buckets


def test_a_second_server_on_the_same_metrics_address_exits_naming_it(
    shared, shared_corpus: Path, tmp_path: Path
) -> None:
    """Several servers on one host each need their own --metrics-listen: the second one on an
    address in use exits with code 1 and a message naming the address and the setting, and
    the first one serves on."""
    first = shared
    taken = first.metrics_address
    second = ServerProcess(
        tmp_path / "second",
        data_root=tmp_path / "second-root",
        config_text=char_config(shared_corpus),
        metrics_listen=taken,
    )
    try:
        assert second.wait_exit(120) == 1, second.log()
    finally:
        second.kill()
    said = second.log()
    assert f"cannot listen for /metrics and /healthz on {taken}" in said, said
    assert "--metrics-listen" in said and "address already in use" in said, said
    assert "Traceback" not in said, said
    with urllib.request.urlopen(f"http://{taken}/healthz", timeout=30) as reply:
        assert reply.status == 200
