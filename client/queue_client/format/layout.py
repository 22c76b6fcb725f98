"""Every path under the data root, named in this one module, and the one way to write there.

<data_root>/
    .batchqueue.lock                      the owning server's pid (the flock is on the root dir)
    .batchqueue.root-id                   the root's random id: who sees this root (GetMeta)
    <dataset>/
        meta.pkl                          the dataset contract (plain-data pickle, meta.py)
        inputs.json                       size, mtime and sha256 of each input it was built from
        queue/<split>/                    published batch files (batchfile.py names them)
        candidates/<split>/               curriculum candidates
        quarantine/<split>/               files that failed to verify, NAME.reason.txt beside
        quarantine/<split>/candidates/    the same for curriculum candidates
        journal/<split>.jsonl             the split's journal (queue_server.journal.records)
        journal/<split>.candidates.jsonl  the journal of its curriculum candidates
        stats/<split>.throughput.json     the split's consumption over the last minute (rates)
        curriculum/corpus-<key>.npy       cached corpus token distributions
        curriculum/<split>/composer-<seq>.npz   composer snapshots
        artifacts/<key>/                  providers' tokenized caches: <name>.npy + info.json
        tokenizer/                        text_lm's tokenizer snapshot
        input-cache/                      blocks and copies of URL inputs (queue_providers.remote)
    <dataset>.reset-<utc>/                a dataset dir that `queue-server reset` moved aside

Nothing else in batchqueue joins a path under the data root by hand: a name checked here
(`check_dataset_name`, `check_split_name`) cannot leave the root, and a file written through
`atomic_write` is either absent or complete, also after a power cut.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from queue_client.errors import InvalidRequest

ROOT_LOCK_FILE = ".batchqueue.lock"
# A random id made once per data root; a client that reads the id the server publishes under
# its own data_root sees the server's files (a path alone can name another disk).
ROOT_ID_FILE = ".batchqueue.root-id"
META_FILE = "meta.pkl"
INPUTS_FILE = "inputs.json"
RESET_INFIX = ".reset-"
QUEUE_DIR = "queue"
CANDIDATES_DIR = "candidates"
QUARANTINE_DIR = "quarantine"
JOURNAL_DIR = "journal"
STATS_DIR = "stats"
CURRICULUM_DIR = "curriculum"
ARTIFACTS_DIR = "artifacts"
TOKENIZER_DIR = "tokenizer"
INPUT_CACHE_DIR = "input-cache"
REASON_SUFFIX = ".reason.txt"
ARTIFACT_INFO_FILE = "info.json"
ARTIFACT_ARRAY_SUFFIX = ".npy"
# Temp files are `.tmp-{pid}-{n}-{final name}`: readers skip the prefix, the server removes
# them at start, and a dead worker's own temp files are found by its pid.
TMP_PREFIX = ".tmp-"

_DATASET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SPLIT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SNAPSHOT_RE = re.compile(r"composer-([0-9]{10,})\.npz")
_SOURCE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_EPOCH_START_RE = re.compile(
    r"([A-Za-z0-9_][A-Za-z0-9_.-]{0,63})\.epoch([0-9]{1,9})\.row([0-9]{1,18})"
)
_TEMP_RE = re.compile(re.escape(TMP_PREFIX) + r"([0-9]+)-[0-9]+-")
_temp_counter = iter(range(1 << 62))
_temp_lock = threading.Lock()


def clip(value: object, limit: int = 80) -> str:
    """repr() of a rejected value, cut short: an error must not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_dataset_name(name: str) -> str:
    """Reject names that could leave the data root (`..`, `/`, NUL, absolute paths)."""
    if not isinstance(name, str) or not _DATASET_RE.fullmatch(name) or ".." in name:
        raise InvalidRequest(
            f"dataset name {clip(name)} is not allowed: use letters, digits, '.', '_' and '-' "
            "(no '..', no '/'), at most 128 characters"
        )
    return name


def check_split_name(split: str) -> str:
    if not isinstance(split, str) or not _SPLIT_RE.fullmatch(split):
        raise InvalidRequest(
            f"split name {clip(split)} is not allowed: use letters, digits, '_' and '-'"
        )
    return split


