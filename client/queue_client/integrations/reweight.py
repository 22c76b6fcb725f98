"""Online mixture weights from each source's loss, framework-free (docs/mixtures.md).

Every row of a mixture batch carries its source (`batch["source"]`), so a source's loss is one
scatter of the per-row loss. The step moves the weights toward the sources whose loss is high,
in the spirit of online data mixing:

    w_s <- w_s * exp(eta * loss_s),  normalised,  then (1 - floor) * w + floor / k

so no source starves. Sums are kept as [sum of losses, rows] per source; a caller that runs
several ranks adds them over ranks before a step, so every rank computes the same weights.
"""

from __future__ import annotations

import math

import torch


def source_sums(losses: torch.Tensor, source: torch.Tensor, k: int) -> torch.Tensor:
    """[2, k]: the sum of the rows' losses and the number of rows of each of k sources."""
    losses = losses.detach().to(torch.float64).flatten()
    source = source.to(device=losses.device, dtype=torch.int64).flatten()
    if losses.shape != source.shape:
        raise ValueError(
            f"one loss per row is needed: {tuple(losses.shape)} losses for "
            f"{tuple(source.shape)} rows' sources"
        )
    sums = torch.zeros(2, k, dtype=torch.float64, device=losses.device)
    sums[0].index_add_(0, source, losses)
    sums[1].index_add_(0, source, torch.ones_like(losses))
    return sums


def exponentiated_gradient(
    weights: torch.Tensor, loss: torch.Tensor, eta: float, floor: float
) -> torch.Tensor:
    """One step of w <- w * exp(eta * loss), normalised, blended with `floor` of uniform."""
    if not (math.isfinite(eta) and eta >= 0):
        raise ValueError(f"eta must be a finite number >= 0, got {eta!r}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must lie in [0, 1], got {floor!r}")
    w = weights * torch.exp(eta * (loss - loss.max()))  # shifted: the same after normalising
    w = w / w.sum()
    return (1 - floor) * w + floor / len(w)


def mean_loss(sums: torch.Tensor) -> torch.Tensor:
    """Each source's mean loss from [2, k] sums (0 for a source with no rows)."""
    return sums[0] / sums[1].clamp(min=1)


__all__ = ["exponentiated_gradient", "mean_loss", "source_sums"]
