"""The corpus token distribution: estimated once from a sample spread over all of the data,
then cached in the dataset dir under a key of what it depends on
(`DatasetLayout.corpus_cache_file`).

The key covers the data's identity (files, sizes, mtimes, provider args), the sample size, the
scored field and the tokenizer (every vocabulary key of meta), so changing any of them
computes it again, and nothing else does. The cache is a plain .npy (float64 [vocab_size]),
loaded with allow_pickle=False.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from queue_client.format.layout import atomic_write

log = logging.getLogger("queue_server.curriculum")

_TOKENIZER_KEYS = ("vocab", "stoi", "itos", "tokenizer", "special", "eos", "bos", "pad", "mask")


def tokenizer_identity(meta: Mapping[str, Any]) -> str:
    """Every meta key that says how text became ids, hashed."""
    keyed = {k: meta[k] for k in sorted(meta) if any(t in k.lower() for t in _TOKENIZER_KEYS)}
    blob = json.dumps(keyed, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()


def cache_key(
    data_identity: str, n_tokens: int, split: str, field: str, meta: Mapping[str, Any]
) -> str:
    parts = {
        "data": data_identity,
        "n_tokens": n_tokens,
        "split": split,
        "field": field,
        "tokenizer": tokenizer_identity(meta),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def load_or_estimate(
    path: Path,
    count: Callable[[Callable[[int], None]], Any],
    n_tokens: int,
    what: str,
    progress_console: Any = None,
) -> np.ndarray:
    """The cached distribution at `path`, or count() it (with a progress bar) and cache it.

    `count(advance)` returns token counts and calls advance(n) as it goes.
    """
    if path.exists():
        dist = np.load(path, allow_pickle=False)
        log.info("%s: corpus distribution loaded from %s", what, path.name)
        return dist
    counts = np.asarray(_count_with_progress(count, n_tokens, what, progress_console), np.float64)
    total = counts.sum()
    if total <= 0:
        raise ValueError(f"{what}: the corpus sample holds no tokens")
    dist = counts / total
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: np.save(f, dist, allow_pickle=False))
    log.info("%s: corpus distribution of %d tokens cached in %s", what, int(total), path.name)
    return dist


def _count_with_progress(
    count: Callable[[Callable[[int], None]], Any], n_tokens: int, what: str, console: Any
) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    console = console or Console(stderr=True)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task(f"{what}: estimating corpus distribution", total=n_tokens)
        return count(lambda n: progress.advance(task, n))


def kl_divergence(p_counts: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) in nats, p given as counts; q floored so a token q misses stays finite."""
    total = p_counts.sum()
    if total <= 0:
        return 0.0
    p = p_counts / total
    mask = p > 0
    return float(np.sum(p[mask] * np.log(p[mask] / np.maximum(q[mask], 1e-12))))
