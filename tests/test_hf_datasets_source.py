"""Hugging Face datasets as text_lm's source: a save_to_disk directory and a folder of Parquet
or JSONL files, each split mapped by hf_splits. Documents go to train and val by the
dataset's own splits (or eval_take), disjoint and in a canonical order, so the same dataset
saved either way gives the same batches; its files are its fingerprint; and a Hub name with
the Hub unreachable fails at once, saying so."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch

from conftest import subprocess_env
from queue_client import QueueClient
from queue_client.errors import ConfigError
from queue_providers import ProviderContext, create
from queue_providers.inputs import check_inputs, describe_inputs, inputs_fingerprint
from queue_providers.text.plan import Boundary, make_chunks, shard, split_ranges
from queue_providers.text.readers import iter_docs

WORDS = "amber birch cedar delta ember fjord grove heron inlet juniper kestrel lumen".split()
DOC = re.compile(r"([TV])(\d{4})#")


def texts(prefix: str, n: int) -> list[str]:
    return [
        f"{prefix}{i:04d}# " + " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(i % 30 + 4))
        for i in range(n)
    ]


def dataset_dict(train: int = 120, val: int = 30) -> datasets.DatasetDict:
    return datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {"text": texts("T", train), "n": list(range(train))}
            ),
            "validation": datasets.Dataset.from_dict({"text": texts("V", val)}),
        }
    )


def save(dd: datasets.DatasetDict, path: Path) -> Path:
    datasets.disable_progress_bars()
    dd.save_to_disk(str(path), max_shard_size="4KB")  # several Arrow files per split
    return path


def make(tmp: Path, worker: int = 0, workers: int = 1, **args: Any):
    ctx = ProviderContext(
        "ds", tmp / "ds", batch_size=2, batches_per_file=2, worker_index=worker,
        num_workers=workers, seed=11,
    )  # fmt: skip
    defaults: dict[str, Any] = {"seq_len": 32, "micro_batch_size": 2, "shuffle_buffer": 8}
    return create("text_lm", ctx, {**defaults, **args})


def split_docs(p: Any, meta: dict[str, Any], split: str, worker: int, workers: int) -> list[str]:
    """The documents worker `worker` of `workers` reads for `split`, in canonical order."""
    raw = meta["text_lm"]["boundary"]
    ranges = split_ranges(p.files, None if raw is None else Boundary(*raw))
    chunks = shard(make_chunks(p.files, ranges[split], workers), worker, workers)
    return [t for c in chunks for _, t in iter_docs(p.files[c.file], c.start, c.end, p.opts)]


def doc_ids(input_ids: torch.Tensor) -> set[str]:
    """The ids ("T0042") of the documents in a byte-tokenized batch, split at EOS (256)."""
    ids = input_ids.numpy().ravel()
    found = set()
    for piece in np.split(ids, np.flatnonzero(ids == 256)):
        text = bytes(piece[piece < 256].astype(np.uint8)).decode(errors="replace")
        found.update(m.group(0)[:-1] for m in DOC.finditer(text))
    return found


def test_save_to_disk_splits_map_to_train_and_val_disjoint_across_workers(tmp_path: Path) -> None:
    """hf_splits {train, val = validation}: val is every validation document in order, train
    is every train document, each read by exactly one of two workers; a batch holds only its
    split's documents; meta says where each split comes from."""
    path = save(dataset_dict(), tmp_path / "saved")
    args = {"hf_dataset": str(path), "hf_splits": {"train": "train", "val": "validation"}}
    p = make(tmp_path, **args)
    meta = p.complete_meta()
    p.set_meta(meta)
    assert meta["split_info"] == {
        "train": {"hf_split": "train"},
        "val": {"hf_split": "validation"},
    }
    hf = meta["text_lm"]["hf"]
    assert hf["kind"] == "save_to_disk" and set(hf["fingerprints"]) == {"train", "val"}
    assert {f.format for f in p.files} == {"arrow"} and len(p.files) > 3
    assert split_docs(p, meta, "val", 0, 1) == texts("V", 30)
    shards = [split_docs(make(tmp_path, w, 2, **args), meta, "train", w, 2) for w in range(2)]
    assert shards[0] and shards[1] and not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(texts("T", 120))
    rng = torch.Generator()
    for split, tag in (("train", "T"), ("val", "V")):
        ids = doc_ids(p.sample_batch(split, rng)["input_ids"])
        assert ids and all(i.startswith(tag) for i in ids), (split, ids)


