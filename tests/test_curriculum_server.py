"""Curriculum selection through a real server and real clients: KL against FIFO, alpha
changes within their bound, determinism, exactly-once across ranks, bounded disk, and exact
resume after SIGKILL. The skewed corpus is written by the tests."""

from __future__ import annotations

import json
import os
import random
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ServerFactory, ServerProcess, skewed_corpus, wait_until
from queue_client import QueueClient, errors
from queue_client.cli import main as cli_main
from queue_client.errors import ConfigError
from queue_client.format.batchfile import scan_queue
from queue_server.config.server import parse_config, tomllib
from queue_server.curriculum.composer import ComposerSettings
from queue_server.curriculum.corpus import kl_divergence

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
NB = 8  # batches per file
BACKLOG = 1
CANDIDATE_WINDOW = ComposerSettings(26, NB, NB, capacity=32, oversample=2.0).candidate_backlog + 2


def dataset(name: str, corpus: Path, extra: str = "") -> str:
    return textwrap.dedent(
        f"""
        [datasets.{name}]
        provider = "char_lm"
        batch_size = 4
        batches_per_file = {NB}
        max_backlog_files = {BACKLOG}
        starting_estimation_token_count = 400000
        {extra}
        [datasets.{name}.args]
        input = "{corpus.as_posix()}"
        block_size = 32
        """
    )


def curriculum(alpha: float, buffer: int = 64) -> str:
    return f'selection = "curriculum"\ncandidate_buffer = {buffer}\ncurriculum_alpha = {alpha}'


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    tmp = tmp_path_factory.mktemp("curriculum")
    corpus = skewed_corpus(tmp / "corpus.txt", segments=400, seed=7)
    config = "".join(
        [
            dataset("fifo", corpus),
            dataset("uniform", corpus, curriculum(1.0)),
            dataset("natural", corpus, curriculum(0.0)),
            dataset("ranks", corpus, curriculum(1.0, buffer=32)),
            dataset("alpha", corpus, curriculum(1.0)),
            # Two datasets of one config: separate composers, the same batches.
            dataset("same_a", corpus, curriculum(1.0)),
            dataset("same_b", corpus, curriculum(1.0)),
            dataset("crash", corpus, curriculum(1.0)),
            dataset("crash_twin", corpus, curriculum(1.0)),
            dataset("elastic", corpus, curriculum(1.0)),
        ]
    )
    factory = ServerFactory(tmp)
    yield factory(config), corpus
    factory.close()


def take(client: QueueClient, n: int, split: str = "train") -> torch.Tensor:
    return torch.stack([client.get_batch(split)[0].clone() for _ in range(n)])


def reference_run(start_server, config: str, root: Path, n: int) -> torch.Tensor:
    """The first n batches of dataset d of `config` on an untroubled server of its own."""
    server = start_server(config, data_root=root)
    with QueueClient(server.address, "d") as client:
        batches = take(client, n)
    server.kill()
    return batches


def train_distribution(client: QueueClient, corpus: Path) -> np.ndarray:
    """The true distribution of the train split's ids (char_lm takes the first 90%)."""
    text = corpus.read_text(encoding="utf-8")
    train = text[: int(len(text) * 0.9)]
    stoi = client.meta["stoi"]
    ids = np.array([stoi[ch] for ch in train])
    counts = np.bincount(ids, minlength=client.meta["vocab_size"])
    return counts / counts.sum()


def counts_of(batches: torch.Tensor, vocab: int) -> np.ndarray:
    return np.bincount(batches.reshape(-1).numpy(), minlength=vocab).astype(np.float64)


@pytest.mark.parametrize("name, alpha, margin", [("uniform", 1.0, 0.65), ("natural", 0.0, 0.5)])
def test_served_distribution_is_closer_to_the_target_than_fifo(
    shared, name: str, alpha: float, margin: float
) -> None:
    """The stated margin: after 160 batches, KL(served || target) under curriculum is below
    `margin` times FIFO's, measured on the batches the client received, against the true
    distribution of the train text (the server's estimate samples 400k tokens of it)."""
    server, corpus = shared
    with QueueClient(server.address, "fifo") as fifo, QueueClient(server.address, name) as cur:
        vocab = cur.meta["vocab_size"]
        target = (1 - alpha) * train_distribution(cur, corpus) + alpha / vocab
        kl_fifo = kl_divergence(counts_of(take(fifo, 160), vocab), target)
        kl_cur = kl_divergence(counts_of(take(cur, 160), vocab), target)
        assert kl_cur < margin * kl_fifo, (kl_cur, kl_fifo)
        stats = cur.stats()["splits"][0]["curriculum"]
    assert stats["alpha"] == alpha and int(stats["buffer_batches"]) > 0
    # The server's own figure (every batch composed so far, against its estimated target)
    # tells the same story as the client's.
    assert 0 < float(stats["kl_to_target"]) < kl_fifo


