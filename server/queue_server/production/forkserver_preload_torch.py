"""The forkserver's first preload where a dataset's provider uses torch: torch, imported once
for every worker to share (a second or more of CPU), under forkserver_preload's watch."""

from __future__ import annotations

from queue_server.production.forkserver_start import abandoned_with_the_server

with abandoned_with_the_server():
    import torch  # noqa: F401  (the preload itself)
