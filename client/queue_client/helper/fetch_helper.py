"""The fetch helper: a process that leases, verifies and copies a trainer's files into shared
memory, so that the trainer's own process does no work per file (QueueClient(fetch_process=True)).

Why a process: in a trainer's process, any per-file Python beside the trainer's thread (the
lease call, the file's map, layout and views, its release) takes the GIL and, on a busy
machine, a core at the moments the trainer wants them; measured, that alone keeps the p99 of
get_batch over 0.1 ms in about half the loops of a tight loop on 2 cores, while the same loop
with no loader work in its process meets it in every loop, busy processes beside it or not
(BENCHMARKS.md). Here a helper process runs a lease client of its own (helper_source.py:
the same lease calls as QueueClient's, files read as numpy, no torch) and copies each file's
stored rows into a slot of a ring of shared memory (a memfd, mapped once by both);
the trainer's stream (helper_stream.py) finds the rows in the slot with no syscall and no
GIL taken by anyone else.

The trainer decides what is read (seqs, resume plans, rows); the helper only executes: it
leases the file the trainer names, puts it in the slot the trainer names, and releases it when
the trainer says it is done with it. The frames are helper_wire.py's; the memfd of a split's
ring goes with its "ring" frame (SCM_RIGHTS over the unix socketpair).

A file stays leased by the helper until the trainer says "done", so a trainer that dies
leaves its unread files to expire back to its rank's stream, as a client's would. The helper
ends when its socket closes: it returns the files it holds (unread) and closes its client.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from queue_client.helper import helper_wire as wire
from queue_client.wire import batchqueue_pb2 as pb

log = logging.getLogger("queue_client")

ALIGN = 64  # each stored field starts on a cache line within its slot


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Ring:
    """One split's slots in one memfd: per stored tensor, max_rows rows at a fixed offset."""

    def __init__(self, split: str, slots: int, row_layout: list[tuple[str, str, list[int], int]],
                 max_rows: int) -> None:  # fmt: skip
        self.split = split
        self.slots = slots
        self.max_rows = max_rows
        self.fields: list[tuple[str, str, list[int], int]] = []  # name, dtype, row shape, offset
        offset = 0
        for name, dtype, shape, row_bytes in row_layout:
            self.fields.append((name, dtype, shape, offset))
            offset += _aligned(row_bytes * max_rows)
        self.slot_bytes = max(offset, ALIGN)
        self.fd = os.memfd_create(f"batchqueue-{split}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.slot_bytes * slots)
        self.map = mmap.mmap(self.fd, self.slot_bytes * slots)
        self.layouts: dict[str, int] = {}  # the fields of a file in a slot -> their id


class Helper:
    """The helper's side of the link: a lease client and the rings it fills."""

    def __init__(self, sock: socket.socket, client_kwargs: dict[str, Any]) -> None:
        from queue_client.helper.helper_source import HelperSource

        self.sock = sock
        kwargs = {k: v for k, v in client_kwargs.items() if k != "prefetch"}
        self.source = HelperSource(**kwargs)
        self._send_lock = threading.Lock()
        self._ring_lock = threading.Lock()
        self.rings: dict[str, Ring] = {}
        self.held: dict[tuple[int, int], Any] = {}  # (split index, slot) -> its StoredFile
        self.splits: dict[int, str] = {}  # the trainer's index of each split -> its name
        self._skips_sent: dict[int, tuple[tuple[int, int], ...]] = {}  # per split index
        self._skips_lock = threading.Lock()
        self._held_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="fetch-helper")

    def send(self, data: bytes, fd: int | None = None) -> None:
        """Send a frame; a link already gone drops it (the reader then ends the helper)."""
        with self._send_lock:
            try:
                if fd is None:
                    self.sock.sendall(data)
                else:
                    socket.send_fds(self.sock, [data], [fd])
            except OSError as exc:
                log.debug("fetch helper: the link is gone: %s", exc)

    def send_error(self, split: int, slot: int, exc: BaseException) -> None:
        self.send(wire.json_frame({"op": "error", "split": split, "slot": slot,
                                   "kind": type(exc).__name__, "message": str(exc)}))  # fmt: skip

    # ---- the jobs -----------------------------------------------------------------------
    def fetch(self, index: int, slot: int, slots: int, seq: int | None, carried: bool) -> None:
        try:
            split = self.splits[index]
            deadline = time.monotonic() + self.source.timeout_s
            loaded = self.source.load(split, seq, carried, deadline)
        except BaseException as exc:  # every failure reaches the trainer, named
            self.send_error(index, slot, exc)
            return
        try:
            layout = self._copy_in(index, split, slot, loaded, slots)
        except BaseException as exc:
            self.source.release(loaded.ref, pb.RETURNED)
            self.send_error(index, slot, exc)
            return
        finally:  # the file's map goes now; its lease stays until the trainer is done
            loaded.arrays, loaded.keep = [], None
        with self._held_lock:
            self.held[(index, slot)] = loaded
        self._pass_on_skips(index, split)
        self.send(wire.ready_frame(index, slot, loaded.seq, loaded.num_batches,
                                   loaded.batch_size, layout, loaded.ref.lease_id))  # fmt: skip

    def _pass_on_skips(self, index: int, split: str) -> None:
        """The split's skipped steps, sent before a file when a lease reply changed them
        (SkipSteps called meanwhile, by any rank): the trainer skips them as it reaches them."""
        skips = self.source.skips.get(split, ())
        with self._skips_lock:
            if self._skips_sent.get(index, ()) == skips:
                return
            self._skips_sent[index] = skips
            self.send(wire.json_frame({"op": "skips", "split": index, "ranges": skips}))

    def _copy_in(self, index: int, split: str, slot: int, loaded: Any, slots: int) -> int:
        """Copy the file's stored rows into `slot` of the split's ring (made at the first
        file, with the memfd sent to the trainer): the id of the fields' layout in the slot,
        sent to the trainer the first time it is used."""
        import numpy as np

        names = self.source.stored_names(split)
        with self._ring_lock:
            ring = self.rings.get(split)
            if ring is None:
                layout = [
                    (n, a.dtype.name, list(a.shape[2:]), a.itemsize * math.prod(a.shape[2:]))
                    for n, a in zip(names, loaded.arrays, strict=True)
                ]
                ring = Ring(split, slots, layout, self._max_rows(loaded))
                self.rings[split] = ring
                self.send(wire.json_frame({"op": "ring", "split": index, "slots": ring.slots,
                                           "slot_bytes": ring.slot_bytes}), fd=ring.fd)  # fmt: skip
        if not 0 <= slot < ring.slots:
            raise ValueError(f"slot {slot} is not one of the ring's {ring.slots} of {split!r}")
        if loaded.rows > ring.max_rows:
            raise ValueError(
                f"seq {loaded.seq} has {loaded.rows} rows, more than the {ring.max_rows} of a "
                "ring slot (meta's batches_per_file x batch_size)"
            )
        base = np.frombuffer(ring.map, dtype=np.uint8)
        fields = []
        for (name, dtype, _shape, offset), a in zip(ring.fields, loaded.arrays, strict=True):
            if a.dtype.name != dtype:
                raise ValueError(f"seq {loaded.seq} stores {name!r} as {a.dtype.name}, not {dtype}")
            start = slot * ring.slot_bytes + offset
            dst = base[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
            np.copyto(dst, a)  # without the GIL: the helper's other fetches go on meanwhile
            fields.append([name, dtype, list(a.shape), offset])
        key = repr(fields)
        with self._ring_lock:
            layout_id = ring.layouts.get(key)
            if layout_id is None:
                layout_id = ring.layouts[key] = len(ring.layouts)
                self.send(wire.json_frame({"op": "layout", "split": index, "id": layout_id,
                                           "fields": fields}))  # fmt: skip
        return layout_id

    def _max_rows(self, loaded: Any) -> int:
        nb = self.source.meta.get("batches_per_file")
        if isinstance(nb, int) and nb > 0:
            return max(nb * self.source.file_batch_size, loaded.rows)
        return int(loaded.rows)

    def take_held(self, index: int, slot: int) -> Any:
        """The file in `slot`, no longer held: in the reader's thread, in the frames' order,
        so a fetch into the same slot that follows can never be taken for it."""
        with self._held_lock:
            return self.held.pop((index, slot), None)

    def release(self, loaded: Any, consumed: bool, waited_s: float) -> None:
        from queue_client import errors

        outcome = pb.CONSUMED if consumed else pb.RETURNED
        try:
            self.source.release(loaded.ref, outcome, waited_s=waited_s)
        except errors.BatchQueueError as exc:
            log.warning("fetch helper: releasing seq %d failed: %s", loaded.seq, exc)

    # ---- the loop -----------------------------------------------------------------------
    def run(self, reader: Any) -> None:
        while (payload := _next_frame(reader)) is not None:
            kind, fields = wire.parse(payload)
            if kind == "F":
                self.pool.submit(self.fetch, *fields)
            elif kind == "D":
                index, slot, consumed, waited_s = fields
                loaded = self.take_held(index, slot)
                if loaded is not None:  # a release RPC: off this thread
                    self.pool.submit(self.release, loaded, consumed, waited_s)
            elif kind == "J" and fields.get("op") == "split":
                self.splits[int(fields["index"])] = str(fields["split"])
        # The trainer closed the link (or died): give back what is still held, unread.
        self.source.stop_waiting()
        self.pool.shutdown(wait=True)
        with self._held_lock:
            held, self.held = list(self.held.items()), {}
        for _, loaded in held:
            try:
                self.source.release(loaded.ref, pb.RETURNED)
            except Exception as exc:  # the server may be gone too: the leases then expire
                log.warning("fetch helper: returning seq %d failed: %s", loaded.seq, exc)
        self.source.close()


def _next_frame(reader: Any) -> bytes | None:
    """The next frame; None once the link is closed, also by a trainer that died with bytes
    unread (the kernel then resets the connection instead of closing it)."""
    try:
        return wire.read_frame(reader)
    except OSError as exc:
        log.debug("fetch helper: the link ended: %s", exc)
        return None


def main() -> int:
    """Run a helper on the socket whose fd is argv[1] (passed by helper_link.start_helper)."""
    import signal

    from queue_client.streaming.lane import yield_on_wakeup

    # Ctrl-C reaches the whole process group: the trainer decides what happens (it closes
    # the link, or dies and the link closes), and the helper gives its files back then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    # SCHED_BATCH for this thread and every thread started after (they inherit it): woken
    # by the trainer's requests, the helper never preempts the trainer's thread.
    yield_on_wakeup()
    sock = socket.socket(fileno=int(sys.argv[1]))
    reader = sock.makefile("rb")
    first = wire.read_frame(reader)
    kind, start = wire.parse(first) if first else ("", {})
    if kind != "J" or start.get("op") != "start":
        return 2
    try:
        helper = Helper(sock, start["client"])
    except BaseException as exc:  # the trainer raises it, named
        sock.sendall(wire.json_frame({"op": "error", "split": -1, "slot": -1,
                                      "kind": type(exc).__name__, "message": str(exc)}))  # fmt: skip
        return 1
    helper.send(wire.json_frame({"op": "started", "client_id": helper.source.client_id}))
    helper.run(reader)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
