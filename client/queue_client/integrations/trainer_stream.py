"""TrainerStream: one rank's batches for a framework's training loop, and the state that loop's
checkpoint keeps.

A loop may fetch a batch before it trains on the one before it (Lightning reads one ahead to
learn whether a batch is an epoch's last), so the client's own state_dict() can stand a batch
past what was trained on when a checkpoint is taken. TrainerStream keeps the state after each
batch it hands out until the loop says it trained on that batch (`consumed`); a batch handed
out but never trained on (a look-ahead dropped at an epoch's end) is handed out again first by
the next iteration. So a checkpoint's state is exactly the rows trained on: none skipped at
resume, none repeated.

A checkpoint holds every rank's state (`every_rank`: torch.distributed.all_gather_object when
distributed), and QueueClient.load_state_dict takes that list at any world size: the same
size resumes each rank where it stood, another size deals out what is left (docs/ordering.md,
"Elastic world size").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from queue_client.client import Batch, QueueClient
from queue_client.errors import InvalidRequest
from queue_client.streaming.rows import batch_size_of

# The checkpoint record's layout: {"version": 1, "states": [every rank's client state]}.
RECORD_VERSION = 1

State = Mapping[str, Any]


class TrainerStream(IterableDataset[Batch]):
    """The batches of one split for this rank, endless; iterate it in the trainer's process
    (a DataLoader with num_workers=0: the client reads ahead in threads of its own).

    `as_dict`: hand out x/y batches as {"x": X, "y": Y} (by the schema's field names), as
    frameworks that call model(**batch) want. `client_kwargs` go to QueueClient."""

    def __init__(
        self,
        address: str,
        dataset: str,
        split: str = "train",
        *,
        batch_size: int | None = None,
        as_dict: bool = False,
        **client_kwargs: Any,
    ) -> None:
        super().__init__()
        size = None if batch_size is None else batch_size_of(batch_size)
        if batch_size is not None and size is None:
            raise InvalidRequest(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
        self.address = address
        self.dataset = dataset
        self.split = split
        self.batch_size = size
        self.as_dict = as_dict
        self.client_kwargs = client_kwargs
        self._client: QueueClient | None = None
        self._pending: list[State] | None = None  # loaded before the client opened
        self._handed: deque[tuple[Batch, dict[str, Any]]] = deque()
        self._state: dict[str, Any] | None = None  # after the last batch trained on

    # ---- lifetime ---------------------------------------------------------------------------
    def open(self, rank: int, world_size: int) -> QueueClient:
        """Connect as rank `rank` of `world_size` (once), resuming from the loaded states, or
        where this stream stood when it was closed."""
        if self._client is None:
            client = QueueClient(
                self.address, self.dataset, rank=rank, world_size=world_size, **self.client_kwargs
            )
            # This rank's own state resumes this rank where it stood.
            start: State | list[State] | None = self._pending or self._state
            try:
                if start is not None:
                    client.load_state_dict(start)
                self._state = client.state_dict()
            except BaseException:
                client.close()
                raise
            self._client, self._pending = client, None
        return self._client

    @property
    def client(self) -> QueueClient:
        if self._client is None:
            raise InvalidRequest(
                f"the stream of {self.dataset!r}/{self.split} is not open: the framework opens "
                "it when it builds the train dataloader"
            )
        return self._client

    def close(self) -> None:
        """Give back the client's leases; the state of what was trained on stays."""
        client, self._client = self._client, None
        self._handed.clear()
        if client is not None:
            client.close()

    # ---- batches ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        if get_worker_info() is not None:
            raise InvalidRequest(
                f"the stream of {self.dataset!r} is read in a DataLoader worker: use "
                "num_workers=0 (its client reads ahead in threads of its own, and its state "
                "must stay with the trainer's checkpoint)"
            )
        client = self.client
        # Handed out by an earlier iteration but never trained on: they come first.
        yield from [batch for batch, _ in self._handed]
        names = [f.name for f in client.schema(self.split)] if self.as_dict else []
        while True:
            batch = client.get_batch(self.split, batch_size=self.batch_size)
            if names and isinstance(batch, tuple):
                batch = dict(zip(names, batch, strict=True))
            self._handed.append((batch, client.state_dict()))
            yield batch

    def consumed(self) -> None:
        """The oldest batch handed out and not yet consumed was trained on."""
        if not self._handed:
            raise InvalidRequest(
                "consumed() with no batch handed out: call it once for each batch the "
                "training loop takes from this stream"
            )
        _, self._state = self._handed.popleft()

    # ---- checkpoints ------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """This rank's client state after the batches trained on (None: never opened)."""
        return self._state

    @property
    def pending(self) -> list[State] | None:
        """States loaded and not applied yet (the client opens later)."""
        return self._pending

    def load(self, states: Sequence[State]) -> None:
        """Resume from every rank's states (a checkpoint's): at once on an open client (what
        it handed out is dropped), else when it opens."""
        if self._client is None:
            self._pending = list(states)
            return
        self._client.load_state_dict(list(states))
        self._handed.clear()
        self._state = self._client.state_dict()


def every_rank(state: State) -> list[State]:
    """Every rank's state, in rank order (a collective: every rank calls it at once)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, dict(state))
        return out
    return [state]


def checkpoint_record(states: Sequence[State]) -> dict[str, Any]:
    """What a checkpoint holds: every rank's state, plain JSON-serialisable data."""
    return {"version": RECORD_VERSION, "states": [dict(s) for s in states]}


def states_of(record: Any, where: str) -> list[State]:
    """The ranks' states of a checkpoint record, checked; InvalidRequest naming `where`."""
    if not isinstance(record, Mapping) or record.get("version") != RECORD_VERSION:
        version = record.get("version") if isinstance(record, Mapping) else type(record).__name__
        raise InvalidRequest(
            f"{where}: expected a batchqueue loader record of version {RECORD_VERSION}, "
            f"got {version!r}"
        )
    states = record.get("states")
    if (
        not isinstance(states, list)
        or not states
        or not all(isinstance(s, Mapping) for s in states)
    ):
        raise InvalidRequest(f"{where}: 'states' must be a non-empty list of client states")
    return states


__all__ = ["RECORD_VERSION", "TrainerStream", "checkpoint_record", "every_rank", "states_of"]
