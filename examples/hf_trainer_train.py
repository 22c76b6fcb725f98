"""The Hugging Face Trainer from a batchqueue server: checkpoints that resume on exactly the
next rows, with no batch replayed, also at another number of processes (docs/hf-trainer.md).

    queue-server &                                   # serves stdlib_char by default
    python examples/hf_trainer_train.py --max-steps 200 --output-dir out
    # killed midway? carry on from the last checkpoint, on as many processes as you have:
    torchrun --standalone --nproc_per_node=2 examples/hf_trainer_train.py --max-steps 300 \
        --output-dir out --resume last

QueueTrainer gives each process its own stream and writes every process's place in it to
checkpoint-N/batchqueue_state.json beside the Trainer's own files. --record DIR writes each
step's rows to DIR/rank<r>.jsonl, to compare runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import TrainingArguments

from queue_client import QueueClient
from queue_client.integrations.hf_trainer import QueueTrainer


class Bigram(torch.nn.Module):
    """Next-token logits from the current token. The Trainer calls model(**batch): a batch
    is a dict of the schema's fields (x and y here), and the output holds the loss."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.logits = torch.nn.Embedding(vocab_size, vocab_size)

    def forward(self, x: torch.Tensor, y: torch.Tensor, **other: Any) -> dict[str, torch.Tensor]:
        logits = self.logits(x)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), y.flatten()), "logits": logits}


class RecordingTrainer(QueueTrainer):
    """Writes the rows of each step as it trains on them, one JSON line per step and rank."""

    record: Path | None = None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        if self.record is not None:
            self.record.mkdir(parents=True, exist_ok=True)
            line = {"step": self.state.global_step + 1, "x": inputs["x"].tolist()}
            with open(self.record / f"rank{self.args.process_index}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        return super().training_step(model, inputs, num_items_in_batch)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--dataset", default="stdlib_char")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch and process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--output-dir", type=Path, default=Path("out"))
    p.add_argument("--save-steps", type=int, default=50, help="a checkpoint every N steps")
    p.add_argument("--resume", default=None, help='a checkpoint-N folder, or "last"')
    p.add_argument("--record", type=Path, default=None, help="write each step's rows here")
    a = p.parse_args()
    with QueueClient(a.address, a.dataset, rank=0, world_size=1) as probe:
        vocab_size = int(probe.meta["vocab_size"])
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(a.output_dir), max_steps=a.max_steps, save_steps=a.save_steps,
        per_device_train_batch_size=a.batch_size, learning_rate=a.lr,
        lr_scheduler_type="constant", ignore_data_skip=True, use_cpu=True,
        report_to=[], logging_steps=a.save_steps, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = RecordingTrainer(
        model=Bigram(vocab_size), args=args, address=a.address, dataset=a.dataset
    )
    trainer.record = a.record
    resume: str | bool | None = True if a.resume == "last" else a.resume
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        print(f"done at step {trainer.state.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
