"""The BatchQueue servicer: translates between protobuf messages and the domain objects.

No queue logic lives here. Domain errors become status codes in one decorator (via
queue_client.wire.codes), so every RPC reports errors the same way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from queue_client import errors
from queue_client.format.batchfile import check_dataset_name
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire import batchqueue_pb2_grpc as pb_grpc
from queue_client.wire.codes import status_for
from queue_server.curriculum import changes as curriculum_changes
from queue_server.dataset import DatasetRuntime
from queue_server.mixture import changes as mixture_changes
from queue_server.process_memory import rss_of
from queue_server.provenance import explain_step
from queue_server.rpc import request_bounds
from queue_server.rpc.fetch_streams import FetchStreams
from queue_server.rpc.file_stream import chunk_size, stream_file
from queue_server.rpc.metrics import MetricsServer
from queue_server.rpc.request_decoding import UndecodableRequest
from queue_server.rpc.stats_proto import split_stats_proto
from queue_server.split.leases import LeaseDirectory
from queue_server.split.queue import SplitQueue
from queue_server.split.stats import prepare_stats, training_view
from queue_server.split.throughput import Throughput
from queue_server.split.training_units import SplitUnits, split_units
from queue_server.steering import skips as step_skips

log = logging.getLogger("queue_server.servicer")

T = TypeVar("T")


def _translate(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            if isinstance(request, UndecodableRequest):
                raise request.refuse()
            request_bounds.check_strings(request)
            return await method(self, request, context)
        except errors.BatchQueueError as exc:
            code, message = status_for(exc)
            await context.abort(code, message)
        raise AssertionError("unreachable")

    return wrapper


class BatchQueueServicer(pb_grpc.BatchQueueServicer):
    def __init__(
        self,
        datasets: dict[str, DatasetRuntime],
        leases: LeaseDirectory[SplitQueue],
        data_root: str,
        lease_ttl_s: float,
        acquire_wait_s: float,
        metrics: MetricsServer | None = None,
        *,
        data_root_id: str = "",
        streams: FetchStreams,
    ) -> None:
        self._metrics = metrics
        self._streams = streams
        self._data_root_id = data_root_id
        self._datasets = datasets
        self._leases = leases
        self._data_root = data_root
        self._ttl_ms = int(lease_ttl_s * 1000)
        self._wait_s = acquire_wait_s
        # (dataset, split) -> its consumption rates and its units, made on first use.
        self._rates: dict[tuple[str, str], Throughput] = {}
        self._split_units: dict[tuple[str, str], SplitUnits] = {}

    async def _dataset(self, name: str, wait_s: float | None = None) -> DatasetRuntime:
        check_dataset_name(name)
        runtime = self._datasets.get(name)
        if runtime is None:
            raise errors.UnknownDataset(
                f"dataset {name!r} is not served here; served: {sorted(self._datasets)}"
            )
        if not runtime.ready.is_set():
            try:
                await asyncio.wait_for(
                    runtime.ready.wait(), self._wait_s if wait_s is None else wait_s
                )
            except asyncio.TimeoutError:
                raise errors.ServerUnavailable(f"dataset {name!r} is still starting") from None
        runtime.check_serving()
        return runtime

    def _queue(self, runtime: DatasetRuntime, split: str) -> SplitQueue:
        return runtime.split(split)

    @_translate
    async def ListDatasets(
        self, request: pb.ListDatasetsRequest, context: Any
    ) -> pb.ListDatasetsResponse:
        return pb.ListDatasetsResponse(datasets=sorted(self._datasets))

    @_translate
    async def GetMeta(self, request: pb.GetMetaRequest, context: Any) -> pb.GetMetaResponse:
        runtime = await self._dataset(request.dataset)
        return pb.GetMetaResponse(
            dataset=runtime.name,
            meta_json=runtime.client_meta_json,
            training_type=str(runtime.meta["training_type"]),
            batch_size=runtime.served_batch_size,
            batches_per_file=runtime.config.batches_per_file,
            data_root=self._data_root,
            mode=runtime.config.mode,
            splits=sorted(runtime.splits),
            lease_ttl_ms=self._ttl_ms,
            data_root_id=self._data_root_id,
        )

    @_translate
    async def GetSchema(self, request: pb.GetSchemaRequest, context: Any) -> pb.GetSchemaResponse:
        runtime = await self._dataset(request.dataset)
        schema = runtime.schema(request.split)
        return pb.GetSchemaResponse(
            dataset=runtime.name,
            split=request.split,
            batch_size=runtime.config.batch_size,
            fields=[
                pb.FieldSpec(
                    name=f.name,
                    dtype=f.dtype,
                    shape=list(f.shape),
                    role=f.role,
                    stored_dtype=f.stored_as,
                    storage=f.storage.kind,
                )
                for f in schema
            ],
        )

    @_translate
    async def GetStats(self, request: pb.GetStatsRequest, context: Any) -> pb.GetStatsResponse:
        check_dataset_name(request.dataset)
        runtime = self._datasets.get(request.dataset)
        if runtime is None:
            raise errors.UnknownDataset(
                f"dataset {request.dataset!r} is not served here; served: {sorted(self._datasets)}"
            )
        names = sorted(runtime.splits)
        for name in names:
            await self._throughput(runtime, name).load()
            await prepare_stats(runtime.splits[name])
        # One moment of every split: no await between the snapshots and the rates.
        snaps = {name: runtime.splits[name].snapshot() for name in names}
        rates = {name: self._throughput(runtime, name).rate() for name in names}
        pids = [pid for snap in snaps.values() for pid in snap.worker_pids]
        pids += [
            w.pid
            for snap in snaps.values()
            for w in snap.workers
            if w.backend == "local" and w.pid and w.pid not in pids
        ]
        rss = await asyncio.to_thread(rss_of, pids)
        splits = []
        for name in names:
            snap, (files_per_s, window_s) = snaps[name], rates[name]
            units = self._units(runtime, name)
            view = training_view(snap.counters.consumed_files, units, files_per_s, window_s)
            splits.append(split_stats_proto(name, snap, view, rss))
        return pb.GetStatsResponse(
            dataset=runtime.name, state=runtime.state, last_error=runtime.last_error, splits=splits
        )

    def _throughput(self, runtime: DatasetRuntime, split: str) -> Throughput:
        key = (runtime.name, split)
        found = self._rates.get(key)
        if found is None:
            found = self._rates[key] = Throughput(runtime.layout.throughput_file(split))
        return found

    def _units(self, runtime: DatasetRuntime, split: str) -> SplitUnits:
        """From meta, which a dataset builds once before its splits exist."""
        key = (runtime.name, split)
        found = self._split_units.get(key)
        if found is None:
            c = runtime.config
            found = split_units(runtime.meta, split, c.batch_size, c.batches_per_file)
            self._split_units[key] = found
        return found

    @_translate
    async def AcquireLease(self, request: pb.AcquireLeaseRequest, context: Any) -> pb.Lease:
        request_bounds.check_acquire(request)
        # The releases it carries first: the files they free may be what this lease waits for.
        released = [r.lease_id for r in request.releases if await self._release_carried(r)]
        wait_s = min(request.wait_ms / 1000, self._wait_s) if request.wait_ms else self._wait_s
        runtime = await self._dataset(request.dataset, wait_s)
        queue = self._queue(runtime, request.split)
        world_size = request.world_size or 1
        seq = request.seq if request.HasField("seq") else None
        lease, entry = await queue.acquire(
            request.rank,
            world_size,
            request.client_id,
            seq,
            wait_s,
            request.carried,
            pin=request.reacquire,
        )
        return pb.Lease(
            lease_id=lease.lease_id,
            dataset=runtime.name,
            split=queue.split,
            seq=lease.seq,
            path=f"{runtime.name}/queue/{queue.split}/{entry.name}",
            num_batches=runtime.config.batches_per_file,
            batch_size=runtime.config.batch_size,
            size_bytes=entry.size_bytes,
            crc32=entry.crc32,
            ttl_ms=self._ttl_ms,
            rank=lease.rank,
            world_size=lease.world_size,
            released=released,
            carries_releases=True,
            skips=_step_ranges(queue.skips),
        )

    async def _release_carried(self, request: pb.ReleaseLeaseRequest) -> bool:
        """Release a lease an AcquireLease carries. A release that fails is left out of the
        reply's `released`: the client sends it as a ReleaseLease of its own and hears why."""
        try:
            await self._release(request)
        except errors.BatchQueueError:
            return False
        return True

    @_translate
    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: Any
    ) -> pb.ReleaseLeaseResponse:
        request_bounds.check_release(request)
        await self._release(request)
        return pb.ReleaseLeaseResponse()

    async def _release(self, request: pb.ReleaseLeaseRequest) -> None:
        try:
            queue = self._leases.owner_of(request.lease_id)
        except errors.UnknownLease:
            if self._leases.released_by(request.lease_id, request.client_id):
                return  # released already, by a call whose answer the client missed
            raise
        queue.release(
            request.lease_id,
            request.client_id,
            int(request.outcome),
            request.reason[: request_bounds.REASON_CHARS],
        )
        self._leases.note_released(request.lease_id, request.client_id)
        if request.outcome == pb.CONSUMED:
            rates = self._throughput(self._datasets[queue.config.name], queue.split)
            rates.consumed()
            await rates.load()  # once: the window the last server left, merged in
        if self._metrics is not None and request.outcome == pb.CONSUMED and request.waited_s >= 0:
            self._metrics.observe_wait(queue.config.name, queue.split, request.waited_s)

    @_translate
    async def SetCurriculum(
        self, request: pb.SetCurriculumRequest, context: Any
    ) -> pb.SetCurriculumResponse:
        request_bounds.check_set_curriculum(request)
        runtime = await self._dataset(request.dataset, self._wait_s)
        queue = self._queue(runtime, request.split or "train")
        alpha = request.alpha if request.HasField("alpha") else None
        position = request.position_seq if request.HasField("position_seq") else None
        at = await curriculum_changes.set_curriculum(queue, alpha, position, request.rank)
        return pb.SetCurriculumResponse(effective_seq=at)

    @_translate
    async def SetMixture(
        self, request: pb.SetMixtureRequest, context: Any
    ) -> pb.SetMixtureResponse:
        request_bounds.check_set_mixture(request)
        runtime = await self._dataset(request.dataset, self._wait_s)
        queue = self._queue(runtime, request.split or "train")
        weights = None if request.reset else dict(request.weights)
        position = request.position_seq if request.HasField("position_seq") else None
        at = await mixture_changes.set_mixture(queue, weights, position, request.rank)
        return pb.SetMixtureResponse(effective_seq=at)

    @_translate
    async def SkipSteps(self, request: pb.SkipStepsRequest, context: Any) -> pb.SkipStepsResponse:
        request_bounds.check_skip_steps(request)
        runtime = await self._dataset(request.dataset, self._wait_s)
        queue = self._queue(runtime, request.split or "train")
        position = request.position_seq if request.HasField("position_seq") else None
        if request.list_only:
            return pb.SkipStepsResponse(skips=_step_ranges(queue.skips))
        skips = await step_skips.skip_steps(
            queue,
            request.from_step,
            request.to_step,
            request.position_step,
            position,
            request.rank,
        )
        return pb.SkipStepsResponse(skips=_step_ranges(skips))

    @_translate
    async def ExplainStep(
        self, request: pb.ExplainStepRequest, context: Any
    ) -> pb.ExplainStepResponse:
        request_bounds.check_explain_step(request)
        runtime = await self._dataset(request.dataset, self._wait_s)
        return await explain_step(runtime, self._queue(runtime, request.split or "train"), request)

    @_translate
    async def Ping(self, request: pb.PingRequest, context: Any) -> pb.PingResponse:
        return pb.PingResponse(payload=request.payload)

    @_translate
    async def RenewLeases(
        self, request: pb.RenewLeasesRequest, context: Any
    ) -> pb.RenewLeasesResponse:
        request_bounds.check_renew(request)
        lost = []
        for lease_id in request.lease_ids:
            try:
                queue = self._leases.owner_of(lease_id)
            except errors.BatchQueueError:
                lost.append(lease_id)
                continue
            if not queue.renew(lease_id, request.client_id):
                lost.append(lease_id)
        return pb.RenewLeasesResponse(lost_lease_ids=lost, ttl_ms=self._ttl_ms)

    @_translate
    async def FetchFile(self, request: pb.FetchFileRequest, context: Any) -> None:
        """Stream a leased file to its holder (rpc/file_stream.py): disk reads in a thread, one
        chunk ahead, each write waiting for the client, the lease checked before each chunk."""
        chunk_bytes = chunk_size(request.max_chunk_bytes)
        queue = self._leases.owner_of(request.lease_id)
        path, size, crc = _leased_file(queue, request.lease_id, request.client_id)
        stream = self._streams.open(request.lease_id, queue.config.name, queue.split)
        # The slot is free once gRPC is done with the call, not before: an error's status
        # may wait behind a chunk that a client never reads.
        context.add_done_callback(lambda _: self._streams.close(stream))
        await stream_file(
            path,
            size,
            crc,
            queue.where,
            context.write,
            lambda: _leased_file(queue, request.lease_id, request.client_id),
            chunk_bytes,
            ended=stream.ended,
            sent=lambda n: self._streams.sent(stream, n),
        )


def _leased_file(queue: SplitQueue, lease_id: str, client_id: str) -> tuple[Path, int, int]:
    """The path, size and crc32 of the file a lease holds, for the lease's holder only: the
    one file FetchFile may read."""
    lease = queue.leases.get(lease_id)
    entry = queue.files.get(lease.seq) if lease is not None else None
    if lease is None or entry is None:
        raise errors.UnknownLease(
            f"lease {lease_id!r} of {queue.where} is not held (expired, released, or the "
            "server restarted)"
        )
    if lease.client_id != client_id:
        raise errors.LeaseConflict(
            f"lease {lease_id!r} belongs to another client, not to {client_id!r}"
        )
    return queue.dir / entry.name, entry.size_bytes, entry.crc32


def _step_ranges(skips: list[tuple[int, int]]) -> list[pb.StepRange]:
    """A split's skipped steps as the wire says them (in every Lease and SkipSteps reply)."""
    return [pb.StepRange(from_step=a, to_step=b) for a, b in skips]
