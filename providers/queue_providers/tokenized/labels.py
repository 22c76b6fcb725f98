"""Label maps and the held-out split of labelled examples (classification, token tagging)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from queue_client.errors import ConfigError

_INT_RE = re.compile(r"-?[0-9]+")


def parse_label_map(raw: Any, *, who: str) -> dict[str, int] | None:
    """A config label_map: a list of labels (id = position) or a table label -> id, with ids
    exactly 0..n-1. None passes through (the map is then derived from the data)."""
    if raw is None:
        return None
    if isinstance(raw, (list, tuple)):
        labels = [str(x) for x in raw]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ConfigError(f"{who}: label_map lists {dupes} more than once")
        result = {label: i for i, label in enumerate(labels)}
    elif isinstance(raw, Mapping):
        result = {}
        for label, idx in raw.items():
            if not isinstance(idx, int) or isinstance(idx, bool):
                raise ConfigError(f"{who}: label_map[{label!r}] = {idx!r}; ids must be ints")
            result[str(label)] = idx
        if sorted(result.values()) != list(range(len(result))):
            raise ConfigError(
                f"{who}: label_map ids must be exactly 0..{len(result) - 1}, each once; got {sorted(result.values())}"
            )
    else:
        raise ConfigError(
            f"{who}: label_map must be a list of labels or a table label -> id, got {raw!r}"
        )
    if not result:
        raise ConfigError(f"{who}: label_map is empty")
    return result


def derive_label_map(labels: Iterable[str]) -> dict[str, int]:
    """Labels sorted (numerically when all are integers, so "0".."n-1" keep their ids)."""
    unique = set(labels)
    if unique and all(_INT_RE.fullmatch(x) for x in unique):
        ordered = sorted(unique, key=int)
    else:
        ordered = sorted(unique)
    return {label: i for i, label in enumerate(ordered)}


def split_indices(n: int, train_fraction: float, *, who: str) -> tuple[np.ndarray, np.ndarray]:
    """A fixed pseudo-random train/val split of n examples.

    Labeled files are often sorted by label, so a contiguous split would put whole classes in
    val. The permutation's seed is a constant, not the config seed, so the val set stays the
    same across runs that sample with different seeds.
    """
    if not 0.0 < train_fraction < 1.0:
        raise ConfigError(f"{who}: train_fraction must lie in (0, 1), got {train_fraction!r}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).numpy()
    n_train = round(n * train_fraction)
    if n_train == 0 or n_train == n:
        raise ConfigError(
            f"{who}: {n} examples with train_fraction={train_fraction} leaves a split empty; "
            "add examples, change train_fraction or give val_input"
        )
    return np.sort(perm[:n_train]), np.sort(perm[n_train:])
