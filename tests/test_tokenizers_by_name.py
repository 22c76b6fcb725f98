"""text_lm's tokenizer given by name: a tiktoken ranks file, a tiktoken encoding found in
tiktoken's cache, a Hugging Face tokenizer found by repo id in a local hub cache. All offline:
what is not on this machine is a ConfigError naming it, and what the tokenizer was read from
is part of the dataset's inputs, so a changed ranks file is refused at the next start."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from conftest import ServerFactory, subprocess_env
from queue_client.client import QueueClient
from queue_client.errors import ConfigError
from queue_providers import ProviderContext, create
from queue_providers.inputs import check_inputs, describe_inputs
from queue_providers.tokenizer_training.train_bpe import train_bpe
from queue_server.testing import ServerExited

WORDS = "the then there thin thing this in ink inn ten tent net".split()
MERGES = [b"th", b"the", b"in", b"ing", b" t", b" the", b"en", b"he"]
REV = "0123456789abcdef0123456789abcdef01234567"
PLUGIN_URL = "https://bq.invalid/bq_test.tiktoken"
PLUGIN = f"""
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext.openai_public import r50k_pat_str


def bq_test():
    ranks = load_tiktoken_bpe({PLUGIN_URL!r})
    return {{
        "name": "bq_test",
        "pat_str": r50k_pat_str,
        "mergeable_ranks": ranks,
        "special_tokens": {{"<|endoftext|>": len(ranks)}},
    }}


ENCODING_CONSTRUCTORS = {{"bq_test": bq_test}}
"""


def write_ranks(path: Path, merges: list[bytes] = MERGES) -> Path:
    """The 256 single bytes, then `merges` in priority order: tiktoken's file format."""
    tokens = [bytes([b]) for b in range(256)] + merges
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    return path


def write_corpus(path: Path, n_docs: int = 80) -> list[str]:
    rnd = random.Random(3)
    docs = [f"D{i:03d} " + " ".join(rnd.choices(WORDS, k=rnd.randint(2, 6))) for i in range(n_docs)]
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return docs


def fake_hub_cache(root: Path, repo: str, tokenizer_json: Path, rev: str = REV) -> Path:
    """A Hugging Face hub cache as huggingface_hub lays it out, holding one tokenizer.json."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(rev)
    return root


def text_lm(tmp: Path, corpus: Path, **args: Any):
    ctx = ProviderContext("ds", tmp / "ds", batch_size=2, batches_per_file=2)
    base = {
        "source": str(corpus),
        "separator": "",
        "seq_len": 32,
        "micro_batch_size": 2,
        "eval_take": 5,
        "shuffle_buffer": 8,
    }
    return create("text_lm", ctx, {**base, **args})


def dataset(name: str, corpus: Path, tokenizer: str) -> str:
    return textwrap.dedent(
        f"""
        [datasets.{name}]
        provider = "text_lm"
        batch_size = 2
        batches_per_file = 2
        max_backlog_files = 1
        [datasets.{name}.args]
        source = "{corpus.as_posix()}"
        separator = ""
        tokenizer = "{tokenizer}"
        seq_len = 32
        micro_batch_size = 2
        eval_take = 5
        shuffle_buffer = 8
        packing = "bin"
        """
    )


def documents_of(batch: dict[str, Any], eos: int) -> list[np.ndarray]:
    """The whole documents of a batch (bin packing keeps short ones whole): a segment whose
    last token is EOS and that starts its row or follows another segment's EOS."""
    ids = batch["input_ids"].numpy().reshape(-1, 32)
    segs = batch["segment_ids"].numpy().reshape(-1, 32)
    docs = []
    for row, seg in zip(ids, segs, strict=True):
        for s in set(seg.tolist()) - {0}:
            piece = row[seg == s]
            if piece[-1] == eos and len(piece) < 32:
                docs.append(piece[:-1])
    return docs


