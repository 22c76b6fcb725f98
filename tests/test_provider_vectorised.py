"""The array-op hot paths give exactly what a plain loop over samples gives.

Each reference below builds a batch the straightforward way, one row (or one piece) at a
time, drawing the same random tensors in the same order as the provider; the providers build
the whole batch with array operations. Equality over many seqs shows that no per-sample rule
was lost and that the batches, hence the files users have stored, did not change.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from queue_providers import ProviderContext, create
from queue_providers.text.packing import IGNORE, PACK_GROUP, pack_bin

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(5)
N_WORDS = 400
SEQS = 40


# ---- text_lm bin packing -------------------------------------------------------------------
def reference_pack_bin(tokens, lengths, seq_len, pad_id, rng):
    """Best fit written out: pieces and bins as lists, each window filled piece by piece."""
    full, rest = [], []
    start = 0
    for n in lengths.tolist():
        cut = 0
        while n - cut >= seq_len:
            full.append((start + cut, seq_len))
            cut += seq_len
        if n > cut:
            rest.append((start + cut, n - cut))
        start += n
    bins: list[list] = []  # [room, piece indices]
    for g in range(0, len(rest), PACK_GROUP):
        group = sorted(range(g, min(g + PACK_GROUP, len(rest))), key=lambda i: -rest[i][1])
        for i in group:
            size = rest[i][1]
            fits = [b for b in range(len(bins)) if bins[b][0] >= size]
            if fits:
                b = min(fits, key=lambda b: (bins[b][0], b))  # fullest; ties: opened first
                bins[b][0] -= size
                bins[b][1].append(i)
            else:
                bins.append([seq_len - size, [i]])
    windows = [[piece] for piece in full] + [[rest[i] for i in sorted(b[1])] for b in bins]
    if rng is not None:
        windows = [windows[i] for i in rng.permutation(len(windows))]
    ends = set((np.cumsum(lengths) - 1).tolist())
    n = len(windows)
    ids = np.full((n, seq_len), pad_id, dtype=np.int32)
    labels = np.full((n, seq_len), IGNORE, dtype=np.int32)
    seg = np.zeros((n, seq_len), dtype=np.int32)
    for w, pieces in enumerate(windows):
        pos = 0
        for k, (s, size) in enumerate(pieces, start=1):
            for j in range(size):
                ids[w, pos + j] = tokens[s + j]
                labels[w, pos + j] = IGNORE if s + j in ends else tokens[s + j + 1]
                seg[w, pos + j] = k
            pos += size
    return ids, labels, seg


@pytest.mark.parametrize("case", range(60))
def test_bin_packing_matches_the_piece_by_piece_reference(case: int) -> None:
    gen = np.random.default_rng(case)
    seq_len = int(gen.choice([8, 16, 33, 64]))
    # Short documents, ones of exactly T, multiples of T, T+1 and long ones, in one block.
    pool = [1, 2, seq_len - 1, seq_len, seq_len + 1, 2 * seq_len, 3 * seq_len + 1]
    n_docs = int(gen.integers(0, 200))
    lengths = np.where(
        gen.random(n_docs) < 0.2,
        gen.choice(pool, n_docs),
        gen.integers(1, 2 * seq_len, n_docs),
    ).astype(np.int64)
    tokens = gen.integers(0, 50_000, int(lengths.sum())).astype(np.int32)
    shuffle = case % 3 != 0
    got = pack_bin(
        tokens,
        lengths,
        seq_len,
        pad_id=7,
        rng=np.random.default_rng(case) if shuffle else None,
    )
    ids, labels, seg = reference_pack_bin(
        tokens, lengths, seq_len, 7, np.random.default_rng(case) if shuffle else None
    )
    assert np.array_equal(got.input_ids, ids)
    assert np.array_equal(got.labels, labels)
    assert np.array_equal(got.segment_ids, seg)
    assert np.array_equal(got.mask(0, len(got)), seg != 0)


# ---- fixed-width token rows ----------------------------------------------------------------
def reference_row(pieces: list[list[int]], width: int) -> tuple[list[int], list[int], list[int]]:
    """[CLS] a [SEP] (b [SEP]) [PAD]...: ids, the position each id came from (-1 for none),
    and token types."""
    ids, src, types = [CLS], [-1], [0]
    for k, (start, tokens) in enumerate(pieces):
        ids += [*tokens, SEP]
        src += [*range(start, start + len(tokens)), -1]
        types += [k] * (len(tokens) + 1)
    pad = width - len(ids)
    return ids + [PAD] * pad, src + [-1] * pad, types + [0] * pad


def longest_first(a: int, b: int, room: int) -> tuple[int, int]:
    """Trim the longer of two lengths one token at a time (ties trim b) until they fit."""
    while a + b > room:
        if a > b:
            a -= 1
        else:
            b -= 1
    return a, b


def f32(value: float) -> float:
    """`value` as the float32 that torch.rand's draws are compared with."""
    return float(np.float32(value))


