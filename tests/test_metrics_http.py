"""HTTP /metrics and /healthz from a real server, parsed with prometheus_client's parser."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from conftest import char_config, wait_until
from queue_client import QueueClient


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


def test_metrics_follow_the_queue(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus))
    assert server.metrics_address
    assert _get(server.metrics_address, "/healthz") == (200, "SERVING\n")
    key = (("dataset", "chars"), ("split", "train"))
    wait_until(
        lambda: _samples(server.metrics_address)[("batchqueue_files_produced_total", key)] >= 4,
        what="production in /metrics",
    )
    with QueueClient(server.address, "chars") as client:
        for _ in range(5 * 3):
            client.get_batch("train")
        wait_until(
            lambda: _samples(server.metrics_address)[("batchqueue_files_consumed_total", key)] >= 2,
            what="consumption in /metrics",
        )
        samples = _samples(server.metrics_address)
    assert samples[("batchqueue_dataset_up", (("dataset", "chars"),))] == 1.0
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
    server = start_server(config, wait_serving=False)
    wait_until(
        lambda: _get(server.metrics_address, "/healthz")[0] == 503, what="healthz to turn 503"
    )
    assert "bad" in _get(server.metrics_address, "/healthz")[1]
    samples = _samples(server.metrics_address)
    assert samples[("batchqueue_dataset_up", (("dataset", "bad"),))] == 0.0
