"""How a dataset's splits get their producers (worker processes, Ray actors, curriculum composers).

It works through ProducedDataset, the few parts of a dataset it reads, which DatasetRuntime
(dataset.py) implements: this module never imports dataset.py (no arrow back up)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from queue_client.format.layout import DatasetLayout
from queue_server.config.server import DatasetConfig, ServerConfig
from queue_server.curriculum.lane import ComposerWorker, CurriculumBackend
from queue_server.curriculum.settings import curriculum_settings
from queue_server.curriculum.streams import shared_streams
from queue_server.production.backend import ProductionBackend
from queue_server.production.process_pool import ProcessPoolBackend
from queue_server.production.worker_process import WorkerProcess
from queue_server.split.queue import SplitQueue

log = logging.getLogger("queue_server.curriculum")


class ProducedDataset(Protocol):
    """What the producers of a dataset's splits are made from."""

    config: DatasetConfig
    server: ServerConfig
    layout: DatasetLayout
    meta: dict[str, Any]
    meta_json: str
    input_records: dict[str, Any] | None  # inputs.json's records, once they match meta

    def workers(self, split: str) -> int:
        """The split's worker processes (slots)."""
        ...

    def unavailable_changed(self, split: str, reason: str | None) -> None:
        """The split's engine went away (reason) or came back (None)."""
        ...

    def split_queue(
        self, split: str, backend: ProductionBackend, candidates: bool = False
    ) -> SplitQueue:
        """A queue for the split's files made by `backend` (a curriculum's candidates)."""
        ...


def worker(rt: ProducedDataset, split: str, index: int, histogram_field: str = "") -> WorkerProcess:
    init = {
        "data_root": str(rt.server.data_root),
        "dataset": rt.config.name,
        "provider": rt.config.provider,
        "args": rt.config.args,
        "batch_size": rt.config.batch_size,
        "batches_per_file": rt.config.batches_per_file,
        "seed": rt.config.seed,
        "worker_index": index,
        "num_workers": rt.workers(split),
        "verbose": rt.server.verbose,
        "extra_meta": {
            "provider": rt.config.provider,
            "config_fingerprint": rt.config.fingerprint(),
        },
        "histogram_field": histogram_field,
        "priority": rt.config.worker_priority,
    }
    fingerprint = rt.meta.get("inputs_fingerprint")
    if rt.input_records and isinstance(fingerprint, str):
        init["inputs"] = {"records": rt.input_records, "fingerprint": fingerprint}
    return WorkerProcess(f"{rt.config.name}/{split} worker {index}", init, rt.server.config_dir)


def backend(rt: ProducedDataset, split: str) -> ProductionBackend:
    """What makes the split's files: provider workers, Ray actors, or a curriculum composer."""
    if rt.config.selection == "curriculum" and split in rt.config.curriculum.splits:
        return curriculum(rt, split)
    if rt.config.backend == "ray":
        return ray_backend(rt, split, rt.layout.queue_dir(split))
    return ProcessPoolBackend(
        split,
        rt.workers(split),
        lambda index: worker(rt, split, index),
        rt.meta_json,
        rt.layout.queue_dir(split),
    )


def ray_backend(
    rt: ProducedDataset, split: str, directory: Path, histogram_field: str = ""
) -> ProductionBackend:
    """The split's providers as Ray actors, publishing into `directory`."""
    from queue_server.production.ray.ray_backend import RayBackend

    return RayBackend(
        split=split,
        directory=directory,
        init=worker(rt, split, 0, histogram_field).init_request,
        meta_json=rt.meta_json,
        cwd=rt.server.config_dir,
        slots=rt.workers(split),
        ray_address=rt.config.ray_address,
        placement=rt.config.ray_placement,
    )


def curriculum(rt: ProducedDataset, split: str) -> CurriculumBackend:
    """The producer of a curriculum split: its candidate queue and its composers (worker
    processes, or Ray actors with backend = "ray", as its candidate providers)."""
    settings, field_name = curriculum_settings(rt.config, rt.meta, split)
    on_ray = rt.config.backend == "ray"
    shared = shared_streams(rt.server.served, settings.streams)
    if shared:
        log.warning(
            "%s/%s: curriculum streams %s hold seqs of ranks served here and elsewhere "
            "(curriculum_streams = %d, world_size %d): this node composes them in full, as "
            "the other nodes do; a multiple of the world size composes only this node's share",
            rt.config.name, split, shared[:8], settings.streams, rt.server.served.world_size,
        )  # fmt: skip

    def candidates() -> SplitQueue:
        # A fresh candidate queue: what the last one said of its engine is moot now.
        rt.unavailable_changed(f"{split} candidates", None)
        workers: ProductionBackend
        if on_ray:
            workers = ray_backend(rt, split, rt.layout.candidates_dir(split), field_name)
        else:
            workers = ProcessPoolBackend(
                split,
                rt.workers(split),
                lambda index: worker(rt, split, index, histogram_field=field_name),
                rt.meta_json,
                rt.layout.candidates_dir(split),
                into_candidates=True,
            )
        return rt.split_queue(split, workers, candidates=True)

    def composer() -> ComposerWorker:
        label = f"{rt.config.name}/{split} composer"
        init = worker(rt, split, 0).init_request
        if on_ray:
            from queue_server.curriculum.ray_composer import RayComposer

            return RayComposer(
                label,
                init,
                rt.server.config_dir,
                ray_address=rt.config.ray_address,
                placement=rt.config.ray_placement,
            )
        return WorkerProcess(label, init, rt.server.config_dir)

    init = {
        "split": split,
        "settings": settings.to_json(),
        "field": field_name,
        "n_tokens": rt.config.curriculum.starting_estimation_token_count,
        "meta_json": rt.meta_json,
    }
    return CurriculumBackend(
        f"{rt.config.name}/{split} curriculum",
        split,
        composer,
        candidates,
        init,
        rt.meta_json,
    )
