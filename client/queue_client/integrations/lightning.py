"""QueueDataModule: a batchqueue split as a Lightning DataModule whose checkpoint holds every
rank's stream, so `trainer.fit(ckpt_path=...)` resumes on exactly the next rows, also at
another number of devices (docs/lightning.md).

    datamodule = QueueDataModule("localhost:50051", "stdlib_char")
    trainer = lightning.pytorch.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1000)
    trainer.fit(model, datamodule=datamodule, ckpt_path="last")

Lightning saves a DataModule's state_dict() in its checkpoint, from rank 0 alone. So
state_dict() gathers every rank's client state first (all_gather_object: Lightning calls it on
every rank as it saves), and load_state_dict() hands the whole list to the client, which
resumes each rank where it stood at the same size and deals out what is left at another
(docs/ordering.md, "Elastic world size").

Lightning fetches a batch ahead of the one it trains on; the DataModule's
on_before_batch_transfer, which Lightning calls as a batch goes to training_step, marks the
batch consumed (integrations/trainer_stream.py), so a checkpoint's state is the rows trained
on. A LightningModule that defines on_before_batch_transfer itself would hide that hook and is
refused at setup.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader

from queue_client.client import Batch, QueueClient
from queue_client.errors import InvalidRequest
from queue_client.integrations.trainer_stream import (
    TrainerStream,
    checkpoint_record,
    every_rank,
    states_of,
)


class QueueDataModule(pl.LightningDataModule):
    """The train split of `dataset` served at `address`: each rank reads its own stream
    (rank r of W reads the files whose seq is r mod W), batches of `batch_size` rows (None:
    the server's). `client_kwargs` go to QueueClient (timeout_s, data_root, auth_token...).

    `client` is this rank's QueueClient once fit has set up (for set_mixture, stats)."""

    def __init__(
        self,
        address: str,
        dataset: str,
        split: str = "train",
        *,
        batch_size: int | None = None,
        **client_kwargs: Any,
    ) -> None:
        super().__init__()
        self.stream = TrainerStream(address, dataset, split, batch_size=batch_size, **client_kwargs)

    @property
    def client(self) -> QueueClient:
        return self.stream.client

    # ---- Lightning's hooks ------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if stage != "fit":
            return
        trainer = self.trainer
        if trainer is None:
            raise InvalidRequest("QueueDataModule.setup needs the Trainer that fits with it")
        if is_overridden("on_before_batch_transfer", trainer.lightning_module):
            raise InvalidRequest(
                f"{type(trainer.lightning_module).__name__} defines on_before_batch_transfer, "
                "which hides QueueDataModule's: it marks each batch trained on, so the "
                "checkpoint's stream state stays exact. Move that code to "
                "on_after_batch_transfer or training_step"
            )
        self.stream.open(trainer.global_rank, trainer.world_size)

    def train_dataloader(self) -> DataLoader[Batch]:
        # num_workers=0: the client reads ahead in threads of its own, and a worker process
        # would keep the stream's state away from the checkpoint.
        return DataLoader(self.stream, batch_size=None, num_workers=0)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training:
            self.stream.consumed()
        return batch

    def teardown(self, stage: str) -> None:
        if stage == "fit":
            self.stream.close()

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{"version", "states": every rank's client state}; a collective while fitting."""
        state = self.stream.state()
        if state is not None:
            return checkpoint_record(every_rank(state))
        pending = self.stream.pending
        return {} if pending is None else checkpoint_record(pending)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stream.load(states_of(state_dict, "the checkpoint's QueueDataModule state"))


__all__ = ["QueueDataModule"]
