"""Compact batch files (format 2): narrow token ids, x and y as one window, derived masks.

Every built-in provider stores its ids in uint16 for a small vocabulary and uint32 past 65,536
ids, and serves exactly the values the format 1 encoding of the same seq holds, in the served
dtypes. A dataset dir built before format 2 keeps writing and serving format 1 files. The
client widens in one copy per field into `out=` buffers, and into fresh memory with
copy=True; verify_diversity reads both formats alike.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import char_config
from queue_client import QueueClient
from queue_client.errors import CorruptBatchFile, MetaError, SchemaMismatch
from queue_client.format.batchfile import (
    FORMAT_VERSION,
    encode_batch_file,
    load_batch_bytes,
    load_batch_file,
    queue_dir,
    scan_queue,
    write_batch_file,
)
from queue_client.format.layout import DatasetLayout
from queue_client.format.meta import dump_meta, load_meta
from queue_client.format.schema import FieldSpec, parse_schema
from queue_client.format.storage import BatchCodec, stack_stored
from queue_client.format.storage_encode import encode_stored
from queue_client.streaming.transfer import StoredBatch, Transfer
from queue_client.wire import batchqueue_pb2 as pb
from queue_providers import ProviderContext, create
from queue_providers.compact import lm_window_schema, packed_lm_schema
from queue_providers.tokenizer_training.train_bpe import train_bpe
from queue_providers.verify.verify_diversity import main as verify_main

BIG = 66_000  # distinct characters / ids: past what uint16 holds
WORDS = "amber birch cedar delta ember fjord grove heron inlet juniper kestrel lumen".split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


# ---- inputs, small and large vocabularies ---------------------------------------------------


def _chars(big: bool) -> list[str]:
    """Characters of the text: a few dozen, or BIG distinct ones (from U+10000, no surrogates)."""
    if not big:
        return list("abcdefghijklmnopqrstuvwxyz .,")
    return [chr(0x10000 + i) for i in range(BIG)]


def _char_text(tmp: Path, big: bool) -> Path:
    rnd = random.Random(0)
    chars = _chars(big)
    body = chars * 2 if big else [rnd.choice(chars) for _ in range(20_000)]
    rnd.shuffle(body)
    path = tmp / "text.txt"
    path.write_text("".join(body), encoding="utf-8")
    return path


def _vocab(tmp: Path, big: bool) -> Path:
    """BERT's specials, the words, and filler tokens up to 70,000 for the large vocabulary."""
    filler = [f"x{k}" for k in range(70_000 - len(SPECIALS) - len(WORDS))] if big else []
    path = tmp / "vocab.txt"
    path.write_text("".join(f"{t}\n" for t in [*SPECIALS, *WORDS, *filler]))
    return path


def _lines(tmp: Path) -> Path:
    rnd = random.Random(1)
    lines = [" ".join(rnd.choices(WORDS, k=rnd.randint(3, 20))) for _ in range(300)]
    path = tmp / "lines.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _ctx(tmp: Path, batch_size: int = 4) -> ProviderContext:
    return ProviderContext("ds", tmp / "ds", batch_size=batch_size, batches_per_file=3, seed=5)


def _char_lm(tmp: Path, big: bool) -> tuple[str, dict[str, Any], ProviderContext]:
    return "char_lm", {"input": str(_char_text(tmp, big)), "block_size": 16}, _ctx(tmp)


def _char_diffusion(tmp: Path, big: bool) -> tuple[str, dict[str, Any], ProviderContext]:
    return "char_diffusion", {"input": str(_char_text(tmp, big)), "block_size": 16}, _ctx(tmp)


def _nanogpt_bin(tmp: Path, big: bool) -> tuple[str, dict[str, Any], ProviderContext]:
    vocab = 70_000 if big else 300
    gen = np.random.default_rng(2)
    for split in ("train", "val"):
        ids = gen.integers(0, vocab, 5_000)
        ids[:2] = vocab - 1  # the top id is there
        ids.astype(np.uint32 if big else np.uint16).tofile(tmp / f"{split}.bin")
    return "nanogpt_bin", {"data_dir": str(tmp), "block_size": 16, "vocab_size": vocab}, _ctx(tmp)


