"""GetStats and `queue-client stats` in training terms, from a real server: tokens/s and
batches/s that survive a restart, epochs and their ETA, each rank's backlog, regenerated files
apart from fresh ones, each worker's resident memory, and two clients claiming one rank."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from conftest import ServerFactory, char_config, subprocess_env, tiny_corpus, wait_until
from queue_client import QueueClient
from queue_client.cli import main
from queue_client.format.layout import DatasetLayout

# char_config: batch_size 4, block_size 16, batches_per_file 5.
TOKENS_PER_FILE = 5 * 4 * 16
TINY = """
[server]
lease_ttl_s = 30
[datasets.tiny]
provider = "bq_test_providers:TinyProvider"
batch_size = 2
batches_per_file = 2
"""


# The module's one server (a server start costs about two seconds of CPU: its workers'
# forkserver imports torch) has a dataset per test that needs no restart, so each starts from
# seq 0 with no other client's leases or warnings.
SHARED_EXTRAS = {
    "backlog": "max_backlog_files = 3",
    "rss": "workers = 2",
    "dup": "",
    "pairs": "",
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("stats_training")
    corpus = tiny_corpus(tmp / "corpus.txt")
    config = TINY + "".join(
        char_config(corpus, name=name, extra=extra, server=None)
        for name, extra in SHARED_EXTRAS.items()
    )
    factory = ServerFactory(tmp)
    yield factory(config)
    factory.close()


def read(client: QueueClient, batches: int, split: str = "train") -> None:
    for _ in range(batches):
        client.get_batch(split)


def cli_stats(capsys: pytest.CaptureFixture[str], address: str, *args: str) -> str:
    assert main(["stats", "--address", address, "--interval", "0", *args]) == 0
    return capsys.readouterr().out


def saved_files(data_root: Path, dataset: str, split: str = "train") -> int:
    """Files consumed in the rate window the server keeps on disk for its next start."""
    path = DatasetLayout(data_root, dataset).throughput_file(split)
    try:
        return sum(files for _, files in json.loads(path.read_bytes())["buckets"])
    except (FileNotFoundError, ValueError):
        return 0


def test_rates_survive_a_restart_and_regenerated_files_are_counted_apart(
    start_server, corpus: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    config = char_config(corpus)
    server = start_server(config)
    with QueueClient(server.address, "chars") as client:
        read(client, 1)
        checkpoint = client.state_dict()  # seq 0, batch 1
        read(client, 5 * 3)
        wait_until(lambda: server.split_stats("chars")["consumed_files"] >= 3, what="consumption")
        live = server.split_stats("chars")
        assert live["tokens_per_s"] > 0 and live["batches_per_s"] > 0
        assert live["tokens_per_s"] == pytest.approx(live["batches_per_s"] * 4 * 16)
        assert 0 < live["rate_window_s"] <= 60
        assert live["tokens_per_file"] == TOKENS_PER_FILE
        assert live["tokens_served"] == live["consumed_files"] * TOKENS_PER_FILE
        # char_lm's meta gives the split's size in tokens: epochs served and the time left.
        tokens = client.meta["split_info"]["train"]["tokens"]
        assert live["epochs"] == pytest.approx(live["tokens_served"] / tokens)
        assert 0 < live["epoch_eta_s"] < 1e6
    consumed = server.split_stats("chars")["consumed_files"]
    wait_until(
        lambda: saved_files(server.data_root, "chars") >= consumed, what="the rate window saved"
    )
    before = server.split_stats("chars")
    server.kill(signal.SIGKILL)

    again = start_server(config, data_root=server.data_root)
    after = again.split_stats("chars")
    # Nothing was consumed since the restart, and yet the rate is the one of a minute ago.
    assert after["tokens_per_s"] > 0 and after["batches_per_s"] > 0
    assert after["consumed_files"] == before["consumed_files"]
    assert after["tokens_served"] == before["tokens_served"]
    assert after["reproduced_files"] == 0 and after["produced_files"] == before["produced_files"]

    # A trainer resumed from its checkpoint reads seqs 0.. again: they are made again, and
    # counted as regenerated, not as fresh files.
    with QueueClient(again.address, "chars") as client:
        client.load_state_dict(checkpoint)
        read(client, 5 * 2)
        # The client releases finished files in the background: wait for the count to move.
        wait_until(
            lambda: again.split_stats("chars")["consumed_files"] > before["consumed_files"],
            what="the resumed trainer's files counted as consumed",
        )
        during = again.split_stats("chars")
        assert during["tokens_per_s"] > 0
        assert during["reproduced_files"] >= 2
        assert during["produced_files"] == before["produced_files"]
        assert during["consumed_files"] > before["consumed_files"]  # counting on, not frozen
        # The terminal view shows them apart, with the training columns.
        monkeypatch.setenv("COLUMNS", "200")
        out = cli_stats(capsys, again.address, "chars")
        for text in ("regenerated", "tokens/s", "batches/s", "epochs", "ETA", "MiB", "backlog"):
            assert text in out, out
        doc = json.loads(cli_stats(capsys, again.address, "chars", "--json"))
        (train,) = [s for s in doc["datasets"][0]["splits"] if s["split"] == "train"]
        assert train["reproduced_files"] >= during["reproduced_files"] >= 2
        assert train["tokens_per_s"] > 0 and train["epochs"] > 0


def test_backlog_per_rank(shared) -> None:
    """Rank 0 of 2 reads (it holds the file it reads and the next); rank 1 has not come yet,
    so its whole window waits ready. Each rank's backlog is its own files, not leased."""
    server = shared
    # Before any client, production fills the window of world size 1 and stops. The first
    # request (world size 2, files already on disk) must set it going again by itself.
    wait_until(lambda: server.split_stats("backlog")["ready_files"] == 5, what="a full window")
    with QueueClient(server.address, "backlog", rank=0, world_size=2, prefetch_files=1) as r0:
        read(r0, 1)

        def backlog() -> list[tuple[int, int, int]] | None:
            s = server.split_stats("backlog")
            ranks = [
                (int(r["rank"]), int(r["ready_files"]), int(r["files_leased"])) for r in s["ranks"]
            ]
            return ranks if ranks == [(0, 3, 2), (1, 5, 0)] else None

        wait_until(backlog, what="each rank's window filled")
        stats = server.split_stats("backlog")
        assert stats["ready_files"] == sum(int(r["ready_files"]) for r in stats["ranks"])


