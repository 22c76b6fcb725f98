"""order = "documents": whole documents shuffled each epoch and packed, shard by shard; with an
end-of-document id, batches carry text_lm's fields, stored compactly and read back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.token_files import write_megatron, write_prepared, write_raw

from queue_client.errors import ConfigError
from queue_client.format.batchfile import load_batch_file
from queue_providers import ProviderContext, create

T = 8


def provider(tmp_path: Path, args: dict):
    ctx = ProviderContext("docs", tmp_path / "root" / "docs", batch_size=4, batches_per_file=3)
    p = create("token_shards", ctx, {"block_size": T, "order": "documents", **args})
    meta = p.complete_meta()
    p.set_meta(meta)
    return p, meta


def files(p, tmp_path: Path, n: int) -> list[dict[str, torch.Tensor]]:
    out = tmp_path / "q"
    out.mkdir(exist_ok=True)
    return [
        load_batch_file(out / str(p.produce_file("train", seq, out).name)).tensors
        for seq in range(n)
    ]


def test_an_epoch_packs_shuffled_whole_documents_and_serves_no_token_twice(
    tmp_path: Path,
) -> None:
    # Ids are positions (1...), documents of uneven lengths over two Megatron shards.
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 20, 40)
    ids = np.arange(1, lengths.sum() + 1)
    docs = np.split(ids, np.cumsum(lengths)[:-1])
    write_megatron(tmp_path / "a", docs[:25])
    write_megatron(tmp_path / "b", docs[25:])
    p, meta = provider(
        tmp_path, {"inputs": [str(tmp_path / "a.idx"), str(tmp_path / "b.idx")], "vocab_size": 2000}
    )
    assert [f["name"] for f in meta["batch_schema"]] == ["x", "y"]
    n = meta["split_info"]["train"]["windows"]
    got = files(p, tmp_path, -(-2 * n // 12))
    x = torch.cat([f["x"].reshape(-1, T) for f in got]).numpy()
    y = torch.cat([f["y"].reshape(-1, T) for f in got]).numpy()
    assert np.array_equal(x[:, 1:], y[:, :-1])
    doc_starts = {int(d[0]) for d in docs}
    for epoch in range(2):
        served = x[epoch * n : (epoch + 1) * n]
        assert len(np.unique(served)) == served.size == n * T  # no token twice in an epoch
        jumps = np.nonzero(np.diff(served, axis=1) != 1)
        assert len(jumps[0]) > 0  # documents out of their file order
        assert set(served[jumps[0], jumps[1] + 1].tolist()) <= doc_starts  # whole documents
    assert not np.array_equal(x[:n], x[n : 2 * n])  # another order each epoch


def test_with_an_eos_id_batches_carry_text_lms_fields(tmp_path: Path) -> None:
    # Documents end in eos 0; the other ids are unique and nonzero.
    rng = np.random.default_rng(1)
    counter = iter(range(1, 10_000))
    shards = [
        [np.array([next(counter) for _ in range(k)] + [0]) for k in rng.integers(2, 15, 12)]
        for _ in range(2)
    ]
    d = write_prepared(tmp_path / "prep", shards, vocab_size=10_000, eos_id=0)
    p, meta = provider(tmp_path, {"inputs": [str(d)]})
    assert meta["eos_id"] == 0 and meta["ignore_index"] == -100
    assert [f["name"] for f in meta["batch_schema"]] == [
        "input_ids",
        "labels",
        "attention_mask",
        "segment_ids",
    ]
    for batch in files(p, tmp_path, 3):
        ids, labels = batch["input_ids"].reshape(-1, T), batch["labels"].reshape(-1, T)
        segments = batch["segment_ids"].reshape(-1, T)
        assert torch.equal(labels == -100, ids == 0)  # no target past a document's end
        inside = labels[:, :-1] != -100
        assert torch.equal(labels[:, :-1][inside], ids[:, 1:][inside])
        # Segments count documents from 1 in each window: one more after each eos.
        expected = 1 + torch.cumsum((ids == 0).int(), 1) - (ids == 0).int()
        assert torch.equal(segments, expected.to(segments.dtype))
        assert bool(batch["attention_mask"].all())


def test_documents_need_boundaries_and_fields_need_eos_terminated_documents(
    tmp_path: Path,
) -> None:
    raw = write_raw(tmp_path / "r.bin", np.arange(100, dtype=np.uint16))
    with pytest.raises(ConfigError, match=r"r\.bin \(raw\) records no document boundaries"):
        provider(tmp_path, {"inputs": [str(raw)]})
    with pytest.raises(ConfigError, match=r"order = 'documents' needs sampling = 'epoch'"):
        provider(tmp_path, {"inputs": [str(raw)], "sampling": "random"})
    mega = write_megatron(tmp_path / "m", [np.arange(1, 30), np.arange(30, 60)])
    p, _ = provider(tmp_path, {"inputs": [str(mega)], "eos_id": 0})
    with pytest.raises(ValueError, match=r"m\.bin ends with id \d+, not eos_id 0"):
        files(p, tmp_path, 1)


def test_a_prepared_corpus_without_its_document_starts_is_refused_at_start(
    tmp_path: Path,
) -> None:
    d = write_prepared(tmp_path / "prep", [[np.arange(1, 20), np.arange(1, 30)]], vocab_size=100)
    np.save(d / "shard-000000.docs.npy", np.array([0], dtype=np.int64))
    with pytest.raises(
        ConfigError,
        match=r"shard-000000\.docs\.npy holds 1 document starts but the manifest says 2",
    ):
        provider(tmp_path, {"inputs": [str(d)]})
    (d / "shard-000000.docs.npy").unlink()
    with pytest.raises(ConfigError, match=r"shard-000000\.docs\.npy"):
        provider(tmp_path, {"inputs": [str(d)]})
    provider(tmp_path, {"inputs": [str(d)], "order": "windows"})  # windows need no documents


def test_a_document_cut_by_a_shard_end_is_read_on_and_explained_where_it_lies(
    tmp_path: Path,
) -> None:
    """A prepared corpus cuts documents at shard ends (continues_document): each is packed
    whole with the shard it starts in, read on from the next shards, and a row's provenance
    names the shard and offset that really hold its first token."""
    from queue_providers.prepare import main

    rng = np.random.default_rng(3)
    docs = [f"doc {i:03d} " + "ab " * int(k) for i, k in enumerate(rng.integers(0, 120, 60))]
    docs[40] = "doc 040 " + "xyz " * 600  # past a whole shard of 1024
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    out = tmp_path / "prep"
    args = ["--input", str(corpus), "--separator", "", "--out", str(out), "--no-progress"]
    assert main([*args, "--shard-tokens", "1024"]) == 0
    shards = {str(p): np.load(p) for p in sorted(out.glob("shard-*[0-9].npy"))}
    p, meta = provider(tmp_path, {"inputs": [str(out)]})
    n = meta["split_info"]["train"]["windows"]
    per_file = 12
    continued = 0
    for seq, batch in enumerate(files(p, tmp_path, -(-n // per_file))):
        ids = batch["input_ids"].reshape(-1, T).numpy()
        eos = ids == 256
        # Segments count documents from 1 in each window: a cut piece would end in no EOS.
        expected = 1 + np.cumsum(eos, 1) - eos
        assert np.array_equal(batch["segment_ids"].reshape(-1, T).numpy(), expected)
        for row, where in enumerate(p.provenance("train", seq, range(per_file))):
            assert shards[where["file"]][where["token_offset"]] == ids[row, 0]
            continued += where["document"] == -1  # in the end of a document of the shard before
    assert continued > 0


def test_a_dataset_built_when_cut_documents_came_in_pieces_is_refused_naming_reset(
    tmp_path: Path,
) -> None:
    """Meta built by the order that served a cut document in two pieces (an epoch of the
    files' windows) is refused: the files still to be made would follow another order."""
    from queue_client.errors import MetaError
    from queue_providers.prepare import main

    docs = [f"doc {i:03d} " + "ab " * (i * 13 % 110) for i in range(50)]
    (tmp_path / "c.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    out = tmp_path / "prep"
    args = ["--input", str(tmp_path / "c.txt"), "--separator", "", "--out", str(out)]
    assert main([*args, "--no-progress", "--shard-tokens", "1024"]) == 0
    p, meta = provider(tmp_path, {"inputs": [str(out)]})
    now = meta["split_info"]["train"]["windows"]
    files = p.corpora["train"].n_windows  # what an epoch was before: the files' windows
    assert files != now
    old = {**meta, "split_info": {"train": {**meta["split_info"]["train"], "windows": files}}}
    with pytest.raises(MetaError, match=rf"built with {files} windows .* give {now} .*reset docs"):
        p.set_meta(old)
    p.set_meta(meta)  # what it builds now is accepted
