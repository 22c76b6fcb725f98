"""One served dataset: its meta (built once, in a worker process) and its split queues.

A dataset whose meta is on disk serves (health SERVING) as soon as its journals are
reconciled: its inputs are checked and its training split's workers start in the background,
and AcquireLease waits for both, as it waits for any file not made yet. Any other split (val)
starts its workers on its first lease (`lazy_split`), so a split nobody reads costs nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from queue_client import errors
from queue_client.format.layout import DatasetLayout, atomic_write, check_split_name
from queue_client.format.meta import (
    dump_meta,
    load_meta,
    meta_from_json,
    meta_to_json,
    split_schema,
    validate_meta,
)
from queue_client.format.schema import FieldSpec
from queue_providers.input_records import inputs_fingerprint, local_files_unchanged
from queue_server import dataset_workers
from queue_server.config.dataset import training_split
from queue_server.config.server import DatasetConfig, ServerConfig
from queue_server.curriculum.settings import curriculum_settings
from queue_server.curriculum.streams import candidate_ranks
from queue_server.mixture.stats import MixtureView
from queue_server.production.backend import ProduceFailed, ProductionBackend, SlotDied
from queue_server.production.worker_process import WorkerDied, WorkerError
from queue_server.split.leases import LeaseDirectory
from queue_server.split.queue import SplitQueue
from queue_server.steering.attach import attach_plane

log = logging.getLogger("queue_server.dataset")

STARTING, SERVING, FAILED = "starting", "serving", "failed"
# Files on disk are still served, but production waits for its engine (a Ray cluster).
UNAVAILABLE = "unavailable"
# The composer's pins on candidate files never expire: they end when a candidate retires.
_PINNED_TTL_S = 1e9


class DatasetRuntime:
    def __init__(
        self,
        config: DatasetConfig,
        server: ServerConfig,
        on_state: Callable[[DatasetRuntime], None],
        leases: LeaseDirectory[SplitQueue] | None = None,
    ) -> None:
        self.config = config
        self.server = server
        self.layout = DatasetLayout(server.data_root, config.name)
        self.dir = self.layout.dir
        self._leases = leases
        # (split, what: "production" or "journal") -> why the split cannot serve now.
        self._unavailable: dict[tuple[str, str], str] = {}
        self.state = STARTING
        self.last_error = ""
        # True when the dataset failed because its config is wrong (bad provider args):
        # the CLI exits with an error instead of serving a dataset that can never work.
        self.config_error = False
        self.meta: dict[str, Any] = {}
        self.meta_json = ""
        # What GetMeta sends: meta, plus which splits serve batches composed whole.
        self.client_meta_json = ""
        # The batch a trainer gets by default: the config's batch_size, also where the files
        # keep the unit the dataset was built with (`_kept_at_built_batch_size`).
        self.served_batch_size = config.batch_size
        self.splits: dict[str, SplitQueue] = {}
        self._on_state = on_state
        self.ready = asyncio.Event()
        # Inputs check and worker starts that run after SERVING; their failure fails it.
        self._starting: list[asyncio.Task[None]] = []
        self._inputs_checked = False
        # inputs.json's records once they are known to match meta: each worker started after
        # checks its own provider's inputs against them (provider_init.check_own_inputs).
        self.input_records: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.config.name

    def workers(self, split: str) -> int:
        """The split's worker processes: the training split's `workers`, others' 1 unless
        split_workers names them (DatasetConfig.workers_for)."""
        return self.config.workers_for(split, list(self.meta.get("split_info", ())))

    def split_queue(
        self, split: str, backend: ProductionBackend, candidates: bool = False
    ) -> SplitQueue:
        config, served = self.config, self.server.served
        if candidates:  # a curriculum's: its "ranks" are the streams composed here
            settings, _ = curriculum_settings(self.config, self.meta, split)
            config = dataclasses.replace(
                config, max_backlog_files=settings.candidate_backlog, selection="fifo"
            )
            served = candidate_ranks(served, config.curriculum.streams)
        elif config.backlog_for(split) != config.max_backlog_files:
            config = dataclasses.replace(config, max_backlog_files=config.backlog_for(split))
        queue = SplitQueue(
            config,
            split,
            self.layout,
            _PINNED_TTL_S if candidates else self.server.lease_ttl_s,
            backend,
            self.fail,
            on_unavailable=lambda source, reason: self.unavailable_changed(
                f"{split} candidates" if candidates else split, reason, source
            ),
            directory=None if candidates else self._leases,
            verbose=self.server.verbose,
            candidates=candidates,
            served=served,
            gated=not candidates,
            on_first_acquire=(
                (lambda: self._in_background(self._start_production(split)))
                if not candidates and self.lazy_split(split)
                else lambda: None
            ),
        )
        if queue.mixture:
            queue.mixture_view = MixtureView(
                config.args, self.meta, split, self.layout.mixture_epochs_dir(split)
            )
        return queue

    def lazy_split(self, split: str) -> bool:
        """Whether the split's workers start on its first lease rather than at start: every
        split but the training one (and a curriculum's, whose composer needs its candidates)."""
        splits = list(self.meta.get("split_info", ()))
        curriculum = (
            self.config.selection == "curriculum" and split in self.config.curriculum.splits
        )
        return split != training_split(splits) and not curriculum

    async def start(self) -> None:
        try:
            await self._start()
        except Exception as exc:
            self._fail_from(exc)
            return
        if self.state == STARTING:  # a worker may have failed the dataset while others started
            self.state = SERVING
            if self._unavailable:  # a split lost its engine or its journal while starting
                self._settle()
        self.ready.set()
        self._on_state(self)
        if self.state != FAILED:
            self._in_background(self._start_serving())

    def _fail_from(self, exc: Exception) -> None:
        self.config_error = isinstance(exc, errors.ConfigError) or (
            isinstance(exc, (WorkerError, ProduceFailed)) and exc.kind == "ConfigError"
        )
        known = isinstance(
            exc, (errors.BatchQueueError, WorkerError, WorkerDied, ProduceFailed, SlotDied)
        )
        self.fail(str(exc) if known else f"{type(exc).__name__}: {exc}")

    def _in_background(self, coro: Any) -> None:
        """Run a start step after SERVING; its error fails the dataset as one at start would."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._fail_from(exc)

        self._starting.append(asyncio.get_running_loop().create_task(guarded()))

    async def _start_serving(self) -> None:
        """After SERVING: check the inputs (leases wait for it), then start the eager splits'
        workers; a lazy split's start on its first lease."""
        if not self._inputs_checked:
            await self._check_inputs(self.meta)
            self._inputs_checked = True
        for queue in self.splits.values():
            queue.allow_serving()
        await asyncio.gather(
            *(self._start_production(s) for s in self.splits if not self.lazy_split(s))
        )

    async def _start_production(self, split: str) -> None:
        queue = self.splits[split]
        await queue.gate.allowed.wait()  # never before the inputs were checked
        if self.state != FAILED:
            await queue.start_production()

    async def _start(self) -> None:
        await asyncio.to_thread(self.dir.mkdir, parents=True, exist_ok=True)
        meta_path = self.layout.meta_file
        if meta_path.exists():
            meta = await asyncio.to_thread(load_meta, meta_path)
            validate_meta(meta, where=str(meta_path))
            want, have = self.config.fingerprint(), meta.get("config_fingerprint")
            kept = self._kept_at_built_batch_size(meta) if have != want else None
            if kept is not None:
                self.config = kept
            elif have != want:
                raise errors.MetaError(
                    f"{meta_path} was built from another config of dataset {self.config.name!r} "
                    f"(fingerprint {have} vs {want}); its batch files would not match. Run "
                    f"`queue-server reset {self.config.name}` (it moves {self.dir} aside, "
                    "nothing is deleted for you) or restore the old config"
                )
        else:
            builder = dataset_workers.worker(self, "meta", 0)
            try:
                await builder.start()
                reply = await builder.call({"op": "meta"})
            finally:
                await builder.stop()
            meta = meta_from_json(reply["meta_json"])
            # The inputs' records first: a meta.pkl on disk always has them beside it.
            inputs = json.dumps(reply.get("inputs", {}), sort_keys=True).encode()
            await asyncio.to_thread(atomic_write, self.layout.inputs_file, inputs)
            await asyncio.to_thread(dump_meta, meta_path, meta)
            self._inputs_checked = True  # just described by the builder
            self.input_records = dict(reply.get("inputs", {}))
        self.meta = meta
        self.meta_json = await asyncio.to_thread(meta_to_json, meta)  # CPU work: off the loop
        self.client_meta_json = self.meta_json
        if self.config.selection != "fifo":
            composed = {**meta, "composed_splits": list(self.config.curriculum.splits)}
            self.client_meta_json = await asyncio.to_thread(meta_to_json, composed)
        if self.config.selection == "curriculum":
            unknown = sorted(set(self.config.curriculum.splits) - set(meta["split_info"]))
            if unknown:
                raise errors.ConfigError(
                    f"datasets.{self.config.name}.curriculum_splits names {unknown}, which "
                    f"the dataset lacks; its splits are {sorted(meta['split_info'])}"
                )
        for split in meta["split_info"]:
            check_split_name(split)
            self.splits[split] = self.split_queue(split, dataset_workers.backend(self, split))
        await asyncio.gather(*(q.open(start_production=False) for q in self.splits.values()))
        if self.server.control_plane:  # the job's control plane (steering/plane.py)
            for split, queue in self.splits.items():
                attach_plane(queue, self.server, self.config.fingerprint(), split, self.unavailable_changed)  # fmt: skip

    def _kept_at_built_batch_size(self, meta: dict[str, Any]) -> DatasetConfig | None:
        """The config the dataset dir was built under, when it differs from this one in
        batch_size alone and its rows are independent: its files keep their unit (meta's
        batch_size), and the config's batch_size is only the default a trainer gets, so
        nothing is rebuilt. None otherwise (composed or [A, B, T] batches: a batch_size
        change changes what is served, and is refused as before)."""
        built = meta.get("batch_size")
        if (
            not isinstance(built, int)
            or built == self.config.batch_size
            or self.config.selection != "fifo"
            or meta.get("grad_accum") is not None
        ):
            return None
        config = dataclasses.replace(self.config, batch_size=built)
        if config.fingerprint() != meta.get("config_fingerprint"):
            return None
        log.info(
            "dataset %s: files keep the batch_size %d they were built with; get_batch serves "
            "%d rows by default",
            self.config.name,
            built,
            self.config.batch_size,
        )
        return config

    async def _check_inputs(self, meta: dict[str, Any]) -> None:
        """Refuse (ConfigError, from a worker: hashing is I/O and CPU) a dataset whose input
        files changed since meta was built; their records in inputs.json name the file."""
        fingerprint = meta.get("inputs_fingerprint")
        if not isinstance(fingerprint, str):
            log.warning(
                "dataset %s: %s has no inputs_fingerprint (it was built by an older batchqueue), "
                "so a change of its input files cannot be noticed; `queue-server reset %s` "
                "rebuilds it with one",
                self.config.name,
                self.layout.meta_file,
                self.config.name,
            )
            return
        recorded = await asyncio.to_thread(_read_inputs, self.layout.inputs_file)
        if meta.get("inputs_fixed") is True and await asyncio.to_thread(
            _fixed_inputs_unchanged, recorded, fingerprint, self.server.config_dir
        ):
            self.input_records = recorded  # no worker (and no torch) before the first lease
            return
        checker = dataset_workers.worker(self, "inputs", 0)
        try:
            await checker.start()
            await checker.call(
                {"op": "check_inputs", "inputs": recorded, "fingerprint": fingerprint}
            )
        finally:
            await checker.stop()
        self.input_records = recorded

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
        for task in self._starting:
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        await asyncio.gather(*(q.close() for q in self.splits.values()), return_exceptions=True)

    def check_serving(self) -> None:
        if self.state == FAILED:
            raise errors.ProviderFailed(f"dataset {self.config.name!r} failed: {self.last_error}")

    def unavailable_changed(
        self, split: str, reason: str | None, source: str = "production"
    ) -> None:
        """A split's production engine (a Ray cluster) or its journal (a disk error, a lost
        journal) went away (reason) or came back (None): health is NOT_SERVING meanwhile, and
        GetStats' last_error names every reason."""
        if reason is None:
            self._unavailable.pop((split, source), None)
        else:
            self._unavailable[(split, source)] = reason
        if self.state in (SERVING, UNAVAILABLE):
            self._settle()
        elif self.state == STARTING:  # say why the start takes long (a Ray node with room)
            self.last_error = self._reasons()

    def _reasons(self) -> str:
        return "; ".join(f"{s}: {r}" for (s, _), r in sorted(self._unavailable.items()))

    def _settle(self) -> None:
        before = self.state
        self.state = UNAVAILABLE if self._unavailable else SERVING
        self.last_error = self._reasons()
        if self.state != before:
            log.warning(
                "dataset %s is %s%s",
                self.name,
                self.state,
                f": {self.last_error}" if self.last_error else "",
            )
            self._on_state(self)

    def split(self, name: str) -> SplitQueue:
        self.check_serving()
        if self.state not in (SERVING, UNAVAILABLE):
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


def _read_inputs(path: Path) -> dict[str, Any]:
    """inputs.json, or {} when it is missing or unreadable: the records only save hashing and
    name the changed file; the fingerprint in meta decides alone."""
    try:
        records = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _fixed_inputs_unchanged(records: dict[str, Any], fingerprint: str, base: Path) -> bool:
    """The check a worker would make, for a provider whose records are its whole input set
    (meta's inputs_fixed): the records are meta's, and each file's size and mtime are still
    theirs. False sends the check to a worker, which names what changed."""
    return inputs_fingerprint(records) == fingerprint and local_files_unchanged(records, base)


def resolve_data_root(root: Path) -> Path:
    return Path(root).expanduser().resolve()
