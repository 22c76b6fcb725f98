"""Widening a stream's next rows ahead of the trainer, in a thread of its own.

A zero-copy CPU trainer gets each batch's narrow token ids widened into memory of its own.
Done in get_batch, that costs every call a copy per field (~25 µs at B=12 T=1024) and lets
the background threads take the GIL in the middle of the call (a torch copy releases it).
Done here, a few batches at a time (a chunk of CHUNK_BATCHES of the file's batches, into
fresh memory: no chunk is ever written twice, so a batch autograd keeps stays intact), the
call hands out views of a widened chunk: a slice, no copy, no GIL released.

Nothing ever waits for this thread: a call whose rows are not widened yet widens them
itself, as before, and the thread moves on to rows ahead of it. It keeps WINDOW_CHUNKS
chunks ahead of the trainer, across the switch to the next file once that file is loaded,
so decoding costs what the batches served cost, a few batches early.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from queue_client.rows import LoadedFile

# Files' batches per chunk, and chunks kept widened ahead of the trainer's row.
CHUNK_BATCHES = 4
WINDOW_CHUNKS = 4

# What to widen: (file, the row the trainer reads next in it), in reading order.
Targets = Callable[[], list[tuple[LoadedFile, int]]]


class AheadWidener:
    def __init__(self, name: str, targets: Targets) -> None:
        self._targets = weakref.WeakMethod(targets)  # type: ignore[arg-type]
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """The trainer entered a new chunk (or caught up): there is room ahead again."""
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                job = self._pick()
                if job is None:
                    self._cond.wait()
                    continue
            file, i = job
            chunks = file.chunks
            if chunks is not None:
                chunks[i] = file.widen_chunk(i)
            del file, chunks

    def _pick(self) -> tuple[LoadedFile, int] | None:
        """The first chunk ahead of the trainer not widened yet, within the window."""
        targets = self._targets()
        if targets is None:  # the stream is gone
            self._closed = True
            return None
        ahead = 0
        for n, (file, row) in enumerate(targets()):
            chunks = file.chunks
            if chunks is None:
                continue
            # In the file being read, the chunk the trainer is in is its own to finish.
            first = row // file.chunk_rows + (1 if n == 0 else 0)
            for i in range(first, len(chunks)):
                if ahead >= WINDOW_CHUNKS:
                    return None
                if chunks[i] is None:
                    return file, i
                ahead += 1
        return None
