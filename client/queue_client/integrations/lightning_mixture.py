"""MixtureReweighting: a Lightning callback that moves a mixture's weights toward the sources
whose loss is high, through QueueClient.set_mixture (docs/mixtures.md, docs/lightning.md).

training_step returns each row's loss beside the loss it minimises:

    def training_step(self, batch, batch_idx):
        rows = self.row_losses(batch["x"], batch["y"])   # [B]
        return {"loss": rows.mean(), "row_losses": rows.detach()}

After each batch the callback adds the rows' losses per source (batch["source"]) and sums
them over the ranks, so every rank holds the same sums; every `every_n_steps` optimizer steps
it takes one exponentiated-gradient step (integrations/reweight.py) and every rank calls
set_mixture, which lands on one seq for all (the call is anchored to the caller's place in
its stream). Its weights and sums go into Lightning's checkpoint (state_dict), and the server
journals each call, so a resume reweights exactly as the uninterrupted run did.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from queue_client.errors import InvalidRequest
from queue_client.integrations.lightning import QueueDataModule
from queue_client.integrations.reweight import exponentiated_gradient, mean_loss, source_sums


class MixtureReweighting(pl.Callback):
    """Reweights the mixture of `datamodule` every `every_n_steps` optimizer steps from the
    per-source mean loss since the last step: w <- w * exp(eta * loss), normalised, mixed
    with `floor` of the uniform mixture. `loss_key`: the key of training_step's output that
    holds each row's loss."""

    def __init__(
        self,
        datamodule: QueueDataModule,
        *,
        every_n_steps: int,
        eta: float = 1.0,
        floor: float = 0.1,
        loss_key: str = "row_losses",
    ) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise InvalidRequest(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        exponentiated_gradient(torch.ones(1), torch.zeros(1), eta, floor)  # checks eta, floor
        self.datamodule = datamodule
        self.every_n_steps = every_n_steps
        self.eta, self.floor, self.loss_key = eta, floor, loss_key
        self.weights: torch.Tensor | None = None  # normalised, in the sources' index order
        self.sums: torch.Tensor | None = None  # [2, k] since the last step, over all ranks
        self.last_step = -1  # the optimizer step last reweighted at
        self.history: list[tuple[int, list[float], int]] = []  # (step, weights, from seq)

    def names(self) -> list[str]:
        mixture = self.datamodule.client.meta.get("mixture")
        if not isinstance(mixture, dict):
            raise InvalidRequest(
                f"dataset {self.datamodule.client.dataset!r} is not a mixture: "
                "MixtureReweighting needs one with [datasets.NAME.sources.SOURCE] tables"
            )
        return [str(n) for n in mixture["sources"]]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        names = self.names()
        if not isinstance(outputs, dict) or self.loss_key not in outputs:
            raise InvalidRequest(
                f"MixtureReweighting needs training_step to return a dict with "
                f"{self.loss_key!r}: each row's loss, shape [batch]"
            )
        if self.weights is None:
            config = torch.tensor(self.datamodule.client.meta["mixture"]["weights"])
            self.weights = (config / config.sum()).to(torch.float64)
        step_sums = source_sums(outputs[self.loss_key], batch["source"], len(names))
        step_sums = trainer.strategy.reduce(step_sums, reduce_op="sum").cpu()
        self.sums = step_sums if self.sums is None else self.sums + step_sums
        step = trainer.global_step
        if step % self.every_n_steps or step == self.last_step:
            return
        self.weights = exponentiated_gradient(
            self.weights, mean_loss(self.sums), self.eta, self.floor
        )
        weights = self.weights.tolist()
        at = self.datamodule.client.set_mixture(dict(zip(names, weights, strict=True)))
        self.history.append((step, weights, at))
        self.sums, self.last_step = None, step
        pl_module.log_dict({f"mixture/{n}": w for n, w in zip(names, weights, strict=True)})

    # ---- checkpoints: the same on every rank, so rank 0's is everyone's ----------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "weights": None if self.weights is None else self.weights.tolist(),
            "sums": None if self.sums is None else self.sums.tolist(),
            "last_step": self.last_step,
            "history": [list(h) for h in self.history],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        weights, sums = state_dict.get("weights"), state_dict.get("sums")
        self.weights = None if weights is None else torch.tensor(weights, dtype=torch.float64)
        self.sums = None if sums is None else torch.tensor(sums, dtype=torch.float64)
        self.last_step = int(state_dict.get("last_step", -1))
        self.history = [(int(s), list(w), int(a)) for s, w, a in state_dict.get("history", [])]


__all__ = ["MixtureReweighting"]
