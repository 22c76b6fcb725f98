"""A trainer restarted without `load_state_dict` starts again at seq = rank: the server makes
those seqs again, the same bytes, while the files it had made ahead for the rank wait on
disk (docs/multi-node.md, "A trainer restarted without its state")."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import char_config, wait_until
from queue_client import QueueClient
from queue_client.format.batchfile import scan_queue
from queue_client.format.layout import DatasetLayout


def test_a_trainer_restarted_without_its_state_reads_from_the_start_again(
    start_server, corpus: Path
) -> None:
    server = start_server(char_config(corpus, batches_per_file=2))
    queue = DatasetLayout(server.data_root, "chars").queue_dir("train")

    def read(n: int) -> list[torch.Tensor]:
        with QueueClient(server.address, "chars", rank=0, world_size=1) as client:
            return [client.get_batch("train")[0].clone() for _ in range(n)]

    first = read(8)  # seqs 0-3, whole
    wait_until(lambda: server.split_stats("chars")["consumed_files"] >= 4, 60, "4 releases")
    backlog = {n.seq for n in scan_queue(queue)}
    assert backlog and min(backlog) >= 4, backlog  # made ahead, not read yet
    again = read(8)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    stats = server.split_stats("chars")
    assert stats["reproduced_files"] >= 4, stats  # seqs 0-3 were made again
    assert backlog <= {n.seq for n in scan_queue(queue)}  # the older backlog waited on disk
