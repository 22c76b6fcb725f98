"""From a checkpointed client state to each split's reading plan, at any world size.

A rank's stream of one split is a plan: a few explicit files, each from a row offset,
then the strided seqs next_seq, next_seq + W, next_seq + 2W, ... A fresh stream is the plan
([], rank). The state saved per split is the same plan, written as the file of the next batch
(`seq`, `offset`), the files after it (`pending`) and `next_seq`. Offsets count rows (state
version 3), so a trainer that changes its batch size (a ramp) resumes exactly; a state of
version 1 or 2 counted batches of the file's unit, and is read as that many rows each.

Elastic resume, from W ranks to W' ranks. Take every old rank's remaining stream (from all W
states, or derived from one state when ranks step in lockstep, as DDP ranks do: each rank is
then at the same place in its own stream). Let L = lcm(W, W') and B the smallest multiple of L
at or above every old rank's next_seq. The carried files are every file the old ranks still
had to read below B (each partial file from its offset), sorted by seq. New rank r' reads the
carried files whose index in that list is r' modulo W', then seqs B + r', B + r' + W', ...
Every batch not yet consumed is read exactly once, and after the carried files each new rank
is back on the plain rule seq = rank (mod W').

A state names its dataset and the fingerprint of the config its files were made under, so it
resumes on any set of servers, fresh disks included, that serve the same data, and is refused
with both values named on servers that serve something else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from queue_client.errors import InvalidRequest
from queue_client.format.batchfile import MAX_SEQ
from queue_client.world import World

# 2 added config_fingerprint; 3 counts offsets in rows, not batches. Versions 1 and 2 still load.
STATE_VERSION = 3
_KEYS = ("version", "dataset", "rank", "world_size", "splits")
_KEYS_SINCE = {2: ("config_fingerprint",)}
_ROWS_SINCE = 3


@dataclass(frozen=True)
class StreamPlan:
    """Explicit (seq, offset) files first, then next_seq, next_seq + stride, ..."""

    items: tuple[tuple[int, int], ...]
    next_seq: int

    def normalized(self, stride: int) -> StreamPlan:
        """Fold trailing items that are just the stride's next seqs back into next_seq."""
        items, next_seq = list(self.items), self.next_seq
        while len(items) > 1 and items[-1] == (next_seq - stride, 0):
            items.pop()
            next_seq -= stride
        return StreamPlan(tuple(items), next_seq)

    def to_state(self, stride: int) -> dict[str, Any]:
        if self.items:
            (seq, offset), rest = self.items[0], self.items[1:]
            return {
                "seq": seq,
                "offset": offset,
                "next_seq": self.next_seq,
                "pending": [list(i) for i in rest],
            }
        return {
            "seq": self.next_seq,
            "offset": 0,
            "next_seq": self.next_seq + stride,
            "pending": [],
        }


