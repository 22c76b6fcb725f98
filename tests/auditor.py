"""The accounting auditor: every seq a provider produced is in exactly one state.

A seq is, at any moment, on disk unleased, leased to one live client, consumed (deleted) or
quarantined with a reason. GetStats reports the counts; this helper checks that they add up,
that the queue and quarantine dirs agree with them, and, when given what the clients say they
read, that no batch was served twice.

    audit(server, "d")                                   # after any fault, at a quiet moment
    audit(server, "d", consumed_batches={"train": [(seq, offset), ...]})
    audit(server, "d", consumed_seqs={"train": [seq, ...]})   # files released CONSUMED
    check_counts(server.split_stats("d"))                # the bare invariant, at any moment

The disk checks tolerate what a live server does between two looks (a worker renames a file
before the server hears of it, a delete runs in a thread): `audit` retries until one
stats-disk-stats sandwich agrees, and fails with every problem it saw after `timeout_s`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_client.format.batchfile import (
    TMP_PREFIX,
    BatchFileName,
    quarantine_dir,
    queue_dir,
    scan_queue,
)
from queue_client.format.layout import temp_owner_pid

# The fields that must not move between the two GetStats calls around a disk scan.
_STABLE = (
    "ready_files",
    "leased_files",
    "seqs_produced",
    "seqs_consumed",
    "seqs_quarantined",
    "quarantined_files",
    "worker_pids",
)


@dataclass(frozen=True)
class DiskView:
    """What one split's directories hold right now."""

    published: list[BatchFileName]
    temp_files: list[str]
    quarantined: list[str]
    reasons: set[str]


def split_ints(split: Mapping[str, Any]) -> dict[str, Any]:
    """GetStats as MessageToDict gives it (int64 as str) with ints where ints belong."""
    return {
        k: int(v) if isinstance(v, str) and v.lstrip("-").isdigit() else v for k, v in split.items()
    }


def check_counts(split: Mapping[str, Any]) -> list[str]:
    """The invariant on one SplitStats, which must hold in every single GetStats reply."""
    s = split_ints(split)
    name = s["split"]
    problems = []
    parts = (
        s["ready_files"]
        + s["leased_files"]
        + s["seqs_consumed"]
        + s["seqs_quarantined"]
        + s["seqs_missing"]
    )
    if s["seqs_produced"] != parts:
        problems.append(
            f"{name}: seqs_produced {s['seqs_produced']} != ready {s['ready_files']} + leased {s['leased_files']} "
            f"+ consumed {s['seqs_consumed']} + quarantined {s['seqs_quarantined']} + missing {s['seqs_missing']}"
        )
    if s["seqs_missing"] != 0:
        problems.append(
            f"{name}: {s['seqs_missing']} seq(s) produced and gone from disk without being consumed"
        )
    if min(s["ready_files"], s["leased_files"], s["seqs_consumed"], s["seqs_quarantined"]) < 0:
        problems.append(f"{name}: a negative count in {s}")
    return problems


def assert_counts(stats: Mapping[str, Any]) -> None:
    """check_counts over every split of one GetStats reply (as ServerProcess.stats gives it)."""
    problems = [p for split in stats["splits"] for p in check_counts(split)]
    assert not problems, "accounting invariant broken:\n" + "\n".join(problems)


def disk_view(data_root: Path, dataset: str, split: str) -> DiskView:
    qdir = queue_dir(data_root, dataset, split)
    temps = sorted(n for n in _listdir(qdir) if n.startswith(TMP_PREFIX))
    qnames = _listdir(quarantine_dir(data_root, dataset, split))
    quarantined = sorted(n for n in qnames if BatchFileName.parse(n) is not None)
    reasons = {n[: -len(".reason.txt")] for n in qnames if n.endswith(".reason.txt")}
    return DiskView(scan_queue(qdir), temps, quarantined, reasons)


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _temp_pid(name: str) -> int | None:
    """`.tmp-{pid}-{n}-{final name}` -> pid."""
    return temp_owner_pid(name)


