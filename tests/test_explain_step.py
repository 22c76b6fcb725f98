"""ExplainStep on real servers: each row of a step a real client read is found again in the
corpus, read here with numpy, at the file and token offset the server names, in the document
and (for a mixture) the source it names; errors a caller can cause are named; the CLI prints
the same rows.

Corpora are written here: token_shards over raw shards (no documents) and a prepared corpus
(documents known), whose ids are distinct across files; and a mixture of nanogpt_bin sources,
source i holding ids i*100 .. i*100+99, reweighted by SetMixture so that its steps are
explained with the journaled change.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.token_files import write_prepared, write_raw

from conftest import ServerFactory
from queue_client import InvalidRequest, QueueClient, UnknownDataset, UnknownSplit
from queue_client.cli import main as cli_main
from queue_client.format.batchfile import load_batch_bytes
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire.rpc import Rpc
from queue_providers.base import ProviderContext
from queue_providers.char_lm import CharLMProvider
from queue_providers.token_shards.provider import TokenShardsProvider

T = 8
B, NB = 4, 5  # batch size, batches per file: 20 rows a file
VOCAB = 2000
NAMES = ("web", "code", "math")


def corpus_tokens(file: str) -> np.ndarray:
    """The token array of an input file, read here: a .npy, else raw uint16 ids."""
    return np.load(file) if file.endswith(".npy") else np.fromfile(file, dtype=np.uint16)


def check_rows(batch: Any, rows: list[dict[str, Any]], sources: list[str] | None = None) -> None:
    """Row i of the batch is T+1 tokens of rows[i]'s file from its token_offset."""
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    assert len(rows) == len(x) == B
    for i, row in enumerate(rows):
        tokens = corpus_tokens(row["file"])[row["token_offset"] : row["token_offset"] + T + 1]
        assert x[i].tolist() == tokens[:-1].tolist(), (i, row)
        assert y[i].tolist() == tokens[1:].tolist(), (i, row)
        if sources is not None:
            assert row["source"] == sources[int(batch["source"][i])], (i, row)


def token_shards_corpus(d: Path) -> tuple[list[str], dict[str, np.ndarray]]:
    """Two raw shards and a prepared corpus of two shards, ids distinct across files; the
    inputs, and each prepared shard's document starts as the test wrote them."""
    d.mkdir()
    write_raw(d / "a.bin", np.arange(0, 90, dtype=np.uint16))
    write_raw(d / "b.bin", np.arange(100, 181, dtype=np.uint16))
    docs = [
        [np.arange(500, 530), np.arange(530, 541), np.arange(541, 600)],
        [np.arange(600, 613), np.arange(613, 671), np.arange(671, 700)],
    ]
    prep = write_prepared(d / "prep", docs, vocab_size=VOCAB)
    starts = {
        str(prep / f"shard-{i:06d}.npy"): np.cumsum([0] + [len(x) for x in shard[:-1]])
        for i, shard in enumerate(docs)
    }
    return [str(d / "a.bin"), str(d / "b.bin"), str(prep)], starts