def reference_mask(ids: torch.Tensor, rng: torch.Generator, p) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's 80/10/10, token by token, on the same three whole-batch draws."""
    select = torch.rand(ids.shape, generator=rng)
    kind = torch.rand(ids.shape, generator=rng)
    normal = [i for i in range(p.tok.vocab_size) if i not in p.tok.special_ids]
    pick = torch.randint(len(normal), ids.shape, generator=rng)
    out, labels = ids.clone(), torch.full_like(ids, -100)
    for r in range(ids.shape[0]):
        for c in range(ids.shape[1]):
            token = int(ids[r, c])
            if token in p.tok.special_ids or not float(select[r, c]) < f32(p.mlm_probability):
                continue
            labels[r, c] = token
            u = float(kind[r, c])
            if u < f32(p.mask_replace):
                out[r, c] = MASK
            elif u < f32(p.mask_replace + p.random_replace):
                out[r, c] = normal[int(pick[r, c])]
    return out, labels


def reference_bert_batch(p, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
    ids, offsets = p.array(split, "ids"), p.array(split, "offsets")
    b, t = p.batch_size, p.block_size
    rows = []
    if p.pairs:
        for i in torch.randint(len(offsets) - 2, (b,), generator=rng).tolist():
            a0, a1, b1 = (int(offsets[i + k]) for k in range(3))
            la, lb = longest_first(a1 - a0, b1 - a1, t - 3)
            rows.append(
                reference_row(
                    [(a0, ids[a0 : a0 + la].tolist()), (a1, ids[a1 : a1 + lb].tolist())], t
                )
            )
    else:
        for s in torch.randint(len(ids) - (t - 2) + 1, (b,), generator=rng).tolist():
            rows.append(reference_row([(s, ids[s : s + t - 2].tolist())], t))
    input_ids = torch.tensor([r[0] for r in rows])
    batch = {"attention_mask": (input_ids != PAD).long()}
    if p.pairs:
        batch["token_type_ids"] = torch.tensor([r[2] for r in rows])
    batch["input_ids"], batch["labels"] = reference_mask(input_ids, rng, p)
    return batch


def assert_same_files(p, reference, splits=("train", "val"), batches: int = 3) -> None:
    """The provider and the reference agree on every batch of SEQS files per split."""
    for split in splits:
        for seq in range(SEQS):
            mine, theirs = p.file_rng(split, seq), p.file_rng(split, seq)
            for _ in range(batches):
                got, want = p.sample_batch(split, mine), reference(p, split, theirs)
                assert sorted(got) == sorted(want)
                for name in want:
                    assert got[name].dtype == torch.int64, name
                    assert torch.equal(got[name], want[name]), (split, seq, name)


def write_vocab(path: Path) -> Path:
    path.write_text("".join(f"{t}\n" for t in [*SPECIALS, *(f"w{k}" for k in range(N_WORDS))]))
    return path


def context(tmp_path: Path, name: str, batch_size: int) -> ProviderContext:
    return ProviderContext(name, tmp_path / name, batch_size=batch_size, batches_per_file=3)


def settle(p):
    p.set_meta(p.complete_meta())
    return p


@pytest.mark.parametrize("pairs", [False, True])
def test_bert_mlm_matches_the_row_by_row_reference(tmp_path: Path, pairs: bool) -> None:
    gen = np.random.default_rng(1)
    lines = [
        " ".join(f"w{int(k)}" for k in gen.integers(0, N_WORDS, int(gen.integers(1, 30))))
        for _ in range(300)
    ]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    args = {
        "input": str(tmp_path / "corpus.txt"),
        "tokenizer": str(write_vocab(tmp_path / "vocab.txt")),
        "block_size": 24,  # short, so pairs are often truncated
        "pairs": pairs,
        "mlm_probability": 0.3,
    }
    p = settle(create("bert_mlm", context(tmp_path, "mlm", 8), args))
    assert_same_files(p, reference_bert_batch)


def reference_single_rows(p, split: str, idx: list[int]) -> list[tuple[list, list, list]]:
    ids, offsets = p.array(split, "ids"), p.array(split, "offsets")
    t = p.block_size
    rows = []
    for i in idx:
        start, end = int(offsets[i]), int(offsets[i + 1])
        rows.append(reference_row([(start, ids[start : min(end, start + t - 2)].tolist())], t))
    return rows


def reference_classification_batch(p, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
    labels = p.array(split, "labels")
    b = p.batch_size
    if split != "train" or p.sampling == "uniform":
        idx = torch.randint(len(labels), (b,), generator=rng).tolist()
    else:
        classes = sorted(set(labels.tolist()))
        members = {c: [i for i in range(len(labels)) if labels[i] == c] for c in classes}
        picks = torch.randint(len(classes), (b,), generator=rng).tolist()
        where = torch.rand(b, generator=rng, dtype=torch.float64).tolist()
        idx = []
        for c, u in zip(picks, where, strict=True):
            group = members[classes[c]]
            idx.append(group[min(int(u * len(group)), len(group) - 1)])
    rows = reference_single_rows(p, split, idx)
    input_ids = torch.tensor([r[0] for r in rows])
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != PAD).long(),
        "labels": torch.tensor([int(labels[i]) for i in idx]),
    }


