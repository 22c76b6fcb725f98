"""Config checks shared by the config dataclasses: each error names the key, the value and
what was expected."""

from __future__ import annotations

import math
from typing import Any

from queue_client.errors import ConfigError


def check(cond: bool, key: str, value: Any, expected: str) -> None:
    if not cond:
        raise ConfigError(f"{key} = {value!r} is invalid: expected {expected}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def in_range(v: Any, low: float, high: float) -> bool:
    """A finite number in [low, high]: NaN, inf and absurd values overflow later conversions
    (seconds to integer milliseconds, deadlines), so they are refused here."""
    return is_number(v) and math.isfinite(v) and low <= v <= high
