"""text_lm packing arithmetic: tokens conserved, no padding in sequential mode, labels are
next tokens within a document, and segments (hence attention) never cross documents."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from queue_providers.text.packing import IGNORE, pack_bin, pack_sequential

EOS = 9999


def make_block(lengths: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents whose tokens say who they are: doc j, token k -> j*1000 + k, then EOS.
    Returns tokens, lengths (EOS included) and each token's document."""
    parts, owner = [], []
    for j, n in enumerate(lengths):
        parts.append(np.concatenate([j * 1000 + np.arange(n), [EOS]]))
        owner.append(np.full(n + 1, j))
    tokens = np.concatenate(parts).astype(np.int32)
    return tokens, np.asarray(lengths, dtype=np.int64) + 1, np.concatenate(owner)


def segment_runs(seg_row: np.ndarray) -> list[tuple[int, int]]:
    cuts = np.flatnonzero(np.diff(seg_row)) + 1
    bounds = [0, *cuts.tolist(), len(seg_row)]
    return [(s, e) for s, e in itertools.pairwise(bounds) if seg_row[s] != 0]


def check_window_invariants(w, tokens_of_doc) -> None:
    """For every window: each segment run is one contiguous piece of one document, its labels
    are the document's next tokens, the attention built from segment ids stays inside it."""
    for row in range(len(w)):
        ids, labels, seg = w.input_ids[row], w.labels[row], w.segment_ids[row]
        mask = w.mask(row, row + 1)[0]
        assert np.array_equal(mask, seg != 0)
        assert np.all(labels[~mask] == IGNORE)
        runs = segment_runs(seg)
        assert [seg[s] for s, _ in runs] == list(range(1, len(runs) + 1))
        for s, e in runs:
            piece = ids[s:e]
            doc = piece[piece != EOS][0] // 1000 if np.any(piece != EOS) else None
            if doc is None:  # a lone EOS: the tail of a document begun in an earlier window
                assert e - s == 1 and labels[s] == IGNORE
                continue
            full = tokens_of_doc[doc]
            offset = int(np.flatnonzero(full == piece[0])[0])
            assert np.array_equal(full[offset : offset + (e - s)], piece)  # one contiguous piece
            nxt = full[offset + 1 : offset + (e - s) + 1]
            want = np.concatenate([nxt, [IGNORE] * ((e - s) - len(nxt))])
            if full[offset + (e - s) - 1] == EOS:
                want[-1] = IGNORE
            assert np.array_equal(labels[s:e], want)
        # The mask a trainer builds: causal and same segment. No pair crosses documents.
        same = (seg[:, None] == seg[None, :]) & (seg[:, None] != 0)
        causal = np.tril(np.ones((len(seg), len(seg)), dtype=bool))
        qi, ki = np.nonzero(same & causal)
        doc_of = np.where(ids == EOS, -1, ids // 1000)
        # EOS belongs to the document it ends: give it the owner of the token before it.
        for i in np.flatnonzero(doc_of == -1):
            doc_of[i] = doc_of[i - 1] if i > 0 and seg[i - 1] == seg[i] else -2
        assert np.all((doc_of[qi] == doc_of[ki]) | (doc_of[qi] == -2) | (doc_of[ki] == -2))


def docs_of(tokens, lengths):
    ends = np.cumsum(lengths)
    return [tokens[e - n : e] for e, n in zip(ends, lengths, strict=True)]


@pytest.mark.parametrize("seed", range(5))
def test_sequential_conserves_tokens_and_never_pads(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 90, size=40).tolist()
    tokens, lens, _ = make_block(lengths)
    t = 32
    w, carry_tokens, carry_lengths = pack_sequential(tokens, lens, t)
    assert w.attention_mask is None and np.all(w.mask(0, len(w)))  # no padding at all
    assert len(w) == len(tokens) // t
    assert np.array_equal(np.concatenate([w.input_ids.ravel(), carry_tokens]), tokens)
    assert int(carry_lengths.sum()) == len(carry_tokens) < t
    # Every position but a document's EOS predicts the next token; EOS predicts nothing.
    flat_labels = w.labels.ravel()
    used = len(w) * t
    is_eos = tokens[:used] == EOS
    assert np.all(flat_labels[is_eos] == IGNORE)
    assert np.array_equal(flat_labels[~is_eos], tokens[1 : used + 1][~is_eos])
    check_window_invariants(w, docs_of(tokens, lens))


def test_sequential_carry_continues_the_stream() -> None:
    tokens, lens, _ = make_block([50, 7, 70])
    w1, ct, cl = pack_sequential(tokens, lens, 32)
    more, more_lens, _ = make_block([5, 40])
    more = np.where(more == EOS, EOS, more + 500_000).astype(np.int32)
    w2, _, _ = pack_sequential(np.concatenate([ct, more]), np.concatenate([cl, more_lens]), 32)
    stream = np.concatenate([tokens, more])
    assert np.array_equal(
        np.concatenate([w1.input_ids.ravel(), w2.input_ids.ravel()]),
        stream[: (len(w1) + len(w2)) * 32],
    )
    # The carried piece is a document's tail: segment 1 of the next window, not a new document.
    assert w2.segment_ids[0, 0] == 1


@pytest.mark.parametrize("seed", range(5))
def test_bin_keeps_documents_whole_and_splits_only_long_ones(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = 64
    lengths = rng.integers(1, 150, size=60).tolist()
    tokens, lens, _ = make_block(lengths)
    w = pack_bin(tokens, lens, t, pad_id=EOS, rng=np.random.default_rng(seed))
    docs = docs_of(tokens, lens)
    check_window_invariants(w, docs)
    # Conservation: every document's tokens appear exactly once, in T-pieces from its start.
    real = w.input_ids[w.attention_mask]
    assert len(real) == len(tokens)
    assert np.array_equal(np.sort(real), np.sort(tokens))
    pieces: dict[int, list[np.ndarray]] = {}
    lone_eos = 0
    for row in range(len(w)):
        for s, e in segment_runs(w.segment_ids[row]):
            piece = w.input_ids[row, s:e]
            if piece[0] == EOS:  # the last piece of a document of T*k+1 tokens: its EOS alone
                assert e - s == 1
                lone_eos += 1
                continue
            pieces.setdefault(int(piece[0] // 1000), []).append(piece)
    assert lone_eos == sum(1 for d in docs if len(d) > t and len(d) % t == 1)
    for j, doc in enumerate(docs):
        got = sorted(pieces[j], key=lambda p: int(p[0]))
        if len(doc) > t and len(doc) % t == 1:
            got.append(doc[-1:])
        assert np.array_equal(np.concatenate(got), doc)
        assert [len(p) for p in got[:-1]] == [t] * (len(got) - 1)  # cut only at multiples of T
        if len(doc) <= t:
            assert len(got) == 1
    # Best fit keeps padding low: at most one window's worth beyond the minimum.
    minimum = -(-len(tokens) // t)
    assert len(w) <= minimum + 2


def test_bin_without_rng_is_deterministic_and_pads_with_pad_id() -> None:
    tokens, lens, _ = make_block([10, 20, 30])
    a = pack_bin(tokens, lens, 64, pad_id=7, rng=None)
    b = pack_bin(tokens, lens, 64, pad_id=7, rng=None)
    assert np.array_equal(a.input_ids, b.input_ids)
    assert np.all(a.input_ids[~a.attention_mask] == 7)
    assert np.all(a.segment_ids[~a.attention_mask] == 0)
