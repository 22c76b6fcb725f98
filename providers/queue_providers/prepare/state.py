"""What an output dir holds, whether this run may write there, and what it was made from.

An output dir is *ours* when it holds manifest.json (a finished corpus) or progress.json (an
unfinished one), both written by this format. progress.json is written before the first
shard, so a killed run always leaves one; it lists the finished shards, each with the resume
point after it, and the run's *identity*: the inputs (their records and fingerprint, as the
server records a dataset's inputs), the reading options, the tokenizer's identity, the shard
size and the piece plan. A run into an ours dir compares its own identity with the recorded
one and refuses any difference, naming it; --overwrite deletes our files and starts over.
A dir holding anything else is never written to.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError
from queue_client.format.layout import is_temp_name, remove_temp_files
from queue_providers.inputs import input_changes
from queue_providers.prepare.layout import (
    FORMAT,
    INPUT_CACHE_DIR,
    MANIFEST_FILE,
    PROGRESS_FILE,
    VERSION,
    ShardRecord,
    is_ours,
    read_json,
    verify_shard,
    write_json,
    writing,
)
from queue_providers.prepare.sharder import ResumePoint
from queue_providers.prepare.tokenizer import tokenizer_change

START = ResumePoint(0, 0, False)
# Identity keys kept at the top level of both files (the manifest's contract names them).
_SPLIT_OUT = ("inputs", "tokenizer")


@dataclass(frozen=True)
class Done:
    """The shards a previous run finished (each with where the next one begins)."""

    shards: list[tuple[ShardRecord, ResumePoint]]
    complete: bool  # manifest.json was written

    @property
    def resume_at(self) -> ResumePoint:
        return self.shards[-1][1] if self.shards else START


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold an flock on the output folder (made if missing) while a run writes it, so two
    runs never write one folder, and a temp file found there is a dead run's leftover."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file, not a folder")
    with writing(out.parent, out.name):
        out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"another queue-prepare is writing {str(out)!r} now: wait for it to end, or "
                "choose another --out"
            ) from None
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the flock


def open_output(out: Path, overwrite: bool) -> dict[str, Any] | None:
    """The recorded manifest or progress of `out` (None: a fresh dir). Refuses a dir that
    holds files that are not ours; with `overwrite`, deletes ours and returns None."""
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    recorded = read_json(out / MANIFEST_FILE) or read_json(out / PROGRESS_FILE)
    # Without a record, only what a run leaves before writing one may be there: temp files,
    # and the cache of URL inputs listed before a failure (a bad tokenizer, say).
    leftovers = all(is_temp_name(name) or name == INPUT_CACHE_DIR for name in entries)
    if recorded is None and not leftovers:
        shown = ", ".join(entries[:5]) + (" ..." if len(entries) > 5 else "")
        raise ConfigError(
            f"--out {str(out)!r} is not empty ({shown}) and holds no prepared corpus (no "
            f"{MANIFEST_FILE} or {PROGRESS_FILE}): choose an empty or new folder"
        )
    remove_temp_files(out)  # a killed run's half-written files; ours, as the lock is ours
    if recorded is not None and overwrite:
        for name in entries:
            if is_ours(name):
                path = out / name
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        return None
    return recorded


def check_same(out: Path, recorded: dict[str, Any], identity: dict[str, Any]) -> None:
    """ConfigError naming everything that differs between the run that wrote `out` and this
    one: changed inputs (each file), tokenizer, reading options, shard size."""
    old = {**recorded.get("identity", {}), **{k: recorded.get(k, {}) for k in _SPLIT_OUT}}
    changes: list[str] = []
    if old.get("inputs", {}).get("fingerprint") != identity["inputs"]["fingerprint"]:
        changes += input_changes(old.get("inputs", {}).get("records", {}),
                                 identity["inputs"]["records"]) or ["the inputs changed"]  # fmt: skip
    change = tokenizer_change(old.get("tokenizer", {}), identity["tokenizer"])
    if change:
        changes.append(change)
    for key in ("reading", "shard_tokens", "plan"):
        if old.get(key) != identity[key]:
            changes.append(f"{key} was {old.get(key)!r}, this run has {identity[key]!r}")
    if changes:
        raise ConfigError(
            f"{out} was prepared from something else: {'; '.join(changes)}. Its shards do not "
            "match this command: run it with --overwrite to delete them and prepare again, or "
            "restore what changed"
        )


def finished_shards(out: Path, recorded: dict[str, Any]) -> Done:
    """The recorded shards that are still intact. A finished corpus whose shard is damaged is
    an error (it may be in use); an unfinished one goes on after its last intact shard."""
    complete = "identity" in recorded and recorded.get("complete") is True
    shards = []
    for raw in recorded.get("shards", []):
        record = ShardRecord.from_json(raw)
        problem = verify_shard(out, record)
        if problem is not None:
            if complete:
                raise ConfigError(
                    f"{out / MANIFEST_FILE} lists {record.file} but {problem}: run with "
                    "--overwrite to prepare the corpus again"
                )
            break
        shards.append((record, ResumePoint(**raw["next"])))
    return Done(shards, complete)


def write_progress(
    out: Path, identity: dict[str, Any], shards: list[tuple[ShardRecord, ResumePoint]]
) -> None:
    write_json(
        out / PROGRESS_FILE,
        {
            "format": FORMAT,
            "version": VERSION,
            "complete": False,
            **{k: identity[k] for k in _SPLIT_OUT},
            "identity": _rest(identity),
            "shards": [{**r.to_json(), "next": at.to_json()} for r, at in shards],
        },
    )


def write_manifest(
    out: Path, identity: dict[str, Any], shards: list[tuple[ShardRecord, ResumePoint]]
) -> dict[str, Any]:
    """manifest.json (the contract's keys, then the resume record, so that a run of the same
    command on a finished corpus can check it); the progress file and input cache go."""
    tok = identity["tokenizer"]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "complete": True,
        "dtype": identity["dtype"],
        "vocab_size": tok["vocab_size"],
        "eos_id": tok["eos_id"],
        "tokenizer": tok,
        "inputs": identity["inputs"],
        "shard_tokens": identity["shard_tokens"],
        "total_tokens": sum(r.tokens for r, _ in shards),
        "total_documents": sum(r.documents for r, _ in shards),
        "shards": [{**r.to_json(), "next": at.to_json()} for r, at in shards],
        "identity": _rest(identity),
    }
    write_json(out / MANIFEST_FILE, manifest)
    (out / PROGRESS_FILE).unlink(missing_ok=True)
    shutil.rmtree(out / INPUT_CACHE_DIR, ignore_errors=True)
    return manifest


def _rest(identity: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in identity.items() if k not in _SPLIT_OUT}
