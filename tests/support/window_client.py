"""A trainer rank that records which windows it read, for the token_shards epoch tests.

    python window_client.py ADDRESS DATASET RANK WORLD BATCHES OUT [STATE_IN] [STATE_OUT]

Writes one JSON line per batch: its position (seq, offset in batches) and each row's x and y[-1] (the
whole window of T+1 tokens). STATE_IN is one state dict or a list of every rank's.
"""

from __future__ import annotations

import json
import os
import sys

from queue_client import QueueClient


def main() -> None:
    address, dataset, rank, world, batches, out = sys.argv[1:7]
    state_in = sys.argv[7] if len(sys.argv) > 7 and sys.argv[7] != "-" else None
    state_out = sys.argv[8] if len(sys.argv) > 8 else None
    with QueueClient(
        address, dataset, rank=int(rank), world_size=int(world), timeout_s=120
    ) as client:
        if state_in:
            client.load_state_dict(json.load(open(state_in)))
        with open(out, "w") as f:
            for _ in range(int(batches)):
                pos = client.state_dict()["splits"].get("train") or {"seq": int(rank), "offset": 0}
                x, y = client.get_batch("train")
                rows = [[*xr, yr[-1]] for xr, yr in zip(x.tolist(), y.tolist(), strict=True)]
                offset = pos["offset"] // client.file_batch_size  # the state counts rows
                f.write(json.dumps({"seq": pos["seq"], "offset": offset, "rows": rows}) + "\n")
        if state_out:
            with open(state_out + ".tmp", "w") as f:
                json.dump(client.state_dict(), f)
            os.replace(state_out + ".tmp", state_out)


if __name__ == "__main__":
    main()
