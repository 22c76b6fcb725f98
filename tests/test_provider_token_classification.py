"""token_classification: tags aligned to first subwords, and CoNLL input checked line by line."""

from __future__ import annotations

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

EXAMPLE = (
    Path(__file__).resolve().parent.parent / "examples" / "configs" / "token_classification.toml"
)
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
PAD, UNK, CLS, SEP = range(4)
IGNORE = -100
LETTERS = "abcdefgh"
TAGS = ["B-LOC", "B-PER", "I-LOC", "I-PER", "O"]  # sorted: the derived label_map's order


def write_vocab(path: Path) -> Path:
    """p0..p1999 as word starts and ##a..##h as continuations: "p12abc" -> p12 ##a ##b ##c."""
    tokens = [*SPECIALS, *(f"p{i}" for i in range(2000)), *(f"##{c}" for c in LETTERS)]
    path.write_text("".join(f"{t}\n" for t in tokens))
    return path


def make_sentences(n: int, seed: int = 0) -> list[list[tuple[str, str]]]:
    """Sentence s starts with the one-subword word p{s}, so a row's first token names it."""
    gen = np.random.default_rng(seed)
    out = []
    for s in range(n):
        words = [(f"p{s}", TAGS[s % len(TAGS)])]
        for _ in range(int(gen.integers(1, 12))):
            word = f"p{int(gen.integers(0, 2000))}" + "".join(
                gen.choice(list(LETTERS), int(gen.integers(0, 4)))
            )
            words.append((word, TAGS[int(gen.integers(0, len(TAGS)))]))
        out.append(words)
    return out


def write_conll(path: Path, sentences: list[list[tuple[str, str]]], extra_columns: int = 0) -> Path:
    lines = ["-DOCSTART- -X- -X- O" if extra_columns else "-DOCSTART- O", ""]
    for sent in sentences:
        lines += [" ".join([w, *(["NN"] * extra_columns), t]) for w, t in sent]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def make(tmp_path: Path, data: Path, *, batch_size: int = 16, **args):
    vocab = write_vocab(tmp_path / "vocab.txt")
    ctx = ProviderContext("tc", tmp_path / "ds", batch_size=batch_size, batches_per_file=4)
    p = create("token_classification", ctx, {"input": str(data), "tokenizer": str(vocab), **args})
    meta = p.complete_meta()
    p.set_meta(meta)
    return p, meta


def expected_row(sent: list[tuple[str, str]], label_map: dict[str, int], t: int) -> list[int]:
    """The reference alignment: the tag on a word's first subword, -100 on the rest."""
    labels = []
    for word, tag in sent:
        labels += [label_map[tag]] + [IGNORE] * (len(word.lstrip("p0123456789")))
    labels = labels[: t - 2]
    return [IGNORE, *labels, IGNORE] + [IGNORE] * (t - len(labels) - 2)


def test_first_subword_carries_the_tag_and_the_rest_are_ignored(tmp_path: Path) -> None:
    sentences = make_sentences(1000)
    t = 24
    p, meta = make(
        tmp_path, write_conll(tmp_path / "d.conll", sentences), batch_size=64, block_size=t
    )
    assert meta["label_map"] == {tag: i for i, tag in enumerate(TAGS)} and meta["num_labels"] == 5
    assert meta["label_alignment"] == "first_subword"
    info = meta["split_info"]
    assert info["train"]["sentences"] + info["val"]["sentences"] == 1000
    assert info["train"]["truncated"] > 0 and info["train"]["words_without_subwords"] == 0
    g = torch.Generator().manual_seed(0)
    rows = 0
    for _ in range(20):  # 1280 rows, each checked exactly
        b = p.sample_batch("train", g)
        check_tensors(split_schema(meta, "train"), b, (64,))
        for row in range(64):
            ids = b["input_ids"][row].tolist()
            s = ids[1] - 4  # p{s} has id 4 + s
            assert b["labels"][row].tolist() == expected_row(sentences[s], meta["label_map"], t)
            n = sum(1 + len(w.lstrip("p0123456789")) for w, _ in sentences[s])
            n = min(n, t - 2)
            assert ids[0] == CLS and ids[n + 1] == SEP and ids[n + 2 :] == [PAD] * (t - n - 2)
            assert b["attention_mask"][row].tolist() == [1] * (n + 2) + [0] * (t - n - 2)
            rows += 1
    assert rows == 1280


