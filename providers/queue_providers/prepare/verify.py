"""`queue-prepare verify FOLDER`: every byte of a prepared corpus against its manifest.

token_shards never hashes a shard when it starts: that would read the whole corpus (a
terabyte, at every start of every server). It checks what headers and sizes show, and each
shard's document starts when it first packs them. This reads every file once, after a copy
or whenever a corpus is in doubt: each shard's and each .docs.npy's sha256 against
manifest.json, then what token_shards checks (headers, token counts, files inside the
folder, every document start), and names each fault, one line each.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from queue_client.errors import BatchQueueError, ConfigError
from queue_providers.prepare.layout import MANIFEST_FILE, PROGRESS_FILE, read_json, sha256_of
from queue_providers.token_shards.prepared import read_prepared

PROG = "queue-prepare verify"


@dataclass(frozen=True)
class Verified:
    """What a verify found: the manifest, how much it holds, and each fault (none: sound)."""

    manifest: Path
    shards: int
    tokens: int
    problems: tuple[str, ...]


def verify(folder: Path, workers: int = 1) -> Verified:
    """Every file of the prepared corpus in `folder` (or at its manifest) checked against
    manifest.json; ConfigError when the folder holds no finished prepared corpus."""
    manifest = folder if folder.name == MANIFEST_FILE else folder / MANIFEST_FILE
    doc = read_json(manifest)
    if doc is None:
        unfinished = (manifest.parent / PROGRESS_FILE).is_file()
        raise ConfigError(
            f"{manifest.parent} holds no {MANIFEST_FILE}: "
            + (
                f"its {PROGRESS_FILE} says a queue-prepare run is unfinished (run that "
                "command again to finish it)"
                if unfinished
                else "it is not a prepared corpus"
            )
        )
    entries = doc.get("shards")
    if not isinstance(entries, list):
        raise ConfigError(f"{manifest}: shards is {entries!r}, expected a list")
    checks: list[tuple[Path, str]] = []
    problems: list[str] = []
    for i, entry in enumerate(entries):
        _entry_files(manifest, f"shards[{i}]", entry, checks, problems)
    with ThreadPoolExecutor(max(1, workers)) as pool:  # hashlib lets go of the GIL
        problems += [p for p in pool.map(_hash_check, checks) if p is not None]
    problems += _as_served(manifest)
    tokens = sum(
        e["tokens"] for e in entries if isinstance(e, dict) and isinstance(e.get("tokens"), int)
    )
    return Verified(manifest, len(entries), tokens, tuple(problems))


def _entry_files(
    manifest: Path, where: str, entry: Any, checks: list[tuple[Path, str]], problems: list[str]
) -> None:
    """Each file a manifest entry names, with its sha256, into `checks`; a fault of the
    entry itself into `problems`."""
    if not isinstance(entry, dict):
        problems.append(f"{manifest}: {where} is {entry!r}, expected a table")
        return
    for name_key, sha_key in (("file", "sha256"), ("docs_file", "docs_sha256")):
        name, sha = entry.get(name_key), entry.get(sha_key)
        if name_key == "docs_file" and name is None and sha is None:
            continue  # a manifest that names a shard's document starts by the shard's name
        if not isinstance(name, str) or PurePosixPath(name).name != name or name[:1] == ".":
            problems.append(f"{manifest}: {where}.{name_key} is {name!r}, expected a file name")
        elif not isinstance(sha, str) or len(sha) != 64:
            problems.append(f"{manifest}: {where}.{sha_key} is {sha!r}, expected 64 hex digits")
        else:
            checks.append((manifest.parent / name, sha))


def _hash_check(check: tuple[Path, str]) -> str | None:
    path, expected = check
    target = path.resolve()
    if not target.is_relative_to(path.parent.resolve()):
        return f"{path} is a symlink to {target}, outside the corpus folder"
    try:
        actual = sha256_of(path)
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror}"
    if actual != expected:
        return f"{path}: sha256 is {actual}, {MANIFEST_FILE} says {expected}"
    return None


def _as_served(manifest: Path) -> list[str]:
    """What token_shards would refuse, at start or when it packs documents."""
    try:
        corpus = read_prepared(manifest, None, None)
    except ConfigError as exc:
        return [str(exc).removeprefix("token_shards: ")]
    problems = []
    for shard in corpus.shards:
        try:
            if shard.check_documents is not None:
                shard.check_documents()
            if shard.doc_starts is not None:
                shard.doc_starts()
        except ConfigError as exc:
            problems.append(str(exc).removeprefix("token_shards: "))
    return problems


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Check a prepared corpus against its manifest.json: every shard's and "
        "every document-start file's sha256, and everything token_shards checks when it "
        "serves it. Exit 0: sound; 1: faults, one line each; 2: not a prepared corpus.",
    )
    p.add_argument("folder", type=Path, help="the prepared corpus's folder (or its manifest)")
    p.add_argument("--workers", type=int, default=1, help="files hashed at once (default 1)")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    try:
        found = verify(args.folder, args.workers)
    except BatchQueueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for problem in found.problems:
        print(f"{PROG}: {problem}", file=sys.stderr)
    if found.problems:
        print(f"{PROG}: {len(found.problems)} fault(s) in {found.manifest}", file=sys.stderr)
        return 1
    print(
        f"{found.manifest}: {found.shards} shard(s), {found.tokens:,} tokens: every file matches "
        "its sha256 and every document start is in order"
    )
    return 0