def test_each_row_of_a_step_is_at_the_file_offset_and_document_explain_names(
    start_server: ServerFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs, starts = token_shards_corpus(tmp_path / "corpus")
    config = textwrap.dedent(
        f"""
        [datasets.tok]
        provider = "token_shards"
        batch_size = {B}
        batches_per_file = {NB}
        [datasets.tok.args]
        inputs = {json.dumps(inputs)}
        block_size = {T}
        vocab_size = {VOCAB}
        """
    )
    server = start_server(config)
    clients = [QueueClient(server.address, "tok", rank=r, world_size=2) for r in range(2)]
    try:
        batches = [[c.get_batch("train") for _ in range(12)] for c in clients]
        files = set()
        for rank, client in enumerate(clients):
            for step in (0, 4, 5, 11):  # the first, both sides of a file's end, one past it
                rows = client.explain(step)
                check_rows(batches[rank][step], rows)
                assert [r["seq"] for r in rows] == [rank + 2 * (step // NB)] * B
                assert [r["row"] for r in rows] == [(step % NB) * B + i for i in range(B)]
                for r in rows:
                    files.add(r["file"])
                    known = starts.get(r["file"], np.array([], dtype=np.int64))
                    at = np.searchsorted(known, r["token_offset"], "right") - 1
                    assert r["document"] == (at if len(known) else -1), r
        assert any(f in starts for f in files) and any(f not in starts for f in files), files
        assert clients[0].explain(3, rank=1) == clients[1].explain(3)
        # Rows of one file by seq and offset: the CLI, as JSON and as a table.
        address = ["--address", server.address]
        assert cli_main(["explain", "tok", "--seq", "2", "--offset", "4", "--json", *address]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["rows"] == clients[0].explain(6)  # step 6 of rank 0: seq 2, rows 4..7
        assert cli_main(["explain", "tok", "--step", "6", "--rank", "0", *address]) == 0
        out = capsys.readouterr().out
        assert all(Path(r["file"]).name in out for r in doc["rows"]), out
        # What a caller can get wrong, each named.
        rpc = Rpc(server.address)
        try:
            with pytest.raises(UnknownDataset, match="'nope' is not served"):
                rpc.call("ExplainStep", pb.ExplainStepRequest(dataset="nope"), timeout_s=30)
            with pytest.raises(UnknownSplit, match="nope"):
                unknown = pb.ExplainStepRequest(dataset="tok", split="nope")
                rpc.call("ExplainStep", unknown, timeout_s=30)
        finally:
            rpc.close()
        with pytest.raises(InvalidRequest, match="past the last seq"):
            clients[0].explain(10**11)
        with pytest.raises(InvalidRequest, match="rank 2 is outside"):
            clients[0].explain(0, rank=2)
        assert cli_main(["explain", "tok", *address]) == 1
        assert "give --step" in capsys.readouterr().err
    finally:
        for c in clients:
            c.close()


def test_after_skipped_steps_a_step_is_still_explained_by_its_number(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    """Skipped steps advance the stream a batch each, so step S is still stream batch S."""
    inputs, _ = token_shards_corpus(tmp_path / "corpus")
    config = textwrap.dedent(
        f"""
        [datasets.tok]
        provider = "token_shards"
        batch_size = {B}
        batches_per_file = {NB}
        max_backlog_files = 1
        [datasets.tok.args]
        inputs = {json.dumps(inputs)}
        block_size = {T}
        vocab_size = {VOCAB}
        """
    )
    server = start_server(config)
    with QueueClient(server.address, "tok") as client:
        seen = {0: client.get_batch("train")}
        client.skip_steps(25, 32)
        while client.state_dict()["splits"]["train"]["step"] < 40:
            batch = client.get_batch("train")
            seen[client.state_dict()["splits"]["train"]["step"] - 1] = batch
        assert not set(range(25, 32)) & set(seen) and {24, 32} <= set(seen), sorted(seen)
        for step in (24, 32, 39):
            check_rows(seen[step], client.explain(step))


def test_in_document_order_a_rows_first_token_and_document_are_named(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    """order = "documents" packs shuffled documents: a row starts at the offset named, in the
    document named (each ends in eos_id 0, as document fields need)."""
    lengths = [[17, 30, 9, 25], [12, 40, 21]]
    docs, first = [], 1  # ids distinct but for the eos ids
    for shard in lengths:
        docs.append([])
        for n in shard:
            docs[-1].append(np.append(np.arange(first, first + n - 1), 0))
            first += n
    prep = write_prepared(tmp_path / "prep", docs, vocab_size=VOCAB)
    config = textwrap.dedent(
        f"""
        [datasets.docs]
        provider = "token_shards"
        batch_size = {B}
        batches_per_file = {NB}
        [datasets.docs.args]
        inputs = ["{prep.as_posix()}"]
        block_size = {T}
        order = "documents"
        """
    )
    server = start_server(config)
    with QueueClient(server.address, "docs") as client:
        batches = [client.get_batch("train") for _ in range(8)]
        for step in (0, 7):
            for i, r in enumerate(client.explain(step)):
                assert (
                    batches[step]["input_ids"][i][0] == corpus_tokens(r["file"])[r["token_offset"]]
                )
                shard = int(Path(r["file"]).stem.split("-")[1])
                starts = np.cumsum([0, *lengths[shard][:-1]])
                assert r["document"] == np.searchsorted(starts, r["token_offset"], "right") - 1


def test_a_mixtures_rows_name_their_source_and_its_file_after_a_weight_change(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    text = f"[datasets.mix]\nbatch_size = {B}\nbatches_per_file = {NB}\nmax_backlog_files = 2\n"
    for i, name in enumerate(NAMES):
        d = tmp_path / "sources" / name
        d.mkdir(parents=True)
        rng = np.random.default_rng(i)
        for split in ("train", "val"):
            ids = rng.integers(i * 100, i * 100 + 100, size=3000).astype(np.uint16)
            ids.tofile(d / f"{split}.bin")
        text += textwrap.dedent(
            f"""
            [datasets.mix.sources.{name}]
            provider = "nanogpt_bin"
            weight = {(0.5, 0.3, 0.2)[i]}
            [datasets.mix.sources.{name}.args]
            data_dir = "{d.as_posix()}"
            block_size = {T}
            vocab_size = 300
            """
        )
    server = start_server(text)
    with QueueClient(server.address, "mix") as client:
        at = client.set_mixture({"web": 0.0, "code": 0.0, "math": 1.0})
        steps = (at + 2) * NB
        batches = [client.get_batch("train") for _ in range(steps)]
        for step in (0, 1, (at - 1) * NB + 3, at * NB, steps - 1):
            rows = client.explain(step)
            check_rows(batches[step], rows, list(NAMES))
            for r in rows:
                assert r["file"].endswith(f"{r['source']}/train.bin"), r
        assert {r["source"] for r in client.explain(at * NB)} == {"math"}
        assert torch.equal(batches[at * NB]["source"], torch.full((B,), 2))


def test_a_provider_without_provenance_is_refused_naming_it(
    start_server: ServerFactory,
) -> None:
    server = start_server(
        '[datasets.tiny]\nprovider = "bq_test_providers:TinyProvider"\nbatch_size = 2\n'
    )
    with QueueClient(server.address, "tiny") as client:
        with pytest.raises(InvalidRequest, match="not available for provider TinyProvider"):
            client.explain(0)


def test_char_lm_and_random_windows_are_placed_as_their_files_draw_them(tmp_path: Path) -> None:
    """The providers themselves (no server): char_lm's rows are the input's characters from
    the offset named (val's after train's), and token_shards' nanoGPT draws start there."""
    text = "".join(chr(97 + (i * 7) % 26) + "\n" * (i % 13 == 0) for i in range(5000))
    (tmp_path / "in.txt").write_text(text)
    context = ProviderContext("c", tmp_path / "c", B, NB)
    char = CharLMProvider(context, input=str(tmp_path / "in.txt"), block_size=T)
    char.set_meta(char.complete_meta())
    for split in ("train", "val"):
        x = load_batch_bytes(char.make_file(split, 3).data, split).tensors["x"].reshape(-1, T)
        for i, r in enumerate(char.provenance(split, 3, range(B * NB))):
            offset = r["token_offset"]
            assert text[offset : offset + T] == "".join(char.itos[int(v)] for v in x[i]), r
    write_raw(tmp_path / "a.bin", np.arange(0, 500, dtype=np.uint16))
    context = ProviderContext("t", tmp_path / "t", B, NB)
    inputs = [str(tmp_path / "a.bin")]
    drawn = TokenShardsProvider(context, inputs=inputs, block_size=T, sampling="random")
    drawn.set_meta(drawn.complete_meta())
    x = load_batch_bytes(drawn.make_file("train", 2).data, "t").tensors["x"].reshape(-1, T)
    starts = [r["token_offset"] for r in drawn.provenance("train", 2, range(B * NB))]
    assert starts == x[:, 0].tolist()
    with pytest.raises(ValueError, match="row 20 is outside the file's 20 rows"):
        drawn.provenance("train", 2, [20])