def test_a_word_with_no_subwords_loses_only_its_own_tag(tmp_path: Path) -> None:
    # U+200B (zero-width space) is not whitespace to str.split but BertNormalizer drops it.
    sent = [("p1", "B-PER"), ("\u200b", "I-PER"), ("p2ab", "B-LOC"), ("p3", "O")]
    data = write_conll(tmp_path / "d.conll", [sent] * 2)
    p, meta = make(tmp_path, data, val_input=str(data), block_size=12)
    assert meta["split_info"]["train"]["words_without_subwords"] == 2
    b = p.sample_batch("train", torch.Generator().manual_seed(0))
    lm = meta["label_map"]
    assert b["input_ids"][0].tolist() == [CLS, 5, 6, 2004, 2005, 7, SEP, PAD, PAD, PAD, PAD, PAD]
    assert b["labels"][0].tolist() == [
        IGNORE,
        lm["B-PER"],
        lm["B-LOC"],
        IGNORE,
        IGNORE,
        lm["O"],
        *[IGNORE] * 6,
    ]


def test_conll_2003_layout_with_four_columns_and_docstart(tmp_path: Path) -> None:
    sentences = make_sentences(50)
    data = write_conll(tmp_path / "d.conll", sentences, extra_columns=2)
    _, meta = make(tmp_path, data, num_columns=4)
    assert meta["split_info"]["train"]["sentences"] + meta["split_info"]["val"]["sentences"] == 50
    assert "-X-" not in meta["label_map"]


def test_wrong_number_of_columns_names_file_and_line(tmp_path: Path) -> None:
    data = tmp_path / "d.conll"
    data.write_text("p1 O\np2 B-PER\n\np3 I-PER\np4 NN O\np5 O\n")
    p = create(
        "token_classification",
        ProviderContext("t", tmp_path / "ds", batch_size=2),
        {"input": str(data), "tokenizer": str(write_vocab(tmp_path / "v.txt"))},
    )
    with pytest.raises(
        ConfigError,
        match=r"d\.conll:5: 3 column\(s\), expected 2 \(as line 1, the file's first token line\): 'p4 NN O'",
    ):
        p.complete_meta()
    p = create(
        "token_classification",
        ProviderContext("t", tmp_path / "ds2", batch_size=2),
        {"input": str(data), "tokenizer": str(write_vocab(tmp_path / "v.txt")), "num_columns": 3},
    )
    with pytest.raises(
        ConfigError, match=r"d\.conll:1: 2 column\(s\), expected 3 \(as num_columns\)"
    ):
        p.complete_meta()


@pytest.mark.parametrize(
    ("text", "args", "message"),
    [
        (
            "p1 O\np2 B-MISC\n\np3 O\n",
            {"label_map": ["O", "B-PER"]},
            r"d\.conll:2: tag 'B-MISC' is not in label_map",
        ),
        (
            "p1 O\np2 O\n",
            {"tag_column": 2},
            r"d\.conll:1: tag_column=2 but a line has 2 column\(s\)",
        ),
        ("p1\np2\n", {}, r"d\.conll:1: one column holds both token and tag"),
        (
            "p1 O\n\np2 O\n",
            {"train_fraction": 0.9},
            r"2 examples with train_fraction=0\.9 leaves a split empty",
        ),
    ],
)
def test_bad_input_fails_in_build_meta_naming_file_and_line(
    tmp_path: Path, text: str, args: dict, message: str
) -> None:
    (tmp_path / "d.conll").write_text(text)
    p = create(
        "token_classification",
        ProviderContext("t", tmp_path / "ds", batch_size=2),
        {
            "input": str(tmp_path / "d.conll"),
            "tokenizer": str(write_vocab(tmp_path / "v.txt")),
            **args,
        },
    )
    with pytest.raises(ConfigError, match=message):
        p.complete_meta()