def journaled_alphas(root: Path, dataset: str) -> dict[int, list[float]]:
    """seq -> the alphas its batches were composed with, from the split's journal."""
    out = {}
    for line in (root / dataset / "journal" / "train.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["e"] == "p":
            out[rec["seq"]] = rec["before"]["alphas"]
    return out


def test_an_alpha_change_reaches_the_stream_within_the_bound(shared) -> None:
    server, _ = shared
    with QueueClient(server.address, "alpha") as client:
        take(client, 3 * NB + 2)  # reading seq 3
        effective = client.set_curriculum(0.25)
        # The bound: (max_backlog_files + 3) files of this rank's stream.
        assert 3 < effective <= 3 + (BACKLOG + 3)
        take(client, (effective + 2) * NB - (3 * NB + 2))
        stats = client.stats()["splits"][0]["curriculum"]
    assert stats["alpha"] == 0.25 and stats["overrides"] == "1"
    alphas = journaled_alphas(server.data_root, "alpha")
    assert all(alphas[s] == [1.0] * NB for s in range(effective))
    assert all(alphas[s] == [0.25] * NB for s in range(effective, effective + 2))


def window_files(server, name: str) -> int:
    s = server.split_stats(name)
    return s["ready_files"] + s["leased_files"]


def test_same_config_and_calls_give_the_same_batches(shared) -> None:
    """Two datasets of the same config (each its own composer and provider processes), the
    same calls at the same steps, one of them at a different speed: the same batches. Exact
    resume after SIGKILL (below) checks the same across server processes."""
    server, _ = shared
    runs = []
    for name, pause in (("same_a", False), ("same_b", True)):
        # One file prefetched: the window of BACKLOG files then stays free to run ahead in.
        with QueueClient(server.address, name, prefetch_files=1) as client:
            first = take(client, 2 * NB + 3)
            if pause:  # let composition run ahead as far as the window allows: BACKLOG + 2
                # files, ready or leased (the client reads ahead deeper for a fast reader)
                wait_until(lambda n=name: window_files(server, n) >= BACKLOG + 2, 30, "backlog")
            client.set_curriculum(0.0)
            runs.append(torch.cat([first, take(client, 6 * NB)]))
    assert torch.equal(runs[0], runs[1])


def test_killed_composer_and_provider_workers_change_nothing_served(shared) -> None:
    """SIGKILL the composer, then a candidate worker, while a trainer reads: both restart
    (the composer from its snapshot) and the trainer reads the stream of an undisturbed run."""
    server, _ = shared
    with QueueClient(server.address, "crash") as client:
        got = [take(client, 2 * NB + 3)]
        client.set_curriculum(0.0)
        # worker_pids: the composer first, then the provider workers.
        for victim in (0, 1):
            before = [int(p) for p in server.split_stats("crash")["worker_pids"]]
            pid = before[victim]
            os.kill(pid, signal.SIGKILL)
            got.append(take(client, 2 * NB))
            # The killed pid gone and every worker back: GetStats lists none while it starts.
            wait_until(
                lambda p=pid, b=before: (
                    p not in (now := [int(q) for q in server.split_stats("crash")["worker_pids"]])
                    and len(now) == len(b)
                ),
                30,
                f"a new process in place of pid {pid}",
            )
    assert server.split_stats("crash")["worker_restarts"] == 2  # the composer, the provider
    with QueueClient(server.address, "crash_twin") as twin:
        twin_run = take(twin, 2 * NB + 3)
        twin.set_curriculum(0.0)
        twin_run = torch.cat([twin_run, take(twin, 4 * NB)])
    assert torch.equal(torch.cat(got), twin_run)


def test_elastic_resume_from_two_ranks_to_one_serves_each_batch_once(shared) -> None:
    """Two ranks read a file and a half each and checkpoint; one rank resumes from both
    states: no batch comes twice, none is skipped, and the composer carries on."""
    server, _ = shared
    received: list[torch.Tensor] = []
    states = []
    for rank in range(2):
        with QueueClient(server.address, "elastic", rank=rank, world_size=2) as client:
            received += list(take(client, NB + NB // 2))
            states.append(client.state_dict())
    with QueueClient(server.address, "elastic", rank=0, world_size=1) as client:
        client.load_state_dict(states)
        received += list(take(client, 5 * NB))  # the two half files, then seqs 4, 5, 6, ...
    consumed = [
        json.loads(line)["seq"]
        for line in (server.data_root / "elastic" / "journal" / "train.jsonl")
        .read_text()
        .splitlines()
        if json.loads(line)["e"] == "c"
    ]
    assert sorted(consumed) == list(range(len(consumed))) and len(consumed) >= 6
    assert len({tuple(b.reshape(-1).tolist()) for b in received}) == len(received) == 8 * NB


def test_two_ranks_get_each_batch_once_and_the_disk_stays_bounded(shared) -> None:
    server, _ = shared
    root = server.data_root / "ranks"
    clients = [QueueClient(server.address, "ranks", rank=r, world_size=2) for r in range(2)]
    try:
        got = [[], []]
        for _ in range(15 * NB):
            for r, client in enumerate(clients):
                got[r].append(client.get_batch("train")[0].clone())
                candidates = len(scan_queue(root / "candidates" / "train"))
                served = len(scan_queue(root / "queue" / "train"))
                assert served <= 2 * (BACKLOG + 2)
                # The candidate window: the oldest file the buffer holds and
                # candidate_backlog (4 for the first fill + 2 per file * (max age 5 + 2)) more.
                assert candidates <= CANDIDATE_WINDOW
    finally:
        for client in clients:
            client.close()
    picks: dict[int, list] = {}
    for line in (root / "journal" / "train.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["e"] == "p":
            picks[rec["seq"]] = [tuple(p) for p in rec["before"]["picks"]]
    served = [p for seq in sorted(picks) for p in picks[seq]]
    assert len(served) == len(set(served))  # no candidate batch went to two files
    consumed = {
        json.loads(line)["seq"]
        for line in (root / "journal" / "train.jsonl").read_text().splitlines()
        if json.loads(line)["e"] == "c"
    }
    assert consumed == set(range(30))  # rank r read exactly the seqs r, r+2, ...
    retired = int(server.split_stats("ranks")["curriculum"]["candidates_ingested"]) // NB
    assert retired > 19  # far more candidate files were made than were ever on disk at once


def test_a_killed_server_resumes_the_curriculum_exactly(start_server, tmp_path: Path) -> None:
    corpus = skewed_corpus(tmp_path / "corpus.txt", segments=400, seed=7)
    config = dataset("d", corpus, curriculum(1.0))
    reference = reference_run(start_server, config, tmp_path / "ref", 9 * NB)

    root = tmp_path / "crash"
    server = start_server(config, data_root=root)
    # The client dies with the server: it gives up on it at once rather than wait to reconnect.
    with QueueClient(server.address, "d", reconnect_timeout_s=0.2) as client:
        before = take(client, 4 * NB + 3)
        state = client.state_dict()
        server.kill(signal.SIGKILL)
    server = start_server(config, data_root=root)
    with QueueClient(server.address, "d") as client:
        client.load_state_dict(state)
        after = take(client, 5 * NB - 3)
    assert torch.equal(torch.cat([before, after]), reference)
    # Rewinding to an older checkpoint makes consumed files again, identically.
    with QueueClient(server.address, "d") as client:
        client.load_state_dict(
            {**state, "splits": {"train": {"seq": 1, "offset": 0, "next_seq": 2}}}
        )
        again = take(client, 2 * NB)
    assert torch.equal(again, reference[NB : 3 * NB])


def test_a_composed_split_serves_its_files_batch_size_only(shared) -> None:
    """A curriculum split's batches are composed whole: another batch_size is refused,
    naming why, before anything is leased; the fifo dataset beside it takes any size."""
    server, _ = shared
    with QueueClient(server.address, "natural") as client:
        assert client.meta["composed_splits"] == ["train"]
        with pytest.raises(errors.InvalidRequest, match="curriculum split, whose batches are"):
            client.get_batch("train", batch_size=client.batch_size + 1)
    with QueueClient(server.address, "fifo") as client:
        assert "composed_splits" not in client.meta
        x, _ = client.get_batch("train", batch_size=client.batch_size + 1)
        assert x.shape[0] == client.batch_size + 1


def test_set_curriculum_on_a_fifo_dataset_is_refused_by_name(shared) -> None:
    server, _ = shared
    with QueueClient(server.address, "fifo") as client:
        with pytest.raises(errors.InvalidRequest, match=r"fifo/train does not use selection"):
            client.set_curriculum(0.5)
        with pytest.raises(errors.InvalidRequest, match="outside"):
            client.set_curriculum(1.5)


@pytest.mark.parametrize(
    "extra, fault",
    [
        ('curriculum_field = "labels"', "curriculum_field = 'labels' is not a field of split"),
        ('curriculum_splits = ["nope"]', "curriculum_splits names ['nope'], which the dataset"),
    ],
)
def test_a_curriculum_that_does_not_fit_the_dataset_fails_the_start_by_name(
    start_server, tmp_path: Path, extra: str, fault: str
) -> None:
    corpus = skewed_corpus(tmp_path / "corpus.txt", segments=400, seed=7)
    server = start_server(dataset("d", corpus, curriculum(1.0) + "\n" + extra), wait_serving=False)
    wait_until(lambda: server.proc.poll() is not None, 60, "the server to exit")
    assert fault in server.log()


@pytest.mark.parametrize(
    "extra, fault",
    [
        ('mode = "best_effort"', 'needs mode = "deterministic"'),
        ("candidate_buffer = 0", "candidate_buffer = 0 is invalid"),
        ("candidate_oversample = 0.5", "candidate_oversample = 0.5 is invalid"),
        ("curriculum_alpha = 2", "curriculum_alpha = 2 is invalid"),
        ('curriculum_schedule_unit = "epochs"', "curriculum_schedule_unit = 'epochs' is invalid"),
        ("curriculum_schedule = [[0, 1.0], [0, 0.5]]", r"curriculum_schedule\[1\]"),
        ('selection = "random"', "selection = 'random' is invalid"),
    ],
)
def test_curriculum_config_errors_name_the_key(extra: str, fault: str, tmp_path: Path) -> None:
    if "selection" not in extra:
        extra = 'selection = "curriculum"\n' + extra
    text = dataset("d", tmp_path / "corpus.txt", extra)
    with pytest.raises(ConfigError, match=fault):
        parse_config(tomllib.loads(text), config_dir=tmp_path)


def test_the_stats_cli_shows_the_curriculum(shared, capsys: pytest.CaptureFixture[str]) -> None:
    server, _ = shared
    with QueueClient(server.address, "uniform") as client:
        take(client, NB)
    assert cli_main(["stats", "uniform", "--address", server.address, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (train,) = [s for s in doc["datasets"][0]["splits"] if s["split"] == "train"]
    cur = train["curriculum"]
    assert cur["alpha"] == 1.0 and cur["buffer_batches"] == 64 and cur["candidate_files"] > 0
    assert cur["served_tokens"] > 0 and cur["kl_to_target"] > 0
    assert cli_main(["stats", "uniform", "--address", server.address]) == 0
    assert "train: curriculum alpha 1.000, KL to target" in capsys.readouterr().out
    assert cli_main(["stats", "fifo", "--address", server.address, "--json"]) == 0
    fifo = json.loads(capsys.readouterr().out)["datasets"][0]["splits"][0]
    assert fifo["curriculum"] is None


def test_metrics_show_the_curriculum_of_train_only(shared) -> None:
    """Prometheus gauges per curriculum split; val (not in curriculum_splits) is plain FIFO."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    server, _ = shared
    with QueueClient(server.address, "natural") as client:
        take(client, NB)
        take(client, NB, split="val")
        assert client.stats()["splits"][1]["split"] == "val"
        assert "curriculum" not in client.stats()["splits"][1]
    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {
        (s.name, s.labels["dataset"], s.labels["split"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "split" in s.labels
    }
    assert samples[("batchqueue_curriculum_alpha", "natural", "train")] == 0.0
    assert samples[("batchqueue_curriculum_buffer_batches", "natural", "train")] == 64
    assert ("batchqueue_curriculum_kl_to_target", "natural", "train") in samples
    assert ("batchqueue_curriculum_alpha", "natural", "val") not in samples
    assert ("batchqueue_curriculum_alpha", "fifo", "train") not in samples


def test_a_streaming_text_dataset_is_served_by_curriculum(start_server, tmp_path: Path) -> None:
    """text_lm (stateful, int32 dict batches, its own corpus sample): the curriculum serves
    schema-exact batches and every candidate batch at most once."""
    src = tmp_path / "docs"
    src.mkdir()
    rng = random.Random(5)
    for i in range(6):
        letters = ALPHABET[4 * i : 4 * i + 6]
        docs = ["".join(rng.choices(letters, k=rng.randint(20, 120))) for _ in range(40)]
        (src / f"part{i}.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    config = textwrap.dedent(
        f"""
        [datasets.text]
        provider = "text_lm"
        batch_size = 1
        batches_per_file = 4
        max_backlog_files = 1
        selection = "curriculum"
        candidate_buffer = 16
        starting_estimation_token_count = 3000
        [datasets.text.args]
        source = "{(src / "*.txt").as_posix()}"
        separator = ""
        seq_len = 32
        micro_batch_size = 2
        eval_take = 5
        shuffle_buffer = 8
        """
    )
    server = start_server(config)
    with QueueClient(server.address, "text") as client:
        batches = [client.get_batch("train") for _ in range(24)]
        set_at = client.set_curriculum(0.0)
        batches += [client.get_batch("train") for _ in range(8)]
    assert set(batches[0]) == {"input_ids", "labels", "attention_mask", "segment_ids"}
    assert batches[0]["input_ids"].shape == (1, 2, 32)
    assert batches[0]["input_ids"].dtype == torch.int32
    assert set_at > 0
    root = server.data_root / "text"
    picks = [
        tuple(p)
        for line in (root / "journal" / "train.jsonl").read_text().splitlines()
        if json.loads(line)["e"] == "p"
        for p in json.loads(line)["before"]["picks"]
    ]
    assert len(picks) >= 32 and len(picks) == len(set(picks))
    assert list((root / "curriculum").glob("corpus-*.npy"))


def test_a_curriculum_whose_providers_cannot_write_says_so_and_recovers(
    start_server, tmp_path: Path
) -> None:
    """Candidates that cannot be written (disk full, injected): the trainer's timeout names
    the provider's write error, stats count it, and serving resumes once the disk frees."""
    fault = tmp_path / "disk-full"
    config = textwrap.dedent(
        f"""
        [datasets.full]
        provider = "bq_test_providers:DiskFullProvider"
        batch_size = 2
        batches_per_file = 4
        selection = "curriculum"
        candidate_buffer = 8
        starting_estimation_token_count = 500
        [datasets.full.args]
        fault_file = "{fault.as_posix()}"
        """
    )
    fault.touch()
    server = start_server(config)
    with QueueClient(server.address, "full", timeout_s=1.5) as client:
        with pytest.raises(errors.NoBatchReady, match=r"cannot write: .*No space left on device"):
            client.get_batch("train")
        stats = server.split_stats("full")
        assert stats["disk_errors"] >= 1 and "No space left" in stats["last_disk_error"]
        fault.unlink()

        def served() -> bool:  # production retries with a backoff of up to 5 s
            try:
                return client.get_batch("train")[0].shape == (2, 4)
            except errors.NoBatchReady:
                return False

        wait_until(served, 60, "serving after the disk freed")


def test_the_example_config_loads() -> None:
    """examples/configs/curriculum_char.toml, as docs/curriculum.md points users to it."""
    from conftest import ROOT
    from queue_server.config.server import load_config

    config = load_config(ROOT / "examples" / "configs" / "curriculum_char.toml")
    (ds,) = config.datasets
    assert ds.selection == "curriculum" and ds.curriculum.schedule == ((1000, 1.0), (5000, 0.0))
