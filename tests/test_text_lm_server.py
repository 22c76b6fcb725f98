"""text_lm behind a real server with two workers per split: the client gets exactly the
batches the provider makes for those seqs, and the verifier's server mode passes the files the
server has queued without consuming any."""

from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path

import torch

from conftest import wait_until
from queue_client.client import QueueClient
from queue_client.format.batchfile import load_batch_file, scan_queue
from queue_client.format.layout import DatasetLayout
from queue_providers import ProviderContext, create
from queue_providers.verify.verify_diversity import main as verify

WORDS = "quartz basalt marble slate granite flint shale chalk jasper onyx agate opal".split()


ARGS = {
    "separator": "",
    "seq_len": 128,
    "micro_batch_size": 2,
    "eval_take": 60,
    "shuffle_buffer": 32,
}


def config(corpus: Path) -> str:
    args = "\n".join(f"{k} = {json.dumps(v)}" for k, v in ARGS.items())  # JSON scalars are TOML
    head = textwrap.dedent(
        """
        [server]
        lease_ttl_s = 30
        [datasets.web]
        provider = "text_lm"
        batch_size = 2
        batches_per_file = 4
        workers = 2
        seed = 1337
        [datasets.web.args]
        """
    )
    return f"{head}source = {json.dumps(corpus.as_posix())}\n{args}\n"


def test_the_server_serves_what_the_provider_makes_and_passes_the_verifier(
    start_server, tmp_path: Path, capsys
) -> None:
    rnd = random.Random(3)
    docs = [f"stone {i}: " + " ".join(rnd.choices(WORDS, k=rnd.randint(5, 40))) for i in range(400)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(docs) + "\n")
    server = start_server(config(corpus))
    with QueueClient(server.address, "web") as client:
        assert client.meta["packing"] == "sequential" and client.meta["vocab_size"] == 257
        served = [client.get_batch("train") for _ in range(12)]
        client.get_batch("val")  # val's worker starts on its first lease
    layout = DatasetLayout(server.data_root, "web")

    def queued() -> dict[str, set[str]]:
        return {s: {str(n) for n in scan_queue(layout.queue_dir(s))} for s in ("train", "val")}

    # Two files (8 batches) of each split on disk, as the backlog fills without a reader.
    wait_until(lambda: all(len(q) >= 2 for q in queued().values()), what="2 files per split")
    before = queued()
    assert verify(["--address", server.address, "--dataset", "web", "--batches", "8"]) == 0
    out = capsys.readouterr().out
    assert "train/val document overlap: 0 of" in out and "verdict: OK" in out
    assert "split train: 8 batches" in out and "split val: 8 batches" in out
    after = queued()
    assert all(before[s] <= after[s] for s in before), "the verifier consumed queued files"
    server.stop()

    # The same files, made in this process by the two workers the server ran: seq s is worker
    # s % 2's (s // 2)-th file, 4 batches each.
    workers = []
    for w in range(2):
        ctx = ProviderContext(
            "web",
            tmp_path / f"w{w}",
            batch_size=2,
            batches_per_file=4,
            seed=1337,
            worker_index=w,
            num_workers=2,
        )
        p = create("text_lm", ctx, ARGS | {"source": str(corpus)})
        p.set_meta(p.complete_meta())
        workers.append(p)
    made = []
    for seq in range(3):
        f = workers[seq % 2].produce_file("train", seq, tmp_path)
        t = load_batch_file(tmp_path / str(f.name)).tensors
        made.extend({k: v[i] for k, v in t.items()} for i in range(4))
    for a, b in zip(served, made, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