def test_each_worker_reports_its_resident_memory(shared) -> None:
    server = shared
    with QueueClient(server.address, "rss") as client:
        client.get_batch("val")  # val starts its worker on its first lease
    wait_until(lambda: len(server.split_stats("rss")["worker_pids"]) == 2, 60, "train's workers")
    for split in ("train", "val"):
        stats = server.split_stats("rss", split)
        pids = [int(p) for p in stats["worker_pids"]]
        rss = [int(b) for b in stats["worker_rss_bytes"]]
        assert len(rss) == len(pids) >= 1
        for pid, size in zip(pids, rss, strict=True):
            status = Path(f"/proc/{pid}/status").read_text()
            (kib,) = [
                int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")
            ]
            # A worker has torch loaded: tens of MiB at least, near what /proc says now.
            assert size > 20 << 20 and abs(size - kib * 1024) < 0.5 * kib * 1024
        # The workers list names the same processes, where they run, and their memory.
        workers = stats["workers"]
        assert [(w["role"], int(w["index"]), w["backend"]) for w in workers] == [
            ("provider", i, "local") for i in range(len(pids))
        ], workers
        assert [int(w["pid"]) for w in workers] == pids
        assert all(int(w["rss_bytes"]) > 20 << 20 and not w["node_id"] for w in workers)


