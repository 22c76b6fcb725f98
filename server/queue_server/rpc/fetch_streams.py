"""The FetchFile streams open in the server: a cap on how many, each one ended with its lease.

Why: a stream holds memory and an open file until it ends, and a client that opens streams
and never reads would hold them for as long as its connection lives. So the server counts
the streams open at once against `server.max_fetch_streams` (one more is ServerBusy,
RESOURCE_EXHAUSTED, naming the cap), and every lease that ends (released, expired, taken
over; the LeaseDirectory tells `lease_ended`) ends the streams of its file, whether their
client reads or not. A slot is given back when the call is over for gRPC, not when the
handler stops reading the file: until then gRPC may still hold a chunk of it for the client.

It also keeps the counts /metrics shows: bytes streamed per split, streams open, refused.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from queue_client import errors


@dataclass(eq=False)
class FetchStream:
    """One open stream: `ended` is done, with why, once its lease ends."""

    lease_id: str
    split: tuple[str, str]  # (dataset, split)
    ended: asyncio.Future[str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class FetchStreams:
    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self._by_lease: dict[str, list[FetchStream]] = {}
        self.open_streams = 0
        self.refused = 0
        # (dataset, split) -> bytes of FileChunk data written to clients.
        self.bytes_sent: dict[tuple[str, str], int] = {}

    def open(self, lease_id: str, dataset: str, split: str) -> FetchStream:
        """A slot for a stream of this lease's file; ServerBusy when every slot is taken."""
        if self.open_streams >= self.max_streams:
            self.refused += 1
            raise errors.ServerBusy(
                f"{self.open_streams} FetchFile streams are open, the most this server allows "
                f"at once (server.max_fetch_streams = {self.max_streams}); retry after a "
                "backoff, or raise server.max_fetch_streams"
            )
        stream = FetchStream(lease_id, (dataset, split))
        self._by_lease.setdefault(lease_id, []).append(stream)
        self.open_streams += 1
        self.bytes_sent.setdefault(stream.split, 0)
        return stream

    def close(self, stream: FetchStream) -> None:
        """Give the stream's slot back (once the call is over)."""
        streams = self._by_lease.get(stream.lease_id, [])
        if stream not in streams:
            return
        streams.remove(stream)
        if not streams:
            del self._by_lease[stream.lease_id]
        self.open_streams -= 1
        if not stream.ended.done():
            stream.ended.cancel()

    def sent(self, stream: FetchStream, n: int) -> None:
        self.bytes_sent[stream.split] = self.bytes_sent.get(stream.split, 0) + n

    def lease_ended(self, lease_id: str, why: str) -> None:
        """End every stream of this lease: `why` is what its client is told."""
        for stream in self._by_lease.get(lease_id, ()):
            if not stream.ended.done():
                stream.ended.set_result(f"lease {lease_id!r} {why}")
