"""Which source each row of a mixture split comes from: a pure, deterministic row schedule.

Weights are quantized to integer quotas over DENOMINATOR rows (largest remainder), and row
n+1 goes to the source of the largest deficit, argmax_s (T_s(n+1) - c_s(n)), ties to the
lowest index, where T_s is the target count (the sum of each weight segment's weight times its
rows) and c_s the realised one. With constant weights of up to three sources the counts stay
within one row of the target at every prefix; with more sources, or just after a change,
they may stray slightly past one row (1.25 at most in searches; under two). Deficits carry
across a weight change, so the counts track the cumulative target.

Counting rows at any n is cheap, never a simulation from row 0. In integer units
d_s = DENOMINATOR * (T_s - c_s), a segment's state after each block of DENOMINATOR rows is
congruent to its initial state modulo DENOMINATOR and bounded, so the block-start states
repeat after a few blocks: each segment simulates blocks until one repeats, and every later
row is read off that cycle. Pure Python (no numpy): the server and trainers import it too.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DENOMINATOR = 10_000
# A segment simulates at most this many blocks looking for its cycle (it is found in a few).
_MAX_BLOCKS = 4096


def is_weight_number(value: object) -> bool:
    """A real number a caller may give as a weight or alpha: Python's or numpy's scalars
    (numpy.float32, numpy.int64 register as numbers.Real; numpy.bool_ does not), never a
    bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def quantize(weights: Sequence[float]) -> tuple[int, ...]:
    """Integer quotas summing to DENOMINATOR, in proportion to `weights` (largest remainder,
    ties to the lowest index). Raises ValueError naming a negative, NaN or all-zero weight.

    Weights are divided by the largest first, so any finite weights quantize, also ones whose
    sum overflows a float (1e308 + 1e308)."""
    for i, w in enumerate(weights):
        if not (is_weight_number(w) and math.isfinite(w) and w >= 0):
            raise ValueError(f"weight {i} is {w!r}: expected a finite number >= 0")
    largest = float(max(weights, default=0.0))
    if largest <= 0:
        raise ValueError(f"weights {list(weights)} are all zero: at least one must be > 0")
    scaled = [float(w) / largest for w in weights]  # each in [0, 1]: the sum is at most k
    total = sum(scaled)
    exact = [w * DENOMINATOR / total for w in scaled]
    quotas = [math.floor(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[: DENOMINATOR - sum(quotas)]:
        quotas[i] += 1
    return tuple(quotas)


class _Segment:
    """The rows of one set of quotas from the deficits it inherits, by offset: its blocks of
    DENOMINATOR rows until a block-start state repeats, then that cycle forever. Holds one
    byte per simulated row and the counts at each block start."""

    def __init__(self, quotas: tuple[int, ...], deficits: tuple[int, ...]) -> None:
        self.quotas, self.deficits = quotas, deficits
        k, big = len(quotas), DENOMINATOR
        picks = bytearray()
        counts = [0] * k
        block_counts: list[tuple[int, ...]] = []
        seen: dict[tuple[int, ...], int] = {}
        d = list(deficits)
        while tuple(d) not in seen:
            if len(block_counts) >= _MAX_BLOCKS:
                raise RuntimeError(f"mixture schedule found no cycle in {_MAX_BLOCKS} blocks")
            seen[tuple(d)] = len(block_counts)
            block_counts.append(tuple(counts))
            for _ in range(big):
                best, best_v = 0, d[0] + quotas[0]
                for s in range(1, k):
                    v = d[s] + quotas[s]
                    if v > best_v:
                        best, best_v = s, v
                for s in range(k):
                    d[s] += quotas[s]
                d[best] -= big
                counts[best] += 1
                picks.append(best)
        block_counts.append(tuple(counts))
        self.cycle_start = seen[tuple(d)]
        self.cycle_blocks = len(block_counts) - 1 - self.cycle_start
        self.picks, self.block_counts = bytes(picks), block_counts
        first = block_counts[self.cycle_start]
        self.cycle_counts = [b - a for a, b in zip(first, counts, strict=True)]

    def _fold(self, m: int, row: bool = False) -> tuple[int, int]:
        """(offset within the simulated blocks, cycles skipped) of offset m: a count's end
        (row False) or a row (True)."""
        b, r = divmod(m, DENOMINATOR)
        end = self.cycle_start + self.cycle_blocks
        if b < end or (b == end and r == 0 and not row):
            return m, 0
        cycles = (b - self.cycle_start) // self.cycle_blocks
        return (b - cycles * self.cycle_blocks) * DENOMINATOR + r, cycles

    def counts(self, m: int) -> list[int]:
        """Rows of each source among the segment's first m rows."""
        at, cycles = self._fold(m)
        b, r = divmod(at, DENOMINATOR)
        part = self.picks[b * DENOMINATOR : b * DENOMINATOR + r]
        return [
            base + part.count(s) + cycles * cc
            for s, (base, cc) in enumerate(
                zip(self.block_counts[b], self.cycle_counts, strict=True)
            )
        ]

    def deficits_at(self, m: int) -> tuple[int, ...]:
        counts = self.counts(m)
        return tuple(
            e + m * q - DENOMINATOR * c
            for e, q, c in zip(self.deficits, self.quotas, counts, strict=True)
        )

    def source_of(self, m: int) -> int:
        return self.picks[self._fold(m, row=True)[0]]


@dataclass(frozen=True)
class WeightSegment:
    """Weights (quotas over DENOMINATOR) in force from row `start` on."""

    start: int
    quotas: tuple[int, ...]


class RowSchedule:
    """The row schedule of one split: weight segments in row order, the first at row 0.

    `memo` (quotas, inherited deficits) -> segment is shared between schedules, so a schedule
    with one more weight change simulates only its new segment."""

    def __init__(
        self,
        segments: Sequence[WeightSegment],
        memo: dict[tuple[tuple[int, ...], tuple[int, ...]], _Segment] | None = None,
    ) -> None:
        if not segments or segments[0].start != 0:
            raise ValueError("a row schedule's first segment starts at row 0")
        memo = {} if memo is None else memo
        k = len(segments[0].quotas)
        self.sources = k
        self.starts = [seg.start for seg in segments]
        self._segments: list[_Segment] = []
        deficits = (0,) * k
        for i, seg in enumerate(segments):
            if len(seg.quotas) != k or sum(seg.quotas) != DENOMINATOR:
                raise ValueError(f"segment {i}: quotas {seg.quotas} are not {k} summing to 1")
            if i and seg.start <= segments[i - 1].start:
                raise ValueError(f"segment {i} starts at row {seg.start}, not after the last")
            if self._segments:
                deficits = self._segments[-1].deficits_at(seg.start - segments[i - 1].start)
            found = memo.get((seg.quotas, deficits))
            if found is None:
                found = memo[(seg.quotas, deficits)] = _Segment(seg.quotas, deficits)
            self._segments.append(found)
        self.ends = [*self.starts[1:], -1]

    def _segment_of(self, n: int) -> int:
        return max(0, bisect.bisect_right(self.starts, n) - 1)

    def counts(self, n: int) -> list[int]:
        """Rows of each source among rows [0, n) of the split."""
        total = [0] * self.sources
        for seg, start, end in zip(self._segments, self.starts, self.ends, strict=True):
            if n <= start:
                break
            upto = n if end < 0 else min(n, end)
            for s, c in enumerate(seg.counts(upto - start)):
                total[s] += c
        return total

    def targets(self, n: int) -> list[float]:
        """The target count of each source among rows [0, n): each segment's weights times
        its rows."""
        total = [0] * self.sources
        for seg, start, end in zip(self._segments, self.starts, self.ends, strict=True):
            if n <= start:
                break
            rows = (n if end < 0 else min(n, end)) - start
            for s, q in enumerate(seg.quotas):
                total[s] += q * rows
        return [t / DENOMINATOR for t in total]

    def sources_of(self, start: int, stop: int) -> list[int]:
        """The source of each row in [start, stop)."""
        out: list[int] = []
        i = self._segment_of(start)
        for n in range(start, stop):
            while i + 1 < len(self.starts) and self.starts[i + 1] <= n:
                i += 1
            out.append(self._segments[i].source_of(n - self.starts[i]))
        return out


def segments_from_weights(
    changes: Sequence[tuple[int, Sequence[float]]], rows_per_file: int
) -> list[WeightSegment]:
    """Weight segments from (first seq, weights) pairs in seq order (the first at seq 0),
    merging neighbours whose quotas are equal."""
    out: list[WeightSegment] = []
    for seq, weights in changes:
        quotas = quantize(weights)
        if out and out[-1].quotas == quotas:
            continue
        out.append(WeightSegment(seq * rows_per_file, quotas))
    return out


def check_weights(weights: Mapping[str, object], names: Sequence[str], where: str) -> list[float]:
    """Weights by source name as a list in `names` order; ValueError naming every unknown
    source, a negative or NaN weight, or all weights zero. A source left out weighs 0."""
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown source(s) {unknown}; the sources are {list(names)}")
    bad = {
        n: w
        for n, w in weights.items()
        if not is_weight_number(w) or not math.isfinite(float(w)) or float(w) < 0  # type: ignore[arg-type]
    }
    if bad:
        raise ValueError(f"{where}: weight(s) {bad} must be finite numbers >= 0")
    out = [float(weights.get(n, 0.0)) for n in names]  # type: ignore[arg-type]
    if not any(out):
        raise ValueError(f"{where}: weights {dict(weights)} are all zero: one must be > 0")
    return out


@dataclass(frozen=True)
class WeightPlan:
    """A mixture split's weights over seqs: the config's weights, its schedule points over
    served tokens, then SetMixture calls. The worker that composes files and the server's
    stats build the same RowSchedule from it."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    # (tokens, weights in names order), tokens increasing.
    schedule: tuple[tuple[int, tuple[float, ...]], ...]
    rows_per_file: int
    tokens_per_row: int = 1

    def point_seqs(self) -> list[int]:
        """The first seq of each schedule point: the first file starting at or past it."""
        per_file = self.rows_per_file * self.tokens_per_row
        return [-(-int(x) // per_file) for x, _ in self.schedule]

    def scheduled(self, seq: int) -> tuple[float, ...]:
        """The config's weights at `seq`: those of the last schedule point at or before it."""
        starts = self.point_seqs()
        i = 0
        while i < len(starts) and starts[i] <= seq:
            i += 1
        return self.weights if i == 0 else self.schedule[i - 1][1]

    def weights_at(
        self, seq: int, changes: Sequence[tuple[int, Sequence[float] | None]]
    ) -> tuple[float, ...]:
        """The weights of file `seq`: the latest call starting at or before it (the later
        call on a tie) unless it went back to the config, else the config's."""
        best: tuple[int, int] | None = None
        value: Sequence[float] | None = None
        for order, (at, weights) in enumerate(changes):
            if at <= seq and (best is None or (at, order) > best):
                best, value = (at, order), weights
        return tuple(value) if value is not None else self.scheduled(seq)

    def segments(
        self, changes: Sequence[tuple[int, Sequence[float] | None]]
    ) -> list[WeightSegment]:
        bounds = sorted({0, *self.point_seqs(), *(at for at, _ in changes)})
        return segments_from_weights(
            [(b, self.weights_at(b, changes)) for b in bounds], self.rows_per_file
        )

    def by_name(self, changes: Sequence[tuple[int, Mapping[str, float] | None]]) -> list:
        """SetMixture calls with weights by name, as lists in names order."""
        return [
            (at, None if w is None else [float(w.get(n, 0.0)) for n in self.names])
            for at, w in changes
        ]


class ScheduleCache:
    """RowSchedules by their segments: one simulation per set of weight segments."""

    def __init__(self, size: int = 16) -> None:
        self._size = size
        self._found: dict[tuple[WeightSegment, ...], RowSchedule] = {}
        self._memo: dict[tuple[tuple[int, ...], tuple[int, ...]], _Segment] = {}

    def get(self, segments: Sequence[WeightSegment]) -> RowSchedule:
        key = tuple(segments)
        found = self._found.get(key)
        if found is None:
            if len(self._found) >= self._size:
                self._found.pop(next(iter(self._found)))
            found = self._found[key] = RowSchedule(segments, self._memo)
        return found


# The latest weight changes `queue-client stats` lists (--json gives them all).
HISTORY_SHOWN = 5


def describe_stats(split: str, stats: Mapping[str, object]) -> list[str]:
    """`queue-client stats` lines for a mixture split's stats (GetStats, as a dict)."""
    lines = [f"{split}: mixture over {int(stats.get('rows_served', 0))} rows served"]  # type: ignore[call-overload]
    for s in stats.get("sources", ()):  # type: ignore[attr-defined]
        epochs = s.get("epochs")
        lines.append(
            f"  {s.get('name')}: weight {float(s.get('weight', 0)):.3f}, share "
            f"{float(s.get('share', 0)):.4f} (target {float(s.get('target_share', 0)):.4f}), "
            f"recent {float(s.get('window_share', 0)):.4f} "
            f"(target {float(s.get('window_target_share', 0)):.4f}), "
            f"{int(s.get('rows_served', 0))} rows, {int(s.get('tokens_served', 0))} tokens"
            + (f", {float(epochs):.3f} epochs" if epochs is not None else "")
        )
    names = [str(s.get("name")) for s in stats.get("sources", ())]  # type: ignore[attr-defined]
    history = list(stats.get("history", ()))  # type: ignore[call-overload]
    if len(history) > 1:
        lines.append(f"  weight history ({len(history) - 1} change(s) after the config's):")
        if len(history) > HISTORY_SHOWN:
            lines.append(f"    ... {len(history) - HISTORY_SHOWN} earlier")
        for h in history[-HISTORY_SHOWN:]:
            weights = h.get("weights") or []
            shown = ", ".join(f"{n} {float(w):g}" for n, w in zip(names, weights, strict=False))
            lines.append(
                f"    from seq {int(h.get('effective_seq', 0))} ({h.get('origin')}): "
                + (shown or "back to the config's")
            )
    return lines