def test_epochs_are_unknown_without_a_split_size(
    shared, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    server = shared
    with QueueClient(server.address, "tiny") as client:
        read(client, 5)
        wait_until(lambda: server.split_stats("tiny")["consumed_files"] >= 2, what="consumption")
        stats = server.split_stats("tiny")
        assert stats["tokens_per_s"] > 0 and stats["tokens_per_file"] == 2 * 2 * 4
        assert "epochs" not in stats and "epoch_eta_s" not in stats  # unset, not 0
        doc = json.loads(cli_stats(capsys, server.address, "tiny", "--json"))
        (train,) = [s for s in doc["datasets"][0]["splits"] if s["split"] == "train"]
        assert train["epochs"] is None and train["epoch_eta_s"] is None
        monkeypatch.setenv("COLUMNS", "200")
        assert "unknown" in cli_stats(capsys, server.address, "tiny")


def test_two_clients_on_one_rank_are_warned_in_stats_and_in_the_log(
    shared, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """Two trainers given the same rank take each other's leases: the server says so."""
    server = shared
    with QueueClient(server.address, "dup") as a, QueueClient(server.address, "dup") as b:
        read(a, 1)
        read(b, 1)  # b starts the rank's stream over: it takes a's lease of seq 0
        read(a, 5)  # a goes on: into its next file

        def warned() -> dict[str, Any] | None:
            s = server.split_stats("dup")
            return s if s["warnings"] else None

        stats = wait_until(warned, what="a duplicate-rank warning in stats")
        (rank0,) = [r for r in stats["ranks"] if int(r["rank"]) == 0]
        assert sorted(rank0["duplicate_clients"]) == sorted([a.client_id, b.client_id])
        assert "rank 0" in stats["warnings"][0] and a.client_id in stats["warnings"][0]
        monkeypatch.setenv("COLUMNS", "300")
        assert "claimed by 2 live clients" in cli_stats(capsys, server.address, "dup")
    log = server.log()
    assert "WARNING" in log and "dup/train: rank 0 is claimed by 2 live clients" in log
    assert a.client_id in log and b.client_id in log


def test_one_client_per_rank_gets_no_warning(shared) -> None:
    server = shared
    with (
        QueueClient(server.address, "pairs", rank=0, world_size=2) as r0,
        QueueClient(server.address, "pairs", rank=1, world_size=2) as r1,
    ):
        for _ in range(3):
            read(r0, 5)
            read(r1, 5)
        stats = server.split_stats("pairs")
    assert stats["warnings"] == [] and all(not r["duplicate_clients"] for r in stats["ranks"])
    # A restarted trainer replacing the one before it is no duplicate either.
    with QueueClient(server.address, "pairs", rank=0, world_size=2) as again:
        read(again, 6)
        assert server.split_stats("pairs")["warnings"] == []
    assert "pairs/train: rank" not in server.log()  # the other datasets' warnings aside


def test_stats_watch_outlasts_a_restart_without_a_zero_rate(start_server, corpus: Path) -> None:
    """`queue-client stats --watch` goes on while the server restarts (saying it cannot reach
    it), and once it answers again the rate is the one from before, not 0/s, and the consumed
    count moves on with the trainer."""
    config = char_config(corpus)
    listen = f"unix:{start_server.tmp_path / 'bq.sock'}"
    server = start_server(config, listen=listen)
    with QueueClient(server.address, "chars") as client:
        read(client, 5 * 3)
        consumed = server.split_stats("chars")["consumed_files"]
    wait_until(lambda: saved_files(server.data_root, "chars") >= consumed, what="window saved")
    watch = subprocess.Popen(
        [sys.executable, "-m", "queue_client.cli", "stats", "chars", "--address", listen, "--watch", "--json", "--interval", "0.3", "--timeout", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=subprocess_env(),
    )  # fmt: skip
    frames: list[dict[str, Any]] = []
    reader = threading.Thread(
        target=lambda: frames.extend(json.loads(line) for line in watch.stdout or ()), daemon=True
    )
    reader.start()
    try:
        wait_until(lambda: len(frames) >= 2, what="frames from the first server")
        server.kill(signal.SIGKILL)
        wait_until(lambda: any(f.get("error") for f in frames), what="an unreachable frame")
        again = start_server(config, data_root=server.data_root, listen=listen)
        seen = len(frames)
        with QueueClient(again.address, "chars") as client:
            read(client, 5 * 2)

            def moved_on() -> bool:
                counts = [t["consumed_files"] for t in _trains(frames[seen:])]
                return bool(counts) and max(counts) > consumed

            wait_until(moved_on, what="the consumed count moving on after the restart")
    finally:
        watch.kill()
        watch.wait(timeout=30)
        reader.join(timeout=30)
        if watch.stdout is not None:
            watch.stdout.close()
    # Every frame with the split after the restart shows the rate from before, not 0/s.
    after_restart = _trains(frames[seen:])
    rates = [(t["tokens_per_s"], t["rate_window_s"], t["consumed_files"]) for t in after_restart]
    assert rates and all(r[0] > 0 for r in rates), rates
    counts = [t["consumed_files"] for t in _trains(frames)]
    assert min(counts) >= consumed, (consumed, counts)
    assert any(
        "unavailable" in f["error"] or listen in f["error"] for f in frames if f.get("error")
    )


def _trains(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The train split of each frame that has one (not while unreachable, nor starting)."""
    return [s for f in frames for d in f["datasets"] for s in d["splits"] if s["split"] == "train"]
