"""What the mixture tests read: batches, each with the position it was served from."""

from __future__ import annotations

from typing import Any

from queue_client import QueueClient


def read_positioned(client: QueueClient, n: int, field: str) -> list[dict[str, Any]]:
    """n train batches: each {"seq", "offset" (in rows), field, "source"}, its position taken
    from the client's state before the batch (a fresh client starts at file `rank`)."""
    out = []
    for _ in range(n):
        state = client.state_dict()["splits"].get("train") or {"seq": client.world.rank}
        batch = client.get_batch("train")
        out.append(
            {
                "seq": state["seq"],
                "offset": state.get("offset", 0),
                field: batch[field].clone(),
                "source": batch["source"].clone(),
            }
        )
    return out