def check_disk(split: Mapping[str, Any], disk: DiskView) -> list[str]:
    """The directories against one SplitStats: published = ready + leased, temp files only from
    live workers (a write in progress), one reason file per quarantined file."""
    s = split_ints(split)
    name = s["split"]
    problems = []
    expected = s["ready_files"] + s["leased_files"]
    if len(disk.published) != expected:
        problems.append(
            f"{name}: {len(disk.published)} published files on disk, stats say ready + leased = {expected}: {[str(n) for n in disk.published]}"
        )
    dup = [seq for seq, n in Counter(n.seq for n in disk.published).items() if n > 1]
    if dup:
        problems.append(f"{name}: seq(s) {dup} published more than once")
    live = {int(p) for p in s.get("worker_pids", [])}
    stray = [t for t in disk.temp_files if _temp_pid(t) not in live]
    if stray:
        problems.append(f"{name}: temp files of no live worker (pids {sorted(live)}): {stray}")
    unexplained = [q for q in disk.quarantined if q not in disk.reasons]
    if unexplained:
        problems.append(f"{name}: quarantined without a .reason.txt: {unexplained}")
    if len(disk.quarantined) != s["quarantined_files"]:
        problems.append(
            f"{name}: {len(disk.quarantined)} files in quarantine/, stats say {s['quarantined_files']} were quarantined"
        )
    return problems


def check_clients(
    split: Mapping[str, Any],
    disk: DiskView,
    consumed_batches: Iterable[tuple[int, int]] | None,
    consumed_seqs: Collection[int] | None,
) -> list[str]:
    """What the clients report against the server: no batch served twice, and (when the given
    seqs are every file released CONSUMED since the data root was new) the server counts
    exactly those files as consumed and none of them is on disk any more."""
    s = split_ints(split)
    name = s["split"]
    problems = []
    if consumed_batches is not None:
        twice = sorted(k for k, n in Counter(map(tuple, consumed_batches)).items() if n > 1)
        if twice:
            problems.append(f"{name}: (seq, offset) served more than once: {twice[:20]}")
    if consumed_seqs is not None:
        twice = sorted(k for k, n in Counter(consumed_seqs).items() if n > 1)
        if twice:
            problems.append(f"{name}: seq(s) consumed by more than one lease: {twice[:20]}")
        if len(set(consumed_seqs)) != s["seqs_consumed"]:
            problems.append(
                f"{name}: clients consumed {len(set(consumed_seqs))} distinct seqs, the server counts {s['seqs_consumed']}"
            )
        back = sorted({n.seq for n in disk.published} & set(consumed_seqs))
        if back:
            problems.append(f"{name}: consumed seq(s) {back} are still published on disk")
    return problems


def audit(
    server: Any,
    dataset: str,
    *,
    consumed_batches: Mapping[str, Iterable[tuple[int, int]]] | None = None,
    consumed_seqs: Mapping[str, Collection[int]] | None = None,
    timeout_s: float = 15.0,
) -> dict[str, dict[str, Any]]:
    """Assert the accounting of every split of `dataset` on a live server; returns the stats
    per split (ints) that passed. `server` is conftest's ServerProcess."""
    batches = {k: list(v) for k, v in (consumed_batches or {}).items()}
    deadline = time.monotonic() + timeout_s
    while True:
        before = server.stats(dataset)
        assert_counts(before)
        views = {
            s["split"]: disk_view(server.data_root, dataset, s["split"]) for s in before["splits"]
        }
        after = server.stats(dataset)
        assert_counts(after)
        problems = []
        for s1, s2 in zip(before["splits"], after["splits"], strict=True):
            a, b = split_ints(s1), split_ints(s2)
            moved = [k for k in _STABLE if a[k] != b[k]]
            if moved:
                problems.append(f"{a['split']}: the queue moved during the look ({moved})")
            problems += check_disk(b, views[b["split"]])
            seqs = None if consumed_seqs is None else consumed_seqs.get(b["split"])
            problems += check_clients(b, views[b["split"]], batches.get(b["split"]), seqs)
        if not problems:
            return {s["split"]: split_ints(s) for s in after["splits"]}
        if time.monotonic() > deadline:
            raise AssertionError(
                f"audit of {dataset!r} failed after {timeout_s}s:\n" + "\n".join(problems)
            )
        time.sleep(0.05)  # poll interval of the retry loop above, bounded by the deadline
