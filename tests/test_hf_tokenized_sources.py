"""Hugging Face datasets as the input of bert_mlm, classification and token_classification.

The same rows as a save_to_disk directory, a folder of Parquet files, or the provider's usual
input files give the same batches; hf_splits serves val from the dataset's own split; every
user error names the key, the dataset and what was found; and a changed dataset is refused at
the next start like a changed input file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import subprocess_env
from queue_client import QueueClient
from queue_client.errors import ConfigError
from queue_providers import ProviderContext, create

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
N_WORDS = 400
NAMES = ["neg", "neu", "pos"]


def write_vocab(path: Path) -> Path:
    path.write_text("".join(f"{t}\n" for t in [*SPECIALS, *(f"w{k}" for k in range(N_WORDS))]))
    return path


def words(k: int, n: int) -> list[str]:
    return [f"w{(k * 7 + j) % N_WORDS}" for j in range(n)]


# ---- rows, and the same rows as the provider's usual input file ----------------------------
def classification_rows(n: int, first: int = 0, int_labels: bool = False) -> dict[str, list]:
    ks = range(first, first + n)
    labels = [k % 3 if int_labels else NAMES[k % 3] for k in ks]
    return {"text": [" ".join(words(k, k % 9 + 2)) for k in ks], "label": labels}


def write_classification(path: Path, rows: dict[str, list]) -> Path:
    lines = [json.dumps({"text": t, "label": y}) for t, y in zip(*rows.values(), strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path


def token_classification_rows(n: int, first: int = 0) -> dict[str, list]:
    ks = range(first, first + n)
    tokens = [words(k, k % 6 + 1) for k in ks]
    return {"tokens": tokens, "ner_tags": [[(k + j) % 4 for j in range(len(t))] for k, t in
                                           zip(ks, tokens, strict=True)]}  # fmt: skip


def write_token_classification(path: Path, rows: dict[str, list]) -> Path:
    lines = []
    for ws, tags in zip(rows["tokens"], rows["ner_tags"], strict=True):
        lines += [f"{w} {t}" for w, t in zip(ws, tags, strict=True)] + [""]
    path.write_text("\n".join(lines))
    return path


def bert_mlm_rows(n: int, first: int = 0) -> dict[str, list]:
    # Some rows hold two lines: each line is an item, as in a text file.
    ks = range(first, first + n)
    return {"text": [" ".join(words(k, 5)) + ("\n" + " ".join(words(k + 1, 3))) * (k % 2)
                     for k in ks]}  # fmt: skip


def write_bert_mlm(path: Path, rows: dict[str, list]) -> Path:
    path.write_text("\n".join(rows["text"]) + "\n")
    return path


@dataclass(frozen=True)
class Kind:
    provider: str
    rows: Callable[..., dict[str, list]]
    write: Callable[[Path, dict[str, list]], Path]
    suffix: str
    args: dict[str, Any]


KINDS = {
    "classification": Kind(
        "classification", classification_rows, write_classification, ".jsonl", {}
    ),
    "token_classification": Kind(
        "token_classification", token_classification_rows, write_token_classification, ".txt", {}
    ),
    "bert_mlm": Kind("bert_mlm", bert_mlm_rows, write_bert_mlm, ".txt", {}),
}


def make(root: Path, kind: Kind, **args: Any):
    """The provider in this process, meta built and set."""
    ctx = ProviderContext("ds", root / "ds", batch_size=4, batches_per_file=2)
    vocab = write_vocab(root.parent / "vocab.txt")
    p = create(kind.provider, ctx, {"tokenizer": str(vocab), "block_size": 16, **kind.args, **args})
    meta = p.complete_meta()
    p.set_meta(meta)
    return p, meta


def assert_same_batches(a: Any, b: Any, splits: tuple[str, ...] = ("train", "val")) -> None:
    for split in splits:
        for seq in range(3):
            x, y = (
                a.sample_batch(split, a.file_rng(split, seq)),
                b.sample_batch(split, b.file_rng(split, seq)),
            )
            assert x.keys() == y.keys()
            for key in x:
                assert torch.equal(x[key], y[key]), (split, seq, key)


def save(ds: datasets.Dataset | datasets.DatasetDict, path: Path) -> Path:
    datasets.disable_progress_bars()
    ds.save_to_disk(str(path))
    return path


def parquet_folder(path: Path, splits: dict[str, dict[str, list]]) -> Path:
    """A plain folder of Parquet files, written with pyarrow: train-*.parquet, validation-*."""
    path.mkdir(parents=True)
    for name, rows in splits.items():
        pq.write_table(pa.table(rows), path / f"{name}-00000-of-00001.parquet")
    return path


def jsonl_folder(path: Path, splits: dict[str, dict[str, list]]) -> Path:
    """A plain folder of JSONL files, one object per row: train-*.jsonl, validation-*."""
    path.mkdir(parents=True)
    for name, rows in splits.items():
        objects = [
            dict(zip(rows, values, strict=True)) for values in zip(*rows.values(), strict=True)
        ]
        text = "".join(json.dumps(o) + "\n" for o in objects)
        (path / f"{name}-00000-of-00001.jsonl").write_text(text)
    return path


# ---- (1) the same rows give the same batches ------------------------------------------------
@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_saved_dataset_serves_what_its_rows_as_input_files_serve(
    tmp_path: Path, name: str
) -> None:
    """One Dataset (no val split): val is cut by train_fraction exactly as from the file."""
    kind = KINDS[name]
    rows = kind.rows(60)
    path = save(datasets.Dataset.from_dict(rows), tmp_path / "saved")
    a, meta_a = make(tmp_path / "a", kind, hf_dataset=str(path))
    b, meta_b = make(
        tmp_path / "b", kind, input=str(kind.write(tmp_path / f"in{kind.suffix}", rows))
    )
    assert meta_a["split_info"] == meta_b["split_info"]
    assert meta_a.get("label_map") == meta_b.get("label_map")
    assert meta_a["hf_dataset"]["kind"] == "save_to_disk"
    assert_same_batches(a, b)


def test_classification_integer_labels_map_as_in_files(tmp_path: Path) -> None:
    """Integer class ids in the label column get the ids a JSONL of the same ints gets."""
    kind = KINDS["classification"]
    rows = classification_rows(45, int_labels=True)
    path = save(datasets.Dataset.from_dict(rows), tmp_path / "saved")
    a, meta_a = make(tmp_path / "a", kind, hf_dataset=str(path))
    b, meta_b = make(
        tmp_path / "b", kind, input=str(write_classification(tmp_path / "c.jsonl", rows))
    )
    assert meta_a["label_map"] == meta_b["label_map"] == {"0": 0, "1": 1, "2": 2}
    assert_same_batches(a, b)


# ---- (2) hf_splits: val from the dataset's own split ---------------------------------------
@pytest.mark.parametrize("source", ["saved", "parquet", "jsonl"])
@pytest.mark.parametrize("name", sorted(KINDS))
def test_hf_splits_serves_val_from_the_datasets_validation_split(
    tmp_path: Path, name: str, source: str
) -> None:
    """{train, val = "validation"}: the same batches as input = train rows and val_input =
    validation rows, so val holds the validation split's rows and only those."""
    kind = KINDS[name]
    train, val = kind.rows(50), kind.rows(20, first=500)
    if source == "saved":
        dd = datasets.DatasetDict(
            {"train": datasets.Dataset.from_dict(train),
             "validation": datasets.Dataset.from_dict(val)}
        )  # fmt: skip
        path = save(dd, tmp_path / "saved")
    else:
        folder = parquet_folder if source == "parquet" else jsonl_folder
        path = folder(tmp_path / "files", {"train": train, "validation": val})
    splits = {"train": "train", "val": "validation"}
    a, meta_a = make(tmp_path / "a", kind, hf_dataset=str(path), hf_splits=splits)
    b, _ = make(
        tmp_path / "b", kind,
        input=str(kind.write(tmp_path / f"train{kind.suffix}", train)),
        val_input=str(kind.write(tmp_path / f"val{kind.suffix}", val)),
    )  # fmt: skip
    assert meta_a["split_info"]["val"]["hf_split"] == "validation"
    assert meta_a["split_info"]["train"]["hf_split"] == "train"
    assert_same_batches(a, b)


