"""A mixture split's stats: each source's rows, tokens, realised share against its target
(since the start and over a recent window), epochs, and the weight history.

A source's epochs: tokens served over its split's tokens where its meta gives them (a
sampling provider, or token_shards, whose epochs are exactly that long); else, for a source
with ordered epochs (text_lm), the epoch its last served row is in, from the epoch starts
the workers record (queue_client/format/mixture_epochs.py: a listing of a small folder).

Served rows are those of the first consumed_files files of the split (ranks read in step,
so this is the served prefix to within a round of files). Counts come from the same row
schedule the workers compose with, read in closed form: no simulation from row 0.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from queue_client.format.meta import token_field
from queue_client.format.mixture_epochs import epoch_at, read_epoch_starts
from queue_client.mixture import DENOMINATOR, ScheduleCache, WeightPlan

# Rows of the recent window of window_share.
WINDOW_ROWS = DENOMINATOR


class MixtureView:
    """What the server knows of one mixture split from its config and meta."""

    def __init__(
        self,
        args: Mapping[str, Any],
        meta: Mapping[str, Any],
        split: str,
        epochs_dir: Path | None = None,
    ) -> None:
        sources = list(args["sources"])
        self.names = tuple(s["name"] for s in sources)
        # The token field's positions per row, as the split's own tokens_served counts them
        # (and the workers count a schedule point's tokens).
        self.tokens_per_row = max(1, token_field(meta, split)[1])
        self.plan = WeightPlan(
            self.names,
            tuple(float(s["weight"]) for s in sources),
            tuple((int(x), tuple(w)) for x, w in args.get("schedule", ())),
            int(meta["batch_size"]) * int(meta.get("batches_per_file", 1)),
            self.tokens_per_row,
        )
        # Each source's split size in tokens, where its meta gives one (for epochs).
        self.epoch_tokens: list[int | None] = []
        for sub in meta.get("mixture", {}).get("source_meta", ()):
            info = sub.get("split_info", {}).get(split, {})
            tokens = info.get("tokens") if isinstance(info, dict) else None
            self.epoch_tokens.append(tokens if isinstance(tokens, int) and tokens > 0 else None)
        ordered = meta.get("mixture", {}).get("ordered_epochs", ())
        self.ordered_epochs = [bool(x) for x in ordered] + [False] * (
            len(self.names) - len(ordered)
        )
        self.epochs_dir = epochs_dir
        self._cache = ScheduleCache(4)
        self._prepare_lock = threading.Lock()
        self._epoch_starts: dict[str, Any] = {}  # as last listed by prepare()

    def prepare(self, changes: Sequence[tuple[int, Mapping[str, float] | None]]) -> None:
        """stats()'s CPU and I/O ahead of it, in a thread (the event loop runs none): the
        simulation of any new weight segment, and the listing of the epoch records. stats()
        then only reads what this kept."""
        with self._prepare_lock:
            self._cache.get(self.plan.segments(self.plan.by_name(changes)))
            if self.epochs_dir is not None and any(self.ordered_epochs):
                self._epoch_starts = read_epoch_starts(self.epochs_dir)

    def check(self, changes: Sequence[tuple[int, Mapping[str, float] | None]]) -> None:
        """Build the row schedule `changes` give, with the code the workers compose with
        (ValueError naming why it cannot be built). A change is checked with this before it
        is journaled, and a journal's changes before they are replayed; the schedule stays
        cached for stats()."""
        with self._prepare_lock:
            try:
                self._cache.get(self.plan.segments(self.plan.by_name(changes)))
            except (ValueError, RuntimeError, OverflowError) as exc:
                raise ValueError(str(exc)) from None

    def epochs(self, source: int, rows: int) -> float | None:
        """Epochs of a source's own data in its first `rows` rows (see the module doc)."""
        tokens = self.epoch_tokens[source] if source < len(self.epoch_tokens) else None
        if tokens:
            return rows * self.tokens_per_row / tokens
        if self.ordered_epochs[source]:
            # The folder of one empty file per epoch, as prepare() last listed it.
            return float(epoch_at(self._epoch_starts.get(self.names[source], {}), rows))
        return None

    def history(self, changes: Sequence[tuple[int, Mapping[str, float] | None]]) -> list[dict]:
        """The config's weights, its schedule points, then every call: weights in names order."""
        out = [{"effective_seq": 0, "origin": "config", "weights": list(self.plan.weights)}]
        for seq, (_, point) in zip(self.plan.point_seqs(), self.plan.schedule, strict=True):
            out.append({"effective_seq": seq, "origin": "schedule", "weights": list(point)})
        for at, called in changes:
            origin = "SetMixture" if called is not None else "reset"
            values = [float(called.get(n, 0.0)) for n in self.names] if called else []
            out.append({"effective_seq": at, "origin": origin, "weights": values})
        return out

    def stats(
        self, changes: Sequence[tuple[int, Mapping[str, float] | None]], consumed_files: int
    ) -> dict[str, Any]:
        by_name = self.plan.by_name(changes)
        schedule = self._cache.get(self.plan.segments(by_name))
        rows = consumed_files * self.plan.rows_per_file
        start = max(0, rows - WINDOW_ROWS)
        counts, targets = schedule.counts(rows), schedule.targets(rows)
        before, targets_before = schedule.counts(start), schedule.targets(start)
        weights = self.plan.weights_at(consumed_files, by_name)
        largest = max(weights, default=0.0) or 1.0  # 1e308 + 1e308 would overflow the sum
        weights = tuple(w / largest for w in weights)
        total = sum(weights) or 1.0
        window = rows - start
        sources = []
        for i, name in enumerate(self.names):
            tokens = counts[i] * self.tokens_per_row
            sources.append(
                {
                    "name": name,
                    "index": i,
                    "weight": weights[i] / total,
                    "rows_served": counts[i],
                    "tokens_served": tokens,
                    "share": counts[i] / rows if rows else 0.0,
                    "target_share": targets[i] / rows if rows else 0.0,
                    "window_share": (counts[i] - before[i]) / window if window else 0.0,
                    "window_target_share": (targets[i] - targets_before[i]) / window
                    if window
                    else 0.0,
                    "epochs": self.epochs(i, counts[i]),
                }
            )
        return {
            "sources": sources,
            "rows_served": rows,
            "window_rows": window,
            "history": self.history(changes),
        }