def _text_lm(tmp: Path, big: bool) -> tuple[str, dict[str, Any], ProviderContext]:
    docs = tmp / "docs"
    docs.mkdir()
    chars = _chars(big)
    rnd = random.Random(3)
    for i in range(40):
        (docs / f"{i:03d}.txt").write_text(
            "".join(rnd.choice(chars) for _ in range(rnd.randint(1, 60))), encoding="utf-8"
        )
    if big:  # every character somewhere, so the char tokenizer's vocabulary is BIG + 2
        (docs / "all.txt").write_text("".join(chars), encoding="utf-8")
    args = {
        "source": str(docs),
        "tokenizer": "char" if big else "byte",
        "seq_len": 24,
        "micro_batch_size": 2,
        "eval_take": 3,
        "packing": "bin",
    }
    return "text_lm", args, _ctx(tmp, batch_size=2)


def _bert_mlm(tmp: Path, big: bool) -> tuple[str, dict[str, Any], ProviderContext]:
    args = {
        "input": str(_lines(tmp)),
        "tokenizer": str(_vocab(tmp, big)),
        "block_size": 16,
        "pairs": True,
    }
    return "bert_mlm", args, _ctx(tmp)


def _classification(tmp: Path, big: bool) -> tuple[str, dict[str, Any], ProviderContext]:
    rnd = random.Random(4)
    path = tmp / "examples.jsonl"
    with open(path, "w") as f:
        for _ in range(100):
            text = " ".join(rnd.choices(WORDS, k=rnd.randint(1, 20)))
            f.write(json.dumps({"text": text, "label": rnd.choice("abc")}) + "\n")
    args = {"input": str(path), "tokenizer": str(_vocab(tmp, big)), "block_size": 16}
    return "classification", args, _ctx(tmp)


def _token_classification(tmp: Path, big: bool) -> tuple[str, dict[str, Any], ProviderContext]:
    rnd = random.Random(5)
    sentences = []
    for _ in range(80):
        words = rnd.choices(WORDS, k=rnd.randint(1, 20))
        sentences.append("\n".join(f"{w} {rnd.choice(['O', 'B-X', 'I-X'])}" for w in words))
    path = tmp / "tags.conll"
    path.write_text("\n\n".join(sentences) + "\n")
    args = {"input": str(path), "tokenizer": str(_vocab(tmp, big)), "block_size": 16}
    return "token_classification", args, _ctx(tmp)


Builder = Callable[[Path, bool], tuple[str, dict[str, Any], ProviderContext]]
# Each provider, and the stored tensor that holds its token ids.
PROVIDERS: list[tuple[Builder, str]] = [
    (_char_lm, "tokens"),
    (_nanogpt_bin, "tokens"),
    (_char_diffusion, "x"),
    (_text_lm, "tokens"),
    (_bert_mlm, "input_ids"),
    (_classification, "input_ids"),
    (_token_classification, "input_ids"),
]


def as_format_1(meta: dict[str, Any]) -> dict[str, Any]:
    """meta as a dataset dir built before format 2 holds it: no batch_format_version and no
    storage keys in the schema."""
    old = {k: v for k, v in meta.items() if k != "batch_format_version"}
    old["batch_schema"] = [
        {k: v for k, v in f.items() if k not in ("stored_dtype", "storage")}
        for f in meta["batch_schema"]
    ]
    return old


def format_1_root(fresh_root: Path, old_root: Path, dataset: str) -> DatasetLayout:
    """`dataset` of `fresh_root` as a batchqueue before format 2 left it, under `old_root`:
    its meta.pkl without the format (so the server writes format 1 files), its inputs."""
    fresh = DatasetLayout(fresh_root, dataset)
    old = DatasetLayout(old_root, dataset)
    old.dir.mkdir(parents=True)
    dump_meta(old.meta_file, as_format_1(load_meta(fresh.meta_file)))
    old.inputs_file.write_bytes(fresh.inputs_file.read_bytes())
    return old


def _made(builder: Builder, tmp: Path, big: bool) -> tuple[Any, Any, dict[str, Any]]:
    """The provider on a new dataset dir (the current format, compact), and one on the same
    data whose meta is from before format 2 (format 1)."""
    name, args, ctx = builder(tmp, big)
    new = create(name, ctx, dict(args))
    meta = new.complete_meta()
    new.set_meta(meta)
    old = create(name, ctx, dict(args))
    old.set_meta(as_format_1(meta))
    return new, old, meta


