"""A mixture on Ray actors (`backend = "ray"`) serves the very rows a local mixture serves,
a SetMixture call included: the sources run inside the actor and the weight changes travel
with each produce call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mixture_server import NB, mixture, write_sources

from queue_client import QueueClient


def test_a_ray_mixture_serves_the_rows_of_a_local_one(start_server, tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'batchqueue[ray]'")
    dirs = write_sources(tmp_path)
    config = mixture("local", dirs) + mixture(
        "onray", dirs, 'backend = "ray"\nray_address = "local"'
    )
    server = start_server(config, timeout_s=180)
    assert server.split_stats("onray")["worker_pids"] == []  # no worker process of its own
    rows = {}
    for name in ("local", "onray"):
        with QueueClient(server.address, name, timeout_s=120) as client:
            got = []
            for step in range(8 * NB):
                got.append(client.get_batch("train"))
                if step == 2:
                    client.set_mixture({"web": 0.0, "code": 0.2, "math": 0.8})
            rows[name] = got
    for a, b in zip(rows["local"], rows["onray"], strict=True):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["source"], b["source"])
    late = torch.cat([b["source"] for b in rows["onray"][6 * NB :]])
    assert late.tolist().count(0) <= 1  # the new weights reached the actor
