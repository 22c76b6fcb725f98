"""Online data mixing from the trainer: per-source loss, exponentiated-gradient reweighting
through SetMixture, and a checkpoint that resumes mid-run (docs/mixtures.md).

    queue-server --config my_mixture.toml &
    python examples/train_mixture.py --dataset mix --steps 400 --reweight-every 50 \
        --checkpoint ckpt.pt --checkpoint-every 25 --resume
    # killed at any point (SIGKILL, preemption)? the same command carries on from the last
    # checkpoint, and steps on exactly as the uninterrupted run would

Every row of a mixture batch carries its source's index (`batch["source"]`), so the loss of
each source is one scatter of the per-row loss. Every `--reweight-every` steps the weights
move toward the sources whose loss is high (w_s <- w_s * exp(eta * loss_s), normalised, mixed
with a little of the uniform mixture so no source starves), in the spirit of online data
mixing, and go to the server with `client.set_mixture`. The server journals each call, so a
resume needs only the client's state_dict: each source continues where it stopped.

With --checkpoint, the model, the optimizer, the weights, the losses summed since the last
reweighting and `client.state_dict()` are saved every --checkpoint-every steps and at the end,
each save written beside the file and renamed over it (a kill mid-save leaves the previous
checkpoint whole). --stop-at saves and stops after that step, as a kill would after a save.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from queue_client import QueueClient


class Bigram(nn.Module):
    """The smallest language model that learns: next-token logits from the current token."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.logits = nn.Embedding(vocab_size, vocab_size)

    def row_losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of each row: [batch]."""
        logits = self.logits(x)
        per_token = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        return per_token.view(y.shape).mean(dim=1)


def per_source(losses: torch.Tensor, source: torch.Tensor, k: int) -> torch.Tensor:
    """Sum of row losses and row count of each source: [2, k]."""
    sums = torch.zeros(k).index_add_(0, source, losses.detach())
    counts = torch.zeros(k).index_add_(0, source, torch.ones_like(losses))
    return torch.stack([sums, counts])


def exponentiated_gradient(
    weights: torch.Tensor, loss: torch.Tensor, eta: float, floor: float
) -> torch.Tensor:
    """One step of w <- w * exp(eta * loss), normalised, blended with `floor` of uniform."""
    w = weights * torch.exp(eta * (loss - loss.max()))  # shifted: the same after normalising
    w = w / w.sum()
    return (1 - floor) * w + floor / len(w)


def save_atomically(state: dict[str, Any], path: Path) -> None:
    """torch.save into a file beside `path`, flushed to disk, then renamed over `path`: the
    checkpoint on disk is always a whole one, the new or the previous."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a power cut
    finally:
        os.close(folder)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--dataset", default="mix")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--reweight-every", type=int, default=50)
    p.add_argument("--eta", type=float, default=1.0)
    p.add_argument("--floor", type=float, default=0.1, help="share of the uniform mixture")
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument(
        "--checkpoint-every", type=int, default=50, help="with --checkpoint: save every N steps"
    )
    p.add_argument("--stop-at", type=int, default=0, help="save and stop after this step")
    p.add_argument("--resume", action="store_true", help="carry on from --checkpoint if it exists")
    args = p.parse_args()
    if args.checkpoint_every < 1:
        p.error(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    if args.resume and args.checkpoint is None:
        p.error("--resume needs --checkpoint")
    torch.manual_seed(0)
    with QueueClient(args.address, args.dataset) as client:
        names = list(client.meta["mixture"]["sources"])
        k = len(names)
        model = Bigram(client.meta["vocab_size"])
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        weights = torch.tensor(client.meta["mixture"]["weights"], dtype=torch.float32)
        weights = weights / weights.sum()
        seen = torch.zeros(2, k)
        step = 0
        if args.resume and args.checkpoint.exists():
            # A plain-data checkpoint (weights_only): no code runs when it is loaded.
            ckpt = torch.load(args.checkpoint, weights_only=True)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            weights, seen, step = ckpt["weights"], ckpt["seen"], int(ckpt["step"])
            client.load_state_dict(ckpt["data"])
            print(f"resumed at step {step}", flush=True)
        elif args.resume:
            print(f"no checkpoint at {args.checkpoint} yet: starting at step 0", flush=True)
        while step < args.steps:
            batch = client.get_batch("train")
            losses = model.row_losses(batch["x"], batch["y"])
            seen += per_source(losses, batch["source"], k)
            opt.zero_grad(set_to_none=True)
            losses.mean().backward()
            opt.step()
            step += 1
            if step % args.reweight_every == 0:
                mean = seen[0] / seen[1].clamp(min=1)
                weights = exponentiated_gradient(weights, mean, args.eta, args.floor)
                at = client.set_mixture(dict(zip(names, weights.tolist(), strict=True)))
                shown = ", ".join(
                    f"{n} loss {float(loss):.3f} weight {float(w):.3f}"
                    for n, loss, w in zip(names, mean, weights, strict=True)
                )
                print(f"step {step}: {shown} (from seq {at})", flush=True)
                seen.zero_()
            stop = step == args.stop_at
            due = stop or step % args.checkpoint_every == 0 or step == args.steps
            if args.checkpoint is not None and due:
                state = {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "weights": weights,
                    "seen": seen,  # the next reweighting's losses so far
                    "step": step,
                    "data": client.state_dict(),
                }
                save_atomically(state, args.checkpoint)
                print(f"saved at step {step}" + ("; stopping" if stop else ""), flush=True)
                if stop:
                    return 0
        final = losses.mean().item()
        print(f"done at step {step}: loss {final:.3f}", flush=True)
    return 0 if math.isfinite(final) else 1


if __name__ == "__main__":
    raise SystemExit(main())