# ---- every provider ---------------------------------------------------------------------------


@pytest.mark.parametrize("big", [False, True], ids=["small-vocab", "large-vocab"])
@pytest.mark.parametrize("builder,ids_tensor", PROVIDERS, ids=lambda v: getattr(v, "__name__", v))
def test_ids_are_stored_narrow_and_served_as_format_1_serves_them(
    tmp_path: Path, builder: Builder, ids_tensor: str, big: bool
) -> None:
    """uint16 ids up to 65,536, uint32 past it; the served fields (dtype, shape, every value)
    are those of the format 1 file of the same seq, in a file a fraction of its size."""
    new, old, meta = _made(builder, tmp_path, big)
    assert meta["batch_format_version"] == FORMAT_VERSION == 3
    assert (meta["vocab_size"] > 1 << 16) == big
    for split, seq in (("train", 0), ("train", 1), ("val", 0)):
        compact, plain = new.make_file(split, seq), old.make_file(split, seq)
        got, want = load_batch_bytes(compact.data, "new"), load_batch_bytes(plain.data, "old")
        assert (got.version, want.version) == (3, 1)
        assert got.stored[ids_tensor].dtype == (torch.uint32 if big else torch.uint16)
        assert want.stored.keys() == want.tensors.keys()  # format 1 stores the served fields
        assert got.tensors.keys() == want.tensors.keys()
        for name, value in want.tensors.items():
            assert got.tensors[name].dtype == value.dtype, name
            assert torch.equal(got.tensors[name], value), f"{split} {seq} {name}"
        assert len(compact.data) < len(plain.data)


def test_lm_windows_hold_x_and_y_once(tmp_path: Path) -> None:
    """char_lm stores [nb, B, T+1] uint16 and nothing else: x = w[:, :-1], y = w[:, 1:]."""
    new, _, meta = _made(_char_lm, tmp_path, False)
    f = load_batch_bytes(new.make_file("train", 0).data, "f")
    ((name, w),) = f.stored.items()
    assert (name, w.dtype, tuple(w.shape)) == ("tokens", torch.uint16, (3, 4, 17))
    assert torch.equal(f.tensors["x"], w[..., :-1].long())
    assert torch.equal(f.tensors["y"], w[..., 1:].long())
    kinds = {s.name: (s.stored_as, s.storage.kind) for s in parse_schema(meta["batch_schema"])}
    assert kinds == {"x": ("uint16", "window"), "y": ("uint16", "window")}


def test_text_lm_with_the_end_of_text_token_inside_documents(tmp_path: Path) -> None:
    """A Hugging Face tokenizer reads "<|endoftext|>" in the text as its EOS id, inside a
    document: those positions are listed per batch, so labels and segment ids stay exactly
    those of format 1 in both packings."""
    rnd = random.Random(0)
    docs = [
        " ".join(rnd.choices(WORDS, k=rnd.randint(2, 25)))
        + (" <|endoftext|> more" if i % 3 == 0 else "")
        for i in range(80)
    ]
    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(docs) + "\n")
    tok = train_bpe([str(src)], tmp_path / "tok" / "tokenizer.json", vocab_size=300, separator="")
    for packing in ("sequential", "bin"):
        ctx = ProviderContext("hf", tmp_path / packing, batch_size=2, batches_per_file=3, seed=1)
        args = {
            "source": str(src),
            "separator": "",
            "seq_len": 32,
            "micro_batch_size": 2,
            "eval_take": 2,
            "tokenizer": "hf",
            "tokenizer_path": str(tok),
            "packing": packing,
        }
        new, old = create("text_lm", ctx, dict(args)), create("text_lm", ctx, dict(args))
        meta = new.complete_meta()
        new.set_meta(meta)
        old.set_meta(as_format_1(meta))
        listed = 0
        for seq in range(3):
            got = load_batch_bytes(new.make_file("train", seq).data, "new")
            want = load_batch_bytes(old.make_file("train", seq).data, "old")
            listed += int((got.stored["eos_exceptions"] >= 0).sum())
            for name, value in want.tensors.items():
                assert torch.equal(got.tensors[name], value), f"{packing} {seq} {name}"
        assert listed > 0  # the case was there