def _check_key(key: str, what: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key) or ".." in key:
        raise InvalidRequest(f"{what} {clip(key)} is not a plain file name")
    return key


def root_lock_file(root: Path) -> Path:
    return Path(root) / ROOT_LOCK_FILE


def root_id_file(root: Path) -> Path:
    return Path(root) / ROOT_ID_FILE


@dataclass(frozen=True)
class DatasetLayout:
    """The paths of one dataset under one data root."""

    root: Path
    dataset: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        check_dataset_name(self.dataset)

    @property
    def dir(self) -> Path:
        return self.root / self.dataset

    @property
    def meta_file(self) -> Path:
        return self.dir / META_FILE

    @property
    def inputs_file(self) -> Path:
        """The records of the input files meta was built from (queue_providers.inputs)."""
        return self.dir / INPUTS_FILE

    def reset_dir(self, stamp: str) -> Path:
        """Where `queue-server reset` moves the dataset dir aside: `<dataset>.reset-<stamp>`
        beside it, in the data root (stamp is a UTC time such as 20250101T120000Z)."""
        name = f"{self.dataset}{RESET_INFIX}{_check_key(stamp, 'reset stamp')}"
        return self.root / check_dataset_name(name)

    def queue_dir(self, split: str) -> Path:
        return self.dir / QUEUE_DIR / check_split_name(split)

    def candidates_dir(self, split: str) -> Path:
        """Where a curriculum split's providers publish candidate files for the composer."""
        return self.dir / CANDIDATES_DIR / check_split_name(split)

    def files_dir(self, split: str, candidates: bool = False) -> Path:
        """The published files of a split, or of its curriculum candidates."""
        return self.candidates_dir(split) if candidates else self.queue_dir(split)

    def quarantine_dir(self, split: str, candidates: bool = False) -> Path:
        base = self.dir / QUARANTINE_DIR / check_split_name(split)
        return base / CANDIDATES_DIR if candidates else base

    @property
    def journal_dir(self) -> Path:
        return self.dir / JOURNAL_DIR

    def journal_file(self, split: str, candidates: bool = False) -> Path:
        suffix = ".candidates.jsonl" if candidates else ".jsonl"
        return self.journal_dir / f"{check_split_name(split)}{suffix}"

    @property
    def stats_dir(self) -> Path:
        return self.dir / STATS_DIR

    def throughput_file(self, split: str) -> Path:
        """The split's recent consumption, kept so that rates survive a server restart."""
        return self.stats_dir / f"{check_split_name(split)}.throughput.json"

    def mixture_epochs_dir(self, split: str) -> Path:
        """Where a mixture's workers record each source's epoch starts (mixture_epochs.py)."""
        return self.stats_dir / f"{check_split_name(split)}.epochs"

    def mixture_epoch_start_file(self, split: str, source: str, epoch: int, row: int) -> Path:
        """The (empty) record that a mixture source's row `row` starts its epoch `epoch`."""
        return self.mixture_epochs_dir(split) / mixture_epoch_start_name(source, epoch, row)

    @property
    def curriculum_dir(self) -> Path:
        return self.dir / CURRICULUM_DIR

    def corpus_cache_file(self, key: str) -> Path:
        return self.curriculum_dir / f"corpus-{_check_key(key, 'corpus cache key')}.npy"

    def composer_snapshot_dir(self, split: str) -> Path:
        return self.curriculum_dir / check_split_name(split)

    def composer_snapshot_file(self, split: str, name: str) -> Path:
        """A composer snapshot by the name a journal record gives (composer_snapshot_name)."""
        if composer_snapshot_seq(name) is None:
            raise InvalidRequest(
                f"composer snapshot name {clip(name)} is not composer-<10-digit seq>.npz"
            )
        return self.composer_snapshot_dir(split) / name

    @property
    def artifacts_dir(self) -> Path:
        return self.dir / ARTIFACTS_DIR

    def artifacts(self, key: str) -> Path:
        return self.artifacts_dir / _check_key(key, "artifacts key")

    @property
    def tokenizer_dir(self) -> Path:
        return self.dir / TOKENIZER_DIR

    @property
    def input_cache_dir(self) -> Path:
        """Where blocks of a provider's URL inputs are cached (least recently used evicted)."""
        return self.dir / INPUT_CACHE_DIR

    def leased_path(self, split: str, file_name: str) -> str:
        """A published file as a lease names it: relative to the data root, '/'-separated."""
        name = _check_key(file_name, "file name")
        return f"{self.dataset}/{QUEUE_DIR}/{check_split_name(split)}/{name}"