def test_one_mapped_split_takes_val_from_eval_take(tmp_path: Path) -> None:
    """With only train mapped, val is its first eval_take documents, as for files."""
    path = save(dataset_dict(), tmp_path / "saved")
    p = make(tmp_path, hf_dataset=str(path), eval_take=10)
    meta = p.complete_meta()
    assert split_docs(p, meta, "val", 0, 1) == texts("T", 10)
    assert split_docs(p, meta, "train", 0, 1) == texts("T", 120)[10:]
    assert "hf_split" not in meta["split_info"]["train"]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_folder_of_data_files_reads_as_the_saved_dataset_does(tmp_path: Path, fmt: str) -> None:
    """`datasets` finds each split's files by their names (train-*, validation-*); text_lm
    reads them in the canonical order: the same val batches as the save_to_disk copy, and the
    same train documents (the shuffle follows the files' layout, so not the same order)."""
    dd = dataset_dict()
    folder = tmp_path / "files" / "data"
    folder.mkdir(parents=True)
    for split, ds in dd.items():
        half = len(ds) // 2
        for k, part in enumerate((ds.select(range(half)), ds.select(range(half, len(ds))))):
            target = str(folder / f"{split}-{k:05d}-of-00002.{fmt}")
            part.to_parquet(target) if fmt == "parquet" else part.to_json(target)
    splits = {"train": "train", "val": "validation"}
    a = make(tmp_path / "a", hf_dataset=str(tmp_path / "files"), hf_splits=splits)
    b = make(tmp_path / "b", hf_dataset=str(save(dd, tmp_path / "saved")), hf_splits=splits)
    metas = [p.complete_meta() for p in (a, b)]
    assert metas[0]["text_lm"]["hf"]["kind"] == "data_files"
    assert {f.format for f in a.files} == {"parquet" if fmt == "parquet" else "jsonl"}
    for p, meta in zip((a, b), metas, strict=True):
        p.set_meta(meta)
    for _ in range(3):
        x, y = a.sample_batch("val", torch.Generator()), b.sample_batch("val", torch.Generator())
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert split_docs(a, metas[0], "val", 0, 1) == texts("V", 30)
    assert sorted(split_docs(a, metas[0], "train", 0, 1)) == sorted(texts("T", 120))


def test_the_fingerprint_is_the_datasets_files(tmp_path: Path) -> None:
    """Its Arrow files are the dataset's inputs: saving other rows over it changes the
    fingerprint, and the check names a changed file."""
    path = save(dataset_dict(), tmp_path / "saved")
    p = make(tmp_path, hf_dataset=str(path))
    inputs = p.input_files()
    assert inputs and all(str(f).endswith(".arrow") for f in inputs)
    records = describe_inputs(inputs)
    fingerprint = inputs_fingerprint(records)
    save(dataset_dict(train=121), tmp_path / "saved")
    q = make(tmp_path, hf_dataset=str(path))
    with pytest.raises(ConfigError, match=r"input '.*\.arrow' (changed|is new)"):
        check_inputs(q.input_files(), records, fingerprint, dataset="ds")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"source": "x.txt"}, "`source` or `hf_dataset`, not both"),
        ({"hf_splits": {"train": "train", "val": "train"}}, "the same split 'train'"),
        ({"hf_splits": {"train": "test"}}, "has no split 'test' (hf_splits.train); it has"),
        ({"hf_splits": {"train": "train", "eval": "validation"}}, "may map 'val'"),
        ({"format": "jsonl"}, "hf_dataset knows its format"),
    ],
)
def test_bad_hf_settings_name_the_fault(tmp_path: Path, args: dict[str, Any], message: str) -> None:
    path = save(dataset_dict(), tmp_path / "saved")
    with pytest.raises(ConfigError, match=re.escape(message)):
        make(tmp_path, hf_dataset=str(path), **args)


def test_without_source_or_dataset_the_error_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs `source`.*or `hf_dataset`"):
        make(tmp_path)


def test_a_hub_name_offline_fails_at_once_with_a_clear_message() -> None:
    """No network here: with HF_HUB_OFFLINE set, a Hub name is refused in well under a
    second of work, naming the dataset and the way out (a local copy)."""
    code = textwrap.dedent(
        """
        import time
        from pathlib import Path
        from queue_providers import ProviderContext, create
        began = time.monotonic()
        ctx = ProviderContext("ds", Path("/nonexistent-root/ds"), batch_size=1)
        try:
            create("text_lm", ctx, {"hf_dataset": "someorg/some-corpus"})
        except Exception as exc:
            print(type(exc).__name__, exc)
        print("took", time.monotonic() - began)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env=subprocess_env(HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert "ConfigError text_lm hf_dataset 'someorg/some-corpus'" in text, text
    assert "HF_HUB_OFFLINE is set" in text and "save_to_disk" in text, text
    took = float(text.rsplit("took", 1)[1])
    assert took < 10, text


def test_a_server_serves_a_saved_dataset_by_its_splits(start_server, tmp_path: Path) -> None:
    """Through a real server and client: train batches hold train documents only, val batches
    validation documents only."""
    path = save(dataset_dict(), tmp_path / "saved")
    config = textwrap.dedent(
        f"""
        [datasets.hf]
        provider = "text_lm"
        batch_size = 2
        batches_per_file = 3
        workers = 2
        [datasets.hf.args]
        hf_dataset = {json.dumps(path.as_posix())}
        hf_splits = {{ train = "train", val = "validation" }}
        seq_len = 32
        micro_batch_size = 2
        shuffle_buffer = 16
        """
    )
    server = start_server(config)
    with QueueClient(server.address, "hf") as client:
        assert client.meta["split_info"]["val"] == {"hf_split": "validation"}
        for split, tag in (("train", "T"), ("val", "V")):
            seen: set[str] = set()
            for _ in range(6):
                seen |= doc_ids(client.get_batch(split)["input_ids"])
            assert seen and all(i.startswith(tag) for i in seen), (split, seen)
