"""SetMixture on a split: checked with the code that applies it, placed at a seq every rank
agrees on, journaled before it is acknowledged, then sent with every produce
(queue_providers.mixture reads it). A journal's mixture records are checked the same way
before they are replayed: one that cannot be applied is left out, named, never fatal."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from queue_client import errors
from queue_client.mixture import check_weights
from queue_server.config.server import DatasetConfig
from queue_server.journal.records import MixtureChange
from queue_server.steering.log import MIXTURE
from queue_server.steering.port import SteeredSplit

log = logging.getLogger("queue_server.mixture")

Changes = list[tuple[int, dict[str, float] | None]]


def source_names(config: DatasetConfig) -> list[str]:
    """The sources of a mixture dataset, in index order (the `source` field's values)."""
    return [s["name"] for s in config.args.get("sources", ())]


def config_weights(config: DatasetConfig) -> dict[str, float]:
    return {s["name"]: float(s["weight"]) for s in config.args.get("sources", ())}


def parse_weights(split: SteeredSplit, weights: Mapping[str, float] | None) -> dict | None:
    """Weights by source name, checked (InvalidRequest naming what is wrong); None stays None."""
    where = split.where
    if not split.mixture:
        raise errors.InvalidRequest(
            f"{where} is not a mixture: SetMixture needs a dataset with "
            f"[datasets.{split.config.name}.sources.NAME] tables"
        )
    if weights is None:
        return None
    names = source_names(split.config)
    try:
        values = check_weights(weights, names, f"SetMixture for {where}")
    except ValueError as exc:
        raise errors.InvalidRequest(str(exc)) from None
    return dict(zip(names, values, strict=True))


def check_applies(split: SteeredSplit, changes: Sequence[tuple[int, Mapping | None]]) -> None:
    """Build the row schedule the workers will build from `changes` (CPU work: run it in a
    thread); ValueError naming why it cannot be."""
    if split.mixture_view is not None:
        split.mixture_view.check(changes)


async def set_mixture(
    split: SteeredSplit, weights: Mapping[str, float] | None, position: int | None, rank: int
) -> int:
    """Weights by source name (None: back to the config's weights and schedule) from a seq
    on; returns that seq. With the caller's position (the seq of the file it reads) the seq
    is the first round of W files past any that can be made already, so the same calls at the
    same steps give the same rows whatever the timing; without one, the next seq not made.

    The change is applied, as the workers will apply it, before it is journaled: a change
    that cannot be (weights whose quotas or schedule cannot be built) is refused and changes
    nothing. Calls on one split are taken one at a time, so each is checked against the
    changes that precede it."""
    parsed = parse_weights(split, weights)
    if position is not None and position < 0:
        raise errors.InvalidRequest(f"position seq {position} for {split.where} is negative")
    async with split.steering_lock:
        if split.plane is not None:  # placed by the job's log: the same seq on every server
            provisional = split.change_point(position, split.plane.horizon)
            try:
                await asyncio.to_thread(
                    check_applies, split, [*split.mixture_changes, (provisional, parsed)]
                )
            except ValueError as exc:
                raise _refused(split, weights, exc) from None
            at = await split.plane.propose(MIXTURE, parsed, position, rank)
            log.info("%s: mixture weights %s from seq %d on", split.where, parsed, at)
            return at
        at = -1
        while True:  # production may pass the seq while the check runs: place it again
            placed = split.change_point(position, split.first_unmade())
            if placed == at:
                break
            at = placed
            try:
                await asyncio.to_thread(
                    check_applies, split, [*split.mixture_changes, (at, parsed)]
                )
            except ValueError as exc:
                raise _refused(split, weights, exc) from None
        split.append_record(MixtureChange(at, parsed, rank))
        split.mixture_changes.append((at, parsed))
    log.info("%s: mixture weights %s from seq %d on", split.where, parsed or "of the config", at)
    return at


def why_not_applied(split: SteeredSplit, at: int, weights: Mapping[str, float] | None) -> str:
    """Why a change from the control plane cannot follow the split's changes ("" if it can;
    CPU work: run it in a thread). Every server runs the same check on the same log, so a
    change left out is left out everywhere."""
    try:
        if weights is not None:
            check_weights(weights, source_names(split.config), "weights")
        check_applies(split, [*split.mixture_changes, (at, dict(weights) if weights else None)])
    except ValueError as exc:
        return (
            f"the change from seq {at} (weights {weights}) cannot be applied and is left out: {exc}"
        )
    return ""


def _refused(
    split: SteeredSplit, weights: Mapping[str, float] | None, exc: ValueError
) -> errors.InvalidRequest:
    return errors.InvalidRequest(
        f"SetMixture for {split.where}: weights {dict(weights or {})} cannot be applied: "
        f"{exc}; nothing was changed"
    )


def replayable(split: SteeredSplit, records: Sequence[MixtureChange]) -> tuple[Changes, list[str]]:
    """The journal's mixture changes that can be applied, in order, and a line naming each
    record left out and why (CPU work: run it in a thread). A record written by an older
    server, or one the config no longer fits (a source renamed), must not stop the dataset:
    no file past its seq could have been made with it."""
    kept: Changes = []
    refused: list[str] = []
    names = source_names(split.config)
    for i, record in enumerate(records):
        try:
            if record.weights is not None:
                check_weights(record.weights, names, "weights")
            check_applies(split, [*kept, (record.at, record.weights)])
        except ValueError as exc:
            refused.append(
                f"mixture change #{i + 1} of the journal (from seq {record.at}, weights "
                f"{record.weights}, rank {record.rank}) cannot be applied and is left out: {exc}"
            )
            continue
        kept.append((record.at, record.weights))
    return kept, refused
