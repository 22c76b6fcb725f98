"""Data-parallel training from a batchqueue server: torchrun, the gloo backend, CPU.

    queue-server &                                   # serves stdlib_char by default
    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --steps 200

torchrun sets RANK and WORLD_SIZE; QueueClient reads them, so rank r of W leases only the
files whose seq is r modulo W: each rank gets its own stream and no batch is read twice,
with no sampler and no data code beyond `client.get_batch("train")`. DDP averages the
gradients; the loss printed is the mean over ranks.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from queue_client import QueueClient


class CharMLP(nn.Module):
    """Predicts each next character from the last `context` ones: tiny, and it learns fast."""

    def __init__(
        self, vocab_size: int, context: int = 3, n_embd: int = 32, hidden: int = 128
    ) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(context * n_embd, hidden), nn.GELU(), nn.Linear(hidden, vocab_size)
        )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        emb = self.tok(idx)  # [B, T, E]
        # The embeddings of positions t-context+1..t side by side (zeros before the start).
        padded = F.pad(emb, (0, 0, self.context - 1, 0))
        windows = torch.cat([padded[:, i : i + idx.shape[1]] for i in range(self.context)], dim=-1)
        logits = self.mlp(windows)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def fingerprint(batch: torch.Tensor) -> int:
    digest = hashlib.blake2b(batch.numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


# The last collective's handle, held until the process exits: gloo's thread drops its own
# reference after the collective completes, and were that the last one, it would hand the
# tensors back to Python (taking the GIL) perhaps while the interpreter exits, which aborts
# the process. Held here, the handle goes with Python's own objects, on the main thread.
LAST_COLLECTIVE: list[object] = []


def gather_over_ranks(values: list[int]) -> list[list[int]]:
    """Every rank's `values` (the same number on each)."""
    mine = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    work = dist.all_gather(out, mine, async_op=True)
    LAST_COLLECTIVE.append(work)
    work.wait()
    return [t.tolist() for t in out]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--address", default=os.environ.get("BATCHQUEUE_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--dataset", default="stdlib_char")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--expect-loss-drop",
        type=float,
        default=0.0,
        help="exit 1 unless the mean loss fell by this much",
    )
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    seen: list[int] = []
    with QueueClient(args.address, args.dataset) as client:  # rank and world size from torchrun
        model = DistributedDataParallel(CharMLP(client.meta["vocab_size"]))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        first = smoothed = None
        for step in range(1, args.steps + 1):
            x, y = client.get_batch("train")
            seen.append(fingerprint(x))
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step == 1 or step % args.log_every == 0 or step == args.steps:
                mean = mean_over_ranks(loss.item())
                first = mean if first is None else first
                smoothed = mean if smoothed is None else 0.5 * smoothed + 0.5 * mean
                if rank == 0:
                    print(f"step {step}: loss {mean:.3f}", flush=True)

    # Each rank leased its own stream: no batch was read by two ranks.
    gathered = gather_over_ranks(seen)
    dist.destroy_process_group()
    assert first is not None and smoothed is not None
    if rank != 0:
        return 0 if first - smoothed >= args.expect_loss_drop else 1
    readers = Counter(fp for fps in gathered for fp in set(fps))
    shared = [fp for fp, n in readers.items() if n > 1]
    print(
        f"{world} ranks read {sum(len(s) for s in gathered)} batches; batches read by more than one rank: {len(shared)}"
    )
    print(f"loss {first:.3f} -> {smoothed:.3f}")
    if shared:
        print("ranks shared batches: their streams overlap")
        return 1
    if first - smoothed < args.expect_loss_drop:
        print(
            f"expected the loss to fall by {args.expect_loss_drop}, it fell by {first - smoothed:.3f}"
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