def test_values_that_do_not_fit_their_storage_are_refused_naming_the_field(
    tmp_path: Path,
) -> None:
    """A meta whose storage cannot hold the values (labels with -100 stored as uint8; a mask
    said to follow from the pad id when it does not) fails make_file with SchemaMismatch naming
    the field, and produce_file publishes nothing."""
    new, _, meta = _made(_char_diffusion, tmp_path, False)
    unsigned = {**meta, "batch_schema": [dict(f) for f in meta["batch_schema"]]}
    unsigned["batch_schema"][1]["stored_dtype"] = "uint8"
    derived = {**meta, "batch_schema": [dict(f) for f in meta["batch_schema"]]}
    derived["batch_schema"][1] = {
        **{k: v for k, v in derived["batch_schema"][1].items() if k != "stored_dtype"},
        "storage": {"kind": "not_equal", "source": "x", "value": 0},
    }
    out = tmp_path / "q"
    out.mkdir()
    for bad in (unsigned, derived):
        new.set_meta(bad)
        with pytest.raises(SchemaMismatch, match="field 'y' does not read back"):
            new.produce_file("train", 0, out)
    assert scan_queue(out) == []


def test_a_meta_from_a_newer_format_is_refused(tmp_path: Path) -> None:
    new, _, meta = _made(_char_lm, tmp_path, False)
    with pytest.raises(MetaError, match="batch_format_version 4"):
        new.set_meta({**meta, "batch_format_version": 4})


# ---- the codec --------------------------------------------------------------------------------


def _packed_codec(padded: bool) -> BatchCodec:
    return BatchCodec(
        parse_schema(packed_lm_schema([2, 8], 300, eos_id=7, ignore=-100, padded=padded))
    )


def _packed_file(padded: bool, nb: int = 5) -> tuple[BatchCodec, dict[str, torch.Tensor]]:
    """Served text_lm-like fields of a file, with EOS (7) inside some documents, made the way
    packing makes them: documents end at EOS, labels are the next token or -100."""
    codec = _packed_codec(padded)
    gen = torch.Generator().manual_seed(0)
    shape = (nb, 3, 2, 8)
    window = torch.randint(0, 300, (*shape[:-1], 9), generator=gen)
    ends = torch.rand(shape, generator=gen) < 0.2
    window[..., :-1][ends] = 7
    inside = (torch.rand(shape, generator=gen) < 0.05) & ~ends  # EOS that ends nothing
    window[..., :-1][inside] = 7
    lengths = (
        torch.randint(1, 9, shape[:-1], generator=gen) if padded else torch.full(shape[:-1], 8)
    )
    pad = torch.arange(8) >= lengths.unsqueeze(-1)
    if padded:  # a padded row's content ends with a document's end, as bin packing makes it
        last = torch.arange(8) == (lengths - 1).unsqueeze(-1)
        ends |= last
        inside &= ~last
        window[..., :-1][last] = 7
    ids = window[..., :-1].masked_fill(pad, 7)
    labels = window[..., 1:].masked_fill(ends | pad, -100)
    seg = (ends.int().cumsum(-1) - ends.int() + 1).masked_fill(pad, 0)
    served = {
        "input_ids": ids.int(),
        "labels": labels.int(),
        "attention_mask": ~pad,
        "segment_ids": seg.int(),
    }
    return codec, served


@pytest.mark.parametrize("padded", [False, True])
def test_codec_round_trip_whole_file_and_batch_by_batch(padded: bool) -> None:
    """The stored tensors read back to the served fields for the whole file at once, for each
    batch on its own, into out= buffers and into fresh memory alike."""
    codec, served = _packed_file(padded)
    stored = encode_stored(codec, served)
    assert stored["tokens"].dtype == torch.uint16 and stored["eos_exceptions"].shape[1] > 0
    assert ("lengths" in stored) == padded and "attention_mask" not in stored
    whole = codec.decode(stored)
    for name in served:
        assert torch.equal(whole[name], served[name]), name
    tensors = [stored[n] for n in codec.stored_names]
    for i in range(stored["tokens"].shape[0]):
        views = [t[i] for t in tensors]
        fields = codec.field_views(views)
        fresh = codec.serve(fields, views, copy=True)
        outs = [torch.full_like(served[n][i], 99) for n in codec.names]
        codec.serve_into(fields, views, outs)
        for name, a, b in zip(codec.names, fresh, outs, strict=True):
            assert torch.equal(a, served[name][i]) and torch.equal(b, served[name][i]), name


