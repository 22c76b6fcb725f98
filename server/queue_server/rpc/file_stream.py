"""FetchFile's sending side: a leased file's bytes as a stream of chunks.

The disk read of chunk k+1 runs in a thread while chunk k is written to the client, so the
network and the disk overlap and the event loop only hands out buffers. Before every chunk the
lease is checked again: a lease that expired or was taken by another client while its file was
streaming ends the stream with the error the holder would get from any other call, instead of
handing out the rest of a file that is no longer theirs.

Memory: a write waits for the client (HTTP/2 flow control), so a stream holds the chunk it
reads ahead, the chunk being written (with gRPC's serialized copies of it) and nothing more,
whatever the file's size: about six chunks, 6 MiB at the default size, also for a client that
never reads. A stream also ends when its lease ends (`ended`, set by rpc/fetch_streams.py) while
it waits on such a client: the file is closed at once and the client, should it ever read
again, gets the chunk gRPC already holds and then NOT_FOUND saying why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

from queue_client import errors
from queue_client.wire import batchqueue_pb2 as pb

# The largest message standard gRPC clients take is 4 MiB (grpcurl, grpc-go, grpc-java and
# Python channels by default); a chunk is one message with a few dozen bytes of fields
# around its data, so 1 MiB less 1 KiB leaves every client far inside it. Measured with
# FileFetcher on a 50 MB file on loopback: 1 MiB chunks 360 MB/s, 4 MiB ones 280 MB/s.
CHUNK_BYTES = (1 << 20) - 1024
# What a client may ask for (FetchFileRequest.max_chunk_bytes): a smaller chunk is sent as
# asked, a larger one as CHUNK_BYTES ("the largest chunk the client takes").
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 16 << 20


def chunk_size(max_chunk_bytes: int) -> int:
    """The chunk size for a request's max_chunk_bytes (0: the default); InvalidRequest names
    the field when it is out of range."""
    if max_chunk_bytes == 0:
        return CHUNK_BYTES
    if not MIN_CHUNK_BYTES <= max_chunk_bytes <= MAX_CHUNK_BYTES:
        raise errors.InvalidRequest(
            f"max_chunk_bytes {max_chunk_bytes} is out of range: 0 (the server's default) or "
            f"{MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES}"
        )
    return min(max_chunk_bytes, CHUNK_BYTES)


async def stream_file(
    path: Path,
    size: int,
    crc32: int,
    where: str,
    write: Callable[[pb.FileChunk], Awaitable[None]],
    still_held: Callable[[], object],
    chunk_bytes: int = CHUNK_BYTES,
    *,
    ended: asyncio.Future[str] | None = None,
    sent: Callable[[int], None] = lambda n: None,
) -> None:
    """Write `path`'s `size` bytes as FileChunks; the first carries size and crc32.

    `still_held` raises (UnknownLease, LeaseConflict) once the lease is no longer the caller's;
    it is called before each chunk. `ended`, once done, holds why the lease ended: the stream
    stops there, also in the middle of a write the client does not take, with UnknownLease.
    `sent(n)` counts the bytes of each chunk written. A file shorter than `size` raises
    CorruptBatchFile."""
    try:
        f = await asyncio.to_thread(path.open, "rb", buffering=0)
    except FileNotFoundError:
        raise errors.CorruptBatchFile(
            f"{where}: {path.name} is gone from the server's disk"
        ) from None
    pending: asyncio.Future[bytes] | None = None
    try:
        offset = 0
        pending = asyncio.ensure_future(asyncio.to_thread(_read, f, min(chunk_bytes, size)))
        while True:
            await _unless_ended(pending, ended, where)
            data = pending.result()
            n = len(data)
            if n < min(chunk_bytes, size - offset):
                raise errors.CorruptBatchFile(
                    f"{where}: {path.name} has {offset + n} bytes, the lease says {size}"
                )
            end = offset + n
            if end < size:  # read ahead while this chunk goes out
                pending = asyncio.ensure_future(
                    asyncio.to_thread(_read, f, min(chunk_bytes, size - end))
                )
            still_held()
            chunk = pb.FileChunk(offset_bytes=offset, data=data)
            del data  # the message holds its own copy: one chunk less while the client waits
            if offset == 0:
                chunk.size_bytes, chunk.crc32 = size, crc32
            writing = asyncio.ensure_future(write(chunk))
            del chunk
            try:
                await _unless_ended(writing, ended, where)
            finally:
                if not writing.done():
                    writing.cancel()  # the lease ended: gRPC keeps only what it already took
                    await asyncio.wait([writing])
            sent(n)
            offset = end
            if offset >= size:
                return
    finally:
        if pending is not None and not pending.done():
            # The read ahead still runs in its thread (the client went away, or the lease was
            # lost): the file is closed when that read ends, never under it.
            try:
                await asyncio.wait([pending])
            except asyncio.CancelledError:
                pending.add_done_callback(lambda _: f.close())
                raise
            if not pending.cancelled():
                pending.exception()  # retrieved: nobody wants this chunk any more
        f.close()


async def _unless_ended(
    step: asyncio.Future[Any], ended: asyncio.Future[str] | None, where: str
) -> None:
    """Wait for `step`; UnknownLease with the reason if the lease ends first."""
    if ended is None:
        await asyncio.wait([step])
    else:
        waited: list[asyncio.Future[Any]] = [step, ended]
        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        if not step.done():
            raise errors.UnknownLease(
                f"{ended.result()} while its {where} file was streaming; the rest of the file "
                "is not sent: acquire it again"
            )
    step.result()  # its error, if it failed


def _read(f: BinaryIO, n: int) -> bytes:
    """Up to `n` bytes; fewer only at the end of the file (an unbuffered read may return
    short, so it loops)."""
    parts = []
    while n > 0:
        data = f.read(n)
        if not data:
            break
        parts.append(data)
        n -= len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)