def test_text_lm_serves_tiktoken_and_hub_cache_tokenizers_and_refuses_a_changed_ranks_file(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus.txt"
    docs = set(write_corpus(corpus))
    ranks = write_ranks(tmp_path / "small.tiktoken")
    bpe = train_bpe(
        [str(corpus)], tmp_path / "bpe" / "tokenizer.json", vocab_size=300, separator=""
    )
    bpe_vocab = Tokenizer.from_file(str(bpe)).get_vocab_size()
    hub = fake_hub_cache(tmp_path / "hub", "bqtest/tiny", bpe)
    # A tiktoken encoding registered by a plugin, its ranks in tiktoken's cache under the
    # sha1 of its URL: "tiktoken:bq_test" must resolve from there, with no network.
    plugins = tmp_path / "plugins" / "tiktoken_ext"
    plugins.mkdir(parents=True)
    (plugins / "bq_test_encodings.py").write_text(PLUGIN)
    tiktoken_cache = tmp_path / "tiktoken-cache"
    tiktoken_cache.mkdir()
    write_ranks(tiktoken_cache / hashlib.sha1(PLUGIN_URL.encode()).hexdigest())
    env = {
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        "TIKTOKEN_CACHE_DIR": str(tiktoken_cache),
        "PYTHONPATH": os.pathsep.join([subprocess_env()["PYTHONPATH"], str(plugins.parent)]),
    }
    config = (
        "[server]\nlease_ttl_s = 30\n"
        + dataset("ranks", corpus, f"tiktoken:{ranks.as_posix()}")
        + dataset("named", corpus, "tiktoken:bq_test")
        + dataset("hub", corpus, "bqtest/tiny")
    )
    data = tmp_path / "data"
    server = start_server(config, data_root=data, env=env)
    for name, kind, vocab in (("ranks", "tiktoken", 265), ("named", "tiktoken", 265)):
        with QueueClient(server.address, name, rank=0, world_size=1) as client:
            meta = client.meta
            assert meta["tokenizer"]["kind"] == kind and meta["vocab_size"] == vocab
            assert meta["eos_id"] == 264  # right after the last rank
            batch = client.get_batch("train")
            ids = batch["input_ids"].numpy()
            assert ids.max() < vocab and (ids >= 256).any() and (ids < 256).any()
            # Every whole document decodes, token by token of the ranks, to a corpus document.
            table = [bytes([b]) for b in range(256)] + MERGES
            found = documents_of(batch, meta["eos_id"])
            assert found
            for doc in found:
                assert b"".join(table[i] for i in doc.tolist()).decode() in docs
    with QueueClient(server.address, "hub", rank=0, world_size=1) as client:
        assert client.meta["tokenizer"]["kind"] == "hf"
        assert client.meta["vocab_size"] == bpe_vocab
        assert client.get_batch("train")["input_ids"].numpy().max() < bpe_vocab
    server.stop()

    # The ranks file is one of the dataset's inputs: changed, the next start is refused.
    write_ranks(ranks, [*MERGES[:-1], b"ng"])
    # Inputs are checked beside the start (a built root serves at once): the server exits 2,
    # before or after it answers SERVING, and no lease is ever granted meanwhile.
    try:
        refused = start_server(config, data_root=data, env=env)
    except ServerExited as exc:
        message = str(exc)
    else:
        assert refused.wait_exit() == 2, refused.log_tail()
        message = refused.log()
    assert "small.tiktoken" in message and "changed" in message, message


def test_a_hub_name_resolves_from_the_local_cache_and_a_moved_ref_is_a_changed_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus.txt"
    write_corpus(corpus)
    tok = train_bpe(
        [str(corpus)], tmp_path / "bpe" / "tokenizer.json", vocab_size=280, separator=""
    )
    hub = fake_hub_cache(tmp_path / "hub", "bqtest/tiny", tok)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = text_lm(tmp_path, corpus, tokenizer="bqtest/tiny")
    files = p.input_files()
    assert files[-1] == hub / "models--bqtest--tiny" / "snapshots" / REV / "tokenizer.json"
    recorded = describe_inputs(files)
    meta = p.complete_meta(recorded)
    assert meta["tokenizer"]["kind"] == "hf" and meta["tokenizer"]["eos_token"] == "<|endoftext|>"
    # "tokenizer = 'hf'" with the name as tokenizer_path, and "hf:NAME", find the same file.
    assert (
        text_lm(tmp_path, corpus, tokenizer="hf", tokenizer_path="bqtest/tiny").input_files()[-1]
        == files[-1]
    )
    assert text_lm(tmp_path, corpus, tokenizer="hf:bqtest/tiny").input_files()[-1] == files[-1]
    # The cache's main ref moves to a new snapshot with another tokenizer: a changed input.
    other = train_bpe(
        [str(corpus)],
        tmp_path / "bpe2" / "tokenizer.json",
        vocab_size=280,
        separator="",
        eos_token="</s>",
    )
    new_rev = "f" * 40
    fake_hub_cache(tmp_path / "hub2", "bqtest/tiny", other, rev=new_rev)
    moved = hub / "models--bqtest--tiny" / "snapshots" / new_rev
    (tmp_path / "hub2" / "models--bqtest--tiny" / "snapshots" / new_rev).rename(moved)
    (hub / "models--bqtest--tiny" / "refs" / "main").write_text(new_rev)
    again = text_lm(tmp_path, corpus, tokenizer="bqtest/tiny")
    with pytest.raises(ConfigError, match="was built from other inputs"):
        check_inputs(again.input_files(), recorded, meta["inputs_fingerprint"], dataset="ds")


def test_names_that_are_not_on_this_machine_are_named_in_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus.txt"
    write_corpus(corpus)
    (tmp_path / "hub").mkdir()
    (tmp_path / "tiktoken-cache").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))

    with pytest.raises(ConfigError, match=r"'bqtest/absent'.*Hugging Face cache.*never downloads"):
        text_lm(tmp_path, corpus, tokenizer="bqtest/absent").complete_meta()
    # A registered encoding whose file tiktoken's cache lacks: named, and no download tried.
    with pytest.raises(ConfigError, match=r"'tiktoken:cl100k_base' is not available offline"):
        text_lm(tmp_path, corpus, tokenizer="tiktoken:cl100k_base").complete_meta()
    with pytest.raises(ConfigError, match=r"tiktoken has no encoding 'no_such_base'"):
        text_lm(tmp_path, corpus, tokenizer="tiktoken:no_such_base").complete_meta()
    with pytest.raises(ConfigError, match=r"ranks file '.*missing\.tiktoken' is not a file"):
        text_lm(tmp_path, corpus, tokenizer=str(tmp_path / "missing.tiktoken")).complete_meta()
    with pytest.raises(ConfigError, match=r"'nope/vocab\.json' is not a file"):
        text_lm(tmp_path, corpus, tokenizer="nope/vocab.json").complete_meta()
    # A ranks file that lacks a byte cannot encode every text: refused, naming it.
    bad = tmp_path / "short.tiktoken"
    bad.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(200)))
    with pytest.raises(ConfigError, match=r"short\.tiktoken.* lacks 56 of the 256 single bytes"):
        text_lm(tmp_path, corpus, tokenizer=f"tiktoken:{bad}").complete_meta()
    with pytest.raises(ConfigError, match="names the tokenizer already"):
        text_lm(tmp_path, corpus, tokenizer="bqtest/absent", tokenizer_path="x.json")


