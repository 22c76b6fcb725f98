"""Walks a QueueClient's split file by file, so a row can time batches inside a file, the one
call that opens the next file, or many files back to back.

File boundaries fall every `batches_per_file` calls (the first call opens the first file).
`settle` waits until the next file is prefetched and the provider's backlog is full, so that
what is timed next is get_batch alone: the state of a trainer whose step is longer than the
provider's time per file.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from bench.servers import Server
from queue_server.testing import wait_until

if TYPE_CHECKING:
    from queue_client.client import QueueClient


class FileWalker:
    def __init__(
        self,
        client: QueueClient,
        split: str,
        batches_per_file: int,
        server: Server,
        dataset: str,
        backlog: int,
    ) -> None:
        self.client = client
        self.split = split
        self.nb = batches_per_file
        self.server = server
        self.dataset = dataset
        self.backlog = backlog
        self.pos = batches_per_file  # no file open: the next call opens one

    def finish_file(self) -> None:
        """Read what is left of the current file, untimed."""
        get = self.client.get_batch
        while self.pos < self.nb:
            get(self.split)
            self.pos += 1

    def open_next(self) -> int:
        """Finish the current file, then time the call that opens the next one (ns)."""
        self.finish_file()
        began = time.perf_counter_ns()
        self.client.get_batch(self.split)
        elapsed = time.perf_counter_ns() - began
        self.pos = 1
        return elapsed

    def settle(self, timeout_s: float = 120.0) -> None:
        """Wait for the prefetch of the next file and for the provider to go idle."""
        wait_until(
            lambda: self._all_ahead_loaded(self.client.stream_view(self.split)),
            timeout_s,
            f"the prefetch of the next {self.split} files",
            poll_s=0.001,
        )
        # Files the client reads ahead beyond the next one are leased out of the backlog.
        view = self.client.stream_view(self.split)
        deeper = getattr(view, "read_ahead", getattr(self.client, "prefetch_files", 1)) - 1
        self.server.wait_ready_files(self.dataset, self.backlog - deeper, self.split, timeout_s)

    @staticmethod
    def _all_ahead_loaded(view: object) -> bool:
        """Every file read ahead is loaded (a client before read_ahead: the next one)."""
        if hasattr(view, "ready_ahead"):
            return view.ready_ahead >= view.read_ahead  # type: ignore[attr-defined]
        return view.next_file != "loading"  # type: ignore[attr-defined]

    def time_rest_of_file(
        self, keep: list | None = None, out: tuple | None = None
    ) -> tuple[int, int]:
        """Time every call left in the current file, back to back: (total ns, calls).

        With `keep`, the batches are appended to it (zero-copy views cost nothing to keep);
        with `out`, each batch is copied into those preallocated tensors (get_batch(out=...))."""
        n = self.nb - self.pos
        get, split = self.client.get_batch, self.split
        if out is not None:
            began = time.perf_counter_ns()
            for _ in range(n):
                get(split, out=out)
            elapsed = time.perf_counter_ns() - began
        elif keep is None:
            began = time.perf_counter_ns()
            for _ in range(n):
                get(split)
            elapsed = time.perf_counter_ns() - began
        else:
            add = keep.append
            began = time.perf_counter_ns()
            for _ in range(n):
                add(get(split))
            elapsed = time.perf_counter_ns() - began
        self.pos = self.nb
        return elapsed, n

    def time_files(self, files: int) -> tuple[int, int]:
        """Time `files` whole files back to back, boundaries included: (total ns, calls)."""
        self.finish_file()
        n = files * self.nb
        get, split = self.client.get_batch, self.split
        began = time.perf_counter_ns()
        for _ in range(n):
            get(split)
        elapsed = time.perf_counter_ns() - began
        self.pos = self.nb
        return elapsed, n
