"""classification: rows carry their example's text and label; stratified sampling balances classes."""

from __future__ import annotations

import csv
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import train_losses
from queue_client.errors import ConfigError
from queue_client.format.batchfile import load_batch_file
from queue_client.format.meta import split_schema
from queue_client.format.schema import check_tensors
from queue_providers import ProviderContext, create
from queue_providers.tokenizer_training.train_wordpiece import train_wordpiece

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "configs" / "classification.toml"
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
PAD, UNK, CLS, SEP = range(4)
N_WORDS = 3000


def write_vocab(path: Path) -> Path:
    """The specials, then w0..w{N_WORDS-1}: w{k} has id 4 + k."""
    path.write_text("".join(f"{t}\n" for t in [*SPECIALS, *(f"w{k}" for k in range(N_WORDS))]))
    return path


def example_text(k: int, n: int) -> str:
    """Example k: n consecutive words starting at w{k}, so its first token names it."""
    return " ".join(f"w{(k + j) % N_WORDS}" for j in range(n))


def write_jsonl(path: Path, labels: list) -> Path:
    gen = np.random.default_rng(0)
    with open(path, "w") as f:
        for k, label in enumerate(labels):
            f.write(
                json.dumps({"text": example_text(k, int(gen.integers(1, 30))), "label": label})
                + "\n"
            )
    return path


def imbalanced_labels() -> list[str]:
    """1000 examples, sorted by label: 700 a, 200 b, 80 c, 20 d."""
    return ["a"] * 700 + ["b"] * 200 + ["c"] * 80 + ["d"] * 20


def make(tmp_path: Path, data: Path, *, batch_size: int = 16, **args):
    vocab = write_vocab(tmp_path / "vocab.txt")
    ctx = ProviderContext("cls", tmp_path / "ds", batch_size=batch_size, batches_per_file=4)
    p = create("classification", ctx, {"input": str(data), "tokenizer": str(vocab), **args})
    meta = p.complete_meta()
    p.set_meta(meta)
    return p, meta


def draw_labels(p, split: str, batches: int) -> np.ndarray:
    g = torch.Generator().manual_seed(0)
    return torch.cat([p.sample_batch(split, g)["labels"] for _ in range(batches)]).numpy()


