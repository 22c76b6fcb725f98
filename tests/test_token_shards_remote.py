"""token_shards over s3:// (a real S3-compatible server in its own process): each format
serves the same files as from local disk, token shards are read by range (never copied
whole), and the inputs are recorded by URL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from support.s3_server import CREDENTIALS, NO_AMBIENT_CREDENTIALS, S3Server
from support.token_files import write_llmc, write_megatron, write_prepared

from queue_client.format.batchfile import load_batch_file
from queue_providers import ProviderContext, create
from queue_providers.inputs import describe_inputs
from queue_providers.prepare import main as prepare_main


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server.start(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {**CREDENTIALS, **NO_AMBIENT_CREDENTIALS}.items():
        monkeypatch.setenv(key, value)


def build(tmp_path: Path, tag: str, args: dict) -> object:
    ctx = ProviderContext("ts", tmp_path / tag / "ts", batch_size=4, batches_per_file=3)
    p = create("token_shards", ctx, {"block_size": 8, "vocab_size": 1000, **args})
    p.set_meta(p.complete_meta())
    return p


def files_of(p: object, tmp_path: Path, tag: str) -> list[torch.Tensor]:
    out = tmp_path / f"q-{tag}"
    out.mkdir()
    return [
        load_batch_file(out / str(p.produce_file("train", seq, out).name)).tensors["x"]
        for seq in range(4)
    ]


def test_every_format_at_a_url_serves_what_the_local_files_serve(
    s3: S3Server, aws_env: None, tmp_path: Path
) -> None:
    local = tmp_path / "corpus"
    local.mkdir()
    write_llmc(local / "train_000.bin", np.arange(1, 90) % 1000)
    np.save(local / "arr.npy", np.arange(100, 170, dtype=np.uint16))
    write_megatron(local / "mega", [np.arange(200, 240), np.arange(240, 290)])
    write_prepared(local / "prep", [[np.arange(300, 350)], [np.arange(400, 461)]], vocab_size=1000)
    bucket = f"bq-{uuid.uuid4().hex[:12]}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        client.put_object(Bucket=bucket, Key=str(path.relative_to(local)), Body=path.read_bytes())
    names = ["train_000.bin", "arr.npy", "mega.idx", "prep"]
    remote = {"storage_options": {"endpoint_url": s3.endpoint}, "block_bytes": 64}
    a = build(tmp_path, "local", {"inputs": [str(local / n) for n in names]})
    b = build(
        tmp_path, "remote", {"inputs": [f"s3://{bucket}/{n}" for n in names], "remote": remote}
    )
    assert [s.format for s in b.corpora["train"].shards] == [
        "llmc",
        "npy",
        "megatron",
        "prepared",
        "prepared",
    ]
    for x, y in zip(files_of(a, tmp_path, "a"), files_of(b, tmp_path, "b"), strict=True):
        assert torch.equal(x, y)
    # Shuffled documents are read by range too, a run of consecutive tokens at a time.
    mega = {"order": "documents"}
    c = build(tmp_path, "local-docs", {"inputs": [str(local / "mega.idx")], **mega})
    d = build(
        tmp_path, "remote-docs", {"inputs": [f"s3://{bucket}/mega.idx"], "remote": remote, **mega}
    )
    for x, y in zip(files_of(c, tmp_path, "c"), files_of(d, tmp_path, "d"), strict=True):
        assert torch.equal(x, y)
    # A prepared corpus's documents cut at shard ends are read on from the next shard at a
    # URL as on disk (each continuing shard's first document start, one ranged read).
    text = "\n\n".join(f"doc {i} " + "ab " * (i * 7 % 90) for i in range(40))
    (tmp_path / "cut.txt").write_text(text + "\n", encoding="utf-8")
    out = local / "cut"
    args = ["--input", str(tmp_path / "cut.txt"), "--separator", "", "--out", str(out)]
    assert prepare_main([*args, "--no-progress", "--shard-tokens", "1024"]) == 0
    for path in sorted(out.iterdir()):
        client.put_object(Bucket=bucket, Key=f"cut/{path.name}", Body=path.read_bytes())
    cut = {"order": "documents", "vocab_size": 257}
    e = build(tmp_path, "local-cut", {"inputs": [str(out)], **cut})
    f = build(tmp_path, "remote-cut", {"inputs": [f"s3://{bucket}/cut"], "remote": remote, **cut})
    assert any(s.continuation for s in f.corpora["train"].shards)
    for seq in range(4):
        made = []
        for p, tag in ((e, "e"), (f, "f")):
            folder = tmp_path / f"q-{tag}"
            folder.mkdir(exist_ok=True)
            made.append(load_batch_file(folder / str(p.produce_file("train", seq, folder).name)))
        assert made[0].tensors.keys() == made[1].tensors.keys() >= {"input_ids", "labels"}
        for name, value in made[0].tensors.items():
            assert torch.equal(value, made[1].tensors[name]), name
    records = describe_inputs(b.input_files())
    assert all(key.startswith(f"s3://{bucket}/") for key in records)
    cache = tmp_path / "remote" / "ts" / "input-cache"
    assert not [p.name for p in cache.iterdir() if p.name.startswith("file-")]  # by range
    assert any(p.name.startswith("blk-") for p in cache.iterdir())
