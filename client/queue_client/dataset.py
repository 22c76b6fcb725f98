"""QueueDataset: one split of a batchqueue dataset as a torch IterableDataset.

    ds = QueueDataset("localhost:50051", "stdlib_char", "train", max_batches=1000)
    for x, y in DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True):
        ...

Batches are already batched, so use `batch_size=None` in the DataLoader; the rows of each
come from the dataset's `batch_size` (default: the server's; any size where rows are
independent, see QueueClient.get_batch). The QueueClient is created inside
`__iter__`, in the process that iterates (a DataLoader worker or the main process), and is
never pickled: a client's channel and threads do not survive fork or pickling.

Streams. Trainer rank r of W (from the arguments, else torchrun's RANK and WORLD_SIZE) reads
the server's stream r of W. With DataLoader num_workers=N > 0, worker i of trainer rank r
reads stream r*N + i of W*N instead (see `worker_world`): every worker gets its own disjoint
share, the DataLoader interleaves them worker by worker, and all ranks must use the same N,
because a split is served at one world size at a time.

Epochs. The stream has no end; `max_batches` ends each iteration. A client lives as long as
its process: in the main process, iterating again continues the stream. With workers, pass
persistent_workers=True so that they (and their streams) live across epochs: a fresh worker
starts its stream over, from the beginning or from the state given to `load_state_dict`,
and so would read the same batches every epoch.

Checkpoints. state_dict() and load_state_dict() are the client's, in the process that reads:
the main process with num_workers=0, else each worker (torchdata's StatefulDataLoader calls
them there, each worker with its own state).
"""

from __future__ import annotations

import multiprocessing.util
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from queue_client.client import Batch, QueueClient
from queue_client.errors import InvalidRequest
from queue_client.streaming.resume import STATE_VERSION
from queue_client.streaming.rows import batch_size_of
from queue_client.world import World

State = Mapping[str, Any] | Sequence[Mapping[str, Any]]


def worker_world(trainer: World, worker_id: int, num_workers: int) -> World:
    """The stream of DataLoader worker `worker_id` of `num_workers` on trainer rank `trainer`:
    rank trainer.rank * num_workers + worker_id of trainer.world_size * num_workers."""
    if not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id {worker_id} must lie in [0, num_workers={num_workers})")
    return World(trainer.rank * num_workers + worker_id, trainer.world_size * num_workers)


class QueueDataset(IterableDataset[Batch]):
    """Batches of one split, each (X, Y) or a dict of tensors as the schema says.

    `batch_size`: the rows of each batch (None: the server's batch_size). `client_kwargs`
    go to QueueClient (timeout_s, data_root, auth_token, ...). `copy` None
    means: copy each batch out of the memory-mapped file in DataLoader workers (a view would
    send its whole file to the main process), hand out zero-copy views in the main process.
    """

    def __init__(
        self,
        address: str,
        dataset: str,
        split: str = "train",
        *,
        rank: int | None = None,
        world_size: int | None = None,
        max_batches: int | None = None,
        copy: bool | None = None,
        batch_size: int | None = None,
        **client_kwargs: Any,
    ) -> None:
        super().__init__()
        if max_batches is not None and max_batches < 0:
            raise ValueError(f"max_batches {max_batches} must be >= 0 or None")
        size = None if batch_size is None else batch_size_of(batch_size)
        if batch_size is not None and size is None:
            raise ValueError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
        if "device" in client_kwargs:
            raise TypeError(
                "QueueDataset yields CPU batches; move them with .to(device) (and pin_memory=True)"
            )
        self.address = address
        self.dataset = dataset
        self.split = split
        self.trainer = World.detect(rank, world_size)
        self.max_batches = max_batches
        self.copy = copy
        self.batch_size = size  # a Python int, also when given a numpy one
        self.client_kwargs = client_kwargs
        self._client: QueueClient | None = None
        self._client_pid: int | None = None
        self._pending_state: State | None = None

    # ---- iteration --------------------------------------------------------------------------
    def world(self) -> World:
        """The stream this process reads: the trainer's, or its DataLoader worker's share."""
        info = get_worker_info()
        return (
            self.trainer if info is None else worker_world(self.trainer, info.id, info.num_workers)
        )

    def client(self) -> QueueClient:
        """This process's client, created on first use (a forked copy of another's is dropped)."""
        if self._client is None or self._client_pid != os.getpid():
            in_worker = get_worker_info() is not None
            world = self.world()
            client = QueueClient(
                self.address,
                self.dataset,
                rank=world.rank,
                world_size=world.world_size,
                copy=in_worker if self.copy is None else self.copy,
                **self.client_kwargs,
            )
            if self._pending_state is not None:
                client.load_state_dict(self._pending_state)
                self._pending_state = None
            if in_worker:
                # A DataLoader worker ends through multiprocessing's bootstrap, which runs
                # this: its leases go back at once instead of expiring after the lease TTL.
                multiprocessing.util.Finalize(None, client.close, exitpriority=10)
            self._client, self._client_pid = client, os.getpid()
        return self._client

    def __iter__(self) -> Iterator[Batch]:
        client = self.client()
        n = 0
        while self.max_batches is None or n < self.max_batches:
            yield client.get_batch(self.split, batch_size=self.batch_size)
            n += 1

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The client's state_dict(), in the process that reads the batches: the main process
        with num_workers=0, else each worker (a stateful DataLoader, such as torchdata's
        StatefulDataLoader, calls this inside its workers)."""
        if self._client is not None and self._client_pid == os.getpid():
            return self._client.state_dict()
        if isinstance(self._pending_state, Mapping):
            return dict(self._pending_state)
        if get_worker_info() is None:
            # Maybe DataLoader workers read the batches: their positions are not known here,
            # and an empty state would silently restart the stream on resume.
            raise InvalidRequest(
                f"{self!r} has read nothing in this process (pid {os.getpid()}): with DataLoader "
                "workers the state lives in each worker; take it there (a stateful DataLoader does)"
            )
        # A worker that has read nothing yet: a fresh stream, built without connecting.
        world = self.world()
        return {
            "version": STATE_VERSION,
            "dataset": self.dataset,
            "rank": world.rank,
            "world_size": world.world_size,
            "splits": {},
        }

    def load_state_dict(self, state: State) -> None:
        """Resume from state_dict(): applied now to a live client, else when it is created."""
        if self._client is not None and self._client_pid == os.getpid():
            self._client.load_state_dict(state)
        else:
            self._pending_state = state

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close this process's client, giving back its leases."""
        client, self._client = self._client, None
        if client is not None and self._client_pid == os.getpid():
            client.close()

    def __enter__(self) -> QueueDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = state["_client_pid"] = None
        return state

    def __repr__(self) -> str:
        return f"QueueDataset({self.address!r}, {self.dataset!r}, {self.split!r}, rank={self.trainer.rank}, world_size={self.trainer.world_size})"


__all__ = ["QueueDataset", "worker_world"]
