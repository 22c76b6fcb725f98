"""What every row shares: its settings, the Result record the report prints, robust statistics
and process memory.

Figures are medians of several interleaved repeats (or percentiles of many samples): the
machine is shared, and one slow repeat must not move a figure.
"""

from __future__ import annotations

import statistics
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Settings:
    """What the command line chose; rows scale their work by `quick`."""

    quick: bool
    text: Path | None
    workdir: Path
    repeats: int

    def pick(self, full: Any, quick: Any) -> Any:
        """`full` for the real run, `quick` for the smoke version."""
        return quick if self.quick else full


@dataclass
class Result:
    """One printed row. `ratio` reads as `ratio_label` says (e.g. "x faster", "x memcpy")."""

    row: str
    case: str
    value: float | None
    unit: str
    ref_name: str = ""
    ref_value: float | None = None
    ref_unit: str = ""
    ratio: float | None = None
    ratio_label: str = ""
    goal: str = ""
    met: bool | None = None
    note: str = ""
    skipped: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between samples."""
    data = sorted(values)
    if not data:
        raise ValueError("no samples")
    k = (len(data) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


_SPIN_BUFFER = bytes(16 * 1024)  # zlib.crc32 releases the GIL for buffers over 5 KiB


def spin_until(deadline_ns: int, *, hold_gil: bool) -> None:
    """Busy-wait, standing for a training step that keeps its core busy.

    hold_gil=False spins in C with the GIL released, as a trainer blocked on the GPU does (the
    CUDA driver spins inside a call that released the GIL); hold_gil=True spins in Python, as a
    step bound by Python code does, so the client's background threads wait for the GIL."""
    now = time.perf_counter_ns
    if hold_gil:
        while now() < deadline_ns:
            pass
    else:
        crc, buf = zlib.crc32, _SPIN_BUFFER
        while now() < deadline_ns:
            crc(buf)


def memory_mb(pid: int | str = "self") -> dict[str, float] | None:
    """VmRSS, VmHWM, RssAnon and RssFile of a process in MiB (Linux /proc), None elsewhere."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) / 1024
    return out or None


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with `digits` significant digits, without exponent for everyday sizes."""
    if value is None:
        return "-"
    rounded = float(f"{value:.{digits}g}")
    if rounded == 0:
        return "0"
    if abs(rounded) >= 10**digits:
        return f"{value:,.0f}"
    decimals = max(0, digits - 1 - int(f"{abs(rounded):e}".split("e")[1]))
    return f"{rounded:.{decimals}f}"