@pytest.mark.parametrize("padded", [False, True])
def test_the_codec_needs_no_uint16_kernel_that_older_torch_lacks(
    padded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11 (as on CUDA images) has no where() for uint16 ("where_cpu" not implemented
    for 'UInt16'), and text_lm's provider failed its first file there. Encoding and serving
    use where() only on types every torch since 2.4 has."""
    real_where = torch.where

    def where(*args: object, **kwargs: object) -> torch.Tensor:
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.uint16 for a in args):
            raise NotImplementedError("\"where_cpu\" not implemented for 'UInt16'")
        return real_where(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "where", where)
    codec, served = _packed_file(padded)
    stored = encode_stored(codec, served)
    whole = codec.decode(stored)
    for name in served:
        assert torch.equal(whole[name], served[name]), name


def test_picked_batches_keep_their_exception_lists() -> None:
    """Batches copied out of files with exception lists of different lengths (a curriculum's
    served file) are padded to the longest and read back the same."""
    codec, served = _packed_file(True)
    stored = encode_stored(codec, served)
    counts = (stored["eos_exceptions"] >= 0).sum(-1)
    assert len(set(counts.tolist())) > 1
    picks = [4, 0, 2]
    narrow = [
        {
            n: t[i][..., : int(counts[i])] if n == "eos_exceptions" else t[i]
            for n, t in stored.items()
        }
        for i in picks
    ]
    stacked = stack_stored(codec.schema, narrow)
    back = codec.decode(stacked)
    for name in served:
        assert torch.equal(back[name], served[name][picks]), name


def test_derived_masks_and_segments_of_the_wordpiece_rows(tmp_path: Path) -> None:
    """bert_mlm with pairs stores input_ids and labels only: attention_mask (from [PAD]) and
    token_type_ids (after the first [SEP]) are derived, and equal format 1's."""
    new, _, meta = _made(_bert_mlm, tmp_path, False)
    f = load_batch_bytes(new.make_file("train", 0).data, "f")
    assert set(f.stored) == {"input_ids", "labels"}
    assert (f.stored["input_ids"].dtype, f.stored["labels"].dtype) == (torch.uint16, torch.int8)
    kinds = {s.name: s.storage.kind for s in parse_schema(meta["batch_schema"])}
    assert kinds["attention_mask"] == "not_equal" and kinds["token_type_ids"] == "after_first"


def test_unknown_storage_and_mismatched_files_are_named() -> None:
    with pytest.raises(MetaError, match=r"'x'.*storage kind 'zip' is unknown"):
        parse_schema([{"name": "x", "dtype": "int64", "shape": [4], "storage": {"kind": "zip"}}])
    with pytest.raises(MetaError, match=r"'mask'.*derived.*no stored_dtype"):
        FieldSpec.from_dict(
            {
                "name": "mask",
                "dtype": "bool",
                "shape": [4],
                "stored_dtype": "uint8",
                "storage": {"kind": "not_equal", "source": "x"},
            }
        )
    # A file whose stored window is int64 while its schema says uint16: refused by name.
    schema = parse_schema(lm_window_schema(4, 50))
    metadata = {"batch_size": 2, "schema": [s.to_dict() for s in schema]}
    bad = encode_batch_file(
        seq=0, tensors={"tokens": torch.zeros(3, 2, 5, dtype=torch.int64)}, metadata=metadata
    )
    with pytest.raises(CorruptBatchFile, match=r"stored tensor 'tokens'.*int64.*uint16"):
        load_batch_bytes(bad.data, "bad.pt")


def test_a_format_1_file_written_by_the_old_encoding_still_loads(tmp_path: Path) -> None:
    """The old encoding: served fields under their names, version 1, a schema without storage.
    It loads as it did, and its fields are what it holds."""
    x = torch.arange(2 * 3 * 4, dtype=torch.int64).view(2, 3, 4)
    schema = [FieldSpec("x", "int64", (4,), "input"), FieldSpec("y", "int64", (4,), "target")]
    published = write_batch_file(
        tmp_path,
        seq=0,
        tensors={"x": x, "y": x + 1},
        metadata={"batch_size": 3, "schema": [s.to_dict() for s in schema]},
        version=1,
    )
    f = load_batch_file(tmp_path / str(published.name))
    assert f.version == 1 and "storage" not in f.metadata["schema"][0]
    assert torch.equal(f.tensors["x"], x) and torch.equal(f.tensors["y"], x + 1)
    assert f.tensors is f.stored


# ---- served through a real server -------------------------------------------------------------


def _text_lm_table(corpus: Path, name: str = "web") -> str:
    return f"""
[datasets.{name}]
provider = "text_lm"
batch_size = 2
batches_per_file = 4
[datasets.{name}.args]
source = "{corpus.as_posix()}"
separator = ""
seq_len = 32
micro_batch_size = 2
eval_take = 4
packing = "bin"
"""


def _docs(path: Path) -> Path:
    rnd = random.Random(7)
    docs = [" ".join(rnd.choices(WORDS, k=rnd.randint(2, 30))) for _ in range(200)]
    path.write_text("\n\n".join(docs) + "\n")
    return path


def _read(client: QueueClient, split: str, n: int, **kw: Any) -> list[Any]:
    def clone(b: Any) -> Any:
        if isinstance(b, tuple):
            return tuple(t.clone() for t in b)
        return {k: v.clone() for k, v in b.items()}

    return [clone(client.get_batch(split, **kw)) for _ in range(n)]


def _same(a: list[Any], b: list[Any]) -> bool:
    def flat(batch: Any) -> list[torch.Tensor]:
        return list(batch) if isinstance(batch, tuple) else [batch[k] for k in sorted(batch)]

    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y)
        for p, q in zip(a, b, strict=True)
        for x, y in zip(flat(p), flat(q), strict=True)
    )


