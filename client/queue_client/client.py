"""QueueClient: nanoGPT's `get_batch(split)`, served from a batchqueue server.

    client = QueueClient("localhost:50051", "stdlib_char", device="cuda")
    X, Y = client.get_batch("train")

The client leases one file at a time per split, memory-maps it and slices batches out of it;
RPCs happen only at file boundaries, in a background thread, one file ahead. A second thread
renews held leases, so a paused trainer (a long eval) keeps its files; if the client dies, its
leases expire and the files go back to its rank's stream. A client that cannot see the
server's data root streams each file instead (transport "grpc", fetch.py), in that same thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from queue_client import errors
from queue_client.explain import ExplainMixin
from queue_client.format.batchfile import check_dataset_name, check_split_name
from queue_client.format.meta import meta_from_json, split_schema
from queue_client.format.schema import FieldSpec
from queue_client.format.storage import codec_for
from queue_client.helper.helper_link import HelperLink, helper_client_kwargs
from queue_client.helper.helper_stream import open_helper_stream
from queue_client.steering import SkippingMixin, SteeringMixin
from queue_client.streaming.fetch import FileFetcher, check_transport, choose_transport
from queue_client.streaming.leasing import LeaseMixin
from queue_client.streaming.resume import STATE_VERSION, StreamPlan, plan_resume
from queue_client.streaming.rows import batch_size_of, rows_dependence
from queue_client.streaming.skipping import StepSkips, step_of
from queue_client.streaming.stream import LeaseRef, SplitStream, StreamView
from queue_client.streaming.transfer import Transfer
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire.rpc import Rpc
from queue_client.world import World

log = logging.getLogger("queue_client")

Batch = tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]


class QueueClient(ExplainMixin, SkippingMixin, LeaseMixin, SteeringMixin):
    """Batches of one dataset for one trainer rank; not thread-safe: one trainer thread calls
    it. Lease RPCs are leasing.py's, steering calls steering.py's, explain explain.py's."""

    def __init__(
        self,
        address: str,
        dataset: str,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | torch.device = "cpu",
        *,
        data_root: str | Path | None = None,
        timeout_s: float = 60.0,
        reconnect_timeout_s: float = 30.0,
        prefetch: bool = True,
        prefetch_files: int = 2,
        copy: bool = False,
        verify_checksums: bool = True,
        auth_token: str | None = None,
        transport: str = "auto",
        tls_ca_file: str | Path | None = None,
        max_fetch_bytes: int = 1 << 30,
        fetch_process: bool = False,
    ) -> None:
        """Connect to the server at `address` and read the dataset's meta.

        transport: how batch files reach this process. "file" reads them under data_root
        (memory-mapped); "grpc" streams each one (FetchFile) into memory, always checked
        by crc32; "auto" reads files when data_root is the server's very data root (it holds
        the root id the server publishes) and streams them otherwise. `self.transport` says
        which it is. max_fetch_bytes: a streamed file bigger than this is refused; a split
        holds at most 1 + 2 * prefetch_files streamed files in memory (the one read and
        those read ahead).
        prefetch_files: files leased and loaded ahead of the one being read (with prefetch),
        so a server slow to answer (a loaded machine) never makes a file switch wait; each
        holds a lease and a mapped file.
        tls_ca_file: a PEM file of the certificate(s) to trust: the connection is TLS (also
        $BATCHQUEUE_TLS_CA_FILE), for a server with server.tls_cert_file.
        fetch_process: lease, verify and load files in a helper process, which copies each
        file's stored rows into shared memory this process maps once (Linux): this process
        then does no work per file beside the trainer's thread, so no file switch takes the
        GIL or a core from it (docs/architecture.md, "A fetch helper process"). Costs a
        process (without torch: some 30 MiB, 0.15 s to start), a copy of each file and a ring
        of (read-ahead + 2) files per split in shared memory; batches are never views of it.
        """
        check_transport(transport)
        if not isinstance(prefetch_files, int) or not 1 <= prefetch_files <= 16:
            raise errors.InvalidRequest(
                f"prefetch_files must be an int in [1, 16], got {prefetch_files!r}"
            )
        self.prefetch_files = prefetch_files
        self.address = address
        self.dataset = check_dataset_name(dataset)
        self.world = World.detect(rank, world_size)
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.prefetch = prefetch
        self.verify_checksums = verify_checksums
        self.client_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._rpc = Rpc(
            address,
            auth_token=auth_token,
            reconnect_timeout_s=reconnect_timeout_s,
            tls_ca_file=tls_ca_file,
        )
        self._closed = False
        self._closing = False
        try:
            self._fetcher = FileFetcher(
                self._rpc, self.client_id, max_bytes=max_fetch_bytes, timeout_s=timeout_s
            )
            reply = self._rpc.call(
                "GetMeta", pb.GetMetaRequest(dataset=self.dataset), timeout_s=timeout_s
            )
        except BaseException:
            self._rpc.close()
            raise
        self.meta: dict[str, Any] = meta_from_json(reply.meta_json)
        self.mode = reply.mode
        self.splits = list(reply.splits)
        # The batch a get_batch without batch_size serves (the server's batch_size), and the
        # files' unit (the batch_size the dataset was built with, in meta).
        self.batch_size = int(reply.batch_size)
        unit = self.meta.get("batch_size")
        self.file_batch_size = unit if isinstance(unit, int) and unit > 0 else self.batch_size
        self._lease_ttl_s = max(reply.lease_ttl_ms / 1000, 0.1)
        root = (
            data_root
            if data_root is not None
            else os.environ.get("BATCHQUEUE_DATA_ROOT") or reply.data_root
        )
        self.data_root = Path(root).expanduser().resolve()
        self.transport = choose_transport(transport, self.data_root, reply.data_root_id)
        if transport == "auto" and self.transport == "grpc":
            log.info(
                "%s does not hold the data root of %s: batch files are streamed over gRPC",
                self.data_root,
                address,
            )
        self.fetch_process = bool(fetch_process)
        if self.fetch_process and not prefetch:
            raise errors.InvalidRequest(
                "fetch_process=True fetches files ahead in a helper process; it needs prefetch=True"
            )
        # What the fetch helper's own client is made with (the token goes by environment).
        self._helper_kwargs = helper_client_kwargs(
            self, reconnect_timeout_s, tls_ca_file, max_fetch_bytes
        )
        self._helper_token = auth_token
        self._helper: HelperLink | None = None
        self._transfer = Transfer(self.device, copy=copy)
        self._streams: dict[str, SplitStream] = {}
        self._resume: dict[str, StreamPlan] = {}
        self._step_skips: dict[str, StepSkips] = {}  # each split's step counter and skips
        self._held: dict[int, LeaseRef] = {}
        self._held_lock = threading.Lock()
        self._stop_renewing = threading.Event()
        self._renewer: threading.Thread | None = None

    # ---- what a training script calls -----------------------------------------------------
    def get_batch(
        self, split: str, out: Batch | None = None, *, batch_size: int | None = None
    ) -> Batch:
        """The next batch of `split`: (X, Y) for x/y schemas, else a dict of tensors.

        batch_size: the rows of this batch (default: the server's batch_size), a Python or
        numpy integer. Any size, per call, up to the rows whose served fields fit in
        MAX_BATCH_BYTES (16 GiB; a larger one is refused naming both): a batch takes the
        next rows of the stream, from the end of one file and the start of the next where it
        must, and state_dict() records rows, so a batch-size ramp resumes exactly. A dataset
        whose batches are made whole (grad-accumulation [A, B, T] layouts, curriculum
        splits) serves only its files' size, and says why otherwise.

        With `out` (the same structure, tensors of the batch's shapes and dtypes, on this
        client's device), the batch is copied into those tensors and `out` is returned: a
        contiguous copy at memcpy speed, into memory the caller owns and reuses.

        Blocks while the queue is empty, up to timeout_s, then raises NoBatchReady naming the
        dataset, split and address.
        """
        stream = self._streams.get(split)
        if stream is None:
            stream = self._open_stream(split)
        skips = self._step_skips[split]
        if (skips.step >= skips.next_at or skips.version != skips.seen) and self._skip_if_due(
            split, skips
        ):
            stream = self._open_stream(split)
        if batch_size is None:
            size = self.batch_size
        elif type(batch_size) is int and batch_size >= 1:
            size = batch_size
        else:  # numpy integers too; check_size bounds every size but the files' own
            checked = batch_size_of(batch_size)
            if checked is None:
                raise errors.InvalidRequest(f"batch_size must be an int >= 1, got {batch_size!r}")
            size = checked
        if size != self.file_batch_size:
            stream.check_size(size)
        if out is not None:
            served: Batch = self._copy_into(stream, out, size)
        else:
            tensors = stream.next_batch(self._transfer, size)
            served = (
                (tensors[0], tensors[1])
                if stream.xy
                else dict(zip(stream.names, tensors, strict=True))
            )
        skips.step += 1  # a step is a batch served: a call that raised counts none
        return served

    def _copy_into(self, stream: SplitStream, out: Batch, size: int) -> Batch:
        targets = list(out) if isinstance(out, tuple) else [out.get(n) for n in stream.names]
        if isinstance(out, tuple) != stream.xy or len(targets) != len(stream.names):
            want = "an (X, Y) tuple" if stream.xy else f"a dict with {stream.names}"
            raise errors.SchemaMismatch(f"out= must be {want} for split {stream.split!r}")
        checked: list[torch.Tensor] = []
        served = stream.served(size)
        for name, target, (shape, dtype) in zip(stream.names, targets, served, strict=True):
            if (
                not isinstance(target, torch.Tensor)
                or target.dtype is not dtype
                or target.shape != shape
            ):
                raise errors.SchemaMismatch(
                    f"out= field {name!r} must be a {dtype} tensor of shape {tuple(shape)}"
                )
            checked.append(target)
        stream.next_into(self._transfer, checked)
        return out

    def stream_view(self, split: str) -> StreamView:
        """Where `split`'s stream stands: the file being read, the next batch's place in it,
        and whether the file after it is prefetched. A snapshot for benchmarks and monitoring
        (which call opens a file, whether it had to wait); it changes nothing, and costs a
        few attribute reads (with fetch_process, a read of what the helper sent, which never
        blocks), so it may be called between any two get_batch calls."""
        stream = self._streams.get(split)
        if stream is None:
            self._check_split(split)
            return StreamView(split, None, 0, 0, "none")
        return stream.view()

    def schema(self, split: str) -> tuple[FieldSpec, ...]:
        self._check_split(split)
        return split_schema(self.meta, split)

    def stats(self) -> dict[str, Any]:
        """The server's counters for this dataset (GetStats), as a dict."""
        from google.protobuf.json_format import MessageToDict

        reply = self._rpc.call("GetStats", pb.GetStatsRequest(dataset=self.dataset))
        return MessageToDict(
            reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )

    def state_dict(self) -> dict[str, Any]:
        """Where each split's stream stands: small and JSON-serialisable, for checkpoints.

        Per split: the file of the next row (`seq`) and the row in it (`offset`, in rows
        since state version 3), the files to read after it before the plain stride resumes
        (`pending`, empty unless resumed at another world size) and `next_seq`; and the rows
        of a file (`rows_per_file`). Prefetched files are not consumed; a resume reads
        them again. The dataset and its config fingerprint say what the seqs are seqs of: the
        state resumes on any servers of that data (fresh ones too), and no others.
        """
        if self.mode != "deterministic":
            raise errors.InvalidRequest(
                f"dataset {self.dataset!r} is served best-effort, which has no exact resume"
            )
        w = self.world.world_size
        splits = {}
        for split in sorted(set(self._streams) | set(self._resume)):
            stream = self._streams.get(split)
            plan = stream.plan() if stream is not None else self._resume[split]
            steps = self._step_skips.get(split)
            splits[split] = {**plan.to_state(w), "step": steps.step if steps else 0}
        return {
            "version": STATE_VERSION,
            "dataset": self.dataset,
            "config_fingerprint": str(self.meta.get("config_fingerprint", "")),
            "rank": self.world.rank,
            "world_size": w,
            "rows_per_file": self.file_batch_size * self._batches_per_file(),
            "splits": splits,
        }

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Resume from `state_dict()`: the next batches are exactly those an uninterrupted run
        would have served. Pass this rank's state, or every rank's states (a list) to resume
        at another world size; one state from another world size assumes the ranks stepped in
        lockstep. Held leases are returned first. See docs/ordering.md for the rule.

        A state of another dataset, of another config of it (meta's config_fingerprint), or
        with an offset past the end of its file is refused with InvalidRequest naming both
        values; nothing is changed then."""
        if self.mode != "deterministic":
            raise errors.InvalidRequest(
                f"dataset {self.dataset!r} is served best-effort, which has no exact resume"
            )
        nb = self._batches_per_file()
        plans = plan_resume(
            state,
            self.world,
            self.dataset,
            fingerprint=str(self.meta.get("config_fingerprint") or "") or None,
            batches_per_file=nb or None,
            file_batch_size=self.file_batch_size,
        )
        unknown = sorted(set(plans) - set(self.splits))
        if unknown:
            raise errors.UnknownSplit(
                f"state holds split(s) {unknown} that dataset {self.dataset!r} lacks"
            )
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._resume = plans
        self._step_skips = {split: StepSkips(step_of(state, split, self.world)) for split in plans}

    def close(self) -> None:
        """Return held leases (finished files as consumed) and close the connection."""
        if self._closed:
            return
        self._closed = True
        self._closing = True  # a prefetch still waiting for its file gives up at once
        for stream in self._streams.values():
            try:
                stream.close()
            except errors.BatchQueueError as exc:
                log.warning("closing %s/%s: %s", self.dataset, stream.split, exc)
        if self._helper is not None:
            self._helper.close()  # it returns what it still holds, then exits
        self._stop_renewing.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        self._rpc.close()

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rows_per_file(self) -> int:
        return self.file_batch_size * self._batches_per_file()

    def _batches_per_file(self) -> int:
        nb = self.meta.get("batches_per_file")
        return nb if isinstance(nb, int) and nb > 0 else 0

    # ---- streams ----------------------------------------------------------------------------
    def _check_split(self, split: str) -> None:
        check_split_name(split)
        if split not in self.splits:
            raise errors.UnknownSplit(
                f"dataset {self.dataset!r} has no split {split!r}; it has {self.splits}"
            )

    def _open_stream(self, split: str) -> SplitStream:
        if self._closed:
            raise errors.InvalidRequest("this QueueClient is closed")
        self._check_split(split)
        self._list_skips(split)  # one call as a stream opens
        self._skip_if_due(split, self._step_skips[split])  # a resume inside a skip moves on
        deterministic = self.mode == "deterministic"
        plan = self._resume.pop(split, StreamPlan((), self.world.rank)) if deterministic else None
        schema = split_schema(self.meta, split)
        if self.fetch_process:
            if self._helper is None:
                self._helper = HelperLink(
                    self._helper_kwargs, self._helper_token, on_skips=self._learn_skips
                )
            stream: SplitStream = open_helper_stream(self, self._helper, split, schema, plan)
        else:
            stream = SplitStream(
                self,
                split,
                schema,
                plan=plan,
                seq_stride=self.world.world_size,
                prefetch=self.prefetch_files if self.prefetch else 0,
                timeout_s=self.timeout_s,
                clock=time.monotonic,
                dependence=rows_dependence(self.meta, codec_for(schema), split),
            )
        self._streams[split] = stream
        return stream
