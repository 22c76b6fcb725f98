"""Which alpha applies to each served batch: a piecewise-linear schedule, then overrides.

Alpha blends the target distribution: target = (1 - alpha) * corpus + alpha * uniform. The
config sets a constant (`curriculum_alpha`) or a schedule of [x, alpha] points over training
steps or served tokens; SetCurriculum overrides it from a given seq on. Everything here is a
pure function of (seq, batch index, world size, tokens served), so composition is
deterministic whatever the timing.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

UNITS = ("step", "tokens")


@dataclass(frozen=True)
class AlphaSchedule:
    alpha: float = 1.0
    points: tuple[tuple[float, float], ...] = ()
    unit: str = "step"

    @classmethod
    def from_json(cls, raw: dict) -> AlphaSchedule:
        return cls(
            float(raw["alpha"]),
            tuple((float(x), float(a)) for x, a in raw.get("points", ())),
            raw.get("unit", "step"),
        )

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "points": [list(p) for p in self.points], "unit": self.unit}

    def scheduled(self, step: int, tokens: int) -> float:
        """The config's alpha at a training step (per rank) or a count of served tokens."""
        if not self.points:
            return self.alpha
        x = float(step if self.unit == "step" else tokens)
        xs = [p[0] for p in self.points]
        i = bisect.bisect_right(xs, x)
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            return self.points[-1][1]
        (x0, a0), (x1, a1) = self.points[i - 1], self.points[i]
        return a0 + (a1 - a0) * (x - x0) / (x1 - x0)


def override_at(overrides: Sequence[Sequence], seq: int) -> tuple[bool, float | None]:
    """(found, alpha) of the override in force at `seq`: the one with the greatest start <= seq,
    the later call winning a tie. alpha None means "back to the schedule"."""
    best: tuple[int, int] | None = None
    value: float | None = None
    for order, (start, alpha) in enumerate(overrides):
        if start <= seq and (best is None or (start, order) > best):
            best, value = (start, order), alpha
    return best is not None, value


def alpha_for(
    schedule: AlphaSchedule,
    overrides: Sequence[Sequence],
    seq: int,
    index: int,
    batches_per_file: int,
    world_size: int,
    tokens: int,
) -> float:
    """Alpha for batch `index` of served file `seq`."""
    found, value = override_at(overrides, seq)
    if found and value is not None:
        return float(value)
    step = (seq // world_size) * batches_per_file + index
    return schedule.scheduled(step, tokens)


def check_points(points: object, where: str) -> tuple[tuple[float, float], ...]:
    """Validate a config schedule, naming the offending point."""
    from queue_client.errors import ConfigError

    if not isinstance(points, (list, tuple)):
        raise ConfigError(f"{where} = {points!r} is invalid: expected a list of [x, alpha] pairs")
    out: list[tuple[float, float]] = []
    for i, point in enumerate(points):
        ok = (
            isinstance(point, (list, tuple))
            and len(point) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in point)
        )
        if not ok:
            raise ConfigError(f"{where}[{i}] = {point!r} is invalid: expected [x, alpha]")
        x, a = float(point[0]), float(point[1])
        if not 0.0 <= a <= 1.0:
            raise ConfigError(f"{where}[{i}] = {point!r} is invalid: alpha must be in [0, 1]")
        if x < 0 or (out and x <= out[-1][0]):
            raise ConfigError(
                f"{where}[{i}] = {point!r} is invalid: x must be >= 0 and increase from point to point"
            )
        out.append((x, a))
    return tuple(out)