def composer_snapshot_name(seq: int) -> str:
    """The name of the composer snapshot taken after served file `seq` (journaled as is)."""
    return f"composer-{seq:010d}.npz"


def composer_snapshot_seq(name: str) -> int | None:
    """The seq a composer snapshot was taken after, or None for any other name."""
    m = _SNAPSHOT_RE.fullmatch(name) if isinstance(name, str) else None
    return int(m.group(1)) if m else None


def mixture_epoch_start_name(source: str, epoch: int, row: int) -> str:
    """`<source>.epoch<E>.row<P>`: source names are letters, digits, '_', '.', '-'."""
    if not isinstance(source, str) or not _SOURCE_RE.fullmatch(source) or ".." in source:
        raise InvalidRequest(f"mixture source name {clip(source)} is not a plain file name")
    return f"{source}.epoch{int(epoch)}.row{int(row)}"


def mixture_epoch_start_of(name: str) -> tuple[str, int, int] | None:
    """(source, epoch, row) of an epoch start record's name, or None for any other name."""
    m = _EPOCH_START_RE.fullmatch(name) if isinstance(name, str) else None
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def artifact_info_file(artifact_dir: Path) -> Path:
    """The info.json of a tokenized cache: in its published dir, or in the temp dir that
    atomic_directory hands out while it is built (so it is not a DatasetLayout method)."""
    return Path(artifact_dir) / ARTIFACT_INFO_FILE


def artifact_array_file(artifact_dir: Path, name: str) -> Path:
    """Array `name` of a tokenized cache (see artifact_info_file)."""
    return Path(artifact_dir) / f"{_check_key(name, 'artifact array name')}{ARTIFACT_ARRAY_SUFFIX}"


def input_cache_file(cache_dir: Path, name: str) -> Path:
    """One entry (a block or a whole copy of a URL input) of an input cache directory."""
    return Path(cache_dir) / _check_key(name, "input cache entry")


def reason_file(quarantined: Path) -> Path:
    """The note beside a quarantined file that says why it was moved there."""
    return quarantined.with_name(quarantined.name + REASON_SUFFIX)


def temp_path(final: Path) -> Path:
    """A temp name beside `final`, unique in this process and marked with its pid."""
    with _temp_lock:
        n = next(_temp_counter)
    return final.with_name(f"{TMP_PREFIX}{os.getpid()}-{n}-{final.name}")


def is_temp_name(name: str) -> bool:
    return name.startswith(TMP_PREFIX)


def is_temp_of(name: str, pid: int) -> bool:
    """Whether `name` is a temp file that process `pid` was writing."""
    return name.startswith(f"{TMP_PREFIX}{pid}-")


def temp_owner_pid(name: str) -> int | None:
    """The pid of the process that was writing temp file `name`, or None if not a temp name."""
    m = _TEMP_RE.match(name)
    return int(m.group(1)) if m else None


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (of any user): a temp file
    whose owner is gone is a leftover, one whose owner lives may still be written."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_temp_files(directory: Path, pid: int | None = None) -> int:
    """Delete leftovers of interrupted writes (only `pid`'s, if given); returns how many."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if is_temp_name(entry.name) and (pid is None or is_temp_of(entry.name, pid)):
            with contextlib.suppress(FileNotFoundError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            removed += 1
    return removed


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path, data: bytes | bytearray | memoryview | Callable[[BinaryIO], object]
) -> None:
    """Write `path` so that it is either absent or complete: temp file, fsync, replace, fsync
    of the directory. `data` is the bytes, or a function that writes them to a binary file."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path | None]:
    """Build a directory under a temp name and rename it into place on success.

    Yields the temp directory to fill, or None when `final` exists already (another process
    built it first, and it is never rebuilt in place). Files written inside should be fsynced
    by the caller (atomic_write does it).
    """
    final = Path(final)
    if final.is_dir():
        yield None
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(final)
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process published it first
            return
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