def test_hf_config_names_the_folders_config(tmp_path: Path) -> None:
    """A data-file folder's one config is "default": naming it reads the same rows; naming
    one it lacks is refused, naming the dataset."""
    kind = KINDS["bert_mlm"]
    path = parquet_folder(tmp_path / "files", {"train": bert_mlm_rows(40)})
    a, _ = make(tmp_path / "a", kind, hf_dataset=str(path), hf_config="default")
    b, _ = make(tmp_path / "b", kind, hf_dataset=str(path))
    assert_same_batches(a, b)
    with pytest.raises(ConfigError, match=r"bert_mlm hf_dataset '.*files' cannot be loaded"):
        make(tmp_path / "c", kind, hf_dataset=str(path), hf_config="nope")


# ---- (3) user errors name the key, the dataset and what was found ---------------------------
@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("classification", {"label_column": "category"},
         r"classification: hf_dataset '.*saved' split 'train' has no column 'category' "
         r"\(label_column\); its columns are \['text', 'label'\]"),
        ("token_classification", {"tokens_column": "words"},
         r"has no column 'words' \(tokens_column\); its columns are \['tokens', 'ner_tags'\]"),
        ("bert_mlm", {"text_column": "body"},
         r"bert_mlm: hf_dataset '.*saved' split 'train' has no column 'body' \(text_column\)"),
        ("classification", {"text_column": "label"},
         r"classification: text_column 'label' of hf_dataset '.*saved' split 'train' holds "
         r"int64 .*must hold strings"),
        ("token_classification", {"tags_column": "tokens", "tokens_column": "ner_tags"},
         r"tokens_column 'ner_tags' of hf_dataset '.*saved' split 'train' holds list<item: "
         r"int64>.*must hold lists of strings"),
        ("bert_mlm", {"hf_splits": {"train": "train", "val": "validation"}},
         r"bert_mlm hf_dataset '.*saved' holds one Dataset.*train_fraction"),
    ],
)  # fmt: skip
def test_bad_columns_and_splits_name_the_key_and_the_dataset(
    tmp_path: Path, name: str, args: dict[str, Any], message: str
) -> None:
    kind = KINDS[name]
    rows = kind.rows(30, **({"int_labels": True} if name == "classification" else {}))
    path = save(datasets.Dataset.from_dict(rows), tmp_path / "saved")
    with pytest.raises(ConfigError, match=message):
        make(tmp_path / "a", kind, hf_dataset=str(path), **args)