def _plan_from_state(
    split: str, pos: Mapping[str, Any], rows_per_file: int | None = None, unit: str = "rows"
) -> StreamPlan:
    """The plan a state's position of one split describes; an offset past the end of a file
    of rows_per_file rows (or batches, `unit`) is refused (it names no row of that file)."""

    def nat(value: Any, what: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEQ:
            raise InvalidRequest(
                f"state of split {split!r}: {what} is {value!r}, expected an int in [0, {MAX_SEQ}]"
            )
        return value

    def offset_in(seq: int, value: Any, what: str) -> int:
        offset = nat(value, what)
        if rows_per_file is not None and offset > rows_per_file:
            raise InvalidRequest(
                f"state of split {split!r}: seq {seq} at {what} {offset}, but a file holds "
                f"{rows_per_file} {unit}, so an offset lies in [0, {rows_per_file}]: "
                "the state belongs to another config, or was edited"
            )
        return offset

    seq = nat(pos.get("seq"), "seq")
    offset = offset_in(seq, pos.get("offset"), "offset")
    next_seq = nat(pos.get("next_seq"), "next_seq")
    pending = pos.get("pending", [])
    if not isinstance(pending, list):
        raise InvalidRequest(f"state of split {split!r}: pending must be a list of [seq, offset]")
    items = [(seq, offset)]
    for item in pending:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise InvalidRequest(
                f"state of split {split!r}: pending item {item!r} is not [seq, offset]"
            )
        pending_seq = nat(item[0], "a pending seq")
        items.append((pending_seq, offset_in(pending_seq, item[1], "a pending offset")))
    return StreamPlan(tuple(items), next_seq)


def _check_state(
    state: Any,
    dataset: str,
    fingerprint: str | None,
    batches_per_file: int | None = None,
    file_batch_size: int = 1,
) -> Mapping[str, Any]:
    """The state checked, with its offsets in rows whatever its version."""
    if not isinstance(state, Mapping):
        raise InvalidRequest(
            f"state must be a dict from QueueClient.state_dict(), got {type(state).__name__}"
        )
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise InvalidRequest(
            f"state lacks keys {missing}: pass what QueueClient.state_dict() returned"
        )
    version = state["version"]
    if version not in range(1, STATE_VERSION + 1) or isinstance(version, bool):
        raise InvalidRequest(
            f"state version {version!r} is not supported (expected 1 to {STATE_VERSION})"
        )
    missing = [k for v, keys in _KEYS_SINCE.items() if version >= v for k in keys if k not in state]
    if missing:
        raise InvalidRequest(
            f"state of version {version} lacks keys {missing}: pass what QueueClient.state_dict() "
            "returned"
        )
    if state["dataset"] != dataset:
        raise InvalidRequest(
            f"state is for dataset {state['dataset']!r}, this client reads {dataset!r}"
        )
    saved = state.get("config_fingerprint") or None
    if saved is not None and fingerprint and saved != fingerprint:
        raise InvalidRequest(
            f"state of dataset {dataset!r} was saved under config fingerprint {saved!r}, but "
            f"the server serves it under {fingerprint!r}: its files hold other batches "
            "(provider, batch_size, batches_per_file, seed, workers or args differ). Resume "
            "with the config the state was saved under"
        )
    World(state["rank"], state["world_size"])
    if not isinstance(state["splits"], Mapping):
        raise InvalidRequest("state['splits'] must be a dict of split name to position")
    rows = None if batches_per_file is None else batches_per_file * file_batch_size
    saved_rows = state.get("rows_per_file")
    if version >= _ROWS_SINCE and saved_rows is not None and rows and saved_rows != rows:
        raise InvalidRequest(
            f"state of dataset {dataset!r} counts {saved_rows!r} rows per file, but the "
            f"server's files hold {rows}: the state belongs to another config of it"
        )
    if version >= _ROWS_SINCE:
        return state
    return _batches_to_rows(state, batches_per_file, file_batch_size)


def _batches_to_rows(
    state: Mapping[str, Any], batches_per_file: int | None, file_batch_size: int
) -> Mapping[str, Any]:
    """A state of version 1 or 2 (offsets in batches of the file's unit) in rows."""
    splits = {}
    for split, pos in state["splits"].items():
        if not isinstance(pos, Mapping):
            raise InvalidRequest(f"state of split {split!r} must be a dict, got {pos!r}")
        plan = _plan_from_state(split, pos, batches_per_file, unit="batches")
        items = [(seq, offset * file_batch_size) for seq, offset in plan.items]
        splits[split] = {
            "seq": items[0][0],
            "offset": items[0][1],
            "next_seq": plan.next_seq,
            "pending": [list(i) for i in items[1:]],
        }
    return {**state, "version": STATE_VERSION, "splits": splits}


def _lockstep_states(
    state: Mapping[str, Any], rows_per_file: int | None
) -> list[Mapping[str, Any]]:
    """Every rank's state from one rank's, assuming each rank read as many batches."""
    w, q = state["world_size"], state["rank"]
    out: list[Mapping[str, Any]] = []
    for r in range(w):
        splits = {}
        for split, pos in state["splits"].items():
            plan = _plan_from_state(split, pos, rows_per_file)
            if (
                len(plan.items) != 1
                or plan.next_seq != plan.items[0][0] + w
                or plan.items[0][0] % w != q
            ):
                raise InvalidRequest(
                    f"state of split {split!r} was itself resumed elastically; pass every rank's state "
                    "(gather them with torch.distributed.all_gather_object) instead of one"
                )
            seq, offset = plan.items[0]
            splits[split] = {
                "seq": seq - q + r,
                "offset": offset,
                "next_seq": plan.next_seq - q + r,
                "pending": [],
            }
        out.append({**state, "rank": r, "splits": splits})
    return out


def elastic_plan(old: Sequence[StreamPlan], old_world: int, world: World) -> StreamPlan:
    """The plan of `world.rank` among world.world_size ranks, from the W old ranks' plans."""
    lcm = math.lcm(old_world, world.world_size)
    top = max([p.next_seq for p in old] + [s + 1 for p in old for s, _ in p.items])
    boundary = lcm * math.ceil(top / lcm)
    carried: list[tuple[int, int]] = []
    for plan in old:
        carried.extend(plan.items)
        carried.extend((s, 0) for s in range(plan.next_seq, boundary, old_world))
    carried.sort()
    seqs = [s for s, _ in carried]
    if len(set(seqs)) != len(seqs):
        raise InvalidRequest("the ranks' states overlap: two ranks claim the same file")
    mine = tuple(carried[world.rank :: world.world_size])
    return StreamPlan(mine, boundary + world.rank)


def plan_resume(
    state: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    world: World,
    dataset: str,
    *,
    fingerprint: str | None = None,
    batches_per_file: int | None = None,
    file_batch_size: int = 1,
) -> dict[str, StreamPlan]:
    """{split: plan} for this rank, from one rank's state or a list of every rank's state;
    a plan's offsets count rows.

    fingerprint: the served dataset's config fingerprint (meta's "config_fingerprint"); a
    state saved under another is refused. batches_per_file and file_batch_size: the files'
    shape; offsets past a file's end are refused, and the batch offsets of old states
    (version 1 and 2) are read as that many batches of file_batch_size rows."""
    nb = None if batches_per_file is None else batches_per_file * file_batch_size
    fb = file_batch_size
    if isinstance(state, Mapping):
        state = _check_state(state, dataset, fingerprint, batches_per_file, fb)
        if state["world_size"] == world.world_size and state["rank"] == world.rank:
            return {split: _plan_from_state(split, p, nb) for split, p in state["splits"].items()}
        states: list[Mapping[str, Any]] = _lockstep_states(state, nb)
    else:
        states = [_check_state(s, dataset, fingerprint, batches_per_file, fb) for s in state]
        if not states:
            raise InvalidRequest("an empty list of states")
        sizes = {s["world_size"] for s in states}
        if len(sizes) != 1:
            raise InvalidRequest(f"the states come from different world sizes {sorted(sizes)}")
        states.sort(key=lambda s: s["rank"])
        if [s["rank"] for s in states] != list(range(states[0]["world_size"])):
            raise InvalidRequest(
                f"need one state per rank 0..{states[0]['world_size'] - 1}, got ranks {[s['rank'] for s in states]}"
            )
    old_world = states[0]["world_size"]
    if old_world == world.world_size:
        mine = states[world.rank]
        return {split: _plan_from_state(split, p, nb) for split, p in mine["splits"].items()}
    splits = set(states[0]["splits"])
    plans = {}
    for split in sorted(splits):
        old = [_plan_from_state(split, s["splits"][split], nb) for s in states]
        plans[split] = elastic_plan(old, old_world, world)
    return plans
