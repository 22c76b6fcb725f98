"""GetStats' split message: a split's snapshot, its rates and its workers' memory as protobuf.

The servicer takes the snapshot (split/stats.py), the training view (rates in tokens, batches
and epochs) and the resident memory of the pids; this module only translates them, field by
field, as mixture/proto.py does for a mixture's stats.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from queue_client.wire import batchqueue_pb2 as pb
from queue_server.mixture.proto import mixture_proto
from queue_server.split.stats import SplitSnapshot, TrainingView


def split_stats_proto(
    name: str, snap: SplitSnapshot, view: TrainingView, rss: Mapping[int, int]
) -> pb.SplitStats:
    """Split `name`'s stats; `rss` maps a pid to its resident bytes (0 when unknown)."""
    c = snap.counters
    stats = pb.SplitStats(
        split=name,
        produced_files=c.produced_files,
        reproduced_files=c.reproduced_files,
        consumed_files=c.consumed_files,
        quarantined_files=c.quarantined_files,
        ready_files=snap.ready_files,
        leased_files=snap.leased_files,
        leases_expired=c.leases_expired,
        produced_bytes=c.produced_bytes,
        worker_restarts=c.worker_restarts,
        max_backlog_files=snap.max_backlog_files,
        world_size=snap.world_size,
        next_seq=snap.next_seq,
        worker_pids=snap.worker_pids,
        worker_rss_bytes=[rss.get(pid, 0) for pid in snap.worker_pids],
        disk_errors=c.disk_errors,
        last_disk_error=snap.last_disk_error,
        journal_error=snap.journal_error,
        worker_backoff_s=snap.worker_backoff_s,
        last_worker_error=snap.last_worker_error,
        seqs_produced=snap.seqs_produced,
        seqs_consumed=snap.seqs_consumed,
        seqs_quarantined=snap.seqs_quarantined,
        seqs_missing=snap.seqs_missing,
        curriculum=_curriculum_stats(snap.curriculum),
        mixture=mixture_proto(snap.mixture),
        tokens_per_s=view.tokens_per_s,
        batches_per_s=view.batches_per_s,
        rate_window_s=view.rate_window_s,
        tokens_served=view.tokens_served,
        tokens_per_file=view.tokens_per_file,
        warnings=snap.warnings,
        workers=[
            pb.WorkerPlacement(
                role=w.role,
                index=w.index,
                backend=w.backend,
                pid=w.pid,
                node_id=w.node_id,
                restarts=w.restarts,
                rss_bytes=rss.get(w.pid, 0) if w.backend == "local" else 0,
            )
            for w in snap.workers
        ],
        ranks=[
            pb.RankStats(
                rank=r.rank,
                last_consumed_seq=r.last_consumed_seq,
                files_leased=r.files_leased,
                lag_files=r.lag_files,
                ready_files=r.ready_files,
                duplicate_clients=r.duplicate_clients,
            )
            for r in snap.ranks
        ],
    )
    if view.epochs is not None:
        stats.epochs = view.epochs
    if view.epoch_eta_s is not None:
        stats.epoch_eta_s = view.epoch_eta_s
    return stats


def _curriculum_stats(stats: dict[str, Any] | None) -> pb.CurriculumStats | None:
    if stats is None:
        return None
    return pb.CurriculumStats(
        alpha=float(stats.get("alpha", 0.0)),
        kl_to_target=float(stats.get("kl_to_target", 0.0)),
        buffer_batches=int(stats.get("buffer_batches", 0)),
        served_tokens=int(stats.get("served_tokens", 0)),
        candidates_ingested=int(stats.get("candidates_ingested", 0)),
        candidates_culled=int(stats.get("candidates_culled", 0)),
        candidate_files=int(stats.get("candidate_files", 0)),
        overrides=int(stats.get("overrides", 0)),
    )
