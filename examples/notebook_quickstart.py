"""The quick start, as a notebook would run it: no separate server to launch.

    python examples/notebook_quickstart.py                     # Python's stdlib sources as text
    python examples/notebook_quickstart.py --input input.txt --steps 200

`serve(...)` starts a queue-server as a child process for the `with` block (its worker
processes prepare batches while this one trains), waits until the dataset serves, and stops
it cleanly at the end. In a Jupyter notebook the same lines work in a cell as they are: the
API is synchronous and never touches the notebook's event loop (`async with serve_async(...)`
is there too). The data root persists, so a second run serves the files already made.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from queue_client import QueueClient
from queue_server import DatasetConfig, serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", help="a text file (default: Python's standard library sources)")
    p.add_argument("--data-root", default="queue_data", help="where the batch files live")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument(
        "--expect-loss-drop", type=float, default=None, help="exit 1 unless the loss fell this much"
    )
    args = p.parse_args(argv)

    # Cell 1: the dataset, as typed config (a TOML file or string works the same).
    dataset = DatasetConfig(
        name="chars",
        provider="char_lm",
        batch_size=16,
        batches_per_file=20,
        args={"block_size": 64, **({"input": args.input} if args.input else {})},
    )

    # Cell 2: serve it for the block, and train a bigram model on its batches.
    with serve(dataset, data_root=args.data_root) as address:
        with QueueClient(address, "chars", rank=0, world_size=1) as client:
            vocab = client.meta["vocab_size"]
            logits_of = torch.nn.Embedding(vocab, vocab)
            opt = torch.optim.Adam(logits_of.parameters(), lr=0.05)
            losses = []
            for step in range(args.steps):
                x, y = client.get_batch("train")
                loss = F.cross_entropy(logits_of(x.long()).view(-1, vocab), y.long().view(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if step % 20 == 0 or step == args.steps - 1:
                    print(f"step {step}: loss {loss.item():.3f}")
    print(f"served from {address}, now stopped; batch files kept under {args.data_root}")

    drop = losses[0] - min(losses[-10:])
    if args.expect_loss_drop is not None and drop < args.expect_loss_drop:
        print(f"loss fell by {drop:.3f}, less than {args.expect_loss_drop}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