def test_an_unknown_split_names_the_split_and_those_there_are(tmp_path: Path) -> None:
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(classification_rows(20))})
    path = save(dd, tmp_path / "saved")
    with pytest.raises(
        ConfigError,
        match=r"classification hf_dataset '.*saved' has no split 'test' \(hf_splits.train\); "
        r"it has \['train'\]",
    ):
        make(
            tmp_path / "a",
            KINDS["classification"],
            hf_dataset=str(path),
            hf_splits={"train": "test"},
        )


@pytest.mark.parametrize("name", sorted(KINDS))
def test_input_and_hf_dataset_together_are_refused_naming_both(tmp_path: Path, name: str) -> None:
    kind = KINDS[name]
    rows = kind.rows(30)
    path = save(datasets.Dataset.from_dict(rows), tmp_path / "saved")
    data = kind.write(tmp_path / f"in{kind.suffix}", rows)
    with pytest.raises(ConfigError, match=rf"{name} takes `input` or `hf_dataset`, not both"):
        make(tmp_path / "a", kind, hf_dataset=str(path), input=str(data))
    with pytest.raises(ConfigError, match=r"val_input = .* goes with `input`; with hf_dataset"):
        make(tmp_path / "b", kind, hf_dataset=str(path), val_input=str(data))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"hf_splits": {"train": "train"}}, r"\['hf_splits'\] apply to hf_dataset only"),
        ({"hf_revision": "v1", "hf_config": "x"}, r"\['hf_config', 'hf_revision'\] apply to"),
        ({"text_column": "body"}, r"\['text_column'\] name columns of hf_dataset, and there is"),
    ],
)
def test_hf_keys_without_hf_dataset_are_refused(
    tmp_path: Path, args: dict[str, Any], message: str
) -> None:
    kind = KINDS["classification"]
    data = write_classification(tmp_path / "c.jsonl", classification_rows(30))
    with pytest.raises(ConfigError, match=message):
        make(tmp_path / "a", kind, input=str(data), **args)


def test_a_null_in_a_tag_list_names_its_row(tmp_path: Path) -> None:
    rows = token_classification_rows(10)
    rows["ner_tags"][7] = [None] * len(rows["tokens"][7])
    rows["ner_tags"][7][0] = 1
    path = save(datasets.Dataset.from_dict(rows), tmp_path / "saved")
    with pytest.raises(ConfigError, match=r"split 'train' row 7: tags_column 'ner_tags' is null"):
        make(tmp_path / "a", KINDS["token_classification"], hf_dataset=str(path))