def test_stratified_sampling_balances_classes_and_uniform_keeps_their_frequencies(
    tmp_path: Path,
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", imbalanced_labels())
    p, meta = make(tmp_path, data, batch_size=500, sampling="stratified")
    assert meta["label_map"] == {"a": 0, "b": 1, "c": 2, "d": 3} and meta["num_classes"] == 4
    counts = meta["split_info"]["train"]["class_counts"]
    assert sum(counts) == 900 and counts[0] > 5 * counts[2]
    # 20k draws: a share of 0.25 has sd 0.003; allow 0.02.
    freq = np.bincount(draw_labels(p, "train", 40), minlength=4) / 20_000
    assert np.all(np.abs(freq - 0.25) < 0.02), freq
    # Within a class, examples are drawn uniformly: each train example of the rarest class
    # (lines 980-999; its first word w{k} names line k) gets ~1/n of the class's draws.
    g = torch.Generator().manual_seed(1)
    batches = [p.sample_batch("train", g) for _ in range(40)]
    first = torch.cat([b["input_ids"][:, 1] for b in batches]).numpy() - 4
    drawn = first[torch.cat([b["labels"] for b in batches]).numpy() == 3]
    assert set(drawn) <= set(range(980, 1000))
    per_example = np.bincount(drawn - 980, minlength=20)
    per_example = per_example[per_example > 0]  # the rare examples held out for val are never drawn
    assert len(per_example) == counts[3]
    expected = len(drawn) / counts[3]  # ~5000 draws over ~18 examples: ~280 each, sd ~16
    assert np.all(np.abs(per_example - expected) < 0.3 * expected), per_example
    # val is always uniform, so its metrics describe the data as it is.
    val_counts = np.array(meta["split_info"]["val"]["class_counts"])
    freq = np.bincount(draw_labels(p, "val", 40), minlength=4) / 20_000
    assert np.all(np.abs(freq - val_counts / val_counts.sum()) < 0.02), freq

    (tmp_path / "u").mkdir()
    u, _ = make(tmp_path / "u", data, batch_size=500)
    freq = np.bincount(draw_labels(u, "train", 40), minlength=4) / 20_000
    assert np.all(np.abs(freq - np.array(counts) / 900) < 0.02), freq


def test_rows_hold_the_example_text_truncated_and_its_label(tmp_path: Path) -> None:
    labels = [["neg", "pos", "neutral"][k % 3] for k in range(600)]
    data = write_jsonl(tmp_path / "d.jsonl", labels)
    t = 16
    p, meta = make(tmp_path, data, batch_size=64, block_size=t)
    lengths = [len(json.loads(line)["text"].split()) for line in data.read_text().splitlines()]
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        b = p.sample_batch("train", g)
        check_tensors(split_schema(meta, "train"), b, (64,))
        for row in range(64):
            ids = b["input_ids"][row].tolist()
            k = ids[1] - 4  # the example's first word is w{k}
            n = min(lengths[k], t - 2)
            assert ids == [CLS, *range(ids[1], ids[1] + n), SEP] + [PAD] * (t - n - 2)
            assert b["attention_mask"][row].tolist() == [1] * (n + 2) + [0] * (t - n - 2)
            assert b["labels"][row].item() == meta["label_map"][labels[k]]
    assert meta["split_info"]["train"]["truncated"] > 0


def test_label_map_from_config_is_used_and_recorded(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", ["pos", "neg"] * 50)
    _, meta = make(tmp_path, data, label_map=["pos", "neg"])
    assert meta["label_map"] == {"pos": 0, "neg": 1}
    (tmp_path / "b").mkdir()
    _, meta = make(tmp_path / "b", data, label_map={"neg": 1, "pos": 0, "unused": 2})
    assert meta["label_map"] == {"neg": 1, "pos": 0, "unused": 2} and meta["num_classes"] == 3


def test_integer_labels_keep_their_numeric_order(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [k % 12 for k in range(240)])
    _, meta = make(tmp_path, data)
    assert meta["label_map"] == {str(k): k for k in range(12)}


def test_label_not_in_label_map_fails_at_start_with_file_and_line(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", ["pos", "neg", "pos", "maybe", "neg"] * 10)
    p = create(
        "classification",
        ProviderContext("c", tmp_path / "ds", batch_size=2),
        {
            "input": str(data),
            "tokenizer": str(write_vocab(tmp_path / "v.txt")),
            "label_map": ["pos", "neg"],
        },
    )
    with pytest.raises(ConfigError, match=r"d\.jsonl:4: label 'maybe' is not in label_map"):
        p.complete_meta()


def test_csv_and_tsv_with_quoting_and_their_errors(tmp_path: Path) -> None:
    rows = [
        (example_text(k, 3) + (", and more" if k % 2 else ""), "x" if k % 2 else "y")
        for k in range(200)
    ]
    for name, delim in (("d.csv", ","), ("d.tsv", "\t")):
        with open(tmp_path / name, "w", newline="") as f:
            w = csv.writer(f, delimiter=delim)
            w.writerow(["id", "sentence", "gold"])
            w.writerows((k, *r) for k, r in enumerate(rows))
        (tmp_path / name.replace(".", "_")).mkdir()
        _, meta = make(
            tmp_path / name.replace(".", "_"),
            tmp_path / name,
            text_field="sentence",
            label_field="gold",
        )
        assert meta["label_map"] == {"x": 0, "y": 1}
        assert (
            sum(meta["split_info"]["train"]["class_counts"])
            + sum(meta["split_info"]["val"]["class_counts"])
            == 200
        )
    vocab = str(write_vocab(tmp_path / "v.txt"))

    def fails(text: str, message: str, **args) -> None:
        path = tmp_path / f"bad{len(list(tmp_path.glob('bad*')))}.csv"
        path.write_text(text)
        p = create(
            "classification",
            ProviderContext("c", tmp_path / "ds", batch_size=2),
            {"input": str(path), "tokenizer": vocab, **args},
        )
        with pytest.raises(ConfigError, match=message):
            p.complete_meta()

    fails("text,label\na,1\nb,2,3\n", r"bad\d\.csv:3: row has more fields than the header's 2")
    fails("text,label\na,1\nb\n", r"bad\d\.csv:3: row has fewer fields than the header's 2")
    fails(
        "sentence,label\na,1\n",
        r"bad\d\.csv:1: header \['sentence', 'label'\] lacks column\(s\) \['text'\]",
    )
    jl = tmp_path / "bad.jsonl"
    jl.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": 1\n')
    p = create(
        "classification",
        ProviderContext("c", tmp_path / "ds", batch_size=2),
        {"input": str(jl), "tokenizer": vocab},
    )
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not valid JSON"):
        p.complete_meta()
    jl.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": 1.5}\n')
    with pytest.raises(
        ConfigError, match=r"bad\.jsonl:2: label 1\.5 must be a string or an integer"
    ):
        create(
            "classification",
            ProviderContext("c", tmp_path / "ds2", batch_size=2),
            {"input": str(jl), "tokenizer": vocab},
        ).complete_meta()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"sampling": "balanced"}, r"sampling must be one of \['uniform', 'stratified'\]"),
        ({"label_map": {"a": 0, "b": 2}}, r"label_map ids must be exactly 0\.\.1"),
        ({"label_map": ["a", "a"]}, r"label_map lists \['a'\] more than once"),
        ({"format": "xml"}, r"format must be 'jsonl', 'csv' or 'tsv'"),
        ({"train_fraction": 1.0}, r"train_fraction must lie in \(0, 1\)"),
    ],
)
def test_bad_config_fails_at_start(tmp_path: Path, args: dict, message: str) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", ["a", "b"] * 10)
    with pytest.raises(ConfigError, match=message):
        create(
            "classification",
            ProviderContext("c", tmp_path, batch_size=2),
            {"input": str(data), "tokenizer": str(write_vocab(tmp_path / "v.txt")), **args},
        )