def test_views_out_buffers_and_copies_serve_the_same_batches(
    start_server, corpus: Path, tmp_path: Path
) -> None:
    """Zero-copy calls (each widening its own rows), get_batch(out=...) (one widening copy
    per field, from the narrow views) and copy=True give the same batches in the served
    dtypes, across file boundaries, for x/y windows and for text_lm's derived fields; out= on
    a client that took views gives the same batches again. A wrong
    out= is refused naming the field, and costs no batch."""
    config = char_config(corpus, batches_per_file=4) + _text_lm_table(_docs(tmp_path / "d.txt"))
    server = start_server(config)
    for dataset, n in (("chars", 10), ("web", 9)):
        with QueueClient(server.address, dataset) as c:
            views = _read(c, "train", n)
            stream = c._streams["train"]
            # No file is decoded whole, ahead or at all: the prefetched one holds its stored
            # (narrow) tensors only, and each call widens its own rows.
            job, _ = stream._pending[0]
            prefetched = job.result(timeout=30)
            assert prefetched.served is None
            assert all(
                t.dtype in (torch.uint8, torch.uint16, torch.int32) for t in prefetched.stored
            )
            first = views[0]
            buffers: Any = (
                tuple(torch.empty_like(t) for t in first)
                if isinstance(first, tuple)
                else {k: torch.empty_like(v) for k, v in first.items()}
            )
            views += _read(c, "train", 3, out=buffers)
            n += 3
        with QueueClient(server.address, dataset) as c:
            x = c.get_batch("train")
            if isinstance(x, tuple):
                out: Any = tuple(torch.full_like(t, -7) for t in x)
                wrong: Any = (out[0].int(), out[1])
                name = "x"
            else:
                out = {k: torch.zeros_like(v) for k, v in x.items()}
                wrong = {**out, "labels": out["labels"].long()}
                name = "labels"
            with pytest.raises(SchemaMismatch, match=f"out= field '{name}' must be a"):
                c.get_batch("train", out=wrong)
            into = [x, *(_read(c, "train", n - 1, out=out))]
        with QueueClient(server.address, dataset, copy=True) as c:
            copies = _read(c, "train", n)
        assert _same(views, into) and _same(views, copies), dataset
        first = views[0]
        dtypes = {str(t.dtype) for t in (first if isinstance(first, tuple) else first.values())}
        assert dtypes == ({"torch.int64"} if dataset == "chars" else {"torch.int32", "torch.bool"})