RUN_WITHOUT_DATASETS = """
import sys
if sys.argv[5] == "without datasets":
    sys.modules["datasets"] = None  # as if the package were not installed
from pathlib import Path
from queue_providers import ProviderContext, create
ctx = ProviderContext("ds", Path(sys.argv[1]) / "ds", batch_size=1)
args = {"hf_dataset": sys.argv[2], "tokenizer": sys.argv[3], **eval(sys.argv[4])}
try:
    create("classification", ctx, args)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize(
    ("env", "dataset", "expected"),
    [
        ({}, "FOLDER", ["classification hf_dataset names a folder of data files",
                        "the `datasets` package", "pip install 'batchqueue[hf]'"]),
        ({"HF_HUB_OFFLINE": "1"}, "someorg/some-labels",
         ["classification hf_dataset 'someorg/some-labels' is not a local directory",
          "HF_HUB_OFFLINE is set", "save_to_disk"]),
    ],
)  # fmt: skip
def test_without_datasets_or_the_hub_the_error_says_what_is_missing(
    tmp_path: Path, env: dict[str, str], dataset: str, expected: list[str]
) -> None:
    """A folder of data files needs `datasets` to find its splits; a Hub name offline (with
    hf_revision given) is refused at once, naming the dataset and the local way out."""
    folder = parquet_folder(tmp_path / "files", {"train": classification_rows(10)})
    extra = {"hf_revision": "v1"} if env else {}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RUN_WITHOUT_DATASETS), str(tmp_path),
         str(folder) if dataset == "FOLDER" else dataset,
         str(write_vocab(tmp_path / "vocab.txt")), repr(extra),
         "with datasets" if env else "without datasets"],
        capture_output=True, text=True, timeout=120, env=subprocess_env(**env),
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert text.startswith("ConfigError"), text
    for part in expected:
        assert part in text, text


# ---- through a real server; (4) a changed dataset is refused at the next start ------------
def server_config(saved: Path, data: dict[str, Path], vocab: Path) -> str:
    def table(name: str, source: str) -> str:
        return (
            textwrap.dedent(
                f"""
            [datasets.{name}]
            provider = "classification"
            batch_size = 4
            batches_per_file = 2
            [datasets.{name}.args]
            tokenizer = {json.dumps(vocab.as_posix())}
            block_size = 16
            """
            )
            + source
        )

    hf = f"hf_dataset = {json.dumps(saved.as_posix())}\n"
    hf += 'hf_splits = { train = "train", val = "validation" }\n'
    files = f"input = {json.dumps(data['train'].as_posix())}\n"
    files += f"val_input = {json.dumps(data['val'].as_posix())}\n"
    return table("hf", hf) + table("files", files)


def test_a_server_serves_the_dataset_as_its_files_and_refuses_it_changed(
    start_server, tmp_path: Path
) -> None:
    """Two datasets of one server, the same rows as a saved DatasetDict and as JSONL files:
    the trainer gets equal batches from both. Then rows saved over the dataset make the next
    start exit with code 2, naming an Arrow file of it and the way to rebuild."""
    train, val = classification_rows(40), classification_rows(16, first=300)
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(train), "validation": datasets.Dataset.from_dict(val)}
    )
    saved = save(dd, tmp_path / "saved")
    data = {
        "train": write_classification(tmp_path / "train.jsonl", train),
        "val": write_classification(tmp_path / "val.jsonl", val),
    }
    config = server_config(saved, data, write_vocab(tmp_path / "vocab.txt"))
    root = tmp_path / "root"
    server = start_server(config, data_root=root)
    with QueueClient(server.address, "hf") as hf, QueueClient(server.address, "files") as files:
        assert hf.meta["label_map"] == files.meta["label_map"]
        for split in ("train", "val", "train"):
            x, y = hf.get_batch(split), files.get_batch(split)
            assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "labels")), split
    server.stop()

    changed = dict(train, text=[t + " w1" for t in train["text"]])
    save(datasets.DatasetDict({"train": datasets.Dataset.from_dict(changed),
                               "validation": datasets.Dataset.from_dict(val)}), saved)  # fmt: skip
    again = start_server(config, data_root=root, wait_serving=False)
    assert again.wait_exit(60) == 2, again.log_tail()
    log = again.log()
    assert re.search(r"input '[^']*saved/train/[^']*\.arrow' changed", log), log
    assert "queue-server reset" in log, log
