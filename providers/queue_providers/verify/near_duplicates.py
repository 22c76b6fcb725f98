"""Near-duplicate documents among a dataset's batches: MinHash over token shingles, LSH to find
the candidate pairs, and each pair's estimated Jaccard similarity.

The verifier already counts exact repeats (a hash of a document's tokens); this finds the
documents that differ by a few words: boilerplate with a changed date, a page scraped twice,
a test set paraphrased into train. A document is the set of its shingles, the runs of
`shingle` consecutive token ids (hashed in numpy, a whole document at a time); its MinHash
signature estimates the Jaccard similarity of two such sets, and banded LSH (datasketch's
MinHashLSH, its bands chosen for recall at `threshold`) proposes the pairs worth comparing, so
the cost grows with
the number of documents, not its square. A pair is reported when its estimate is at least
`threshold`. Identical documents (the same hash) are one entry with several places: repeats of
one document are the exact-duplicate count's business, and val repeats by design.

Needs datasketch, the optional extra `dedup` (pip install 'batchqueue[dedup]').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

EXTRA = "dedup"
# MinHashLSH's (false positive, false negative) weights when it picks its bands.
_LSH_WEIGHTS = (0.05, 0.95)
# Odd 64-bit multipliers: a polynomial over a shingle's ids, then a 64-bit finaliser.
_POLY = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)


class MissingExtra(ImportError):
    """datasketch is not installed; the message names the extra that brings it."""


def _datasketch() -> Any:
    try:
        import datasketch
    except ImportError:
        raise MissingExtra(
            f"near-duplicate detection needs the datasketch package: pip install "
            f"'batchqueue[{EXTRA}]'"
        ) from None
    return datasketch


def shingle_hashes(ids: np.ndarray, shingle: int) -> np.ndarray:
    """The distinct 32-bit hashes of the document's runs of `shingle` ids (the whole document
    as one run when it is shorter), sorted."""
    ids = np.asarray(ids).astype(np.uint64)
    if len(ids) == 0:
        return np.zeros(0, np.uint64)
    runs = (
        np.lib.stride_tricks.sliding_window_view(ids, shingle)
        if len(ids) >= shingle
        else ids[None, :]
    )
    h = np.full(len(runs), np.uint64(runs.shape[1]), np.uint64)
    for j in range(runs.shape[1]):  # `shingle` steps, each over every run of the document
        h = h * _POLY + runs[:, j] + np.uint64(1)
    h ^= h >> np.uint64(33)
    h *= _MIX1
    h ^= h >> np.uint64(33)
    h *= _MIX2
    h ^= h >> np.uint64(33)
    return np.unique(h >> np.uint64(32))


@dataclass(frozen=True)
class Place:
    """Where a document was read: split, the file's seq, the batch in it, the row."""

    split: str
    seq: int
    batch: int
    row: int

    def describe(self, world_size: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "split": self.split,
            "seq": self.seq,
            "batch": self.batch,
            "row": self.row,
        }
        if world_size and self.seq >= 0:
            out["rank"] = self.seq % world_size  # deterministic mode: rank r reads seqs r mod W
        return out


class NearDuplicates:
    """Collects documents (token ids with a place), then `pairs()` finds the similar ones."""

    def __init__(self, *, threshold: float = 0.8, shingle: int = 5, num_perm: int = 128) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must lie in (0, 1], got {threshold!r}")
        if shingle < 1 or num_perm < 16:
            raise ValueError(f"shingle must be >= 1 and num_perm >= 16, got {shingle}, {num_perm}")
        ds = _datasketch()
        self.threshold, self.shingle, self.num_perm = threshold, shingle, num_perm
        # Bands tuned for recall (a false negative is a pair never seen; a false positive
        # costs one signature comparison): at 0.8 and 128 permutations, a pair of similarity
        # 0.85 becomes a candidate with probability 0.99, not datasketch's default 0.69.
        self._lsh = ds.MinHashLSH(threshold=threshold, num_perm=num_perm, weights=_LSH_WEIGHTS)
        # One template: a copy shares its permutations instead of drawing them again.
        self._empty = ds.MinHash(num_perm=num_perm, hashfunc=int)
        self._sigs: dict[bytes, Any] = {}
        self._places: dict[bytes, list[Place]] = {}
        self._tokens: dict[bytes, int] = {}

    def add(self, ids: np.ndarray, key: bytes, place: Place) -> None:
        """One document; `key` identifies its exact content (the verifier's hash)."""
        if key in self._places:
            self._places[key].append(place)
            return
        sig = self._empty.copy()
        sig.update_batch(shingle_hashes(ids, self.shingle).tolist())
        self._lsh.insert(key, sig)
        self._sigs[key], self._places[key], self._tokens[key] = sig, [place], len(ids)

    def __len__(self) -> int:
        return len(self._sigs)

    def pairs(self) -> list[tuple[float, bytes, bytes]]:
        """(estimated similarity, key, key) of every near-duplicate pair, most similar first."""
        found = []
        for key, sig in self._sigs.items():
            for other in self._lsh.query(sig):
                if other <= key:  # each pair once, and never a document with itself
                    continue
                estimate = float(sig.jaccard(self._sigs[other]))
                if estimate >= self.threshold:
                    found.append((estimate, key, other))
        found.sort(key=lambda p: (-p[0], p[1], p[2]))
        return found

    def report(self, world_size: int | None = None, limit: int = 20) -> dict[str, Any]:
        """Counts and the first `limit` pairs, each with both documents' places."""
        pairs = self.pairs()

        def spread(key_a: bytes, key_b: bytes, of: Any) -> int:
            return len({of(p) for p in (*self._places[key_a], *self._places[key_b])})

        across = sum(spread(a, b, lambda p: p.split) > 1 for _, a, b in pairs)

        def doc(key: bytes) -> dict[str, Any]:
            places = self._places[key]
            return {
                "tokens": self._tokens[key],
                "at": places[0].describe(world_size),
                "times_read": len(places),
            }

        return {
            "threshold": self.threshold,
            "shingle": self.shingle,
            "num_perm": self.num_perm,
            "documents": len(self._sigs),
            "pairs": len(pairs),
            "pairs_across_splits": across,
            "pairs_across_ranks": (
                sum(spread(a, b, lambda p: p.seq % world_size) > 1 for _, a, b in pairs)
                if world_size
                else None
            ),
            "shown": [
                {"similarity": round(sim, 4), "a": doc(a), "b": doc(b)}
                for sim, a, b in pairs[:limit]
            ],
        }
