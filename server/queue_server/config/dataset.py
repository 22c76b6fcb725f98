"""A [datasets.NAME] table: frozen, validated on construction, errors naming the key."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from queue_client.errors import ConfigError, InvalidRequest
from queue_client.format.layout import check_dataset_name, check_split_name
from queue_server.config.checks import check, in_range, is_int, is_number
from queue_server.mixture.config import MIXTURE_KEYS, take_mixture
from queue_server.production.priority import PRIORITIES

MODES = ("deterministic", "best_effort")
SELECTIONS = ("fifo", "curriculum")
# Candidates ingested per served batch: beyond this a curriculum split does nothing else.
MAX_CANDIDATE_OVERSAMPLE = 1_000.0
# Composer processes per curriculum split: each pick waits for all of them.
MAX_COMPOSER_WORKERS = 64
# Curriculum streams of a split: a world size's worth (served_ranks.MAX_WORLD_SIZE).
MAX_CURRICULUM_STREAMS = 65536

BACKENDS = ("local", "ray")
_RAY_LABEL = re.compile(r"node:([A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?)=([A-Za-z0-9._-]*)")


def parse_ray_placement(placement: Any) -> dict[str, str] | None:
    """{} for "spread", {KEY: VALUE} for "node:KEY=VALUE", None for anything else."""
    if placement == "spread":
        return {}
    match = _RAY_LABEL.fullmatch(placement) if isinstance(placement, str) else None
    return {match.group(1): match.group(3)} if match else None


@dataclass(frozen=True)
class CurriculumConfig:
    """How a curriculum split picks its served batches (docs/curriculum.md). In TOML its keys
    stand in the dataset's table under the names in CURRICULUM_KEYS."""

    # The splits it applies to; the others (val) are served as produced.
    splits: tuple[str, ...] = ("train",)
    # Alpha of target = (1 - alpha) * corpus + alpha * uniform, before any schedule point or
    # SetCurriculum call.
    alpha: float = 1.0
    # (x, alpha) points over schedule_unit ("step": batches per rank; "tokens": tokens served).
    schedule: tuple[tuple[float, float], ...] = ()
    schedule_unit: str = "step"
    # The batch field whose token ids are scored ("" picks meta's token_field, else "x" or
    # "input_ids").
    field: str = ""
    # Candidate batches in the buffer, and candidates ingested per served batch.
    candidate_buffer: int = 1000
    candidate_oversample: float = 2.0
    # Tokens sampled (spread over all of the data) to estimate the corpus distribution.
    starting_estimation_token_count: int = 10_000_000
    # Composer processes per curriculum split, each scoring its share of the buffer; the
    # served batches are the same for any count (not in the fingerprint).
    composer_workers: int = 1
    # Independent curriculum streams: stream k composes the served seqs = k (mod streams) from
    # candidates of its own, with its own buffer and served counts, so a node composes only
    # the streams of its ranks when world_size divides it. 1: one stream for the whole job.
    streams: int = 1

    def validate(self, where: str) -> None:
        from queue_server.curriculum.schedule import UNITS, check_points

        check(
            is_int(self.candidate_buffer) and self.candidate_buffer >= 1,
            f"{where}.candidate_buffer",
            self.candidate_buffer,
            "an integer >= 1",
        )
        check(
            in_range(self.candidate_oversample, 1, MAX_CANDIDATE_OVERSAMPLE),
            f"{where}.candidate_oversample",
            self.candidate_oversample,
            f"a number in [1, {MAX_CANDIDATE_OVERSAMPLE:g}]",
        )
        check(
            is_number(self.alpha) and 0 <= self.alpha <= 1,
            f"{where}.curriculum_alpha",
            self.alpha,
            "a number in [0, 1]",
        )
        check_points([list(p) for p in self.schedule], f"{where}.curriculum_schedule")
        check(
            self.schedule_unit in UNITS,
            f"{where}.curriculum_schedule_unit",
            self.schedule_unit,
            f"one of {UNITS}",
        )
        check(
            is_int(self.starting_estimation_token_count)
            and self.starting_estimation_token_count >= 1,
            f"{where}.starting_estimation_token_count",
            self.starting_estimation_token_count,
            "an integer >= 1",
        )
        check(
            bool(self.splits) and all(isinstance(x, str) and x for x in self.splits),
            f"{where}.curriculum_splits",
            list(self.splits),
            'a non-empty list of split names such as ["train"]',
        )
        check(isinstance(self.field, str), f"{where}.curriculum_field", self.field, "a field name")
        check(
            is_int(self.composer_workers) and 1 <= self.composer_workers <= MAX_COMPOSER_WORKERS,
            f"{where}.composer_workers",
            self.composer_workers,
            f"an integer in [1, {MAX_COMPOSER_WORKERS}]",
        )
        check(
            is_int(self.streams) and 1 <= self.streams <= MAX_CURRICULUM_STREAMS,
            f"{where}.curriculum_streams",
            self.streams,
            f"an integer in [1, {MAX_CURRICULUM_STREAMS}]",
        )

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str) -> CurriculumConfig:
        """Take the curriculum keys out of a dataset's TOML table."""
        kwargs: dict[str, Any] = {}
        for key, name in CURRICULUM_KEYS.items():
            if key in table:
                kwargs[name] = table.pop(key)
        if "splits" in kwargs:
            check(
                isinstance(kwargs["splits"], list),
                f"{where}.curriculum_splits",
                kwargs["splits"],
                'a non-empty list of split names such as ["train"]',
            )
            kwargs["splits"] = tuple(kwargs["splits"])
        if "schedule" in kwargs:
            from queue_server.curriculum.schedule import check_points

            check_points(kwargs["schedule"], f"{where}.curriculum_schedule")
            kwargs["schedule"] = tuple(tuple(p) for p in kwargs["schedule"])
        return cls(**kwargs)


