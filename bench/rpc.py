"""Row 4: the lease RPCs beside a bare unary echo (the Ping RPC) on the same server.

A file boundary cost the client one AcquireLease and one ReleaseLease, so each sample is
that pair, timed beside a pair of Pings: the same two round trips with no queue logic. Both
go through the client's own Rpc wrapper on one channel, in interleaved chunks. The lease is
for a file already on disk and is released RETURNED, so the same file is leased again and
nothing waits on the provider. The last rows time what a boundary costs now: one
AcquireLease carrying the release of the lease before it, beside one Ping.

Servers: TCP loopback and a unix socket, each on uvloop and on asyncio's default loop.
"""

from __future__ import annotations

import time
from typing import Any

from bench.data import Tokens
from bench.harness import Result, Settings, percentile
from bench.servers import Server, ServerSpec, dataset_toml

DATASET = "rpc"
GOAL = 1.5
_PAYLOAD = b"x" * 128  # about a Lease reply's size


def _combos(settings: Settings) -> list[tuple[str, str]]:
    full = [("tcp", "uvloop"), ("tcp", "asyncio"), ("unix", "uvloop"), ("unix", "asyncio")]
    # The smoke version covers each transport and each loop once.
    return settings.pick(full, [("tcp", "uvloop"), ("unix", "asyncio")])


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    datasets = (
        dataset_toml(
            DATASET, text=tokens.text_path, batch_size=2, block_size=16, batches_per_file=2
        ),
    )
    return [
        ServerSpec(f"rpc-{transport}-{loop}", datasets, transport, loop)
        for transport, loop in _combos(settings)
    ]


class _Probe:
    """One client connection to one server, collecting samples in µs."""

    def __init__(self, server: Server) -> None:
        from queue_client.wire import batchqueue_pb2 as pb
        from queue_client.wire.rpc import Rpc

        self.pb = pb
        self.rpc = Rpc(server.address)
        self.acquire_req = pb.AcquireLeaseRequest(
            dataset=DATASET,
            split="train",
            rank=0,
            world_size=1,
            client_id="bench-rpc",
            seq=0,
            wait_ms=30_000,
        )
        self.ping_req = pb.PingRequest(payload=_PAYLOAD)
        self.samples: dict[str, list[float]] = {
            k: [] for k in ("ping", "ping_pair", "acquire", "release", "lease_pair", "carried")
        }
        self.held: object | None = None  # the lease the next carried sample releases

    def pings(self, n: int, record: bool = True) -> None:
        call, req, now = self.rpc.call, self.ping_req, time.perf_counter_ns
        for _ in range(n):
            t0 = now()
            call("Ping", req)
            t1 = now()
            call("Ping", req)
            t2 = now()
            if record:
                self.samples["ping"].append((t1 - t0) / 1e3)
                self.samples["ping_pair"].append((t2 - t0) / 1e3)

    def leases(self, n: int, record: bool = True) -> None:
        pb, call, now = self.pb, self.rpc.call, time.perf_counter_ns
        for _ in range(n):
            t0 = now()
            lease = call("AcquireLease", self.acquire_req, timeout_s=60)
            t1 = now()
            call(
                "ReleaseLease",
                pb.ReleaseLeaseRequest(
                    lease_id=lease.lease_id, client_id="bench-rpc", outcome=pb.RETURNED
                ),
            )
            t2 = now()
            if record:
                self.samples["acquire"].append((t1 - t0) / 1e3)
                self.samples["release"].append((t2 - t1) / 1e3)
                self.samples["lease_pair"].append((t2 - t0) / 1e3)

    def carried(self, n: int, record: bool = True) -> None:
        """AcquireLease carrying the release (RETURNED) of the lease it took before."""
        pb, call, now = self.pb, self.rpc.call, time.perf_counter_ns
        for _ in range(n):
            request = pb.AcquireLeaseRequest()
            request.CopyFrom(self.acquire_req)
            if self.held is not None:
                request.releases.append(self._returned(self.held))
            t0 = now()
            self.held = call("AcquireLease", request, timeout_s=60)
            t1 = now()
            if record:
                self.samples["carried"].append((t1 - t0) / 1e3)

    def _returned(self, lease: Any) -> Any:
        return self.pb.ReleaseLeaseRequest(
            lease_id=lease.lease_id, client_id="bench-rpc", outcome=self.pb.RETURNED
        )

    def close(self) -> None:
        if self.held is not None:
            self.rpc.call("ReleaseLease", self._returned(self.held))
        self.rpc.close()


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    combos = _combos(settings)
    probes = {c: _Probe(found[f"rpc-{c[0]}-{c[1]}"]) for c in combos}
    try:
        for p in probes.values():  # connect, and lease once: waits for the first file
            p.leases(settings.pick(20, 2), record=False)
            p.pings(settings.pick(50, 2), record=False)
            p.carried(settings.pick(20, 2), record=False)
        rounds, chunk = settings.pick((20, 50), (2, 5))
        for r in range(rounds):
            for p in probes.values():
                units = [p.pings, p.leases, p.carried]
                for unit in units[r % 3 :] + units[: r % 3]:
                    unit(chunk)
    finally:
        for p in probes.values():
            p.close()
    results = []
    for (transport, loop), p in probes.items():
        s = p.samples
        lease50, ping50 = percentile(s["lease_pair"], 50), percentile(s["ping_pair"], 50)
        lease99, ping99 = percentile(s["lease_pair"], 99), percentile(s["ping_pair"], 99)
        where = f"{'TCP loopback' if transport == 'tcp' else 'unix socket'}, server on {loop}"
        singles = f"one call p50: acquire {percentile(s['acquire'], 50):.0f}, release {percentile(s['release'], 50):.0f}, Ping {percentile(s['ping'], 50):.0f} µs; {len(s['lease_pair'])} pairs"
        results.append(
            Result(
                "4",
                f"acquire+release p50, {where}",
                lease50,
                "µs",
                "2 Pings p50",
                ping50,
                "µs",
                lease50 / ping50,
                "x echo",
                f"<= {GOAL:g}x",
                lease50 / ping50 <= GOAL,
                singles,
            )
        )
        results.append(
            Result(
                "4",
                f"acquire+release p99, {where}",
                lease99,
                "µs",
                "2 Pings p99",
                ping99,
                "µs",
                lease99 / ping99,
                "x echo",
                "info",
                None,
            )
        )
    for (transport, loop), p in probes.items():  # after the rows above, whose ids stay
        s = p.samples
        carried50, ping50 = percentile(s["carried"], 50), percentile(s["ping"], 50)
        where = f"{'TCP loopback' if transport == 'tcp' else 'unix socket'}, server on {loop}"
        results.append(
            Result(
                "4",
                f"acquire carrying the last release p50, {where}",
                carried50,
                "µs",
                "1 Ping p50",
                ping50,
                "µs",
                carried50 / ping50,
                "x echo",
                "info",
                None,
                f"one call per file boundary, against {percentile(s['lease_pair'], 50):.0f} µs "
                f"for acquire+release (p99 {percentile(s['carried'], 99):.0f} µs)",
            )
        )
    return results
