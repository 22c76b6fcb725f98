"""SetMixture on a split: validated, placed at a seq every rank agrees on, journaled before
it is acknowledged, then sent with every produce (queue_providers.mixture reads it)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from queue_client import errors
from queue_client.mixture import check_weights
from queue_server.config.server import DatasetConfig
from queue_server.journal.records import MixtureChange

if TYPE_CHECKING:
    from queue_server.split.queue import SplitQueue

log = logging.getLogger("queue_server.mixture")


def source_names(config: DatasetConfig) -> list[str]:
    """The sources of a mixture dataset, in index order (the `source` field's values)."""
    return [s["name"] for s in config.args.get("sources", ())]


def config_weights(config: DatasetConfig) -> dict[str, float]:
    return {s["name"]: float(s["weight"]) for s in config.args.get("sources", ())}


def first_unmade(queue: SplitQueue) -> int:
    """The first seq past every seq made or being made by any slot."""
    plan = queue.production.plan
    return max(nxt + plan.slots if nxt in plan.in_production else nxt for nxt in plan.next_forward)


def set_mixture(
    queue: SplitQueue, weights: Mapping[str, float] | None, position: int | None, rank: int
) -> int:
    """Weights by source name (None: back to the config's weights and schedule) from a seq
    on; returns that seq. With the caller's position (the seq of the file it reads) the seq
    is the first round of W files past any that can be made already, so the same calls at the
    same steps give the same rows whatever the timing; without one, the next seq not made."""
    where = queue.where
    if not queue.mixture:
        raise errors.InvalidRequest(
            f"{where} is not a mixture: SetMixture needs a dataset with "
            f"[datasets.{queue.config.name}.sources.NAME] tables"
        )
    names = source_names(queue.config)
    parsed: dict[str, float] | None = None
    if weights is not None:
        try:
            values = check_weights(weights, names, f"SetMixture for {where}")
        except ValueError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        parsed = dict(zip(names, values, strict=True))
    if position is not None and position < 0:
        raise errors.InvalidRequest(f"position seq {position} for {where} is negative")
    at = first_unmade(queue)
    if position is not None:
        at = queue.schedule.change_point(position, at)
    queue._journal(MixtureChange(at, parsed, rank))
    queue.mixture_changes.append((at, parsed))
    log.info("%s: mixture weights %s from seq %d on", where, parsed or "of the config", at)
    return at
