"""QueueTrainer: the Hugging Face Trainer reading a batchqueue split, resuming from
checkpoint-N on exactly the next rows with no batch replayed, also at another number of
processes (docs/hf-trainer.md).

    args = TrainingArguments("out", max_steps=1000, save_steps=100, ignore_data_skip=True,
                             per_device_train_batch_size=8)
    trainer = QueueTrainer(model=model, args=args, address="localhost:50051", dataset="mix")
    trainer.train(resume_from_checkpoint=True)

The Trainer resumes an IterableDataset by iterating it again and dropping the batches of the
steps done (accelerate's skip_first_batches), which reads those rows a second time and is
wrong for a stream that resumes itself. So QueueTrainer needs ignore_data_skip=True and:

- builds the train DataLoader itself (get_train_dataloader): rank r of W (the Trainer's
  process_index and world_size) reads its own stream, batches of per_device_train_batch_size
  rows as dicts of the schema's fields (model(**batch)), and accelerate does not wrap it: it
  would dispatch rank 0's batches to every rank, or read each rank's stream W times over;
- marks a batch consumed as training_step takes it, whatever the loop fetched ahead;
- on every save gathers each rank's state (all_gather_object) and writes them, atomically,
  to batchqueue_state.json in the checkpoint-N folder; train(resume_from_checkpoint=...)
  reads them back, and the client resumes each rank where it stood at the same size and deals
  out what is left at another (docs/ordering.md, "Elastic world size").
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from queue_client.client import Batch
from queue_client.errors import InvalidRequest
from queue_client.integrations.trainer_stream import (
    State,
    TrainerStream,
    checkpoint_record,
    every_rank,
    states_of,
)

# Beside the Trainer's own files in each checkpoint-N folder.
STATE_FILE = "batchqueue_state.json"


def write_states(folder: Path, states: list[State]) -> Path:
    """Every rank's state into folder/STATE_FILE: a temporary file, fsynced, renamed."""
    if not folder.is_dir():
        raise InvalidRequest(f"checkpoint folder {folder} does not exist: nothing was saved there")
    path = folder / STATE_FILE
    fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}.", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(checkpoint_record(states), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_states(folder: Path) -> list[State]:
    """The ranks' states a checkpoint folder holds; InvalidRequest naming the file if not."""
    path = folder / STATE_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidRequest(
            f"{path} is missing: the checkpoint was saved without QueueTrainer, or its save "
            "was cut off; resume from another checkpoint"
        ) from None
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{path} cannot be read as JSON: {exc}") from None
    return states_of(record, str(path))


class QueueStateSaver(TrainerCallback):
    """On every save, every rank's stream state into the checkpoint folder (a collective: the
    Trainer calls on_save on every process); at the end of training, the client closed."""

    def __init__(self, stream: TrainerStream) -> None:
        self.stream = stream

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        mine = self.stream.state()
        if mine is None:
            raise InvalidRequest("a checkpoint is saved before the train stream opened")
        states = every_rank(mine)
        if args.should_save:
            folder = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            write_states(folder, states)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.stream.close()  # its leases go back; a later train() carries on from its state


class QueueTrainerMixin:
    """QueueTrainer's parts, to put before another Trainer class:
    `class MyTrainer(QueueTrainerMixin, SFTTrainer): ...`. `address`, `dataset`, `split`:
    what to read; `client_kwargs` go to QueueClient."""

    args: TrainingArguments

    def __init__(
        self,
        *args: Any,
        address: str,
        dataset: str,
        split: str = "train",
        client_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("train_dataset") is not None:
            raise InvalidRequest(
                "QueueTrainer reads the train split from the queue: pass no train_dataset"
            )
        super().__init__(*args, **kwargs)
        targs = self.args
        if not targs.ignore_data_skip:
            raise InvalidRequest(
                "QueueTrainer needs TrainingArguments(ignore_data_skip=True): the queue resumes "
                "its stream from the checkpoint, and the Trainer's skipping would read the "
                "rows of the steps done again and drop them"
            )
        if targs.dataloader_num_workers:
            raise InvalidRequest(
                f"dataloader_num_workers={targs.dataloader_num_workers}: QueueTrainer reads in "
                "the trainer's process (the client reads ahead in threads of its own); use 0"
            )
        self.queue = TrainerStream(
            address, dataset, split, batch_size=targs.per_device_train_batch_size,
            as_dict=True, **dict(client_kwargs or {}),
        )  # fmt: skip
        self.add_callback(QueueStateSaver(self.queue))  # type: ignore[attr-defined]

    def get_train_dataloader(self) -> DataLoader[Batch]:
        targs = self.args
        self.queue.open(targs.process_index, targs.world_size)
        pin = targs.dataloader_pin_memory and targs.device.type == "cuda"
        return DataLoader(self.queue, batch_size=None, num_workers=0, pin_memory=pin)

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        self.queue.consumed()
        out: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        return out

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """Trainer.train; a checkpoint to resume from (True: the last in output_dir) gives
        the stream every rank's state saved in it."""
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.args.output_dir)  # None: the Trainer says so
        if isinstance(folder, (str, os.PathLike)):
            self.queue.load(read_states(Path(folder)))
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)  # type: ignore[misc]


class QueueTrainer(QueueTrainerMixin, Trainer):
    """transformers.Trainer over a batchqueue split; see the module's docstring."""


__all__ = ["STATE_FILE", "QueueStateSaver", "QueueTrainer", "QueueTrainerMixin", "read_states"]
