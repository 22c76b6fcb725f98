"""A stream's next file: leased, opened (mapped from the data root, or streamed over gRPC)
and checked against its lease and the schema's stored layout, with the retries a corrupt or
lost file gets."""

from __future__ import annotations

from queue_client import errors
from queue_client.format.batchfile import load_batch_bytes
from queue_client.format.storage import BatchCodec
from queue_client.streaming.file_map import map_leased, prefault
from queue_client.streaming.lease_retry import CORRUPT_RETRIES, fetch_leased  # noqa: F401  (re-exported)
from queue_client.streaming.rows import LoadedFile
from queue_client.streaming.stream_api import LeaseRef, LeaseSource
from queue_client.wire import batchqueue_pb2 as pb


def open_leased(
    source: LeaseSource, codec: BatchCodec, plain_codec: BatchCodec, lease: pb.Lease, ref: LeaseRef
) -> LoadedFile:
    """The leased file's rows, checked against the lease (seq, batches) and the codec of its
    format (`plain_codec` for format 1 files, which store the served fields themselves)."""
    streamed = source.transport == "grpc"
    if streamed:
        where = f"{lease.path} (streamed)"
        batch_file = load_batch_bytes(source.fetch_file(ref, lease), where)
    else:
        where, batch_file = map_leased(
            source.data_root, source.dataset, source.verify_checksums, lease
        )
    meta = batch_file.metadata
    if meta.get("seq") != lease.seq or meta.get("num_batches") != lease.num_batches:
        raise errors.CorruptBatchFile(
            f"{where} says seq {meta.get('seq')} with {meta.get('num_batches')} batches; the "
            f"lease says seq {lease.seq} with {lease.num_batches}"
        )
    if batch_file.version < 2:
        codec = plain_codec
    try:
        codec.check_stored(batch_file.stored, (lease.num_batches, lease.batch_size))
    except errors.SchemaMismatch as exc:
        raise errors.SchemaMismatch(f"{where}: {exc}") from None
    tensors = [batch_file.stored[name] for name in codec.stored_names]
    # Streamed tensors were just written, and a verified file's map was read by its hash:
    # either way their pages are mapped already.
    if not streamed and not source.verify_checksums:
        prefault(tensors)
    return LoadedFile(ref, lease.seq, lease.num_batches, lease.batch_size, codec, tensors)