def test_tiktoken_encodes_special_token_text_as_text_and_matches_tiktoken(tmp_path: Path) -> None:
    import tiktoken

    corpus = tmp_path / "corpus.txt"
    write_corpus(corpus)
    ranks = write_ranks(tmp_path / "small.tiktoken")
    p = text_lm(tmp_path, corpus, tokenizer=str(ranks))  # by the .tiktoken suffix alone
    p.set_meta(p.complete_meta())
    tok = p.tokenizer
    assert tok is not None and tok.kind == "tiktoken"
    texts = ["the thing in <|endoftext|> then", "", "thin tent", "é the"] * 20
    flat, lengths = tok.encode_docs(texts)
    enc = tiktoken.Encoding(
        "ref",
        pat_str=tok.pat_str,
        mergeable_ranks={t: i for i, t in enumerate([bytes([b]) for b in range(256)] + MERGES)},
        special_tokens={"<|endoftext|>": 264},
    )
    want = [np.array([*enc.encode_ordinary(t), 264]) for t in texts]
    assert lengths.tolist() == [len(w) for w in want]
    assert flat.dtype == np.int32 and np.array_equal(flat, np.concatenate(want))
    assert int((flat == tok.eos_id).sum()) == len(texts)  # the typed EOS text stayed text
    assert tok.decode(flat[: lengths[0] - 1]) == texts[0]


def test_bert_mlm_finds_a_vocab_txt_by_hub_name_or_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus.txt"
    write_corpus(corpus)
    folder = tmp_path / "bert-folder"
    folder.mkdir()
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    snap = tmp_path / "hub" / "models--bqtest--bert" / "snapshots" / REV
    snap.mkdir(parents=True)
    (snap / "vocab.txt").write_bytes(vocab.read_bytes())
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(REV)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for given, found in (("bqtest/bert", snap / "vocab.txt"), (str(folder), vocab)):
        ctx = ProviderContext("b", tmp_path / f"b{len(given)}", batch_size=2, batches_per_file=2)
        p = create("bert_mlm", ctx, {"input": str(corpus), "tokenizer": given, "block_size": 16})
        assert p.input_files()[-1] == found
        assert p.complete_meta()["vocab_size"] == 5 + len(WORDS)
    ctx = ProviderContext("b", tmp_path / "b", batch_size=2, batches_per_file=2)
    with pytest.raises(ConfigError, match=r"bert_mlm: tokenizer 'bqtest/other' .*Hugging Face"):
        create("bert_mlm", ctx, {"input": str(corpus), "tokenizer": "bqtest/other"})
