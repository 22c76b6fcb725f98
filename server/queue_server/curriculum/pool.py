"""The scoring pool, split out of scoring.py so that each module does one job."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from queue_server.curriculum.file_rows import FileRows

# Rounding allowance on each tightening of kept tail sums (Pool.tighten).
_TIGHTEN_SLACK = 1e-6


def concat_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated [start, start + len) index ranges."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    shift = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return np.arange(total, dtype=np.int64) + shift


def _grown(array: np.ndarray, used: int, need: int, axis: int = 0) -> np.ndarray:
    """`array`, or a new one with room for at least `need` items along `axis` (doubling) and
    its first `used` items copied."""
    have = array.shape[axis]
    if need <= have:
        return array
    shape = list(array.shape)
    shape[axis] = max(need, 2 * have, 16)
    out = np.empty(shape, array.dtype)
    keep = (slice(None),) * axis + (slice(0, used),)
    out[keep] = array[keep]
    return out


class Pool:
    """The batches one composer scores, kept from one served file to the next: each batch's
    entries back to back, its float32 head row, its kept tail sums (with the rounding
    allowance `slack`), and the rare entries of every batch sorted by token (`rare_start`:
    where each token's run starts). Batches join at the end as their files are ingested, so
    pool order is buffer order; a batch picked or culled is only marked dead, and the
    composer builds a fresh pool when the dead outnumber half the living."""

    def __init__(self, width: int, vocab: int) -> None:
        self.n = 0  # rows used, dead ones included
        self.live = 0
        self.start = np.zeros(0, np.int64)
        self.head_len = np.zeros(0, np.int64)
        self.tail_len = np.zeros(0, np.int64)
        self.alive = np.zeros(0, bool)
        self.parts = np.zeros((4, 0))
        self.slack = np.zeros((4, 0))
        self.head32 = np.zeros((0, width), np.float32)
        self.used = 0  # entries used
        self.tail_entries = 0  # of them, tail entries (of living rows, or dead ones)
        self.tok = np.zeros(0, np.int64)
        self.cnt = np.zeros(0)
        self.ca = np.zeros(0)
        self.rare_row = np.zeros(0, np.int64)
        self.rare_cnt = np.zeros(0)
        self.rare_ca = np.zeros(0)
        self.rare_start = np.zeros(vocab + 1, np.int64)
        self._pending: list[tuple[np.ndarray, ...]] = []  # rare entries added, not indexed

    def __len__(self) -> int:
        return self.n

    def reserve(self, rows: int, entries: int) -> None:
        """Room for `rows` more batches of `entries` entries in all (a fresh pool's size)."""
        self._grow(self.n + rows, self.used + entries)

    def _grow(self, rows: int, used: int) -> None:
        n = self.n
        self.start = _grown(self.start, n, rows)
        self.head_len = _grown(self.head_len, n, rows)
        self.tail_len = _grown(self.tail_len, n, rows)
        self.alive = _grown(self.alive, n, rows)
        self.parts = _grown(self.parts, n, rows, axis=1)
        self.slack = _grown(self.slack, n, rows, axis=1)
        self.head32 = _grown(self.head32, n, rows)
        self.tok = _grown(self.tok, self.used, used)
        self.cnt = _grown(self.cnt, self.used, used)
        self.ca = _grown(self.ca, self.used, used)

    def add(self, fr: FileRows, batches: np.ndarray, parts: np.ndarray | None = None) -> None:
        """Append the batches `batches` of one file (in order), with kept tail sums `parts`
        (4 x len(batches); none kept: NaN, so each is scored exactly at its first pick).
        Their rare entries join the index at the next index()."""
        k, first = len(batches), self.n
        lens = fr.head_len[batches] + fr.tail_len[batches]
        at = concat_ranges(fr.start[batches], lens)
        rows, used = self.n + k, self.used + len(at)
        self._grow(rows, used)
        self.start[first:rows] = self.used + np.cumsum(lens) - lens
        self.head_len[first:rows] = fr.head_len[batches]
        self.tail_len[first:rows] = fr.tail_len[batches]
        self.alive[first:rows] = True
        self.parts[:, first:rows] = np.nan if parts is None else parts
        self.slack[:, first:rows] = 0.0
        self.head32[first:rows] = fr.head32[batches]
        np.take(fr.tok, at, out=self.tok[self.used : used])
        np.take(fr.cnt, at, out=self.cnt[self.used : used])
        np.take(fr.ca, at, out=self.ca[self.used : used])
        self.used, self.n, self.live = used, rows, self.live + k
        self.tail_entries += int(fr.tail_len[batches].sum())
        row_of = np.full(len(fr.start), -1, np.int64)  # batch in file -> pool row
        row_of[batches] = np.arange(first, rows)
        mine = row_of[fr.rare_batch] >= 0
        self._pending.append(
            (fr.rare_tok[mine], row_of[fr.rare_batch[mine]], fr.rare_cnt[mine], fr.rare_ca[mine])
        )

    def index(self) -> None:
        """Take the rare entries of the files added since into the by-token index: a counting
        sort into an empty index, else one insertion of them all (each file's entries come
        sorted by token; within a token, entries stay in the order they were added)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        vocab = len(self.rare_start) - 1
        counts = [np.bincount(p[0], minlength=vocab) for p in pending]
        if len(self.rare_row) == 0:
            total = np.sum(counts, axis=0)
            cursor = np.cumsum(total) - total
            size = int(total.sum())
            row, cnt, ca = np.empty(size, np.int64), np.empty(size), np.empty(size)
            for (tok, r, c, a), n in zip(pending, counts, strict=True):
                at = cursor[tok] + np.arange(len(tok)) - np.searchsorted(tok, tok)
                row[at], cnt[at], ca[at] = r, c, a
                cursor += n
            self.rare_row, self.rare_cnt, self.rare_ca = row, cnt, ca
        else:
            tok = np.concatenate([p[0] for p in pending])
            order = np.argsort(tok, kind="stable")
            where = self.rare_start[tok[order] + 1]  # each at the end of its token's run
            for name, k in (("rare_row", 1), ("rare_cnt", 2), ("rare_ca", 3)):
                values = np.concatenate([p[k] for p in pending])[order]
                setattr(self, name, np.insert(getattr(self, name), where, values))
            counts = [np.bincount(tok, minlength=vocab)]
        self.rare_start[1:] += np.cumsum(np.sum(counts, axis=0))

    def compact(self) -> None:
        """Drop the dead rows: the living keep their order (buffer order), entries, head rows,
        kept sums and rare entries. Room is left for as many again, as files keep coming."""
        n, vocab = self.n, len(self.rare_start) - 1
        live = np.flatnonzero(self.alive[:n])
        renumber = np.full(n, -1, np.int64)
        renumber[live] = np.arange(len(live))
        lengths = self.head_len[:n] + self.tail_len[:n]
        keep = np.repeat(self.alive[:n], lengths)
        rows, used = len(live), int(lengths[live].sum())

        def room(array: np.ndarray, values: np.ndarray, size: int, axis: int = 0) -> np.ndarray:
            shape = list(values.shape)
            shape[axis] = 2 * size + 16
            out = np.empty(shape, array.dtype)
            out[(slice(None),) * axis + (slice(0, size),)] = values
            return out

        self.tok = room(self.tok, self.tok[: self.used][keep], used)
        self.cnt = room(self.cnt, self.cnt[: self.used][keep], used)
        self.ca = room(self.ca, self.ca[: self.used][keep], used)
        self.start = room(self.start, np.cumsum(lengths[live]) - lengths[live], rows)
        self.head_len = room(self.head_len, self.head_len[live], rows)
        self.tail_len = room(self.tail_len, self.tail_len[live], rows)
        self.alive = room(self.alive, np.ones(rows, bool), rows)
        self.parts = room(self.parts, self.parts[:, live], rows, axis=1)
        self.slack = room(self.slack, self.slack[:, live], rows, axis=1)
        self.head32 = room(self.head32, self.head32[live], rows)
        self.n = self.live = rows
        self.used = used
        self.tail_entries = int(self.tail_len[:rows].sum())
        renumbered = renumber[self.rare_row]
        kept = renumbered >= 0
        rare_tok = np.repeat(np.arange(vocab), np.diff(self.rare_start))[kept]
        self.rare_row = renumbered[kept]
        self.rare_cnt, self.rare_ca = self.rare_cnt[kept], self.rare_ca[kept]
        self.rare_start = np.zeros(vocab + 1, np.int64)
        np.cumsum(np.bincount(rare_tok, minlength=vocab), out=self.rare_start[1:])

    def kill(self, rows: np.ndarray) -> None:
        rows = rows[self.alive[rows]]
        self.alive[rows] = False
        self.live -= len(rows)

    def tighten(
        self,
        ids: np.ndarray,
        counts: np.ndarray,
        served_before: np.ndarray,
        eps_before: float,
        eps_after: float,
        rare: np.ndarray,
    ) -> None:
        """A batch holding (ids, counts) was served: lower the kept tail sums of the rows that
        share its rare tokens by what that certainly took from them, keeping them bounds.

        A token not served before leaves the unseen sums (exactly its count * corpus and
        count) and joins the served ones at its new g. One served before had, in any kept
        sum, a g of at least 1 / (served_before + eps_before); it now has at most
        1 / (served_after + eps_after); the difference comes off."""
        pick = rare[ids]
        toks, cp = ids[pick], counts[pick]
        lo = self.rare_start[toks]
        lens = self.rare_start[toks + 1] - lo
        entries = concat_ranges(lo, lens)
        if len(entries) == 0:
            return
        tok = np.repeat(np.arange(len(toks)), lens)
        rows = self.rare_row[entries]
        s_old = served_before[toks].astype(np.float64)
        g_new = 1.0 / (s_old + cp + eps_after)
        unseen = s_old == 0
        drop = np.where(unseen, 0.0, (1.0 / (s_old + eps_before) - g_new) * (1 - _TIGHTEN_SLACK))
        gain = np.where(unseen, g_new * (1 + _TIGHTEN_SLACK), 0.0)
        cnt, ca = self.rare_cnt[entries], self.rare_ca[entries]
        u = unseen[tok].astype(np.float64)
        change = gain[tok] - drop[tok]
        n = self.n
        self.parts[0, :n] -= np.bincount(rows, ca * u, minlength=n)
        self.parts[1, :n] -= np.bincount(rows, cnt * u, minlength=n)
        self.parts[2, :n] += np.bincount(rows, ca * change, minlength=n)
        self.parts[3, :n] += np.bincount(rows, cnt * change, minlength=n)
