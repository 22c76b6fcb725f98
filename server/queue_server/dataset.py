"""One served dataset: its meta (built once, in a worker process) and its split queues."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from queue_client import errors
from queue_client.batchfile import META_FILE, check_split_name, dataset_dir
from queue_client.meta import (
    dump_meta,
    load_meta,
    meta_from_json,
    meta_to_json,
    split_schema,
    validate_meta,
)
from queue_client.schema import FieldSpec
from queue_server.config import DatasetConfig, ServerConfig
from queue_server.curriculum.composer import ComposerSettings
from queue_server.curriculum.lane import CurriculumLane
from queue_server.curriculum.schedule import AlphaSchedule
from queue_server.split_queue import SplitQueue
from queue_server.workers import WorkerDied, WorkerError, WorkerProcess

log = logging.getLogger("queue_server.dataset")

STARTING, SERVING, FAILED = "starting", "serving", "failed"
# The composer's pins on candidate files never expire: they end when a candidate retires.
_PINNED_TTL_S = 1e9


class DatasetRuntime:
    def __init__(
        self,
        config: DatasetConfig,
        server: ServerConfig,
        on_state: Callable[[DatasetRuntime], None],
    ) -> None:
        self.config = config
        self.server = server
        self.dir = dataset_dir(server.data_root, config.name)
        self.state = STARTING
        self.last_error = ""
        # True when the dataset failed because its config is wrong (bad provider args):
        # the CLI exits with an error instead of serving a dataset that can never work.
        self.config_error = False
        self.meta: dict[str, Any] = {}
        self.meta_json = ""
        self.splits: dict[str, SplitQueue] = {}
        self._on_state = on_state
        self.ready = asyncio.Event()

    @property
    def name(self) -> str:
        return self.config.name

    def _worker(self, split: str, index: int, histogram_field: str = "") -> WorkerProcess:
        init = {
            "data_root": str(self.server.data_root),
            "dataset": self.config.name,
            "provider": self.config.provider,
            "args": self.config.args,
            "batch_size": self.config.batch_size,
            "batches_per_file": self.config.batches_per_file,
            "seed": self.config.seed,
            "worker_index": index,
            "num_workers": self.config.workers,
            "verbose": self.server.verbose,
            "extra_meta": {
                "provider": self.config.provider,
                "config_fingerprint": self.config.fingerprint(),
            },
            "histogram_field": histogram_field,
        }
        return WorkerProcess(
            f"{self.config.name}/{split} worker {index}", init, self.server.config_dir
        )

    def _lane(self, split: str) -> CurriculumLane:
        """The producer of a curriculum split: its candidate queue and its composer."""
        settings, field_name = curriculum_settings(self.config, self.meta, split)
        candidates = SplitQueue(
            dataclasses.replace(
                self.config, max_backlog_files=settings.candidate_backlog, selection="fifo"
            ),
            split,
            self.server.data_root,
            _PINNED_TTL_S,
            lambda index: self._worker(split, index, histogram_field=field_name),
            self.meta_json,
            self.fail,
            verbose=self.server.verbose,
            candidates=True,
        )
        init = {
            "split": split,
            "settings": settings.to_json(),
            "field": field_name,
            "n_tokens": self.config.starting_estimation_token_count,
            "meta_json": self.meta_json,
        }
        composer = WorkerProcess(
            f"{self.config.name}/{split} composer",
            self._worker(split, 0).init_request,
            self.server.config_dir,
        )
        return CurriculumLane(f"{self.config.name}/{split} curriculum", composer, candidates, init)

    async def start(self) -> None:
        try:
            await self._start()
        except Exception as exc:
            self.config_error = isinstance(exc, errors.ConfigError) or (
                isinstance(exc, WorkerError) and exc.kind == "ConfigError"
            )
            known = isinstance(exc, (errors.BatchQueueError, WorkerError, WorkerDied))
            self.fail(str(exc) if known else f"{type(exc).__name__}: {exc}")
            return
        if self.state == STARTING:  # a worker may have failed the dataset while others started
            self.state = SERVING
        self.ready.set()
        self._on_state(self)

    async def _start(self) -> None:
        await asyncio.to_thread(self.dir.mkdir, parents=True, exist_ok=True)
        meta_path = self.dir / META_FILE
        if meta_path.exists():
            meta = await asyncio.to_thread(load_meta, meta_path)
            validate_meta(meta, where=str(meta_path))
            want, have = self.config.fingerprint(), meta.get("config_fingerprint")
            if have != want:
                raise errors.MetaError(
                    f"{meta_path} was built from another config of dataset {self.config.name!r} "
                    f"(fingerprint {have} vs {want}); its batch files would not match. Move "
                    f"{self.dir} aside (nothing is deleted for you) or restore the old config"
                )
        else:
            builder = self._worker("meta", 0)
            try:
                await builder.start()
                reply = await builder.call({"op": "meta"})
            finally:
                await builder.stop()
            meta = meta_from_json(reply["meta_json"])
            await asyncio.to_thread(dump_meta, meta_path, meta)
        self.meta = meta
        self.meta_json = meta_to_json(meta)
        if self.config.selection == "curriculum":
            unknown = sorted(set(self.config.curriculum_splits) - set(meta["split_info"]))
            if unknown:
                raise errors.ConfigError(
                    f"datasets.{self.config.name}.curriculum_splits names {unknown}, which "
                    f"the dataset lacks; its splits are {sorted(meta['split_info'])}"
                )
        for split in meta["split_info"]:
            check_split_name(split)
            if self.config.selection == "curriculum" and split in self.config.curriculum_splits:
                curriculum_settings(self.config, meta, split)  # a bad field fails here, named
                make = lambda index, split=split: self._lane(split)  # noqa: E731
            else:
                make = lambda index, split=split: self._worker(split, index)  # noqa: E731
            queue = SplitQueue(
                self.config,
                split,
                self.server.data_root,
                self.server.lease_ttl_s,
                make,
                self.meta_json,
                self.fail,
                verbose=self.server.verbose,
            )
            self.splits[split] = queue
        await asyncio.gather(*(q.open() for q in self.splits.values()))

    def fail(self, message: str) -> None:
        if self.state == FAILED:
            return
        log.error("dataset %s failed: %s", self.config.name, message)
        self.state = FAILED
        self.last_error = message
        for queue in self.splits.values():
            queue.fail(message)
        self.ready.set()
        self._on_state(self)

    async def close(self) -> None:
        await asyncio.gather(*(q.close() for q in self.splits.values()), return_exceptions=True)

    def check_serving(self) -> None:
        if self.state == FAILED:
            raise errors.ProviderFailed(f"dataset {self.config.name!r} failed: {self.last_error}")

    def split(self, name: str) -> SplitQueue:
        self.check_serving()
        if self.state != SERVING:
            raise errors.ServerUnavailable(f"dataset {self.config.name!r} is still starting")
        check_split_name(name)
        try:
            return self.splits[name]
        except KeyError:
            raise errors.UnknownSplit(
                f"dataset {self.config.name!r} has no split {name!r}; it has {sorted(self.splits)}"
            ) from None

    def schema(self, split: str) -> tuple[FieldSpec, ...]:
        self.split(split)
        return split_schema(self.meta, split)

    def worker_pids(self) -> dict[str, list[int]]:
        return {name: q.worker_pids() for name, q in self.splits.items()}


def resolve_data_root(root: Path) -> Path:
    return Path(root).expanduser().resolve()


def curriculum_settings(
    config: DatasetConfig, meta: dict[str, Any], split: str
) -> tuple[ComposerSettings, str]:
    """The composer's settings for one split, and the field it scores; errors name the key."""
    where = f"datasets.{config.name}"
    vocab_size = meta.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise errors.ConfigError(
            f'{where}.selection = "curriculum" needs a vocab_size in meta; provider '
            f"{config.provider!r} declares {vocab_size!r}"
        )
    schema = {f.name: f for f in split_schema(meta, split)}
    field_name = config.curriculum_field or meta.get("token_field") or ""
    if not field_name:
        field_name = next((n for n in ("x", "input_ids") if n in schema), "")
    spec = schema.get(field_name)
    if spec is None:
        raise errors.ConfigError(
            f"{where}.curriculum_field = {field_name!r} is not a field of split {split!r}; "
            f"its fields are {sorted(schema)}"
        )
    if not spec.dtype.startswith(("int", "uint")):
        raise errors.ConfigError(
            f"{where}.curriculum_field = {field_name!r} holds {spec.dtype}, not token ids"
        )
    schedule = AlphaSchedule(
        float(config.curriculum_alpha),
        tuple((float(x), float(a)) for x, a in config.curriculum_schedule),
        config.curriculum_schedule_unit,
    )
    settings = ComposerSettings(
        vocab_size=vocab_size,
        batches_per_file=config.batches_per_file,
        candidate_batches_per_file=config.batches_per_file,
        capacity=max(config.candidate_buffer, config.batches_per_file),
        oversample=float(config.candidate_oversample),
        schedule=schedule,
    )
    return settings, field_name
