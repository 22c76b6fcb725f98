"""Prometheus metrics and a health probe over plain HTTP, on the server's own event loop.

`/metrics` is the Prometheus text format, rendered by prometheus_client from a collector that
reads the split queues when scraped (no background bookkeeping; the workers' resident memory
is read from /proc in a thread just before); no `_created` series (they only restate the
server's start time); FetchFile's counts (bytes streamed per split, streams open and refused)
come from rpc/fetch_streams.py the same way. `/healthz` is 200 while every dataset is SERVING, and 503 otherwise
with one line per other dataset: its name, state and why. The HTTP side is a minimal asyncio responder: it reads
one request line, answers and closes, so a scrape never blocks gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from queue_server.config.server import parse_listen
from queue_server.mixture.proto import add_mixture_metrics, mixture_families
from queue_server.process_memory import rss_of
from queue_server.split.stats import prepare_stats
from queue_server.split.training_units import SplitUnits, split_units

if TYPE_CHECKING:
    from queue_server.dataset import DatasetRuntime
    from queue_server.rpc.fetch_streams import FetchStreams

log = logging.getLogger("queue_server.metrics")

# Waits at a file boundary, as clients report them: 0 when the prefetch was in time, which
# falls in the first bucket (a le="0.0" bucket would only split hairs at zero).
WAIT_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class QueueCollector:
    """Reads every split queue at scrape time."""

    def __init__(
        self, datasets: Mapping[str, DatasetRuntime], streams: FetchStreams | None = None
    ) -> None:
        self._datasets = datasets
        self._streams = streams
        # pid -> resident bytes, read in a thread before each scrape (MetricsServer).
        self.rss: dict[int, int] = {}
        self._units: dict[tuple[str, str], SplitUnits] = {}

    def worker_pids(self) -> list[int]:
        return [
            pid
            for rt in self._datasets.values()
            for q in rt.splits.values()
            for pid in q.worker_pids()
        ]

    def _tokens_per_file(self, runtime: DatasetRuntime, split: str) -> int:
        key = (runtime.name, split)
        units = self._units.get(key)
        if units is None:
            c = runtime.config
            units = self._units[key] = split_units(
                runtime.meta, split, c.batch_size, c.batches_per_file
            )
        return units.tokens_per_file

    async def prepare(self) -> None:
        """What collect() would compute on the event loop, first in a thread (split/stats.py)."""
        for runtime in list(self._datasets.values()):
            for queue in list(runtime.splits.values()):
                await prepare_stats(queue)

    def collect(self) -> Iterator[Metric]:
        labels = ["dataset", "split"]
        rss = GaugeMetricFamily(
            "batchqueue_worker_rss_bytes",
            "Resident memory of each worker process (0 when unreadable)",
            labels=["dataset", "split", "worker"],
        )
        tokens = CounterMetricFamily(
            "batchqueue_tokens_served",
            "Tokens in the files consumed (the token field's positions, padding included)",
            labels=labels,
        )
        up = GaugeMetricFamily(
            "batchqueue_dataset_up", "1 while the dataset is SERVING", labels=["dataset"]
        )
        gauges = {
            "ready": GaugeMetricFamily(
                "batchqueue_backlog_files", "Files on disk and not leased", labels=labels
            ),
            "leased": GaugeMetricFamily(
                "batchqueue_leased_files", "Files leased to clients now", labels=labels
            ),
            "cap": GaugeMetricFamily(
                "batchqueue_max_backlog_files", "Configured ready files per rank", labels=labels
            ),
            "world": GaugeMetricFamily(
                "batchqueue_world_size", "World size of the ranks reading", labels=labels
            ),
        }
        counters = {
            "produced_files": CounterMetricFamily(
                "batchqueue_files_produced", "Files produced (first time)", labels=labels
            ),
            "reproduced_files": CounterMetricFamily(
                "batchqueue_files_reproduced", "Files produced again", labels=labels
            ),
            "consumed_files": CounterMetricFamily(
                "batchqueue_files_consumed", "Files consumed and deleted", labels=labels
            ),
            "produced_bytes": CounterMetricFamily(
                "batchqueue_produced_bytes", "Bytes of batch files written", labels=labels
            ),
            "leases_expired": CounterMetricFamily(
                "batchqueue_leases_expired", "Leases whose client stopped renewing", labels=labels
            ),
            "quarantined_files": CounterMetricFamily(
                "batchqueue_quarantined_files", "Files moved to quarantine", labels=labels
            ),
            "worker_restarts": CounterMetricFamily(
                "batchqueue_provider_errors", "Provider worker crashes and errors", labels=labels
            ),
            "disk_errors": CounterMetricFamily(
                "batchqueue_disk_errors",
                "Writes that failed for lack of space or permission",
                labels=labels,
            ),
        }
        curriculum = {
            "alpha": GaugeMetricFamily(
                "batchqueue_curriculum_alpha",
                "Curriculum alpha of the last composed batch (1 uniform, 0 corpus)",
                labels=labels,
            ),
            "kl_to_target": GaugeMetricFamily(
                "batchqueue_curriculum_kl_to_target",
                "KL divergence of the served tokens to the curriculum target, nats",
                labels=labels,
            ),
            "buffer_batches": GaugeMetricFamily(
                "batchqueue_curriculum_buffer_batches",
                "Candidate batches in the curriculum buffer",
                labels=labels,
            ),
            "candidate_files": GaugeMetricFamily(
                "batchqueue_curriculum_candidate_files",
                "Curriculum candidate files on disk",
                labels=labels,
            ),
        }
        mixture = mixture_families(labels)
        for name, runtime in self._datasets.items():
            up.add_metric([name], 1.0 if runtime.state == "serving" else 0.0)
            for split, queue in runtime.splits.items():
                snap = queue.snapshot()
                key = [name, split]
                gauges["ready"].add_metric(key, snap.ready_files)
                gauges["leased"].add_metric(key, snap.leased_files)
                gauges["cap"].add_metric(key, snap.max_backlog_files)
                gauges["world"].add_metric(key, snap.world_size)
                for attr, family in counters.items():
                    family.add_metric(key, getattr(snap.counters, attr))
                tokens.add_metric(
                    key, snap.counters.consumed_files * self._tokens_per_file(runtime, split)
                )
                for worker, pid in enumerate(snap.worker_pids):
                    rss.add_metric([name, split, str(worker)], self.rss.get(pid, 0))
                for attr, gauge in curriculum.items():
                    if snap.curriculum is not None and attr in snap.curriculum:
                        gauge.add_metric(key, float(snap.curriculum[attr]))
                add_mixture_metrics(mixture, key, snap.mixture)
        yield up
        yield from gauges.values()
        yield from curriculum.values()
        yield from mixture.values()
        yield from counters.values()
        yield tokens
        yield rss
        if self._streams is not None:
            yield from _stream_metrics(self._streams)


def _stream_metrics(streams: FetchStreams) -> Iterator[Metric]:
    """FetchFile: bytes streamed per split, streams open now, streams refused at the cap."""
    sent = CounterMetricFamily(
        "batchqueue_fetch_bytes",
        "Bytes of batch files streamed to clients by FetchFile",
        labels=["dataset", "split"],
    )
    for (dataset, split), n in sorted(streams.bytes_sent.items()):
        sent.add_metric([dataset, split], n)
    yield sent
    yield GaugeMetricFamily(
        "batchqueue_fetch_streams_open",
        "FetchFile streams open now (server.max_fetch_streams at most)",
        value=streams.open_streams,
    )
    yield CounterMetricFamily(
        "batchqueue_fetch_streams_refused",
        "FetchFile calls refused because server.max_fetch_streams streams were open",
        value=streams.refused,
    )


class MetricsServer:
    def __init__(
        self,
        datasets: Mapping[str, DatasetRuntime],
        listen: str,
        streams: FetchStreams | None = None,
    ) -> None:
        disable_created_metrics()  # process-wide: no `_created` series anywhere
        self.registry = CollectorRegistry()
        self.collector = QueueCollector(datasets, streams)
        self.registry.register(self.collector)
        self.wait_seconds = Histogram(
            "batchqueue_get_batch_wait_seconds",
            "How long get_batch blocked at a file boundary, as reported by clients",
            ["dataset", "split"],
            buckets=WAIT_BUCKETS_S,
            registry=self.registry,
        )
        self._datasets = datasets
        self._listen = listen
        self._server: asyncio.AbstractServer | None = None
        self.address = ""

    async def start(self) -> str:
        """Listen; OSError naming the address and the setting when it cannot (most often a
        second server on the host left at the default address)."""
        listen = parse_listen(self._listen)
        try:
            if listen.unix_path:
                self._server = await asyncio.start_unix_server(self._handle, path=listen.unix_path)
            else:
                self._server = await asyncio.start_server(
                    self._handle, host=listen.host, port=listen.port
                )
        except OSError as exc:
            why = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise OSError(
                f"cannot listen for /metrics and /healthz on {self._listen} "
                f"(server.metrics_listen, --metrics-listen): {why}; another "
                "process, such as a second queue-server on this host, may hold it: give each "
                'server its own --metrics-listen, or "" to turn the listener off',
            ) from None
        if listen.unix_path:
            self.address = f"unix:{listen.unix_path}"
        else:
            port = self._server.sockets[0].getsockname()[1]
            self.address = f"{listen.host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def observe_wait(self, dataset: str, split: str, waited_s: float) -> None:
        self.wait_seconds.labels(dataset, split).observe(max(0.0, waited_s))

    def _not_serving(self) -> str:
        """`NOT_SERVING name (state): reason` per dataset that is not serving; "" if none."""
        lines = [
            f"NOT_SERVING {name} ({rt.state})" + (f": {rt.last_error}" if rt.last_error else "")
            for name, rt in sorted(self._datasets.items())
            if rt.state != "serving"
        ]
        return "".join(line + "\n" for line in lines)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            parts = line.decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                status, ctype, body = (
                    "405 Method Not Allowed",
                    "text/plain",
                    b"GET /metrics or /healthz\n",
                )
            elif path == "/metrics":
                self.collector.rss = await asyncio.to_thread(rss_of, self.collector.worker_pids())
                await self.collector.prepare()
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
            elif path == "/healthz":
                status, ctype, body = "200 OK", "text/plain", b"SERVING\n"
                if bad := self._not_serving():
                    status, body = "503 Service Unavailable", bad.encode()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"GET /metrics or /healthz\n"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + (body if parts[:1] != ["HEAD"] else b""))
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, IndexError) as exc:
            log.debug("metrics request dropped: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