@pytest.mark.parametrize("sampling", ["uniform", "stratified"])
def test_classification_matches_the_row_by_row_reference(tmp_path: Path, sampling: str) -> None:
    gen = np.random.default_rng(2)
    with open(tmp_path / "d.jsonl", "w") as f:
        for k in range(400):
            n = int(gen.integers(0, 40))  # empty texts and ones longer than a row
            text = " ".join(f"w{int(w)}" for w in gen.integers(0, N_WORDS, n))
            f.write(json.dumps({"text": text, "label": "abcd"[min(k % 7, 3)]}) + "\n")
    args = {
        "input": str(tmp_path / "d.jsonl"),
        "tokenizer": str(write_vocab(tmp_path / "vocab.txt")),
        "block_size": 16,
        "sampling": sampling,
    }
    p = settle(create("classification", context(tmp_path, "cls", 8), args))
    assert_same_files(p, reference_classification_batch)


def reference_tagging_batch(p, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
    n = len(p.array(split, "offsets")) - 1
    idx = torch.randint(n, (p.batch_size,), generator=rng).tolist()
    tags = p.array(split, "labels")
    rows = reference_single_rows(p, split, idx)
    return {
        "input_ids": torch.tensor([r[0] for r in rows]),
        "attention_mask": torch.tensor([[int(i != PAD) for i in r[0]] for r in rows]),
        "labels": torch.tensor([[-100 if s < 0 else int(tags[s]) for s in r[1]] for r in rows]),
    }


def test_token_classification_matches_the_row_by_row_reference(tmp_path: Path) -> None:
    gen = np.random.default_rng(3)
    lines = []
    for _ in range(300):
        for w in gen.integers(0, N_WORDS, int(gen.integers(1, 25))):
            lines.append(f"w{int(w)} {'BIO'[int(w) % 3]}")
        lines.append("")
    (tmp_path / "d.conll").write_text("\n".join(lines))
    args = {
        "input": str(tmp_path / "d.conll"),
        "tokenizer": str(write_vocab(tmp_path / "vocab.txt")),
        "block_size": 16,
    }
    p = settle(create("token_classification", context(tmp_path, "tc", 8), args))
    assert_same_files(p, reference_tagging_batch)


@pytest.mark.parametrize("provider_name", ["char_lm", "nanogpt_bin"])
@pytest.mark.parametrize("big", [False, True], ids=["uint16-ids", "uint32-ids"])
@pytest.mark.parametrize("histograms", [False, True], ids=["plain", "curriculum"])
def test_window_files_are_the_ones_sample_batch_makes(
    tmp_path: Path, provider_name: str, big: bool, histograms: bool
) -> None:
    """char_lm and nanogpt_bin gather their windows from narrow ids straight into the stored
    window: every file is, byte for byte, the one the base class makes from sample_batch
    (int64 x and y, stacked, checked and encoded), in both splits, with a curriculum's token
    histograms too. A file of format 1 (an old data root) is made the base class's way."""
    from test_compact_storage import _char_lm, _nanogpt_bin, as_format_1

    from queue_providers.base import DataProviderBase

    _, args, _ = (_char_lm if provider_name == "char_lm" else _nanogpt_bin)(tmp_path, big)
    ctx = ProviderContext(
        "ds", tmp_path / "ds", batch_size=3, batches_per_file=4, seed=7,
        histogram_field="x" if histograms else "",
    )  # fmt: skip
    provider = create(provider_name, ctx, args)
    meta = provider.complete_meta()
    provider.set_meta(meta)
    assert provider._codecs["train"].schema[0].stored_as == ("uint32" if big else "uint16")
    for split in ("train", "val"):
        for seq in (0, 1, 5):
            fast = provider.make_file(split, seq)
            reference = DataProviderBase.make_file(provider, split, seq)
            assert (fast.crc32, bytes(fast.data)) == (reference.crc32, bytes(reference.data))
    compact = bytes(provider.make_file("train", 2).data)
    provider.set_meta(as_format_1(meta))
    old = provider.make_file("train", 2)
    assert bytes(old.data) == bytes(DataProviderBase.make_file(provider, "train", 2).data)
    assert bytes(old.data) != compact  # format 1: x and y stored as served, not a window
