"""A trainer rank in its own process, for the ordering and resume tests.

    python rank_client.py SPEC.json

SPEC: {"address", "rank", "world_size", "split", "hold": bool, "fetch_process": bool, "jobs": [{"dataset",
"batches", "sizes": [batch_size, ...]|null, "state_in": path|null, "state_out": path|null,
"out": path}]}. With "sizes", each get_batch takes the next size (a ramp) instead of
`batches` default ones, and each line also holds the batch's rows of its first field. For each job it
loads the state (one state dict, or a list of every rank's), reads `batches` batches and
writes one line per batch: the batch's position (seq, offset in batches) and a hash of its bytes. With
"hold" it prints READY and waits on stdin, holding its leases until it is killed.
"""

from __future__ import annotations

import hashlib
import json
import sys

from queue_client import QueueClient


def batch_hash(batch: object) -> str:
    h = hashlib.sha1()
    tensors = batch if isinstance(batch, tuple) else tuple(batch.values())
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    split = spec.get("split", "train")
    clients = []
    for job in spec["jobs"]:
        client = QueueClient(
            spec["address"],
            job["dataset"],
            rank=spec["rank"],
            world_size=spec["world_size"],
            timeout_s=spec.get("timeout_s", 60),
            fetch_process=spec.get("fetch_process", False),
        )
        clients.append(client)
        if job.get("state_in"):
            client.load_state_dict(json.load(open(job["state_in"])))
        sizes = job.get("sizes") or [None] * job["batches"]
        with open(job["out"], "w") as out:
            for size in sizes:
                pos = client.state_dict()["splits"].get(split)
                batch = client.get_batch(split, batch_size=size)
                if size is not None:
                    first = batch[0] if isinstance(batch, tuple) else next(iter(batch.values()))
                    out.write(json.dumps({"rows": first.tolist()}) + "\n")
                    continue
                if pos is None:  # the first batch of a fresh stream
                    pos = {"seq": spec["rank"], "offset": 0}
                # The state counts rows; these lines count batches of the file's unit.
                offset = pos["offset"] // client.file_batch_size
                out.write(
                    json.dumps({"seq": pos["seq"], "offset": offset, "hash": batch_hash(batch)})
                    + "\n"
                )
        if job.get("state_out"):
            with open(job["state_out"] + ".tmp", "w") as f:
                json.dump(client.state_dict(), f)
            import os

            os.replace(job["state_out"] + ".tmp", job["state_out"])
    if spec.get("hold"):
        print("READY", flush=True)
        sys.stdin.read()
    for client in clients:
        client.close()


if __name__ == "__main__":
    main()
