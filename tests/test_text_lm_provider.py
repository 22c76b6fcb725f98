"""text_lm end to end through produce_file: meta and shapes, disjoint train/val, disjoint worker
shards with a reshuffle each epoch, byte-identical replay from every journaled state, the
tokenizer snapshot, and bad inputs that fail loudly without losing what was produced."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from queue_client.errors import ConfigError, MetaError
from queue_client.format.batchfile import load_batch_file
from queue_providers import ProviderContext, create
from queue_providers.text.errors import CorpusError
from queue_providers.tokenizer_training.train_bpe import train_bpe

WORDS = "amber birch cedar delta ember fjord grove heron inlet juniper kestrel lumen".split()
DOC_ID = re.compile(r"D(\d{4})#")


def write_corpus(
    tmp: Path, n_docs: int, *, fmt: str = "txt", seed: int = 0
) -> tuple[str, list[str]]:
    """Documents that each start with a unique id "D0042#", in the given format."""
    rnd = random.Random(seed)
    docs = [
        f"D{i:04d}# " + " ".join(rnd.choices(WORDS, k=rnd.randint(2, 25))) for i in range(n_docs)
    ]
    if fmt == "txt":
        path = tmp / "corpus.txt"
        path.write_text("\n\n".join(docs) + "\n")
    elif fmt == "jsonl":
        path = tmp / "corpus.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp / "corpus.parquet"
        pq.write_table(pa.table({"text": docs}), path, row_group_size=40)
    return str(path), docs


def make(
    tmp: Path,
    source: str,
    *,
    worker: int = 0,
    workers: int = 1,
    a: int = 2,
    bpf: int = 3,
    **args: Any,
):
    ctx = ProviderContext(
        "ds",
        tmp / "ds",
        batch_size=a,
        batches_per_file=bpf,
        worker_index=worker,
        num_workers=workers,
        seed=7,
    )
    defaults: dict[str, Any] = {
        "source": source,
        "separator": "" if source.endswith(".txt") else None,
        "seq_len": 32,
        "micro_batch_size": 2,
        "eval_take": 10,
        "shuffle_buffer": 8,
    }
    defaults.update(args)
    p = create("text_lm", ctx, defaults)
    return p


def ready(p, meta=None):
    meta = meta if meta is not None else p.complete_meta()
    p.set_meta(meta)
    return meta


def produce(p, split: str, seq: int, qdir: Path) -> dict[str, torch.Tensor]:
    qdir.mkdir(parents=True, exist_ok=True)
    f = p.produce_file(split, seq, qdir)
    return load_batch_file(qdir / str(f.name)).tensors


def stream_ids(tensors_list: list[dict[str, torch.Tensor]]) -> np.ndarray:
    """The token stream of sequentially packed files, in order (no padding to drop)."""
    return np.concatenate([t["input_ids"].numpy().ravel() for t in tensors_list])


def doc_ids_in_stream(ids: np.ndarray) -> list[int]:
    """Ids of the documents in a byte-tokenized stream, split at EOS (256)."""
    cuts = np.flatnonzero(ids == 256)
    out, start = [], 0
    for c in cuts:
        m = DOC_ID.match(bytes(ids[start:c].astype(np.uint8)).decode())
        if m:
            out.append(int(m.group(1)))
        start = c + 1
    return out


def test_meta_and_batch_shapes(tmp_path: Path) -> None:
    src, _ = write_corpus(tmp_path, 60)
    p = make(tmp_path, src, a=3, bpf=2, micro_batch_size=4, seq_len=16)
    meta = ready(p)
    assert (meta["vocab_size"], meta["block_size"], meta["eos_id"], meta["batch_size"]) == (
        257,
        16,
        256,
        3,
    )
    assert (meta["grad_accum"], meta["micro_batch_size"], meta["packing"]) == (3, 4, "sequential")
    assert set(meta["split_info"]) == {"train", "val"}
    assert (tmp_path / "ds" / "tokenizer" / "snapshot.json").is_file()
    for split in ("train", "val"):
        t = produce(p, split, 0, tmp_path / "q" / split)
        assert {k: (tuple(v.shape), v.dtype) for k, v in t.items()} == {
            "input_ids": ((2, 3, 4, 16), torch.int32),
            "labels": ((2, 3, 4, 16), torch.int32),
            "attention_mask": ((2, 3, 4, 16), torch.bool),
            "segment_ids": ((2, 3, 4, 16), torch.int32),
        }
        assert bool(t["attention_mask"].all())  # sequential: no padding


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_train_and_val_never_share_a_document(tmp_path: Path, fmt: str) -> None:
    src, _ = write_corpus(tmp_path, 120, fmt=fmt)
    seen: dict[str, set[int]] = {"train": set(), "val": set()}
    for w in range(2):
        p = make(tmp_path, src, worker=w, workers=2, eval_take=30)
        ready(p)
        for split in seen:
            files = [produce(p, split, w + 2 * i, tmp_path / f"q{w}" / split) for i in range(12)]
            seen[split].update(doc_ids_in_stream(stream_ids(files)))
    assert seen["val"] == set(range(30))  # val is exactly the first eval_take documents
    assert seen["train"] == set(range(30, 120))
    assert not seen["train"] & seen["val"]


def test_workers_read_disjoint_shards_and_reshuffle_each_epoch(tmp_path: Path) -> None:
    src, _ = write_corpus(tmp_path, 150)
    shards = []
    for w in range(3):
        p = make(tmp_path, src, worker=w, workers=3, eval_take=0, bpf=4)
        ready(p)
        files = [produce(p, "train", w + 3 * i, tmp_path / f"q{w}") for i in range(30)]
        ids = doc_ids_in_stream(stream_ids(files))
        shard = set(ids)  # 30 files run past two epochs, so they hold the whole shard
        n = len(shard)
        assert len(ids) >= 2 * n, "the test must run past two epochs"
        e0, e1 = ids[:n], ids[n : 2 * n]
        assert set(e0) == shard and set(e1) == shard  # each epoch: every document once
        assert e0 != e1  # and in a new order
        shards.append(shard)
    assert not (shards[0] & shards[1] or shards[0] & shards[2] or shards[1] & shards[2])
    assert set().union(*shards) == set(range(150))


@pytest.mark.parametrize("packing", ["sequential", "bin"])
def test_replay_from_every_journaled_state_is_byte_identical(tmp_path: Path, packing: str) -> None:
    src, _ = write_corpus(tmp_path, 80)
    p = make(tmp_path, src, worker=1, workers=2, packing=packing, shuffle_buffer=5)
    meta = ready(p)
    states, files = [], []
    for i in range(14):  # several blocks and more than one epoch
        states.append(json.loads(json.dumps(p.state_dict("train"))))  # as the journal stores it
        files.append(produce(p, "train", 1 + 2 * i, tmp_path / "fwd"))
    assert p.state_dict("train")["epoch"] >= 1
    forward = p.state_dict("train")

    # The server's replay: load the old state, produce, restore the forward state.
    for i in reversed(range(len(files))):
        p.load_state_dict("train", states[i])
        again = produce(p, "train", 1 + 2 * i, tmp_path / "replay")
        assert all(torch.equal(again[k], files[i][k]) for k in files[i])
    p.load_state_dict("train", forward)
    p.load_state_dict("train", states[-1])
    again = produce(p, "train", 99, tmp_path / "r2")
    assert all(torch.equal(again[k], files[-1][k]) for k in files[-1])

    # A restarted worker (new process: new instance, same meta and snapshot) from any state.
    for i in (0, 4, 9, 13):
        q = make(tmp_path, src, worker=1, workers=2, packing=packing, shuffle_buffer=5)
        ready(q, meta)
        q.load_state_dict("train", states[i])
        again = produce(q, "train", 1 + 2 * i, tmp_path / "restart")
        assert all(torch.equal(again[k], files[i][k]) for k in files[i])


def test_a_state_from_another_layout_is_refused(tmp_path: Path) -> None:
    src, _ = write_corpus(tmp_path, 40)
    p = make(tmp_path, src, worker=0, workers=2)
    ready(p)
    q = make(tmp_path, src, worker=1, workers=2)
    ready(q)
    with pytest.raises(ValueError, match="layout"):
        q.load_state_dict("train", p.state_dict("train"))


def test_bin_packing_keeps_short_documents_whole(tmp_path: Path) -> None:
    src, docs = write_corpus(tmp_path, 60)
    p = make(tmp_path, src, packing="bin", seq_len=256, eval_take=0)
    ready(p)
    t = produce(p, "train", 0, tmp_path / "q")
    ids, seg = t["input_ids"].numpy().reshape(-1, 256), t["segment_ids"].numpy().reshape(-1, 256)
    whole = set(docs)
    for row in range(ids.shape[0]):
        for s in set(seg[row].tolist()) - {0}:
            piece = ids[row][seg[row] == s]
            assert piece[-1] == 256  # every segment is a whole document ending in EOS
            assert bytes(piece[:-1].astype(np.uint8)).decode() in whole
    pad = 1 - t["attention_mask"].float().mean().item()
    assert pad < 0.25


def test_char_tokenizer_snapshot_pins_tokenization_across_restarts(tmp_path: Path) -> None:
    src, docs = write_corpus(tmp_path, 50)
    p = make(tmp_path, src, tokenizer="char")
    meta = ready(p)
    chars = sorted(set("".join(docs)))
    assert meta["vocab_size"] == len(chars) + 2 and meta["eos_id"] == len(chars)
    assert meta["stoi"] == {c: i for i, c in enumerate(chars)}
    first = produce(p, "train", 0, tmp_path / "a")
    # The corpus gains a character the vocabulary lacks: the restart keeps the snapshot's
    # vocabulary (meta is rebuilt, the corpus fingerprint changes, the tokenizer does not).
    Path(src).write_text(Path(src).read_text() + "\nZ€Z\n")
    q = make(tmp_path, src, tokenizer="char")
    meta2 = ready(q)
    assert meta2["tokenizer"]["sha256"] == meta["tokenizer"]["sha256"]
    assert meta2["vocab_size"] == meta["vocab_size"]
    assert torch.equal(produce(q, "train", 0, tmp_path / "b")["input_ids"], first["input_ids"])
    # A worker holding the old meta notices the corpus changed instead of reading new data.
    r = make(tmp_path, src, tokenizer="char")
    with pytest.raises(CorpusError, match=r"changed since meta\.pkl was built"):
        r.set_meta(meta)


def test_hf_tokenizer_from_a_trained_bpe(tmp_path: Path) -> None:
    src, docs = write_corpus(tmp_path, 80)
    tok_path = train_bpe([src], tmp_path / "tok" / "tokenizer.json", vocab_size=300, separator="")
    p = make(tmp_path, src, tokenizer="hf", tokenizer_path=str(tok_path), packing="bin", seq_len=64)
    meta = ready(p)
    assert meta["tokenizer"]["kind"] == "hf" and meta["tokenizer"]["eos_token"] == "<|endoftext|>"
    assert meta["eos_id"] == 0 and meta["vocab_size"] == 300
    t = produce(p, "train", 0, tmp_path / "q")
    ids, seg = t["input_ids"].numpy().reshape(-1, 64), t["segment_ids"].numpy().reshape(-1, 64)
    piece = ids[0][seg[0] == 1]
    if piece[-1] == 0 and len(piece) < 64:  # a whole document: decodes to one of the corpus's
        assert p.tokenizer.decode(piece[:-1]) in set(docs)
    # The snapshot, not the configured file, is what the dataset uses from now on; a changed
    # file is refused rather than silently mixing two tokenizations in one queue.
    train_bpe([src], tok_path, vocab_size=280, separator="")
    q = make(tmp_path, src, tokenizer="hf", tokenizer_path=str(tok_path), packing="bin", seq_len=64)
    with pytest.raises(ConfigError, match="differs from the snapshot"):
        q.complete_meta()


def test_a_tokenizer_file_that_does_not_load_is_named(tmp_path: Path) -> None:
    src, _ = write_corpus(tmp_path, 20)
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    p = make(tmp_path, src, tokenizer="hf", tokenizer_path=str(bad))
    with pytest.raises(ConfigError, match=r"broken\.json.* does not load"):
        p.complete_meta()
    with pytest.raises(ConfigError, match="tokenizer_path"):
        make(tmp_path, src, tokenizer="hf")


def test_a_bad_line_fails_the_file_and_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": f"D{i:04d}# " + "word " * 12}) for i in range(60)]
    lines[45] = '{"text": broken'
    path.write_text("\n".join(lines) + "\n")
    p = make(tmp_path, str(path), eval_take=0, shuffle=False, shuffle_buffer=4)
    ready(p)
    qdir = tmp_path / "q"
    published = []
    with pytest.raises(CorpusError, match=r"c\.jsonl:46: not valid JSON"):
        for seq in range(100):
            before = p.state_dict("train")
            published.append(produce(p, "train", seq, qdir))
    assert published, "some files were produced before the bad line"
    assert p.state_dict("train") == before  # the failed file consumed nothing
    for f in sorted(qdir.iterdir()):  # and every published file is intact
        load_batch_file(f)
    with pytest.raises(CorpusError, match=r"c\.jsonl:46"):  # a retry fails the same way
        produce(p, "train", seq, qdir)


def test_empty_corpus_and_bad_args_fail_at_meta(tmp_path: Path) -> None:
    (tmp_path / "e.txt").write_text("\n\n  \n")
    p = make(tmp_path, str(tmp_path / "e.txt"))
    with pytest.raises(CorpusError, match=r"e\.txt.*holds no documents"):
        p.complete_meta()
    src, _ = write_corpus(tmp_path, 5)
    with pytest.raises(CorpusError, match="only 5 document"):
        make(tmp_path, src, eval_take=5).complete_meta()
    with pytest.raises(ConfigError, match="packing"):
        make(tmp_path, src, packing="zigzag")
    with pytest.raises(ConfigError, match="matches no files"):
        make(tmp_path, str(tmp_path / "missing*.txt"))
    p = make(tmp_path, src, eval_take=0)
    with pytest.raises(MetaError):
        p.produce_file("train", 0, tmp_path)


def test_a_shard_without_documents_says_so(tmp_path: Path) -> None:
    src, _ = write_corpus(tmp_path, 12)
    p = make(tmp_path, src, worker=1, workers=2, eval_take=1)
    ready(p)
    with pytest.raises(CorpusError, match="val shard 1 of 2 holds no documents"):
        produce(p, "val", 1, tmp_path / "q")


def test_document_ids_are_seen_once_per_epoch_in_bin_mode(tmp_path: Path) -> None:
    """Bin mode across two workers: over whole epochs, each train document appears as often
    as every other (once per epoch) and in one worker only."""
    src, _ = write_corpus(tmp_path, 90)
    owners: dict[int, set[int]] = {}
    for w in range(2):
        p = make(
            tmp_path,
            src,
            worker=w,
            workers=2,
            packing="bin",
            seq_len=256,
            eval_take=10,
            bpf=1,
            a=1,
            micro_batch_size=1,
        )
        ready(p)
        counts: Counter[int] = Counter()
        seq = w
        while p.state_dict("train")["epoch"] < 3:
            t = produce(p, "train", seq, tmp_path / f"q{w}")
            seq += 2
            ids, seg = t["input_ids"].numpy().ravel(), t["segment_ids"].numpy().ravel()
            for s in set(seg.tolist()) - {0}:
                m = DOC_ID.match(bytes(ids[seg == s][:-1].astype(np.uint8)).decode())
                counts[int(m.group(1))] += 1
        # Three epochs began; the first two are complete: every document at least twice, and
        # no document ahead of another by more than the epoch in progress.
        assert min(counts.values()) >= 2 and max(counts.values()) - min(counts.values()) <= 1
        for d in counts:
            owners.setdefault(d, set()).add(w)
    assert set(owners) == set(range(10, 90))
    assert all(len(o) == 1 for o in owners.values())


def test_the_example_config_loads_and_serves(tmp_path: Path, monkeypatch) -> None:
    from queue_server.config.server import load_config

    example = Path(__file__).resolve().parent.parent / "examples" / "configs" / "text_lm.toml"
    (ds,) = load_config(example).datasets
    assert ds.provider == "text_lm"
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus", 1200)
    monkeypatch.chdir(tmp_path)  # the server resolves relative args against the config's dir
    ctx = ProviderContext(
        ds.name, tmp_path / "root" / ds.name, batch_size=ds.batch_size, batches_per_file=1
    )
    p = create("text_lm", ctx, dict(ds.args))
    meta = ready(p)
    assert meta["split_info"]["val"]["documents"] == 1000
    t = produce(p, "train", 0, tmp_path / "q")
    assert tuple(t["input_ids"].shape) == (1, 4, 8, 1024)


def test_corpus_sample_is_spread_over_every_file_not_a_prefix(tmp_path: Path) -> None:
    """Eight files, each written in letters of its own: a small sample for a curriculum's
    corpus distribution still sees every file's letters, in about equal measure."""
    src = tmp_path / "src"
    src.mkdir()
    groups = ["abc", "def", "ghi", "jkl", "mno", "pqr", "stu", "vwx"]
    rnd = random.Random(3)
    for i, letters in enumerate(groups):
        docs = ["".join(rnd.choices(letters, k=200)) for _ in range(30)]
        (src / f"part{i}.txt").write_text("\n\n".join(docs) + "\n")
    p = make(tmp_path, str(src / "*.txt"), separator="", eval_take=2)
    meta = ready(p)
    seen: list[int] = []
    counts = p.corpus_token_counts("train", 4000, "input_ids", meta["vocab_size"], seen.append)
    assert sum(seen) == int(counts.sum()) and 4000 <= sum(seen) < 4000 + 300
    per_group = [sum(int(counts[ord(ch)]) for ch in letters) for letters in groups]
    assert min(per_group) > 0.5 * max(per_group), per_group


def test_data_identity_moves_when_a_file_changes(tmp_path: Path) -> None:
    source, _ = write_corpus(tmp_path, 40)
    before = make(tmp_path, source).data_identity()
    assert make(tmp_path, source).data_identity() == before
    Path(source).write_text(Path(source).read_text() + "\n\nD9999# more words\n")
    assert make(tmp_path, source).data_identity() != before
