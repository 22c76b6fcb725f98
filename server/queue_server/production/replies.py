"""The worker protocol's reply to a produce, shared by provider workers and the composer."""

from __future__ import annotations

from typing import Any

from queue_client.format.batchfile import PublishedFile


def produced_reply(
    seq: int, published: PublishedFile, before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    """What the split's production journals: the file, and the stream state before and after."""
    return {
        "ok": True,
        "seq": seq,
        "name": str(published.name),
        "bytes": published.size_bytes,
        "crc": published.crc32,
        "before": before,
        "after": after,
    }
