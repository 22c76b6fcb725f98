"""Lightning from a batchqueue server: DDP on CPU (gloo), checkpoints that resume on exactly
the next rows, also at another number of devices, and online mixing (docs/lightning.md).

    queue-server &                                   # serves stdlib_char by default
    python examples/lightning_train.py --devices 2 --max-steps 200 --ckpt-dir ckpt
    # killed midway? carry on from the last checkpoint, on as many devices as you have:
    python examples/lightning_train.py --devices 1 --max-steps 300 --ckpt-dir ckpt --resume last

The QueueDataModule gives each rank its own stream and puts every rank's place in it into
Lightning's checkpoint. On a mixture dataset, --reweight-every N moves the weights toward the
sources whose loss is high every N steps (MixtureReweighting); its weights are in the
checkpoint too. --record DIR writes each step's rows to DIR/rank<r>.jsonl, to compare runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from queue_client import QueueClient
from queue_client.integrations.lightning import QueueDataModule
from queue_client.integrations.lightning_mixture import MixtureReweighting


def xy(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """x and y of a batch: an (X, Y) tuple, or a dict that also holds "source" (a mixture)."""
    return (batch["x"], batch["y"]) if isinstance(batch, dict) else batch


class Bigram(pl.LightningModule):
    """Next-token logits from the current token: the smallest language model that learns."""

    def __init__(self, vocab_size: int, lr: float) -> None:
        super().__init__()
        self.logits = torch.nn.Embedding(vocab_size, vocab_size)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = xy(batch)
        per_token = F.cross_entropy(self.logits(x).flatten(0, 1), y.flatten(), reduction="none")
        rows = per_token.view(y.shape).mean(dim=1)
        # Each row's loss too, for MixtureReweighting's per-source loss.
        return {"loss": rows.mean(), "row_losses": rows.detach()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RowRecorder(pl.Callback):
    """Each step's rows, one JSON line per step and rank: what a resumed run is checked by."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        line = {"step": trainer.global_step, "x": xy(batch)[0].tolist()}
        if isinstance(batch, dict) and "source" in batch:
            line["source"] = batch["source"].tolist()
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--dataset", default="stdlib_char")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=None, help="rows per batch (the server's)")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--save-every", type=int, default=50, help="a checkpoint every N steps")
    p.add_argument("--resume", default=None, help='a checkpoint file, or "last"')
    p.add_argument("--reweight-every", type=int, default=0, help="mixture steps (0: off)")
    p.add_argument("--eta", type=float, default=1.0)
    p.add_argument("--floor", type=float, default=0.1)
    p.add_argument("--record", type=Path, default=None, help="write each step's rows here")
    args = p.parse_args()
    with QueueClient(args.address, args.dataset, rank=0, world_size=1) as probe:
        vocab_size = int(probe.meta["vocab_size"])
    pl.seed_everything(0, verbose=False)
    datamodule = QueueDataModule(args.address, args.dataset, batch_size=args.batch_size)
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(
            dirpath=args.ckpt_dir, filename="step{step:04d}", auto_insert_metric_name=False,
            every_n_train_steps=args.save_every, save_top_k=-1, save_last=True,
        )
    ]  # fmt: skip
    reweighting = None
    if args.reweight_every:
        reweighting = MixtureReweighting(
            datamodule, every_n_steps=args.reweight_every, eta=args.eta, floor=args.floor
        )
        callbacks.append(reweighting)
    if args.record is not None:
        callbacks.append(RowRecorder(args.record))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Bigram(vocab_size, args.lr), datamodule=datamodule, ckpt_path=args.resume)
    if trainer.is_global_zero:
        for step, weights, at in reweighting.history if reweighting else []:
            shown = ", ".join(f"{w:.4f}" for w in weights)
            print(f"reweighted at step {step}: {shown} (from seq {at})", flush=True)
        print(f"done at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
