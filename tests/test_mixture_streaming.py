"""Streaming sources in a mixture, through real servers: two text_lm sources and a
stateless source of the same rows (bq_mixture_providers; char_lm and nanogpt_bin serve x/y
rows, refused beside text_lm's packed ones), two workers. Each source's rows over the run are exactly its own stream (its provider's files
made in order in this process, and the source served alone as a dataset), with a worker
killed mid-run, and across a SIGKILL of the server and a trainer resumed at world size 1 from
the states of 2 ranks. The small source wraps within the run: its next epoch is logged once,
counted in stats, and its rows run on into that epoch with nothing skipped or repeated.

The sources' texts use disjoint characters (web a-m, code n-z, bytes digits), so a row's
bytes name its source.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.mixture_reads import read_positioned

from conftest import SUPPORT, ServerFactory, wait_until
from queue_client import QueueClient
from queue_client.cli import main as cli_main
from queue_client.format.batchfile import load_batch_bytes
from queue_client.format.mixture_epochs import read_epoch_starts
from queue_client.mixture import RowSchedule, WeightPlan
from queue_providers import create
from queue_providers.base import ProviderContext
from queue_providers.mixture.sources import build_sources, source_meta
from queue_providers.seeding import derive_seed
from queue_providers.tokenizer_training.train_bpe import train_bpe
from queue_server.mixture.epochs import record_epoch_starts
from queue_server.testing import ServerExited, ServerProcess

B, NB, T, MICRO = 2, 3, 16, 2  # batch size, batches per file, seq_len, micro_batch_size
R = B * NB  # rows per file
SEED = 1337
NAMES = ("web", "code", "bytes")
WEIGHTS = (0.2, 0.6, 0.2)  # web: fewer rows than a file per file, so a worker reuses one
LETTERS = {"web": "abcdefghijklm", "code": "nopqrstuvwxyz", "bytes": "0123456789"}
STREAMING = ("web", "code")
DOCS = {"web": 150, "code": 25}  # code wraps after about 40 of its rows
ARGS = {"separator": "", "seq_len": T, "micro_batch_size": MICRO, "eval_take": 3,
        "shuffle_buffer": 8}  # fmt: skip
EOS = 256  # the byte tokenizer's end of document
PACKED = "bq_mixture_providers:PackedBytesProvider"


def write_corpora(tmp: Path) -> dict[str, Path]:
    out = {}
    for name in STREAMING:
        rnd = random.Random(name)
        docs = [
            " ".join(
                "".join(rnd.choices(LETTERS[name], k=rnd.randint(2, 7)))
                for _ in range(rnd.randint(3, 12))
            )
            for _ in range(DOCS[name])
        ]
        out[name] = tmp / f"{name}.txt"
        out[name].write_text("\n\n".join(docs) + "\n")
    return out


def source_args(corpus: Path) -> str:
    lines = [f"source = {json.dumps(corpus.as_posix())}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in ARGS.items()]  # JSON scalars are TOML
    return "\n".join(lines) + "\n"


def specs(corpora: dict[str, Path]) -> list[dict[str, Any]]:
    """The sources, as the mixture provider takes them."""
    out: list[dict[str, Any]] = []
    for name, weight in zip(NAMES, WEIGHTS, strict=True):
        if name in STREAMING:
            out.append({"name": name, "provider": "text_lm", "weight": weight,
                        "args": ARGS | {"source": corpora[name].as_posix()}})  # fmt: skip
        else:
            args = {"text": LETTERS[name] * 20, "seq_len": T, "micro_batch_size": MICRO}
            out.append({"name": name, "provider": PACKED, "weight": weight, "args": args})
    return out


def config(corpora: dict[str, Path], alone: bool = False) -> str:
    text = f"[datasets.mix]\nbatch_size = {B}\nbatches_per_file = {NB}\nworkers = 2\n"
    text += f"seed = {SEED}\n"
    for spec in specs(corpora):
        name = spec["name"]
        text += f'[datasets.mix.sources.{name}]\nprovider = "{spec["provider"]}"\n'
        text += f"weight = {spec['weight']}\n[datasets.mix.sources.{name}.args]\n"
        text += "".join(f"{k} = {json.dumps(v)}\n" for k, v in spec["args"].items())
    if alone:  # the code source served on its own: its seed, one worker (one stream)
        seed = derive_seed(SEED, "mixture source", "code")
        text += textwrap.dedent(
            f"""
            [datasets.alone]
            provider = "text_lm"
            batch_size = {B}
            batches_per_file = {NB}
            workers = 1
            seed = {seed}
            [datasets.alone.args]
            """
        )
        text += source_args(corpora["code"])
    return text


class OwnStreams:
    """Each source's own stream: its provider's files, made in order in this process."""

    def __init__(self, corpora: dict[str, Path], tmp: Path) -> None:
        context = ProviderContext("mix", tmp / "own", B, NB, seed=SEED)
        self.providers = build_sources(context, specs(corpora))
        for p in self.providers:
            p.set_meta(source_meta(p, context))
        self.made: list[list[torch.Tensor]] = [[] for _ in NAMES]

    def rows(self, source: int, n: int) -> torch.Tensor:
        """input_ids of rows [0, n) of the source's stream, [n, MICRO, T]."""
        made = self.made[source]
        while len(made) * R < n:
            encoded = self.providers[source].make_file("train", len(made))
            ids = load_batch_bytes(encoded.data, "own").tensors["input_ids"]
            made.append(ids.reshape(R, MICRO, T))
        return torch.cat(made)[:n] if made else torch.empty(0, MICRO, T)


