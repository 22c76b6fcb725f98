"""A dataset's splits joined to the job's control plane (steering/plane.py), as the dataset
starts them: one log per split, under keys that name the job, the dataset and its config."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from queue_server.steering.plane import SplitPlane
from queue_server.steering.store import TorchStore, parse_address

if TYPE_CHECKING:
    from queue_server.config.server import ServerConfig
    from queue_server.split.queue import SplitQueue

# One store call's limit: a store that does not answer within it is reported unreachable.
CONNECT_S = 10.0


def attach_plane(
    queue: SplitQueue,
    server: ServerConfig,
    fingerprint: str,
    split: str,
    on_unavailable: Callable[[str, str | None, str], None],
) -> None:
    """Give one split of a dataset its plane: its log's keys name the job's namespace, the
    dataset, its config's fingerprint (servers of another config share no log with it) and
    the split."""
    spec = server.control_plane
    host, port = parse_address(spec, "server.control_plane")
    prefix = f"batchqueue/{server.control_namespace}/{queue.config.name}/{fingerprint}/{split}/"
    queue.attach_plane(
        SplitPlane(
            queue,
            lambda: TorchStore(host, port, timeout_s=CONNECT_S),
            prefix,
            spec,
            round_size=lambda: queue.schedule.world_size,
            files_per_window=lambda: queue.schedule.files_per_window,
            on_unavailable=lambda why: on_unavailable(split, why, "control"),
            kick=queue.production.kick,
            snapshot_every=server.control_snapshot_records,
        )
    )
