"""FetchFile's sending side (queue_server.rpc.file_stream) on real files: chunks in order with the
size and crc32 up front, the lease checked before every chunk, short files reported."""

from __future__ import annotations

import asyncio
import os
import zlib
from pathlib import Path

import pytest

from queue_client import errors
from queue_client.wire import batchqueue_pb2 as pb
from queue_server.rpc.file_stream import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    chunk_size,
    stream_file,
)


def _file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = os.urandom(size)
    path = tmp_path / "f.pt"
    path.write_bytes(data)
    return path, data


def _stream(path: Path, size: int, crc: int, still_held=lambda: None) -> list[pb.FileChunk]:
    sent: list[pb.FileChunk] = []

    async def write(chunk: pb.FileChunk) -> None:
        sent.append(chunk)

    asyncio.run(stream_file(path, size, crc, "ds/train", write, still_held))
    return sent


@pytest.mark.parametrize("size", [0, 1, CHUNK_BYTES, 2 * CHUNK_BYTES + 17])
def test_chunks_join_to_the_file_with_size_and_crc_first(tmp_path: Path, size: int) -> None:
    path, data = _file(tmp_path, size)
    chunks = _stream(path, size, zlib.crc32(data))
    assert b"".join(c.data for c in chunks) == data
    assert (chunks[0].size_bytes, chunks[0].crc32) == (size, zlib.crc32(data))
    assert all(c.size_bytes == 0 for c in chunks[1:])
    offsets = [c.offset_bytes for c in chunks]
    assert offsets == [i * CHUNK_BYTES for i in range(len(chunks))]
    assert all(len(c.data) <= CHUNK_BYTES for c in chunks)


def test_a_lease_lost_mid_stream_ends_it_before_the_next_chunk(tmp_path: Path) -> None:
    size = 3 * CHUNK_BYTES
    path, data = _file(tmp_path, size)
    checks = 0

    def still_held() -> None:
        nonlocal checks
        checks += 1
        if checks > 1:
            raise errors.UnknownLease("lease 'l' of ds/train is not held (expired)")

    with pytest.raises(errors.UnknownLease, match="not held"):
        _stream(path, size, zlib.crc32(data), still_held)
    assert checks == 2


def test_a_file_shorter_than_its_lease_is_reported(tmp_path: Path) -> None:
    path, data = _file(tmp_path, CHUNK_BYTES + 10)
    with pytest.raises(errors.CorruptBatchFile, match=r"has \d+ bytes, the lease says"):
        _stream(path, CHUNK_BYTES + 20, zlib.crc32(data))


def test_a_file_gone_from_disk_is_reported_by_name(tmp_path: Path) -> None:
    with pytest.raises(errors.CorruptBatchFile, match=r"gone\.pt is gone"):
        _stream(tmp_path / "gone.pt", 10, 0)


def test_the_file_is_closed_after_a_client_goes_away(tmp_path: Path) -> None:
    """A write that fails (the client went away) leaves no open file behind, even with a
    read ahead still in its thread."""
    size = 3 * CHUNK_BYTES
    path, data = _file(tmp_path, size)

    async def write(chunk: pb.FileChunk) -> None:
        raise ConnectionResetError("client gone")

    def open_fds() -> int:
        return sum(1 for fd in os.listdir("/proc/self/fd") if _points_to(fd, path))

    async def run() -> None:
        with pytest.raises(ConnectionResetError):
            await stream_file(path, size, zlib.crc32(data), "ds/train", write, lambda: None)

    asyncio.run(run())
    assert not [fd for fd in os.listdir("/proc/self/fd") if _points_to(fd, path)]


def _points_to(fd: str, path: Path) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == str(path)
    except OSError:
        return False


def test_the_default_chunk_fits_standard_clients_and_bigger_asks_are_capped() -> None:
    """A whole first chunk (every field at its widest) is at most 1 MiB on the wire, far
    inside the 4 MiB that grpcurl and gRPC's default channels take; a client asking for more
    gets the default, one asking for less gets what it asked."""
    widest = pb.FileChunk(
        offset_bytes=2**62, data=b"x" * CHUNK_BYTES, size_bytes=2**62, crc32=2**32 - 1
    )
    assert widest.ByteSize() <= 1 << 20
    assert chunk_size(0) == chunk_size(MAX_CHUNK_BYTES) == CHUNK_BYTES
    assert chunk_size(MIN_CHUNK_BYTES) == MIN_CHUNK_BYTES


def test_a_lease_that_ends_during_a_write_nobody_takes_ends_the_stream(tmp_path: Path) -> None:
    """The client never reads, so the write never completes: the lease's end still ends the
    stream, with UnknownLease saying why, and the file is closed."""
    size = 3 * CHUNK_BYTES
    path, data = _file(tmp_path, size)
    counted: list[int] = []

    async def run() -> None:
        ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        blocked = asyncio.Event()

        async def write(chunk: pb.FileChunk) -> None:
            blocked.set()
            await asyncio.Event().wait()  # a client that never takes it

        streaming = asyncio.ensure_future(
            stream_file(
                path,
                size,
                zlib.crc32(data),
                "ds/train",
                write,
                lambda: None,
                ended=ended,
                sent=counted.append,
            )
        )
        await blocked.wait()
        assert [fd for fd in os.listdir("/proc/self/fd") if _points_to(fd, path)]
        ended.set_result("lease 'l' expired (not renewed within lease_ttl_s = 2 s)")
        with pytest.raises(errors.UnknownLease, match=r"lease 'l' expired .* while its ds/train"):
            await streaming

    asyncio.run(run())
    assert counted == []  # nothing was taken
    assert not [fd for fd in os.listdir("/proc/self/fd") if _points_to(fd, path)]
