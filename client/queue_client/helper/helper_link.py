"""The trainer's end of the fetch helper (fetch_helper.py): starting it, talking to it, and
the rings of shared memory it fills, mapped once.

Nothing here runs in a thread of its own: the trainer's thread sends a request (one `send`)
and reads what has arrived when a stream needs a file (one `recv` per batch of messages), so
no other Python in the trainer's process ever wants the GIL between two get_batch calls.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from queue_client import errors
from queue_client.format.schema import torch_dtype
from queue_client.helper import helper_wire as wire

# How long the helper may take to start (a fresh interpreter importing torch and gRPC, and
# its client's GetMeta) on a loaded machine.
START_TIMEOUT_S = 120.0
_ERRORS: dict[str, type[errors.BatchQueueError]] = {
    name: cls
    for name, cls in vars(errors).items()
    if isinstance(cls, type) and issubclass(cls, errors.BatchQueueError)
}


@dataclass
class SlotFile:
    """A file the helper put in a slot: where its stored tensors are, and its lease."""

    split: str
    slot: int
    seq: int
    num_batches: int
    batch_size: int
    lease_id: str
    stored: list[torch.Tensor]
    layout: int  # the id of where its fields lie in a slot (the same for files alike)


@dataclass
class _Ring:
    slots: int
    slot_bytes: int
    map: mmap.mmap
    base: torch.Tensor  # the whole ring as bytes
    # Views made once per (slot, fields as the helper sent them): a file of the usual shape
    # costs no torch call at all when its slot comes round again.
    views: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    layouts: dict[int, list[list[Any]]] = field(default_factory=dict)  # id -> fields


class HelperLink:
    """One helper process for one QueueClient, for all its splits."""

    def __init__(
        self,
        client_kwargs: dict[str, Any],
        token: str | None,
        on_skips: Callable[[str, Sequence[tuple[int, int]]], None] = lambda split, ranges: None,
    ) -> None:
        if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
            raise errors.InvalidRequest(
                "fetch_process=True needs Linux (memfd_create and passing file descriptors "
                "over a unix socket); this platform has neither"
            )
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        if token is not None:
            env["BATCHQUEUE_TOKEN"] = token  # the environment, never the command line
        package_parent = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_parent, env.get("PYTHONPATH", "")) if p
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "queue_client.helper.fetch_helper", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # the trainer's stdout stays the trainer's (its logs: stderr)
        )
        theirs.close()
        ours.setblocking(False)  # reads never block unless asked to wait (select)
        self.sock = ours
        self._outbox: list[bytes] = []
        self._split_index: dict[str, int] = {}
        self._split_name: dict[int, str] = {}
        self._buf = bytearray()
        self._fds: deque[int] = deque()
        self.rings: dict[str, _Ring] = {}
        self.ring_slots: dict[str, int] = {}  # per split, the slots its streams use
        # Per split: messages about slots not asked for yet ("ready"/"error" by slot).
        self._arrived: dict[tuple[str, int], Any] = {}
        self.on_skips = on_skips  # a split's skipped steps, as the helper's leases give them
        self.closed = False
        try:
            self.send(wire.json_frame({"op": "start", "client": client_kwargs}))
            started = self._next_message(time.monotonic() + START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        if started.get("op") != "started":
            self.close()
            raise _error(started, "the fetch helper could not start")
        self.client_id = str(started.get("client_id", ""))

    # ---- requests -------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        """Queue a frame; it goes with the next flush (every wait and read flushes first), so
        the requests of one file switch cost one write."""
        if self.closed:
            raise errors.InvalidRequest("the fetch helper of this QueueClient was closed")
        self._outbox.append(data)

    def flush(self) -> None:
        if not self._outbox or self.closed:
            return
        data = b"".join(self._outbox)
        self._outbox.clear()
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[self.sock.send(view) :]
                except BlockingIOError:  # the helper reads slower than this writes: wait
                    select.select([], [self.sock], [], 1.0)
        except OSError as exc:
            raise self._gone(f"sending to it failed: {exc}") from None

    def _index(self, split: str) -> int:
        index = self._split_index.get(split)
        if index is None:
            index = self._split_index[split] = len(self._split_index)
            self._split_name[index] = split
            self.send(wire.json_frame({"op": "split", "split": split, "index": index}))
        return index

    def fetch(self, split: str, slot: int, slots: int, seq: int | None, carried: bool) -> None:
        self.send(wire.fetch_frame(self._index(split), slot, slots, seq, carried))

    def done(self, split: str, slot: int, consumed: bool, waited_s: float = 0.0) -> None:
        self.send(wire.done_frame(self._index(split), slot, consumed, waited_s))

    # ---- answers --------------------------------------------------------------------------
    def arrived(self, split: str, slot: int) -> bool:
        """Has the answer for `slot` come (reads what is waiting, never blocks)?"""
        if (split, slot) not in self._arrived and not self.closed:
            self.flush()
            self._drain(0.0)
        return (split, slot) in self._arrived

    def wait(self, split: str, slot: int, deadline: float) -> SlotFile:
        """The file in `slot` once the helper says so; its error, raised, if it failed."""
        key = (split, slot)
        self.flush()
        while key not in self._arrived:
            if self.closed:
                raise errors.InvalidRequest("the fetch helper of this QueueClient was closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.NoBatchReady(
                    f"the fetch helper gave no file for {split} slot {slot} in time"
                )
            self._drain(remaining)
        msg = self._arrived.pop(key)
        if isinstance(msg, dict):
            raise _error(msg, f"{split}: the fetch helper could not fetch a file")
        seq, batches, rows, layout, lease_id = msg
        stored = self.views(split, slot, layout)
        return SlotFile(split, slot, seq, batches, rows, lease_id, stored, layout)

    def forget(self, split: str, slot: int) -> None:
        self._arrived.pop((split, slot), None)

    def views(self, split: str, slot: int, layout: int) -> list[torch.Tensor]:
        """The tensors of `slot` laid out as `layout` says: made once, then the same ones."""
        ring = self.rings[split]
        key = (slot, layout)
        views = ring.views.get(key)
        if views is None:
            views = []
            for _name, dtype, shape, offset in ring.layouts[layout]:
                dt = torch_dtype(dtype)
                start = slot * ring.slot_bytes + int(offset)
                nbytes = dt.itemsize * _numel(shape)
                views.append(ring.base[start : start + nbytes].view(dt).view(shape))
            if len(ring.views) >= 4 * ring.slots:
                ring.views.clear()
            ring.views[key] = views
        return views

    def _drain(self, timeout_s: float) -> None:
        """Read what the helper sent, waiting up to timeout_s for the first bytes."""
        try:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
            except BlockingIOError:
                if timeout_s <= 0 or not select.select([self.sock], [], [], timeout_s)[0]:
                    return
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
        except BlockingIOError:
            return
        except OSError as exc:
            raise self._gone(f"reading from it failed: {exc}") from None
        self._fds.extend(fds)
        if not data:
            raise self._gone("it closed the link")
        self._buf += data
        for payload in wire.take_frames(self._buf):
            self._take(*wire.parse(payload))

    def _take(self, kind: str, msg: Any) -> None:
        if kind == "R":
            index, slot, *rest = msg
            self._arrived[(self._split_name[index], slot)] = tuple(rest)
            return
        op = msg.get("op")
        split = self._split_name.get(int(msg.get("split", -1)), "")
        if op == "ring":
            fd = self._fds.popleft()
            size = int(msg["slots"]) * int(msg["slot_bytes"])
            # Every page mapped now, once: no get_batch ever faults on a slot.
            populate = getattr(mmap, "MAP_POPULATE", 0)
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
            os.close(fd)
            base = torch.frombuffer(m, dtype=torch.uint8)
            self.rings[split] = _Ring(int(msg["slots"]), int(msg["slot_bytes"]), m, base)
        elif op == "layout":
            self.rings[split].layouts[int(msg["id"])] = msg["fields"]
        elif op == "skips":  # sent before the file whose lease reply told of them
            self.on_skips(split, [(int(a), int(b)) for a, b in msg["ranges"]])
        elif op == "error" and int(msg.get("slot", -1)) >= 0:
            self._arrived[(split, int(msg["slot"]))] = msg
        else:
            self._arrived[("", -1)] = msg  # "started", or an error before it

    def _next_message(self, deadline: float) -> dict[str, Any]:
        self.flush()
        while ("", -1) not in self._arrived:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.ServerUnavailable(
                    f"the fetch helper did not start within {START_TIMEOUT_S:g}s"
                )
            self._drain(remaining)
        return self._arrived.pop(("", -1))

    def _gone(self, why: str) -> errors.BatchQueueError:
        code = self.proc.poll()
        self.closed = True
        state = f"exited with {code}" if code is not None else "is still running"
        return errors.ServerUnavailable(f"the fetch helper (pid {self.proc.pid}, {state}): {why}")

    def close(self, timeout_s: float = 30.0) -> None:
        """Close the link: the helper returns what it still holds and exits (killed if it
        has not after timeout_s). Idempotent; also for a helper that is gone already."""
        if self.sock.fileno() < 0:
            return
        try:
            self.flush()  # the last releases
        except errors.BatchQueueError:
            pass
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()
        # The rings' memory goes once nothing views it (no batch ever does: helper_stream.py).
        self.rings.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def helper_client_kwargs(
    client: Any, reconnect_timeout_s: float, tls_ca_file: str | Path | None, max_fetch_bytes: int
) -> dict[str, Any]:
    """The keyword arguments of the helper's own QueueClient: `client`'s dataset, rank, data
    root and resolved transport (its token goes by the helper's environment, not here)."""
    return {
        "address": client.address,
        "dataset": client.dataset,
        "rank": client.world.rank,
        "world_size": client.world.world_size,
        "data_root": str(client.data_root),
        "timeout_s": client.timeout_s,
        "reconnect_timeout_s": reconnect_timeout_s,
        "prefetch": False,
        "verify_checksums": client.verify_checksums,
        "transport": client.transport,
        "tls_ca_file": None if tls_ca_file is None else str(tls_ca_file),
        "max_fetch_bytes": max_fetch_bytes,
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _error(msg: dict[str, Any], context: str) -> errors.BatchQueueError:
    cls = _ERRORS.get(str(msg.get("kind")), errors.BatchQueueError)
    return cls(f"{context}: {msg.get('kind')}: {msg.get('message')}")
