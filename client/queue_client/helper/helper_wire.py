"""The frames between a trainer and its fetch helper (helper_link.py, fetch_helper.py).

Each frame is a 4-byte little-endian length and a payload whose first byte says what it is.
The ones of every file switch are fixed binary records (packing a JSON object costs the
trainer's thread more than the rest of a switch); the rare ones (start, a split's index, a
ring, a layout, an error) are JSON:

    J  JSON object, with "op"
    F  fetch:  split index, slot, slots, seq (-1: the rank's next), carried
    D  done:   split index, slot, consumed (1) or returned (0), seconds the trainer waited
    R  ready:  split index, slot, seq, batches, rows per batch, layout id, then the lease id
"""

from __future__ import annotations

import json
import struct
from typing import Any

_LEN = struct.Struct("<I")
_FETCH = struct.Struct("<cBHHqB")
_DONE = struct.Struct("<cBHBd")
_READY = struct.Struct("<cBHqqqI")
MAX_FRAME = 1 << 20  # a JSON error message is the largest frame


def frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


def json_frame(msg: dict[str, Any]) -> bytes:
    return frame(b"J" + json.dumps(msg, separators=(",", ":")).encode())


def fetch_frame(split: int, slot: int, slots: int, seq: int | None, carried: bool) -> bytes:
    return frame(_FETCH.pack(b"F", split, slot, slots, -1 if seq is None else seq, carried))


def done_frame(split: int, slot: int, consumed: bool, waited_s: float) -> bytes:
    return frame(_DONE.pack(b"D", split, slot, consumed, waited_s))


def ready_frame(
    split: int, slot: int, seq: int, batches: int, rows: int, layout: int, lease_id: str
) -> bytes:
    return frame(_READY.pack(b"R", split, slot, seq, batches, rows, layout) + lease_id.encode())


def parse(payload: bytes) -> tuple[str, Any]:
    """(kind, fields): ("J", dict), ("F", (split, slot, slots, seq | None, carried)),
    ("D", (split, slot, consumed, waited_s)), ("R", (split, slot, seq, batches, rows, layout,
    lease_id))."""
    kind = payload[:1]
    if kind == b"R":
        _, split, slot, seq, batches, rows, layout = _READY.unpack_from(payload)
        return "R", (split, slot, seq, batches, rows, layout, payload[_READY.size :].decode())
    if kind == b"F":
        _, split, slot, slots, seq, carried = _FETCH.unpack(payload)
        return "F", (split, slot, slots, None if seq < 0 else seq, bool(carried))
    if kind == b"D":
        _, split, slot, consumed, waited_s = _DONE.unpack(payload)
        return "D", (split, slot, bool(consumed), waited_s)
    if kind == b"J":
        msg = json.loads(payload[1:])
        if not isinstance(msg, dict):
            raise ValueError("a JSON frame that is not an object")
        return "J", msg
    raise ValueError(f"a frame of unknown kind {kind!r}")


def take_frames(buf: bytearray) -> list[bytes]:
    """The whole frames at the start of `buf`, removed from it."""
    out = []
    at = 0
    while len(buf) - at >= _LEN.size:
        (n,) = _LEN.unpack_from(buf, at)
        if n > MAX_FRAME:
            raise ValueError(f"a frame of {n} bytes, more than {MAX_FRAME}")
        if len(buf) - at - _LEN.size < n:
            break
        out.append(bytes(buf[at + _LEN.size : at + _LEN.size + n]))
        at += _LEN.size + n
    del buf[:at]
    return out


def read_frame(reader: Any) -> bytes | None:
    """The next frame from a blocking binary file (the helper's side); None at its end."""
    head = reader.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes, more than {MAX_FRAME}")
    payload = reader.read(n)
    return payload if len(payload) == n else None
