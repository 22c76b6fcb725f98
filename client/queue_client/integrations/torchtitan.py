"""BatchQueueDataLoader: a batchqueue split as torchtitan's data loader, whose checkpoint holds
every data-parallel rank's stream, so a resume reads exactly the rows an uninterrupted run
would, also at another data-parallel degree (docs/torchtitan.md).

    from queue_client.integrations.torchtitan import BatchQueueDataLoader
    config.dataloader = BatchQueueDataLoader.Config(address="localhost:50051", dataset="web")

torchtitan's trainer builds the loader through its Config (`config.dataloader.build(dp_rank=,
dp_world_size=, local_batch_size=, seq_len=, ...)`) and hands it to its checkpoint manager,
which saves `state_dict()` into the DCP checkpoint under `dataloader.` and, on resume, calls
`load_state_dict` with what DCP read back.

Why one entry with every rank's state, not torchtitan's `dp_rank_N` entries: DCP reads only the
keys the loading rank names in its own state_dict, and a loader at another dp degree cannot
know the old ranks' keys, so torchtitan refuses to reshard its loader. Here `state_dict()`
gathers every dp rank's client state (all_gather_object: the checkpoint manager calls it on
every rank at once, as it saves and as it loads) into one JSON entry whose key never depends
on the degree; DCP writes it once. `load_state_dict` hands the whole list to
QueueClient.load_state_dict: the same degree resumes each rank where it stood, another deals
out what is left, every row once (docs/ordering.md, "Elastic world size").

torchtitan takes one batch from the loader per microbatch and trains on it before it takes
the next, then saves after the step: the client's state at a save is the rows trained on.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

try:
    from torchtitan.components.dataloader import BaseDataLoader
except ImportError as exc:  # queue_client itself never imports this module
    raise ImportError(
        "queue_client.integrations.torchtitan needs torchtitan: pip install 'batchqueue[torchtitan]'"
    ) from exc

from queue_client.client import Batch, QueueClient
from queue_client.errors import InvalidRequest
from queue_client.integrations.trainer_stream import (
    State,
    checkpoint_record,
    every_rank,
    states_of,
)

# The loader's one checkpoint entry: `dataloader.batchqueue` in DCP, the JSON text of the
# record every framework integration keeps (trainer_stream.checkpoint_record).
STATE_KEY = "batchqueue"


class BatchQueueDataLoader(BaseDataLoader):
    """This dp rank's batches of one split, endless: ({"input": X, "positions": P}, Y) with X
    and Y [local_batch_size, seq_len] and P each row's positions 0..seq_len-1 (a row is one
    causal sequence; flex and varlen attention build their masks from it).

    Every rank of the job must be a data-parallel rank (FSDP, HSDP, DDP): ranks that share a dp
    rank (tensor, context or pipeline parallel) would each lease that rank's files."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """`dataset` (inherited) names the batchqueue dataset; `dataset_path` stays unset."""

        address: str = "localhost:50051"
        """The batchqueue server: host:port, or unix:PATH."""

        split: str = "train"
        """The split to train on."""

        input_field: str = "x"
        """The schema's field of input token ids (x for the LM providers)."""

        label_field: str = "y"
        """The schema's field of target token ids (y for the LM providers)."""

        timeout_s: float = 60.0
        """How long a batch may be waited for before NoBatchReady."""

        data_root: str | None = None
        """Where this host sees the server's data root (None: the path the server reports);
        a host without it streams files over gRPC (transport "auto")."""

        prefetch_files: int = 2
        """Files leased and loaded ahead of the one being read."""

    def __init__(
        self,
        config: Config,
        *,
        dp_rank: int,
        dp_world_size: int,
        local_batch_size: int,
        seq_len: int,
        **_unused: Any,  # tokenizer, snapshot_every_n_steps: the batches arrive as token ids
    ) -> None:
        if not config.dataset:
            raise InvalidRequest(
                "dataloader.dataset is empty: name the batchqueue dataset to train on"
            )
        if config.dataset_path is not None:
            raise InvalidRequest(
                f"dataloader.dataset_path is {config.dataset_path!r}: BatchQueueDataLoader "
                f"reads from the server at dataloader.address ({config.address}); leave it unset"
            )
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world != dp_world_size:
            raise InvalidRequest(
                f"data-parallel degree {dp_world_size} but {world} ranks: ranks that share a dp "
                "rank (tensor, context or pipeline parallel) would each lease that rank's files; "
                "BatchQueueDataLoader needs every rank to be a data-parallel rank"
            )
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.local_batch_size, self.seq_len = local_batch_size, seq_len
        self.client = QueueClient(
            config.address,
            config.dataset,
            rank=dp_rank,
            world_size=dp_world_size,
            timeout_s=config.timeout_s,
            data_root=config.data_root,
            prefetch_files=config.prefetch_files,
        )
        # The leases go back when the loader is dropped or the process exits (torchtitan's
        # trainer never closes its loader), not a lease TTL later.
        self._finalizer = weakref.finalize(self, self.client.close)
        positions = torch.arange(seq_len, dtype=torch.int64)
        self._positions = positions.repeat(local_batch_size, 1)

    # ---- batches ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        split, size = self.config.split, self.local_batch_size
        while True:
            inputs, labels = self._fields(self.client.get_batch(split, batch_size=size))
            yield {"input": inputs, "positions": self._positions}, labels

    def _fields(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's input and label tensors, checked against the trainer's shape."""
        if isinstance(batch, tuple):
            fields = dict(
                zip([f.name for f in self.client.schema(self.config.split)], batch, strict=True)
            )
        else:
            fields = batch
        names = (self.config.input_field, self.config.label_field)
        missing = [name for name in names if name not in fields]
        if missing:
            raise InvalidRequest(
                f"dataset {self.config.dataset!r} split {self.config.split!r} has no field(s) "
                f"{missing} (its fields: {sorted(fields)}): set dataloader.input_field and "
                "dataloader.label_field"
            )
        inputs, labels = fields[names[0]], fields[names[1]]
        want = (self.local_batch_size, self.seq_len)
        for name, tensor in zip(names, (inputs, labels), strict=True):
            if tuple(tensor.shape) != want:
                raise InvalidRequest(
                    f"field {name!r} of dataset {self.config.dataset!r} is shaped "
                    f"{list(tensor.shape)}, but the trainer wants [local_batch_size, seq_len] = "
                    f"{list(want)}: set training.seq_len to the dataset's block_size"
                )
        return inputs, labels

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every dp rank's client state in one JSON entry (a collective: every rank calls it)."""
        record = checkpoint_record(every_rank(self.client.state_dict()))
        return {STATE_KEY: json.dumps(record, separators=(",", ":"))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from every dp rank's saved state, at this degree or another."""
        if not state_dict:  # torchtitan's convention: nothing saved for the loader
            return
        self.client.load_state_dict(checkpoint_entry(state_dict))

    def close(self) -> None:
        """Give back the client's leases and close its connection."""
        self._finalizer()


def checkpoint_entry(state_dict: Mapping[str, Any]) -> list[State]:
    """The dp ranks' client states of the loader's checkpoint entry, checked."""
    where = f"the checkpoint's dataloader.{STATE_KEY}"
    text = state_dict.get(STATE_KEY)
    if not isinstance(text, str):
        raise InvalidRequest(
            f"{where} is missing (the loader's keys: {sorted(state_dict)}): the checkpoint was "
            "not saved by BatchQueueDataLoader"
        )
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{where} is not JSON: {exc}") from None
    return states_of(record, where)


__all__ = ["STATE_KEY", "BatchQueueDataLoader", "checkpoint_entry"]