def test_held_out_val_is_fixed_across_seeds_and_covers_a_sorted_file(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", imbalanced_labels())
    metas, val_examples = [], []
    for seed in (1, 2):
        ctx = ProviderContext("c", tmp_path / f"s{seed}", batch_size=500, seed=seed)
        p = create(
            "classification",
            ctx,
            {"input": str(data), "tokenizer": str(write_vocab(tmp_path / "v.txt"))},
        )
        metas.append(p.complete_meta())
        p.set_meta(metas[-1])
        # 4000 uniform draws over 100 val examples miss one with probability ~3e-16.
        g = torch.Generator().manual_seed(seed)
        val_examples.append(
            {int(i) for _ in range(8) for i in p.sample_batch("val", g)["input_ids"][:, 1]}
        )
    assert len(val_examples[0]) == 100 and val_examples[0] == val_examples[1]
    assert metas[0]["split_info"] == metas[1]["split_info"]
    val_counts = metas[0]["split_info"]["val"]["class_counts"]
    assert sum(val_counts) == 100 and all(c > 0 for c in val_counts[:3]), val_counts


def test_example_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tomllib.loads(EXAMPLE.read_text())
    ((name, table),) = cfg["datasets"].items()
    args = table["args"]
    monkeypatch.chdir(tmp_path)
    Path(args["input"]).parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(
        Path(args["input"]), [args["label_map"][k % len(args["label_map"])] for k in range(300)]
    )
    train_wordpiece([args["input"]], vocab_size=200, out=args["tokenizer"])
    ctx = ProviderContext(
        name, tmp_path / "root" / name, batch_size=table["batch_size"], batches_per_file=2
    )
    p = create(table["provider"], ctx, args)
    p.set_meta(p.complete_meta())
    (tmp_path / "q").mkdir()
    f = load_batch_file(tmp_path / "q" / str(p.produce_file("train", 0, tmp_path / "q").name))
    assert f.tensors["labels"].shape == (2, table["batch_size"])


def test_tiny_classifier_trains_through_queue_client(tmp_path: Path, start_server) -> None:
    from queue_client.client import QueueClient

    # The label is which of w0..w3 the text contains, among noise words w100..w199.
    gen = np.random.default_rng(0)
    data = tmp_path / "kw.jsonl"
    with open(data, "w") as f:
        for _ in range(2000):
            c = int(gen.integers(0, 4))
            words = [f"w{100 + int(i)}" for i in gen.integers(0, 100, 8)]
            words.insert(int(gen.integers(0, 9)), f"w{c}")
            f.write(
                json.dumps({"text": " ".join(words), "label": ["red", "green", "blue", "gold"][c]})
                + "\n"
            )
    vocab = write_vocab(tmp_path / "vocab.txt")
    server = start_server(
        textwrap.dedent(
            f"""
            [datasets.kw]
            provider = "classification"
            batch_size = 32
            batches_per_file = 10
            [datasets.kw.args]
            input = "{data.as_posix()}"
            tokenizer = "{vocab.as_posix()}"
            block_size = 16
            sampling = "stratified"
            """
        )
    )
    client = QueueClient(server.address, "kw", rank=0, world_size=1, device="cpu")
    try:
        meta = client.meta
        assert meta["training_type"] == "CLASSIFICATION" and meta["num_classes"] == 4
        torch.manual_seed(0)
        emb = torch.nn.Embedding(meta["vocab_size"], 16)
        head = torch.nn.Linear(16, meta["num_classes"])

        def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled = (emb(batch["input_ids"]) * mask).sum(1) / mask.sum(1)
            return torch.nn.functional.cross_entropy(head(pooled), batch["labels"])

        losses = train_losses(client, [*emb.parameters(), *head.parameters()], loss_of, lr=0.05)
    finally:
        client.close()
    # From ln(4) ~ 1.39: the keyword decides the class.
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
