"""Turning a checkpointed client state into each split's starting position."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from queue_client.errors import InvalidRequest
from queue_client.world import World

_KEYS = ("version", "dataset", "rank", "world_size", "splits")


def plan_resume(state: Mapping[str, Any], world: World, dataset: str) -> dict[str, tuple[int, int]]:
    """{split: (seq, offset)} for this rank, from a state saved by QueueClient.state_dict()."""
    if not isinstance(state, Mapping):
        raise InvalidRequest(f"state must be a dict from QueueClient.state_dict(), got {type(state).__name__}")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise InvalidRequest(f"state lacks keys {missing}: pass what QueueClient.state_dict() returned")
    if state["version"] != 1:
        raise InvalidRequest(f"state version {state['version']!r} is not supported (expected 1)")
    if state["dataset"] != dataset:
        raise InvalidRequest(f"state is for dataset {state['dataset']!r}, this client reads {dataset!r}")
    if state["world_size"] != world.world_size:
        raise InvalidRequest(
            f"state was saved with world_size {state['world_size']}, this client has {world.world_size}"
        )
    if state["rank"] != world.rank:
        raise InvalidRequest(f"state was saved by rank {state['rank']}, this client is rank {world.rank}")
    positions = {}
    for split, pos in state["splits"].items():
        seq, offset = pos.get("seq"), pos.get("offset")
        if not isinstance(seq, int) or not isinstance(offset, int) or seq < 0 or offset < 0:
            raise InvalidRequest(f"state of split {split!r} has seq={seq!r}, offset={offset!r}: expected ints >= 0")
        if not world.owns(seq):
            raise InvalidRequest(f"state of split {split!r}: seq {seq} is not one of rank {world.rank}'s seqs")
        positions[split] = (seq, offset)
    return positions