# TOML key in [datasets.NAME] -> CurriculumConfig field.
CURRICULUM_KEYS = {
    "curriculum_splits": "splits",
    "curriculum_alpha": "alpha",
    "curriculum_schedule": "schedule",
    "curriculum_schedule_unit": "schedule_unit",
    "curriculum_field": "field",
    "candidate_buffer": "candidate_buffer",
    "candidate_oversample": "candidate_oversample",
    "starting_estimation_token_count": "starting_estimation_token_count",
    "composer_workers": "composer_workers",
    "curriculum_streams": "streams",
}


@dataclass(frozen=True)
class DatasetConfig:
    """One [datasets.NAME] table."""

    name: str
    provider: str
    batch_size: int
    # Batches per file: big enough that the per-file lease RPC is amortised over many steps.
    batches_per_file: int = 100
    # Ready files kept ahead of each rank beyond the two it holds (the one it reads and the
    # prefetched next); production pauses at this depth and a release resumes it.
    max_backlog_files: int = 2
    seed: int = 1337
    # Worker processes of the training split; worker w produces seqs w, w+workers, ...
    workers: int = 1
    # Worker processes of other splits, by name: an evaluation split is read a few batches
    # at a time, so each gets 1 worker unless named here (split_workers = { val = 2 }).
    split_workers: dict[str, Any] = field(default_factory=dict)
    # Ready files per rank of other splits, by name (split_max_backlog_files = { val = 1 }):
    # a split not named here keeps max_backlog_files.
    split_max_backlog_files: dict[str, Any] = field(default_factory=dict)
    # "deterministic": rank r of W reads seqs r, r+W, ...; "best_effort": any rank takes the
    # next ready file, at most max_lead files ahead of the slowest rank.
    mode: str = "deterministic"
    max_lead: int = 4
    # Worker crashes (process death or a raised error) in a row before the dataset is failed.
    max_worker_restarts: int = 3
    # Journal records appended before the journal is compacted (0: never); and the files per
    # rank, behind the slowest, whose stream states are kept for a rewind (streaming providers).
    journal_compact_records: int = 10_000
    journal_keep_files: int = 1_000
    # "fifo": files are served as produced; "curriculum": each served batch is picked from a
    # buffer of candidates by token neglect against an alpha-blended target (docs/curriculum.md).
    selection: str = "fifo"
    # selection = "curriculum": how served batches are picked; set by the curriculum_* keys
    # (and candidate_*, starting_estimation_token_count) of the dataset's table.
    curriculum: CurriculumConfig = field(default_factory=lambda: CurriculumConfig())
    # "idle": provider workers (and a curriculum's composers) run in Linux's SCHED_IDLE
    # class, on cores the trainer leaves free (production/priority.py); "normal" is the default.
    worker_priority: str = "normal"
    # Where the providers run: "local" worker processes, or "ray" actors on a Ray cluster.
    backend: str = "local"
    # backend = "ray": the cluster to join (HOST:PORT of its head, as `ray start --head`
    # prints it), or "local" to start a one-machine cluster in the server, for trying it.
    ray_address: str = "local"
    # backend = "ray": "spread" actors over all nodes, or "node:KEY=VALUE" to keep them on
    # the nodes started with that label.
    ray_placement: str = "spread"
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"datasets.{self.name}"
        try:
            check_dataset_name(self.name)
        except InvalidRequest as exc:
            raise ConfigError(f"[{where}]: {exc}") from None
        check(
            isinstance(self.provider, str) and bool(self.provider),
            f"{where}.provider",
            self.provider,
            "a provider name such as 'char_lm'",
        )
        for key in ("batch_size", "batches_per_file", "max_backlog_files", "workers", "max_lead"):
            value = getattr(self, key)
            check(is_int(value) and value >= 1, f"{where}.{key}", value, "an integer >= 1")
        check(is_int(self.seed), f"{where}.seed", self.seed, "an integer")
        check(
            is_int(self.max_worker_restarts) and self.max_worker_restarts >= 0,
            f"{where}.max_worker_restarts",
            self.max_worker_restarts,
            "an integer >= 0",
        )
        for key in ("journal_compact_records", "journal_keep_files"):
            value = getattr(self, key)
            check(is_int(value) and value >= 0, f"{where}.{key}", value, "an integer >= 0")
        check(self.mode in MODES, f"{where}.mode", self.mode, f"one of {MODES}")
        check(
            self.worker_priority in PRIORITIES,
            f"{where}.worker_priority",
            self.worker_priority,
            f"one of {PRIORITIES}",
        )
        check(isinstance(self.args, dict), f"{where}.args", self.args, "a table")
        self._check_split_workers(where)
        self._check_split_table(where, "split_max_backlog_files")
        self._check_curriculum(where)
        self._check_backend(where)

    def _check_split_workers(self, where: str) -> None:
        self._check_split_table(where, "split_workers")

    def _check_split_table(self, where: str, name: str) -> None:
        """A { split = integer >= 1 } table: split_workers, split_max_backlog_files."""
        key, table = f"{where}.{name}", getattr(self, name)
        check(isinstance(table, dict), key, table, "a table such as { val = 1 }")
        for split, count in table.items():
            try:
                check_split_name(split)
            except InvalidRequest as exc:
                raise ConfigError(f"{key}: {exc}") from None
            check(is_int(count) and count >= 1, f"{key}.{split}", count, "an integer >= 1")

    def workers_for(self, split: str, splits: Sequence[str]) -> int:
        """Worker processes of `split` among the dataset's `splits` (meta's split_info order):
        split_workers[split] if set; else `workers` for the training split ("train", else
        the first) and for anything that is no split (the meta builder); else 1."""
        if split in self.split_workers:
            return self.split_workers[split]
        if split not in splits or split == training_split(splits):
            return self.workers
        return 1

    def backlog_for(self, split: str) -> int:
        """Ready files per rank kept ahead of `split`: split_max_backlog_files[split] if set,
        else max_backlog_files."""
        return self.split_max_backlog_files.get(split, self.max_backlog_files)

    def _check_curriculum(self, where: str) -> None:
        check(
            self.selection in SELECTIONS,
            f"{where}.selection",
            self.selection,
            f"one of {SELECTIONS}",
        )
        if self.selection == "curriculum" and self.mode != "deterministic":
            raise ConfigError(
                f'{where}.selection = "curriculum" needs mode = "deterministic" (it is {self.mode!r}): '
                "served batches are composed in seq order"
            )
        check(
            isinstance(self.curriculum, CurriculumConfig),
            f"{where}.curriculum",
            self.curriculum,
            "a CurriculumConfig",
        )
        self.curriculum.validate(where)

    def _check_backend(self, where: str) -> None:
        check(self.backend in BACKENDS, f"{where}.backend", self.backend, f"one of {BACKENDS}")
        check(
            isinstance(self.ray_address, str) and bool(self.ray_address.strip()),
            f"{where}.ray_address",
            self.ray_address,
            '"local" or the HOST:PORT of a Ray cluster\'s head',
        )
        check(
            parse_ray_placement(self.ray_placement) is not None,
            f"{where}.ray_placement",
            self.ray_placement,
            '"spread" or "node:KEY=VALUE" (a node label)',
        )

    def fingerprint(self) -> str:
        """What the produced data depends on; a dataset dir built under another is refused."""
        keyed = {
            "provider": self.provider,
            "batch_size": self.batch_size,
            "batches_per_file": self.batches_per_file,
            "seed": self.seed,
            "workers": self.workers,
            # args.remote says how URL inputs are fetched (queue_providers.remote), not what
            # they hold: the inputs fingerprint catches a changed object.
            "args": {k: v for k, v in self.args.items() if k != "remote"},
        }
        # Other splits' workers: which worker makes a seq changes a streaming provider's
        # files. Absent when every split has one worker, as before split_workers existed.
        others = {
            k: v for k, v in sorted(self.split_workers.items()) if v != 1 or self.workers != 1
        }
        if self.workers != 1 or others:
            keyed["split_workers"] = {"default": 1, **others}
        if self.selection != "fifo":  # what is served depends on these too
            c = self.curriculum
            curriculum: list[Any] = [  # this order: data dirs built before keep their fingerprint
                self.selection,
                c.candidate_buffer,
                c.candidate_oversample,
                c.alpha,
                [list(p) for p in c.schedule],
                c.schedule_unit,
                c.starting_estimation_token_count,
                c.field,
                list(c.splits),
            ]
            if c.streams != 1:  # absent at 1, so directories built before keep theirs
                curriculum.append(["streams", c.streams])
            keyed["curriculum"] = curriculum
        return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[
            :16
        ]


def training_split(splits: Sequence[str]) -> str:
    """The split a dataset trains on: "train", else the first of meta's split_info."""
    if "train" in splits or not splits:
        return "train"
    return splits[0]


def dataset_from_table(name: str, table: dict[str, Any]) -> DatasetConfig:
    """A DatasetConfig from its TOML table (a copy is consumed), naming unknown keys."""
    table = dict(table)
    where = f"datasets.{name}"
    unknown = sorted(set(table) - DATASET_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {[f'{where}.{k}' for k in unknown]}: expected some of {sorted(DATASET_KEYS)}"
        )
    take_mixture(table, where)
    for key in ("provider", "batch_size"):
        if key not in table:
            raise ConfigError(f"{where}.{key} is missing")
    curriculum = CurriculumConfig.from_table(table, where)
    return DatasetConfig(name=name, curriculum=curriculum, **table)


# The keys a [datasets.NAME] table may hold.
DATASET_KEYS = (
    ({f.name for f in fields(DatasetConfig)} - {"name", "curriculum"})
    | set(CURRICULUM_KEYS)
    | MIXTURE_KEYS
)
