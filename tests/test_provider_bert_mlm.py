"""bert_mlm: BERT's 15% / 80-10-10 masking over 100k+ tokens, specials never masked, row layout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import train_losses
from queue_client.errors import ConfigError, MetaError, SchemaMismatch
from queue_client.format.batchfile import load_batch_file
from queue_client.format.meta import split_schema
from queue_client.format.schema import check_tensors
from queue_providers import ProviderContext, create
from queue_providers.tokenizer_training.train_wordpiece import main as train_wordpiece_main
from queue_providers.tokenizer_training.train_wordpiece import train_wordpiece

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "configs" / "bert_mlm.toml"
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(5)
IGNORE = -100


def write_vocab(path: Path, n_words: int, specials: list[str] = SPECIALS) -> Path:
    """specials, then w0..w{n-1}: the id of w{k} is len(specials) + k."""
    path.write_text("".join(f"{t}\n" for t in [*specials, *(f"w{k}" for k in range(n_words))]))
    return path


def write_stream(path: Path, n_tokens: int, n_words: int, seed: int = 0) -> list[int]:
    """w{j % n_words} for j = 0..n_tokens-1, cut into lines of 3-40 words; returns line lengths."""
    gen = np.random.default_rng(seed)
    lengths, j, lines = [], 0, []
    while j < n_tokens:
        n = min(int(gen.integers(3, 41)), n_tokens - j)
        lines.append(" ".join(f"w{(j + k) % n_words}" for k in range(n)))
        lengths.append(n)
        j += n
    path.write_text("\n".join(lines) + "\n")
    return lengths


def make(
    tmp_path: Path,
    *,
    n_tokens: int = 4000,
    n_words: int = 5000,
    batch_size: int = 16,
    batches_per_file: int = 4,
    **args,
):
    vocab = write_vocab(tmp_path / "vocab.txt", n_words)
    lengths = write_stream(tmp_path / "corpus.txt", n_tokens, n_words)
    ctx = ProviderContext(
        "mlm", tmp_path / "ds", batch_size=batch_size, batches_per_file=batches_per_file
    )
    p = create(
        "bert_mlm", ctx, {"input": str(tmp_path / "corpus.txt"), "tokenizer": str(vocab), **args}
    )
    meta = p.complete_meta()
    p.set_meta(meta)
    return p, meta, lengths


def test_masking_rates_over_400k_tokens_and_specials_are_never_masked(tmp_path: Path) -> None:
    t = 128
    p, meta, _ = make(tmp_path, batch_size=256, block_size=t)
    assert (
        meta["mask_token_id"],
        meta["cls_token_id"],
        meta["sep_token_id"],
        meta["pad_token_id"],
    ) == (MASK, CLS, SEP, PAD)
    g = torch.Generator().manual_seed(0)
    ids, labels = [], []
    for _ in range(14):  # 14 * 256 * 126 = 451k maskable tokens
        b = p.sample_batch("train", g)
        assert torch.all(b["attention_mask"] == 1), "packed rows have no padding"
        ids.append(b["input_ids"])
        labels.append(b["labels"])
    ids, labels = torch.cat(ids), torch.cat(labels)
    # Specials: [CLS] first, [SEP] last, never selected, never replaced.
    assert torch.all(ids[:, 0] == CLS) and torch.all(ids[:, -1] == SEP)
    assert torch.all(labels[:, [0, -1]] == IGNORE)
    content_ids, content_labels = ids[:, 1:-1], labels[:, 1:-1]
    selected = content_labels != IGNORE
    # The originals: labels where selected, input elsewhere, are a consecutive run of the corpus.
    original = torch.where(selected, content_labels, content_ids)
    assert torch.all(original.diff(dim=1) == 1), (
        "labels and unselected ids restore the corpus window"
    )
    assert torch.all(original >= 5), "labels never name a special token"
    n = selected.numel()
    rate = selected.sum().item() / n
    # Bernoulli(0.15) over 451k tokens: sd ~0.0005; allow 0.005.
    assert abs(rate - 0.15) < 0.005, rate
    sel_in, sel_orig = content_ids[selected], content_labels[selected]
    k = len(sel_in)  # ~68k selected tokens: a 10% share has sd ~0.0012; allow 0.01.
    masked = (sel_in == MASK).sum().item() / k
    unchanged = (sel_in == sel_orig).sum().item() / k
    replaced = ((sel_in != MASK) & (sel_in != sel_orig)).sum().item() / k
    normal = meta["vocab_size"] - len(meta["special_ids"])
    # A random replacement can draw the original token: 1 in `normal`.
    assert abs(masked - 0.8) < 0.01, masked
    assert abs(unchanged - (0.1 + 0.1 / normal)) < 0.01, unchanged
    assert abs(replaced - 0.1 * (1 - 1 / normal)) < 0.01, replaced
    random_ids = sel_in[(sel_in != MASK) & (sel_in != sel_orig)]
    assert not torch.isin(random_ids, torch.tensor(meta["special_ids"])).any(), (
        "random replacements are never special"
    )
    # Unselected tokens are untouched.
    assert torch.all(content_ids[~selected] == original[~selected])


def longest_first(la: int, lb: int, m: int) -> tuple[int, int]:
    """The reference: trim the longer segment one token at a time (ties trim b) until it fits."""
    while la + lb > m:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return la, lb


def test_pairs_are_consecutive_lines_truncated_longest_first_and_padding_is_never_masked(
    tmp_path: Path,
) -> None:
    t = 48
    p, meta, lengths = make(tmp_path, batch_size=256, block_size=t, pairs=True)
    assert [f["name"] for f in meta["batch_schema"]] == [
        "input_ids",
        "token_type_ids",
        "attention_mask",
        "labels",
    ]
    n_train = int(len(lengths) * 0.9)
    starts = np.concatenate([[0], np.cumsum(lengths)])[: n_train + 1]
    line_of_start = {int(s): i for i, s in enumerate(starts[:-1])}
    g = torch.Generator().manual_seed(0)
    selected_total = maskable_total = 0
    for _ in range(10):  # 10 * 256 * 48 = 123k positions
        b = p.sample_batch("train", g)
        ids, labels, tt, am = b["input_ids"], b["labels"], b["token_type_ids"], b["attention_mask"]
        original = torch.where(labels != IGNORE, labels, ids)
        special = torch.isin(original, torch.tensor(meta["special_ids"]))
        assert torch.all(labels[special] == IGNORE), "special positions are never selected"
        assert torch.all(ids[special] == original[special]), "special positions are never replaced"
        selected_total += (labels != IGNORE).sum().item()
        maskable_total += (~special).sum().item()
        for row in range(len(ids)):
            o = original[row].tolist()
            sep1 = o.index(SEP)
            sep2 = o.index(SEP, sep1 + 1)
            a, bb = o[1:sep1], o[sep1 + 1 : sep2]
            i = line_of_start[a[0] - 5]
            assert bb[0] - 5 == starts[i + 1], "b is the line after a"
            assert (len(a), len(bb)) == longest_first(lengths[i], lengths[i + 1], t - 3)
            assert a == list(range(a[0], a[0] + len(a))) and bb == list(
                range(bb[0], bb[0] + len(bb))
            )
            assert o[0] == CLS and all(x == PAD for x in o[sep2 + 1 :])
            assert tt[row].tolist() == [0] * (sep1 + 1) + [1] * (sep2 - sep1) + [0] * (t - sep2 - 1)
            assert am[row].tolist() == [1] * (sep2 + 1) + [0] * (t - sep2 - 1)
    # Bernoulli(0.15) over ~90k maskable positions: sd ~0.0012; allow 0.008.
    assert abs(selected_total / maskable_total - 0.15) < 0.008


def test_produced_file_matches_schema_and_a_mismatched_schema_names_the_field(
    tmp_path: Path,
) -> None:
    p, meta, _ = make(tmp_path, block_size=32)
    out = tmp_path / "q"
    out.mkdir()
    f = load_batch_file(out / str(p.produce_file("val", 0, out).name))
    check_tensors(split_schema(meta, "val"), f.tensors, (4, 16))
    bad = {
        **meta,
        "batch_schema": [
            dict(x, dtype="int32") if x["name"] == "labels" else x for x in meta["batch_schema"]
        ],
    }
    p.set_meta(bad)
    with pytest.raises(SchemaMismatch, match=r"field 'labels' has dtype int64, schema says int32"):
        p.produce_file("train", 0, out)


def test_vocab_without_mask_fails_at_start_naming_the_file(tmp_path: Path) -> None:
    vocab = write_vocab(tmp_path / "nomask.txt", 10, specials=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    write_stream(tmp_path / "c.txt", 100, 10)
    with pytest.raises(ConfigError, match=r"tokenizer .*nomask\.txt has no \[MASK\] token"):
        create(
            "bert_mlm",
            ProviderContext("m", tmp_path, batch_size=2),
            {"input": str(tmp_path / "c.txt"), "tokenizer": str(vocab)},
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"mask_replace": 0.95, "random_replace": 0.1},
            r"mask_replace \+ random_replace = 1\.05 exceeds 1",
        ),
        ({"mlm_probability": 0}, r"mlm_probability must lie in \(0, 1\]"),
        ({"lowercase": False, "tokenizer": "tok.json"}, r"lowercase applies to a vocab\.txt only"),
        ({"input": "missing.txt"}, r"input 'missing\.txt' is not a file"),
        ({"block_size": 2}, r"block_size must be an int >= 3"),
    ],
)
def test_bad_config_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: dict, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    write_vocab(tmp_path / "vocab.txt", 50)
    write_stream(tmp_path / "c.txt", 400, 50)
    train_wordpiece([tmp_path / "c.txt"], vocab_size=100, out=tmp_path / "tok.json")
    with pytest.raises(ConfigError, match=message):
        create(
            "bert_mlm",
            ProviderContext("m", tmp_path, batch_size=2),
            {"input": "c.txt", "tokenizer": "vocab.txt", **args},
        )


def test_corpus_too_small_fails_in_build_meta(tmp_path: Path) -> None:
    write_vocab(tmp_path / "vocab.txt", 50)
    write_stream(tmp_path / "c.txt", 400, 50)
    p = create(
        "bert_mlm",
        ProviderContext("m", tmp_path, batch_size=2),
        {
            "input": str(tmp_path / "c.txt"),
            "tokenizer": str(tmp_path / "vocab.txt"),
            "block_size": 100,
        },
    )
    with pytest.raises(
        ConfigError, match=r"the val split has \d+ tokens, fewer than block_size-2=98"
    ):
        p.complete_meta()


def test_train_wordpiece_command_makes_a_tokenizer_bert_mlm_uses(tmp_path: Path) -> None:
    text = tmp_path / "prose.txt"
    gen = np.random.default_rng(1)
    words = [
        "serving",
        "served",
        "server",
        "batches",
        "batching",
        "queued",
        "queues",
        "leasing",
        "leased",
        "ranks",
    ]
    text.write_text("\n".join(" ".join(gen.choice(words, 12)) for _ in range(3000)))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(ROOT / "providers"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")]
        ),
    )
    cmd = [
        sys.executable,
        "-m",
        "queue_providers.tokenizer_training.train_wordpiece",
        "--input",
        str(text),
        "--vocab-size",
        "60",
        "--out",
        str(tmp_path / "wp.json"),
    ]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=60)
    assert (
        train_wordpiece_main(
            ["--input", str(text), "--vocab-size", "60", "--out", str(tmp_path / "vocab.txt")]
        )
        == 0
    )
    for tok in ("wp.json", "vocab.txt"):
        ctx = ProviderContext("m", tmp_path / f"ds-{tok}", batch_size=64)
        p = create(
            "bert_mlm",
            ctx,
            {"input": str(text), "tokenizer": str(tmp_path / tok), "block_size": 64},
        )
        meta = p.complete_meta()
        p.set_meta(meta)
        assert meta["special_ids"] == [0, 1, 2, 3, 4] and meta["mask_token_id"] == 4
        b = p.sample_batch("train", torch.Generator().manual_seed(0))
        assert torch.all(b["labels"][:, [0, -1]] == IGNORE)
        # A 60-token vocab splits some of these words into ## pieces.
        assert meta["split_info"]["train"]["tokens"] > 12 * 2700


def test_example_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tomllib.loads(EXAMPLE.read_text())
    ((name, table),) = cfg["datasets"].items()
    args = table["args"]
    monkeypatch.chdir(tmp_path)
    Path(args["input"]).parent.mkdir(parents=True, exist_ok=True)
    write_stream(Path(args["input"]), 20_000, 300)
    train_wordpiece([args["input"]], vocab_size=400, out=args["tokenizer"])
    ctx = ProviderContext(
        name, tmp_path / "root" / name, batch_size=table["batch_size"], batches_per_file=2
    )
    p = create(table["provider"], ctx, args)
    p.set_meta(p.complete_meta())
    (tmp_path / "q").mkdir()
    f = load_batch_file(tmp_path / "q" / str(p.produce_file("train", 0, tmp_path / "q").name))
    assert f.tensors["input_ids"].shape == (2, table["batch_size"], args["block_size"])


def test_workers_load_the_corpus_cache_meta_names_even_after_the_input_changes(
    tmp_path: Path,
) -> None:
    p, meta, _ = make(tmp_path, block_size=32)
    args = {
        "input": str(tmp_path / "corpus.txt"),
        "tokenizer": str(tmp_path / "vocab.txt"),
        "block_size": 32,
    }

    def worker():
        """A fresh provider over the same dataset dir, as a worker process builds one."""
        return create("bert_mlm", ProviderContext("mlm", tmp_path / "ds", batch_size=16), args)

    # Workers read the cache and never tokenize again: the corpus's lines, reversed behind
    # the cache's back (same size and mtime, so the same cache key), would give other batches.
    corpus = tmp_path / "corpus.txt"
    st = corpus.stat()
    corpus.write_text("".join(reversed(corpus.read_text().splitlines(keepends=True))))
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert corpus.stat().st_size == st.st_size
    w = worker()
    w.set_meta(meta)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a, b = p.sample_batch("train", g1), w.sample_batch("train", g2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The corpus changes under a running server: workers still serve what meta describes.
    write_stream(tmp_path / "corpus.txt", 9000, 5000, seed=7)
    w = worker()
    w.set_meta(meta)
    b = w.sample_batch("train", torch.Generator().manual_seed(5))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # ... and if that cache is gone too, they refuse rather than serve other data.
    shutil.rmtree(tmp_path / "ds" / "artifacts" / meta["artifacts"])
    with pytest.raises(MetaError, match=r"the inputs changed since meta was built"):
        worker().set_meta(meta)


class TinyMLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.conv = torch.nn.Conv1d(dim, dim, kernel_size=3, padding=1)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        return self.out(torch.relu(self.conv(h.transpose(1, 2))).transpose(1, 2))


def test_tiny_mlm_trains_through_queue_client(tmp_path: Path, start_server) -> None:
    from queue_client.client import QueueClient

    write_vocab(tmp_path / "vocab.txt", 40)
    write_stream(tmp_path / "corpus.txt", 20_000, 40)
    server = start_server(
        textwrap.dedent(
            f"""
            [datasets.mlm]
            provider = "bert_mlm"
            batch_size = 32
            batches_per_file = 10
            [datasets.mlm.args]
            input = "{(tmp_path / "corpus.txt").as_posix()}"
            tokenizer = "{(tmp_path / "vocab.txt").as_posix()}"
            block_size = 32
            mlm_probability = 0.3
            """
        )
    )
    client = QueueClient(server.address, "mlm", rank=0, world_size=1, device="cpu")
    try:
        meta = client.meta
        assert meta["training_type"] == "MLM"
        vocab = meta["vocab_size"]
        torch.manual_seed(0)
        model = TinyMLM(vocab)

        def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            logits = model(batch["input_ids"], batch["attention_mask"])
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, vocab), batch["labels"].reshape(-1), ignore_index=IGNORE
            )

        losses = train_losses(client, model.parameters(), loss_of, lr=0.02)
    finally:
        client.close()
    # From ln(45) ~ 3.8: a masked word is its left neighbour + 1.
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