def schedule() -> RowSchedule:
    plan = WeightPlan(NAMES, WEIGHTS, (), R)
    return RowSchedule(plan.segments(plan.by_name([])))


def check_rows(batches: list[dict[str, Any]], own: OwnStreams) -> dict[int, int]:
    """Every row is its scheduled source's own row at that source's count there; returns
    {global row: source}."""
    sched = schedule()
    seen: dict[int, int] = {}
    for b in batches:
        first = b["seq"] * R + b["offset"]
        expected = sched.sources_of(first, first + B)
        assert b["source"].tolist() == expected, (b["seq"], b["offset"])
        counts = sched.counts(first)
        for i, s in enumerate(expected):
            letters = {
                chr(c) for c in b["input_ids"][i].flatten().tolist() if c < 128 and chr(c).isalnum()
            }
            assert letters <= set(LETTERS[NAMES[s]]), (first + i, s)
            want = own.rows(s, counts[s] + 1)[counts[s]]
            assert torch.equal(b["input_ids"][i], want), (
                f"row {first + i}: not {NAMES[s]}'s row {counts[s]}"
            )
            counts[s] += 1
            assert first + i not in seen, f"row {first + i} served twice"
            seen[first + i] = s
    return seen


def read_ids(client: QueueClient, n: int) -> list[dict[str, Any]]:
    return read_positioned(client, n, "input_ids")