def test_an_old_data_dir_keeps_serving_format_1_files(
    start_server, corpus: Path, tmp_path: Path
) -> None:
    """A data dir whose meta.pkl predates format 2 keeps writing format 1 files and serving
    them; a new data dir of the same config writes format 2 files a fraction of their size;
    trainers of both get the same batches. GetSchema says how each stores the fields."""
    config = char_config(corpus, batches_per_file=4)
    fresh = start_server(config, data_root=tmp_path / "fresh")
    new_batches = []
    with QueueClient(fresh.address, "chars") as c:
        new_batches = _read(c, "train", 10)
        schema = fresh.stub.GetSchema(pb.GetSchemaRequest(dataset="chars", split="train"))
    assert [(f.dtype, f.stored_dtype, f.storage) for f in schema.fields] == [
        ("int64", "uint16", "window")
    ] * 2
    fresh.stop()
    old_layout = format_1_root(tmp_path / "fresh", tmp_path / "old", "chars")
    old = start_server(config, data_root=tmp_path / "old")
    with QueueClient(old.address, "chars") as c:
        old_batches = _read(c, "train", 10)
        schema = old.stub.GetSchema(pb.GetSchemaRequest(dataset="chars", split="train"))
        on_disk = []
        for n in scan_queue(old_layout.queue_dir("train")):
            try:  # the client releases a read file in the background: it may go meanwhile
                on_disk.append(load_batch_file(old_layout.queue_dir("train") / str(n)))
            except FileNotFoundError:
                continue
    assert [(f.dtype, f.stored_dtype, f.storage) for f in schema.fields] == [
        ("int64", "int64", "plain")
    ] * 2
    assert on_disk and {f.version for f in on_disk} == {1}
    assert all(set(f.stored) == {"x", "y"} for f in on_disk)
    assert "batch_format_version" not in load_meta(old_layout.meta_file)
    assert _same(new_batches, old_batches)


def test_verify_diversity_reads_both_formats_alike(tmp_path: Path, capsys) -> None:
    """The same text_lm batches in format 1, 2 and 3 files give the same report."""
    src = _docs(tmp_path / "docs.txt")
    reports = []
    for fmt in (1, 2, 3):
        root = tmp_path / f"root{fmt}"
        ctx = ProviderContext("web", root / "web", batch_size=2, batches_per_file=3)
        args = {
            "source": str(src),
            "separator": "",
            "seq_len": 64,
            "micro_batch_size": 2,
            "eval_take": 40,
            "packing": "bin",
        }
        p = create("text_lm", ctx, args)
        meta = p.complete_meta()
        meta = as_format_1(meta) if fmt == 1 else {**meta, "batch_format_version": fmt}
        p.set_meta(meta)
        for split in ("train", "val"):
            qdir = queue_dir(root, "web", split)
            qdir.mkdir(parents=True)
            for seq in range(2):
                p.produce_file(split, seq, qdir)
            assert {load_batch_file(qdir / str(n)).version for n in scan_queue(qdir)} == {fmt}
        dump_meta(root / "web" / "meta.pkl", meta)
        assert verify_main(["--data-dir", str(root), "--dataset", "web", "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0] == reports[1] == reports[2]
    assert reports[0]["splits"]["train"]["documents"] > 0


def test_transfer_copies_widen_into_fresh_memory() -> None:
    """copy=True hands out new int64 tensors (never the file's memory), one per field."""
    codec = BatchCodec(parse_schema(lm_window_schema(4, 50)))
    w = torch.arange(10).view(2, 5).to(torch.uint16)
    batch = StoredBatch(codec, codec.field_views([w]), [w])
    x, y = Transfer("cpu", copy=True).deliver(batch)
    assert x.dtype == y.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x, w[:, :-1].long()) and torch.equal(y, w[:, 1:].long())
    w.copy_(torch.zeros(2, 5, dtype=torch.int64))
    assert int(x.sum()) > 0  # a copy: the stored window changing does not change it
