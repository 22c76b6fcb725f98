"""A mixture on Ray actors (`backend = "ray"`) serves the very rows a local mixture serves,
a SetMixture call included: the sources run inside the actor and the weight changes travel
with each produce call. On the session's two-node cluster, with the actors on the node that
is not the server's, the epoch starts of a streaming source travel with the files to the
server, which records and logs them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ray_cluster import PINNED_LABEL, RayCluster
from ray_serving import ray_keys
from test_mixture_server import NB, mixture, write_sources
from test_mixture_streaming import ARGS, MICRO, PACKED, T, source_args, write_corpora
from test_mixture_streaming import NB as SNB
from test_mixture_streaming import B as SB

from conftest import wait_until
from queue_client import QueueClient
from queue_client.format.layout import DatasetLayout
from queue_client.format.mixture_epochs import read_epoch_starts

# A Ray worker that imports torch takes a minute and more to make a first file on a loaded
# 2-core machine; each wait below is on a condition, and this only bounds a hung test.
pytestmark = pytest.mark.timeout(600)


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


def test_epoch_starts_made_on_another_node_are_recorded_by_the_server(
    ray_cluster: RayCluster, start_server, tmp_path: Path
) -> None:
    """The actors run on the pinned node, not the server's: each file names the source epochs
    that start in it, and the server, which publishes it, records and logs each one once
    (an actor's node need not share the data root's filesystem). GetStats counts them."""
    corpora = write_corpora(tmp_path)
    key, value = PINNED_LABEL
    keys = ray_keys(ray_cluster.address, workers=1, placement=f"node:{key}={value}")
    text = f"[datasets.mix]\nbatch_size = {SB}\nbatches_per_file = {SNB}\nseed = 1\n{keys}\n"
    text += '[datasets.mix.sources.code]\nprovider = "text_lm"\nweight = 0.6\n'
    text += f"[datasets.mix.sources.code.args]\n{source_args(corpora['code'])}"
    text += f'[datasets.mix.sources.bytes]\nprovider = "{PACKED}"\nweight = 0.4\n'
    text += f'[datasets.mix.sources.bytes.args]\ntext = "{"0123456789" * 20}"\n'
    text += f"seq_len = {T}\nmicro_batch_size = {MICRO}\n"
    server = start_server(text, data_root=tmp_path / "root", timeout_s=180)
    files = 20  # code (3.6 rows of each file's 6) runs through its train documents twice
    with QueueClient(server.address, "mix", timeout_s=120) as client:
        for _ in range(files * SNB):
            client.get_batch("train")
    wait_until(lambda: "source code starts epoch 2 " in server.log(), what="the epoch log lines")
    workers = server.split_stats("mix")["workers"]
    assert {w["node_id"] for w in workers} == {ray_cluster.pinned_node_id}, workers
    lines = [x for x in server.log().splitlines() if "starts epoch" in x]
    # Logged by the server's own logger, once per epoch, never by an actor.
    assert all(" INFO queue_server.mixture: dataset mix split train: source code" in x
               for x in lines), lines  # fmt: skip
    logged = {int(x.split("epoch ")[1].split()[0]): int(x.split("row ")[1].split(",")[0])
              for x in lines}  # fmt: skip
    assert len(logged) == len(lines) and set(logged) == set(range(1, max(logged) + 1)), lines
    assert max(logged) >= 2, lines
    # Where each epoch starts, from the corpus alone (see test_mixture_streaming).
    docs = corpora["code"].read_text().strip().split("\n\n")
    e = sum(len(d.encode()) + 1 for d in docs[ARGS["eval_take"] :])
    assert logged == {k: -(-(k * e // T) // MICRO) for k in logged}
    recorded = read_epoch_starts(
        DatasetLayout(tmp_path / "root", "mix").mixture_epochs_dir("train")
    )
    assert recorded == {"code": logged}
    wait_until(lambda: int(server.split_stats("mix")["consumed_files"]) >= files - 1,
               what="the files read consumed")  # fmt: skip
    mix = server.split_stats("mix")["mixture"]
    by_name = {s["name"]: s for s in mix["sources"]}
    code_rows = int(by_name["code"]["rows_served"])
    want = max((k for k, row in logged.items() if row < code_rows), default=0)
    assert want >= 1 and float(by_name["code"]["epochs"]) == want