@pytest.fixture(scope="module", autouse=True)
def support_importable() -> Iterator[None]:
    """The stand-in provider (tests/support) is made in this process too, by its name."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SUPPORT))
        yield


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, OwnStreams]]:
    tmp = tmp_path_factory.mktemp("mixstream")
    corpora = write_corpora(tmp)
    factory = ServerFactory(tmp)
    server = factory(config(corpora, alone=True))
    yield server, OwnStreams(corpora, tmp)
    factory.close()


@pytest.fixture(scope="module")
def served(shared) -> list[dict[str, Any]]:
    """The first 40 files of the mixture, read by one rank."""
    server, _ = shared
    with QueueClient(server.address, "mix") as client:
        assert client.meta["mixture"]["sources"] == list(NAMES)
        return read_ids(client, 40 * NB)


def test_each_streaming_source_serves_its_own_stream_with_two_workers(shared, served) -> None:
    """Two workers make alternate files; every row is its source's own next row, and the
    code source's rows are those the same provider serves as a dataset of its own."""
    server, own = shared
    seen = check_rows(served, own)
    assert sorted(seen) == list(range(40 * R))
    assert len(server.split_stats("mix")["worker_pids"]) == 2
    code = torch.cat([b["input_ids"][b["source"] == 1] for b in served])
    with QueueClient(server.address, "alone") as client:
        alone = torch.cat([client.get_batch("train")["input_ids"] for _ in range(len(code) // B)])
    assert torch.equal(code[: len(alone)], alone)


def test_a_source_that_wraps_starts_its_next_epoch_and_says_so(shared, served, capsys) -> None:
    """code's corpus is read through several times within the run: the worker that makes
    the first row of each epoch logs it once; stats count code's epochs; and its rows run on
    into each next epoch with nothing skipped or repeated (its stream holds every train
    document once per epoch, each epoch starting where the one before ended)."""
    server, own = shared
    wait_until(lambda: "source code starts epoch 2 " in server.log(), what="the epoch log lines")
    lines = [line for line in server.log().splitlines() if "starts epoch" in line]
    assert all("dataset mix split train: source code starts epoch" in x for x in lines), lines
    logged = {
        int(x.split("epoch ")[1].split()[0]): int(x.split("row ")[1].split(",")[0]) for x in lines
    }
    assert len(logged) == len(lines), f"an epoch logged twice: {lines}"
    # Where each epoch must start, from the corpus alone: epoch k at token k * E of the
    # stream (E: the train documents' bytes and an end id each); a row belongs to the epoch
    # of its first window, and windows are T tokens apart.
    docs = Path(own.providers[1].files[0].path).read_text().strip().split("\n\n")
    train = docs[ARGS["eval_take"] :]
    e = sum(len(d.encode()) + 1 for d in train)
    for k, row in logged.items():
        assert row == -(-(k * e // T) // MICRO), (k, row)
    stream = own.rows(1, max(logged.values()) + R).reshape(-1).tolist()
    text = bytes(t if t != EOS else 0 for t in stream).decode().split("\0")
    for k in range(max(logged)):
        assert sorted(text[k * len(train) : (k + 1) * len(train)]) == sorted(train), k
    # Stats: code's epoch at the rows served, web still in its first.
    wait_until(lambda: int(server.split_stats("mix")["consumed_files"]) >= 39, what="consumed")
    with QueueClient(server.address, "mix") as client:
        stats = next(s for s in client.stats()["splits"] if s["split"] == "train")
    mix = stats["mixture"]
    code_rows = schedule().counts(int(mix["rows_served"]))[1]
    want = max((k for k, row in logged.items() if row < code_rows), default=0)
    by_name = {s["name"]: s for s in mix["sources"]}
    assert want >= 1 and float(by_name["code"]["epochs"]) == want
    # A row's tokens are its token field's (MICRO windows of T), as the split counts them.
    tokens = [int(s["tokens_served"]) for s in mix["sources"]]
    assert sum(tokens) == int(mix["rows_served"]) * MICRO * T == int(stats["tokens_served"])
    assert float(by_name["web"]["epochs"]) == 0
    assert cli_main(["stats", "--address", server.address, "mix"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # lines may wrap at the terminal's width
    code_line = out.split("code: weight")[1].split("bytes: weight")[0]
    assert f", {float(want):.3f} epochs" in code_line, code_line
    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert (
        f'batchqueue_mixture_epochs{{dataset="mix",source="code",split="train"}} {want}.0'
        in metrics
    )


def test_a_killed_worker_a_sigkill_and_a_resume_at_world_size_1_continue_every_source(
    start_server, tmp_path: Path
) -> None:
    """2 ranks read; a worker is killed (restarted from its journaled state); they checkpoint
    mid-file and read on (lost work); the server is SIGKILLed; 1 rank resumes from the 2
    states on a restarted server. Every source's rows over the whole run are exactly its own
    stream's prefix, and each epoch start is logged once, files made again and all."""
    corpora = write_corpora(tmp_path)
    root = tmp_path / "root"
    server = start_server(config(corpora), data_root=root)
    own = OwnStreams(corpora, tmp_path)
    clients = [QueueClient(server.address, "mix", rank=r, world_size=2) for r in range(2)]
    kept: list[dict] = []
    for step in range(16):
        for c in clients:
            kept += read_ids(c, 1)
        if step == 4:
            pid = server.split_stats("mix")["worker_pids"][0]
            os.kill(int(pid), signal.SIGKILL)
    wait_until(
        lambda: int(server.split_stats("mix")["worker_restarts"]) >= 1,
        what="the worker restarted",
    )
    states = [c.state_dict() for c in clients]  # the checkpoint: mid-file
    for c in clients:
        read_ids(c, 4)  # served, never checkpointed: served again after the resume
        c.close()
    server.kill(signal.SIGKILL)
    killed, server = server, start_server(config(corpora), data_root=root)
    with QueueClient(server.address, "mix", rank=0, world_size=1) as resumed:
        resumed.load_state_dict(states)
        kept += read_ids(resumed, 30)
    seen = check_rows(kept, own)
    # Each epoch start is logged once, by both servers' workers together.
    logs = killed.log() + server.log()
    lines = [x for x in logs.splitlines() if "starts epoch" in x]
    assert lines and len({x.split(": source ")[1] for x in lines}) == len(lines), lines
    # The rows served are a prefix of the split's rows, up to the files still being read.
    end = max(seen) + 1
    missing = sorted(set(range(end)) - set(seen))
    assert not missing or missing[0] >= end - 2 * R, missing[:5]


def test_token_shards_reports_where_each_epoch_starts(tmp_path: Path, caplog) -> None:
    """token_shards (sampling = "epoch") serves each window once per epoch: the rows it says
    start an epoch are those after which the windows come again (random sampling has none),
    and a mixture of it logs and records each start once."""
    path = tmp_path / "tokens.bin"
    np.arange(1, 60, dtype=np.uint16).tofile(path)  # 59 tokens: 14 windows of 4 + 1
    context = ProviderContext("ts", tmp_path / "ts", B, NB, seed=SEED)
    args = {"inputs": [str(path)], "block_size": 4, "vocab_size": 100}
    provider = create("token_shards", context, args)
    provider.set_meta(provider.complete_meta())
    assert provider.ordered_epochs
    rows, starts = [], []
    for seq in range(8):  # 48 rows: 3 epochs and a bit
        x = load_batch_bytes(provider.make_file("train", seq).data, "ts").tensors["x"]
        rows += [tuple(r) for r in x.reshape(R, 4).tolist()]
        starts += [(seq * R + row, epoch) for row, epoch in provider.epoch_starts("train", seq)]
    n = len(set(rows))
    assert starts == [(k * n, k) for k in range(1, len(rows) // n + 1) if k * n < len(rows)]
    for k in range(len(rows) // n):
        assert len(set(rows[k * n : (k + 1) * n])) == n  # each window once per epoch
    sampler = create("token_shards", context, args | {"sampling": "random"})
    sampler.set_meta(sampler.complete_meta())
    sampler.make_file("train", 5)
    assert not sampler.ordered_epochs and sampler.epoch_starts("train", 5) == []
    # In a mixture: the file holding the row names the epoch's start, and its publisher
    # records and logs it, once, however often the file is made.
    mixture = create("mixture", context, {"sources": [{"name": "ts", "provider": "token_shards",
                                                        "weight": 1.0, "args": args}]})  # fmt: skip
    mixture.set_meta(mixture.complete_meta())
    named = []
    with caplog.at_level(logging.INFO, logger="queue_server.mixture"):
        for seq in [*range(8), 3, 5]:
            encoded = mixture.make_file("train", seq)
            named += [(row, epoch) for _, epoch, row in encoded.epoch_starts]
            record_epoch_starts(context.layout, "train", encoded.seq, encoded.epoch_starts)
    assert sorted(set(named)) == starts
    logged = [r.getMessage() for r in caplog.records if "starts epoch" in r.getMessage()]
    assert (
        logged[0]
        == f"dataset ts split train: source ts starts epoch 1 (its row {n}, in file seq {n // R})"
    )
    assert len(logged) == len(starts)
    recorded = read_epoch_starts(context.layout.mixture_epochs_dir("train"))
    assert recorded == {"ts": {epoch: row for row, epoch in starts}}


def test_text_lm_sources_with_different_tokenizers_are_refused_at_start(
    start_server, tmp_path: Path
) -> None:
    """web names a BPE tokenizer, code the byte one: their ids are of two vocabularies, so the
    start fails naming both sources and both tokenizers, and no snapshot is written."""
    corpora = write_corpora(tmp_path)
    tok = train_bpe([str(corpora["web"])], tmp_path / "bpe" / "tokenizer.json", vocab_size=280)
    text = config(corpora).replace(
        "[datasets.mix.sources.web.args]\n",
        f"[datasets.mix.sources.web.args]\ntokenizer = {json.dumps(tok.as_posix())}\n",
    )
    root = tmp_path / "root"
    try:
        refused = start_server(text, data_root=root)
    except ServerExited as exc:
        message = str(exc)
    else:
        assert refused.wait_exit() == 2, refused.log_tail()
        message = refused.log()
    assert (
        f"text_lm sources 'web' (tokenizer 'hf {tok.as_posix()}') and 'code' (tokenizer "
        "'byte') use different tokenizers" in " ".join(message.split())
    ), message
    assert not (root / "mix" / "tokenizer").exists()
