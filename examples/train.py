"""Train a tiny GPT from a batchqueue server, nanoGPT style, on CPU or CUDA.

    queue-server &                      # serves stdlib_char by default
    python examples/train.py --steps 300

The only data code is `client.get_batch("train")`: batches are prepared by the server's
worker processes while this script trains.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from queue_client import QueueClient


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int = 2, n_head: int = 4, n_embd: int = 64
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head) for _ in range(n_layer)))
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--dataset", default="stdlib_char")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--transport",
        default="auto",
        choices=("auto", "file", "grpc"),
        help="how batch files reach this process: read under the data root, or streamed over "
        "gRPC (no shared disk needed)",
    )
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument(
        "--expect-loss-drop",
        type=float,
        default=0.0,
        help="exit 1 unless the loss fell by this much",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    with QueueClient(
        args.address, args.dataset, device=args.device, transport=args.transport
    ) as client:
        meta = client.meta
        model = TinyGPT(meta["vocab_size"], meta["block_size"]).to(args.device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        first = last = math.nan
        smoothed = None
        start = time.perf_counter()
        x, y = client.get_batch("train")
        for step in range(1, args.steps + 1):
            loss = model(x, y)
            x, y = client.get_batch("train")  # the next batch, while backward runs on this one
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            value = loss.item()
            smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
            if step == 1:
                first = value
            if step % args.eval_every == 0 or step == args.steps:
                with torch.no_grad():
                    vx, vy = client.get_batch("val")
                    val = model(vx, vy).item()
                print(
                    f"step {step}: train loss {smoothed:.3f}, val loss {val:.3f}, {(time.perf_counter() - start) / step * 1000:.1f} ms/step",
                    flush=True,
                )
            last = smoothed
    drop = first - last
    print(f"loss {first:.3f} -> {last:.3f}")
    if drop < args.expect_loss_drop:
        print(f"expected the loss to fall by {args.expect_loss_drop}, it fell by {drop:.3f}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