def test_bad_config_fails_in_init(tmp_path: Path) -> None:
    data = write_conll(tmp_path / "d.conll", make_sentences(10))
    vocab = str(write_vocab(tmp_path / "v.txt"))
    for args, message in (
        ({"num_columns": 1}, r"num_columns must be an int >= 2"),
        (
            {"num_columns": 4, "tag_column": 4},
            r"num_columns=4: tag_column=4 but a line has 4 column",
        ),
        ({"num_columns": 2, "tag_column": -2}, r"one column holds both token and tag"),
        ({"tag_column": "last"}, r"tag_column must be an int"),
        ({"label_map": {"O": 1}}, r"label_map ids must be exactly 0\.\.0"),
    ):
        with pytest.raises(ConfigError, match=message):
            create(
                "token_classification",
                ProviderContext("t", tmp_path, batch_size=2),
                {"input": str(data), "tokenizer": vocab, **args},
            )


def test_example_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tomllib.loads(EXAMPLE.read_text())
    ((name, table),) = cfg["datasets"].items()
    args = table["args"]
    monkeypatch.chdir(tmp_path)
    Path(args["input"]).parent.mkdir(parents=True, exist_ok=True)
    tags = args["label_map"]
    write_conll(
        Path(args["input"]),
        [[(w, tags[i % len(tags)]) for i, (w, _) in enumerate(s)] for s in make_sentences(300)],
    )
    train_wordpiece([args["input"]], vocab_size=300, out=args["tokenizer"])
    ctx = ProviderContext(
        name, tmp_path / "root" / name, batch_size=table["batch_size"], batches_per_file=2
    )
    p = create(table["provider"], ctx, args)
    p.set_meta(p.complete_meta())
    (tmp_path / "q").mkdir()
    f = load_batch_file(tmp_path / "q" / str(p.produce_file("train", 0, tmp_path / "q").name))
    assert f.tensors["labels"].shape == (2, table["batch_size"], args["block_size"])


def test_tiny_tagger_trains_through_queue_client(tmp_path: Path, start_server) -> None:
    from queue_client.client import QueueClient

    # A word's tag is fixed by its stem, so a per-token classifier can learn it.
    gen = np.random.default_rng(0)
    sentences = []
    for _ in range(500):
        stems = gen.integers(0, 60, int(gen.integers(3, 10)))
        sentences.append([(f"p{s}" + "ab" * int(gen.integers(0, 2)), TAGS[s % 5]) for s in stems])
    data = write_conll(tmp_path / "d.conll", sentences)
    vocab = write_vocab(tmp_path / "vocab.txt")
    server = start_server(
        textwrap.dedent(
            f"""
            [datasets.ner]
            provider = "token_classification"
            batch_size = 32
            batches_per_file = 10
            [datasets.ner.args]
            input = "{data.as_posix()}"
            tokenizer = "{vocab.as_posix()}"
            block_size = 24
            """
        )
    )
    client = QueueClient(server.address, "ner", rank=0, world_size=1, device="cpu")
    try:
        meta = client.meta
        assert meta["training_type"] == "TOKEN_CLASSIFICATION" and meta["num_labels"] == 5
        torch.manual_seed(0)
        emb = torch.nn.Embedding(meta["vocab_size"], 16)
        head = torch.nn.Linear(16, meta["num_labels"])

        def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            logits = head(emb(batch["input_ids"]))
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, 5), batch["labels"].reshape(-1), ignore_index=IGNORE
            )

        losses = train_losses(client, [*emb.parameters(), *head.parameters()], loss_of, lr=0.05)
    finally:
        client.close()
    # From ln(5) ~ 1.6: the first subword names the tag.
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
