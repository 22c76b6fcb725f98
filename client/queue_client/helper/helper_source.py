"""The fetch helper's client: leases, renewals and releases (LeaseMixin, as QueueClient's),
and each leased file opened as numpy arrays, verified, without torch.

The helper only moves bytes: a file's stored tensors, checked against its lease (seq,
batches, size, crc32) and the split's stored names, go into a ring slot as they are; the
trainer's stream checks them against the schema when it views them. So the helper's process
imports no torch, which would cost it most of its memory and of its start. A file of
format 1 or 2 (torch's own format, from an old root) is read with torch after all.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from queue_client import errors
from queue_client.format import batchfile_v3, checksum
from queue_client.format.meta import meta_from_json, split_schema
from queue_client.format.storage import codec_for
from queue_client.streaming.fetch import FileFetcher
from queue_client.streaming.lease_path import leased_file
from queue_client.streaming.lease_retry import fetch_leased
from queue_client.streaming.leasing import LeaseMixin
from queue_client.streaming.stream_api import LeaseRef
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire.rpc import Rpc
from queue_client.world import World


@dataclass
class StoredFile:
    """A leased file's stored tensors, in the split's stored order, each [batches, rows, ...]."""

    ref: LeaseRef
    seq: int
    num_batches: int
    batch_size: int
    arrays: list[np.ndarray]
    keep: Any = None  # what the arrays view (a map), kept open while they are used

    @property
    def rows(self) -> int:
        return self.num_batches * self.batch_size


class HelperSource(LeaseMixin):
    """A lease client for one dataset and rank (the trainer's), without torch."""

    def __init__(
        self,
        *,
        address: str,
        dataset: str,
        rank: int,
        world_size: int,
        data_root: str,
        timeout_s: float,
        reconnect_timeout_s: float,
        verify_checksums: bool,
        transport: str,
        tls_ca_file: str | None,
        max_fetch_bytes: int,
    ) -> None:
        self.address = address
        self.dataset = dataset
        self.world = World(rank, world_size)
        self.timeout_s = timeout_s
        self.verify_checksums = verify_checksums
        self.transport = transport
        self.data_root = Path(data_root)
        self.client_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._rpc = Rpc(
            address, reconnect_timeout_s=reconnect_timeout_s, tls_ca_file=tls_ca_file
        )  # the token: $BATCHQUEUE_TOKEN, set by the trainer for this process
        try:
            self._fetcher = FileFetcher(
                self._rpc, self.client_id, max_bytes=max_fetch_bytes, timeout_s=timeout_s
            )
            reply = self._rpc.call(
                "GetMeta", pb.GetMetaRequest(dataset=dataset), timeout_s=timeout_s
            )
        except BaseException:
            self._rpc.close()
            raise
        self.meta: dict[str, Any] = meta_from_json(reply.meta_json)
        self.mode = reply.mode
        self.batch_size = int(reply.batch_size)
        unit = self.meta.get("batch_size")
        self.file_batch_size = unit if isinstance(unit, int) and unit > 0 else self.batch_size
        self._lease_ttl_s = max(reply.lease_ttl_ms / 1000, 0.1)
        self._closing = False
        self._held: dict[int, LeaseRef] = {}
        self._held_lock = threading.Lock()
        self._stop_renewing = threading.Event()
        self._renewer: threading.Thread | None = None
        self._stored_names: dict[str, tuple[str, ...]] = {}
        # Per split, the skipped steps the latest lease reply gave (the helper passes them on).
        self.skips: dict[str, tuple[tuple[int, int], ...]] = {}

    def _note_skips(self, split: str, skips: Sequence[pb.StepRange]) -> None:
        self.skips[split] = tuple((int(r.from_step), int(r.to_step)) for r in skips)

    def stored_names(self, split: str) -> tuple[str, ...]:
        names = self._stored_names.get(split)
        if names is None:
            names = self._stored_names[split] = codec_for(
                split_schema(self.meta, split)
            ).stored_names
        return names

    def load(self, split: str, seq: int | None, carried: bool, deadline: float) -> StoredFile:
        """Lease `seq` (the rank's next for None) and open it, verified; a corrupt file is
        released as such and leased anew (lease_retry.py)."""
        return fetch_leased(
            self, split, seq, carried, deadline, lambda lease, ref: self._open(split, lease, ref)
        )

    def _open(self, split: str, lease: pb.Lease, ref: LeaseRef) -> StoredFile:
        if self.transport == "grpc":
            where = f"{lease.path} (streamed)"
            buf: Any = self.fetch_file(ref, lease)  # checked against size and crc32
        else:
            where, buf = self._map(lease)
        if not batchfile_v3.has_magic(bytes(buf[: len(batchfile_v3.MAGIC)])):
            return self._open_old_format(split, lease, ref)
        layout = batchfile_v3.parse(buf, where, batchfile_v3.VERSION)
        meta = layout.metadata
        if meta.get("seq") != lease.seq or meta.get("num_batches") != lease.num_batches:
            raise errors.CorruptBatchFile(
                f"{where} says seq {meta.get('seq')} with {meta.get('num_batches')} batches; "
                f"the lease says seq {lease.seq} with {lease.num_batches}"
            )
        try:
            stored = batchfile_v3.arrays(buf, layout)
        except ValueError as exc:
            raise errors.SchemaMismatch(f"{where}: {exc}") from None
        return self._checked(split, lease, ref, stored, where, buf)

    def _checked(
        self, split: str, lease: pb.Lease, ref: LeaseRef, stored: dict[str, Any], where: str,
        keep: Any,
    ) -> StoredFile:  # fmt: skip
        names = self.stored_names(split)
        if set(stored) != set(names):
            raise errors.SchemaMismatch(
                f"{where} stores {sorted(stored)}; the schema of {self.dataset}/{split} stores "
                f"{sorted(names)}"
            )
        lead = (lease.num_batches, lease.batch_size)
        for name in names:
            if tuple(stored[name].shape[:2]) != lead:
                raise errors.InvalidRequest(
                    f"{where}: stored tensor {name!r} of shape {tuple(stored[name].shape)} is "
                    f"not per row of the file's {lead[0]} x {lead[1]}: fetch_process serves "
                    "datasets whose stored tensors are all per row"
                )
        arrays = [stored[n] for n in names]
        return StoredFile(ref, lease.seq, lease.num_batches, lease.batch_size, arrays, keep)

    def _map(self, lease: pb.Lease) -> tuple[str, mmap.mmap]:
        """The leased file under the data root, mapped and verified (size, crc32)."""
        path = leased_file(self.data_root, self.dataset, lease)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise errors.CorruptBatchFile(f"{path} is missing from the data root") from None
        except (OSError, ValueError) as exc:
            raise errors.CorruptBatchFile(f"{path}: cannot be read: {exc}") from None
        if self.verify_checksums:
            found = checksum.crc32(mm)
            if found != lease.crc32:
                raise errors.CorruptBatchFile(
                    f"{path} has crc32 {found:#010x}, the server wrote {lease.crc32:#010x}"
                )
        return str(path), mm

    def _open_old_format(self, split: str, lease: pb.Lease, ref: LeaseRef) -> StoredFile:
        """A file of format 1 or 2: read by the client's own loader (torch), as numpy."""
        from queue_client.format.schema import FieldSpec
        from queue_client.streaming.leased_file import open_leased

        schema = split_schema(self.meta, split)
        plain = codec_for(tuple(FieldSpec(f.name, f.dtype, f.shape) for f in schema))
        loaded = open_leased(self, codec_for(schema), plain, lease, ref)
        stored = dict(zip(loaded.codec.stored_names, loaded.stored, strict=True))
        arrays = {n: t.contiguous().numpy() for n, t in stored.items()}
        return self._checked(split, lease, ref, arrays, str(lease.path), loaded)

    def stop_waiting(self) -> None:
        """Fetches still waiting for a file give up at once; leases held stay renewed until
        close() (the helper returns them first)."""
        self._closing = True

    def close(self) -> None:
        self.stop_waiting()
        self._stop_renewing.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        self._rpc.close()
