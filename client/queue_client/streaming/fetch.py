"""Batch files over the network, for a trainer that cannot see the server's data root.

FetchFile streams a leased file in chunks; the client joins them in memory, checks size and
crc32 against the lease, and loads the bytes with the same safe loader as a file on disk
(`batchfile.load_batch_bytes`: nothing in them can run code). The prefetch thread does this
one file ahead, where a file on disk would be mapped and verified, so get_batch in steady
state still makes no RPC.

Memory: a file's bytes live only while it loads; its tensors are copies and stay instead. A
split holds the file being read and the prefetched one, so a client holds at most two files
of tensors per split, and one file's bytes more while the next one loads. `max_bytes`
refuses a bigger file before anything is allocated.

A server at its cap of open streams (server.max_fetch_streams) answers ServerBusy; the fetch
is tried again with a capped exponential backoff until timeout_s has passed.

Which transport: "auto" reads files when the client's data_root holds the root id that the
server publishes in GetMeta (the very same directory: a path alone may name another disk on
another host), and streams them otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from pathlib import Path

from queue_client.errors import CorruptBatchFile, InvalidRequest, ServerBusy
from queue_client.format import checksum
from queue_client.format.layout import root_id_file
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire.rpc import Rpc

# Retry jitter from a generator of our own: a trainer's seeded global `random` is never
# drawn from by the client's background threads.
_JITTER = random.Random()

log = logging.getLogger("queue_client")

TRANSPORTS = ("auto", "file", "grpc")
# A file that fails its checksum is fetched once more (the fault may have been in transit);
# a second failure is reported, and the caller releases the lease as CORRUPT.
CHECKSUM_ATTEMPTS = 2
# Backoff between fetches refused for the server's stream cap: first and longest, seconds.
_BUSY_BACKOFF_S = (0.05, 2.0)


def check_transport(transport: str) -> str:
    if transport not in TRANSPORTS:
        raise InvalidRequest(f"transport {transport!r} is not one of {TRANSPORTS}")
    return transport


def read_root_id(root: Path) -> str:
    """The id in `root`'s root id file; "" when this process cannot read one there."""
    try:
        return root_id_file(root).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def choose_transport(transport: str, data_root: Path, server_root_id: str) -> str:
    """The transport to use, "file" or "grpc", for the one asked; "auto" means "file"
    when `data_root` is the server's own data root (it holds the id the server published)."""
    if check_transport(transport) != "auto":
        return transport
    if not server_root_id:
        return "file"  # a server without FetchFile publishes no id: files are the only way
    return "file" if read_root_id(data_root) == server_root_id else "grpc"


class FileFetcher:
    """Streams leased files of one client into memory, verified."""

    def __init__(
        self,
        rpc: Rpc,
        client_id: str,
        *,
        max_bytes: int,
        timeout_s: float,
        chunk_bytes: int = 0,
    ) -> None:
        """chunk_bytes: the largest chunk to take (0: the server's default)."""
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise InvalidRequest(f"max_fetch_bytes {max_bytes!r} must be an integer >= 1")
        self.chunk_bytes = chunk_bytes
        self._rpc = rpc
        self.client_id = client_id
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def fetch(self, lease_id: str, size_bytes: int, crc32: int, where: str) -> bytes:
        """The bytes of the file that lease `lease_id` holds, checked against the lease's size
        and crc32. Raises CorruptBatchFile after CHECKSUM_ATTEMPTS failed fetches."""
        if size_bytes > self.max_bytes:
            raise InvalidRequest(
                f"{where} has {size_bytes} bytes, more than max_fetch_bytes={self.max_bytes}: "
                "raise QueueClient(max_fetch_bytes=...) or make files smaller (batches_per_file)"
            )
        for attempt in range(1, CHECKSUM_ATTEMPTS + 1):
            try:
                return self._fetch_when_free(lease_id, size_bytes, crc32, where)
            except CorruptBatchFile as exc:
                if attempt == CHECKSUM_ATTEMPTS:
                    raise CorruptBatchFile(f"{exc} (fetched {attempt} times)") from None
                log.warning("%s; fetching it again", exc)
        raise AssertionError("unreachable")

    def _fetch_when_free(self, lease_id: str, size_bytes: int, crc32: int, where: str) -> bytes:
        """_fetch_once, again after a backoff while the server refuses it as busy."""
        deadline = time.monotonic() + self.timeout_s
        delay = _BUSY_BACKOFF_S[0]
        while True:
            try:
                return self._fetch_once(lease_id, size_bytes, crc32, where)
            except ServerBusy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                # Backoff, not synchronisation: the server offers nothing to wait on.
                time.sleep(min(remaining, delay * (0.5 + _JITTER.random())))
                delay = min(delay * 2, _BUSY_BACKOFF_S[1])

    def _fetch_once(self, lease_id: str, size_bytes: int, crc32: int, where: str) -> bytes:
        request = pb.FetchFileRequest(
            lease_id=lease_id, client_id=self.client_id, max_chunk_bytes=self.chunk_bytes
        )
        parts: list[bytes] = []
        received = 0
        crc = 0  # running: each chunk is checked while gRPC's threads receive the next
        stream = self._rpc.stream("FetchFile", request, timeout_s=self.timeout_s)
        with contextlib.closing(stream):
            for chunk in stream:
                data = chunk.data  # each read of a bytes field copies it: read it once
                if not parts and (chunk.size_bytes, chunk.crc32) != (size_bytes, crc32):
                    raise CorruptBatchFile(
                        f"{where}: the server streams {chunk.size_bytes} bytes with crc32 "
                        f"{chunk.crc32:#010x}; the lease says {size_bytes} with {crc32:#010x}"
                    )
                n = len(data)
                if chunk.offset_bytes != received or received + n > size_bytes:
                    raise CorruptBatchFile(
                        f"{where}: a chunk of {n} bytes at offset {chunk.offset_bytes} does not "
                        f"follow the {received} of {size_bytes} bytes received"
                    )
                parts.append(data)
                crc = checksum.crc32(data, crc)
                received += n
        if received != size_bytes:
            raise CorruptBatchFile(
                f"{where}: the stream ended after {received} of {size_bytes} bytes"
            )
        if crc != crc32:
            raise CorruptBatchFile(
                f"{where}: the fetched bytes have crc32 {crc:#010x}, the server wrote {crc32:#010x}"
            )
        return parts[0] if len(parts) == 1 else b"".join(parts)
