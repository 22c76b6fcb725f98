"""What the tokenized providers (bert_mlm, classification, token_classification) share.

- `load_tokenizer`: a local WordPiece vocab.txt or tokenizer.json as a `tokenizers.Tokenizer`,
  with BERT's special tokens checked at start-up rather than discovered mid-run.
- `Ragged` and `cached_arrays`: token sequences kept as one flat array plus offsets, built once
  by build_meta and saved under the dataset dir, so every worker maps them (set_meta) instead
  of tokenizing the corpus again.
- `single_rows` / `pair_rows` / `RowLayout`: fixed-width rows ([CLS] a [SEP] (b [SEP]) [PAD]...)
  laid out for a whole batch with torch ops, no loop per token.
- `parse_label_map` / `derive_label_map`: the label-to-id map that classification and
  token_classification record in meta.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from queue_client.errors import ConfigError, MetaError

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
BERT_SPECIALS = (PAD, UNK, CLS, SEP, MASK)
_INT_RE = re.compile(r"-?[0-9]+")
# The label of positions with nothing to predict (torch's cross_entropy default ignore_index).
IGNORE_INDEX = -100

# Under the dataset dir: arrays a provider derives from its inputs (see cached_arrays).
ARTIFACTS_DIR = "artifacts"

# Encoding in chunks bounds the memory held by `tokenizers.Encoding` objects at once.
_ENCODE_CHUNK = 8192


# ---- tokenizers ----------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer plus the ids the providers need; `digest` keys the on-disk caches."""

    tokenizer: Any  # tokenizers.Tokenizer (imported lazily: it is an optional dependency)
    path: Path
    vocab_size: int
    ids: Mapping[str, int]  # BERT special token -> id, for those the vocab has
    special_ids: tuple[int, ...]  # every special token's id, sorted
    digest: str

    def id(self, token: str) -> int:
        return self.ids[token]


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(
            "the tokenized providers need the `tokenizers` package: pip install 'batchqueue[text]'"
        ) from None
    return tokenizers


def _read_vocab_txt(path: Path) -> dict[str, int]:
    vocab: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            token = line.rstrip("\r\n")
            if not token:
                raise ConfigError(
                    f"{path}:{line_no}: empty line; a vocab.txt holds one token per line"
                )
            if token in vocab:
                raise ConfigError(
                    f"{path}:{line_no}: token {token!r} repeats line {vocab[token] + 1}"
                )
            vocab[token] = len(vocab)
    if not vocab:
        raise ConfigError(f"{path} is empty; a vocab.txt holds one token per line")
    return vocab


def bert_wordpiece(vocab: Mapping[str, int] | None, *, lowercase: bool) -> Any:
    """BERT's WordPiece pipeline (BertNormalizer, BertPreTokenizer, ## continuation)."""
    tk = _tokenizers()
    model = (
        tk.models.WordPiece(dict(vocab), unk_token=UNK)
        if vocab is not None
        else tk.models.WordPiece(unk_token=UNK)
    )
    tok = tk.Tokenizer(model)
    tok.normalizer = tk.normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tok.decoder = tk.decoders.WordPiece()
    return tok


def load_tokenizer(
    path: str | os.PathLike[str],
    *,
    lowercase: bool | None = None,
    require: Sequence[str] = (PAD, UNK, CLS, SEP),
    who: str = "provider",
) -> LoadedTokenizer:
    """Load `tokenizer.json` (any name ending .json) or a BERT `vocab.txt` (anything else).

    `lowercase` applies to vocab.txt only (default True, as bert-base-uncased); a tokenizer.json
    carries its own normaliser. Raises ConfigError naming the file and every token of `require`
    the vocab lacks.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"{who}: tokenizer {str(path)!r} is not a file (expected vocab.txt or tokenizer.json)"
        )
    tk = _tokenizers()
    raw = path.read_bytes()
    if path.suffix == ".json":
        if lowercase is not None:
            raise ConfigError(
                f"{who}: lowercase applies to a vocab.txt only; {path} carries its own normalizer"
            )
        try:
            tok = tk.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:
            raise ConfigError(f"{who}: {path} is not a valid tokenizer.json: {exc}") from None
    else:
        tok = bert_wordpiece(
            _read_vocab_txt(path), lowercase=True if lowercase is None else lowercase
        )
    ids = {t: i for t in BERT_SPECIALS if (i := tok.token_to_id(t)) is not None}
    missing = [t for t in require if t not in ids]
    if missing:
        raise ConfigError(
            f"{who}: tokenizer {path} has no {' '.join(missing)} token; this provider needs "
            f"{' '.join(require)} in the vocab"
        )
    # Treat the BERT tokens as special even in a plain vocab.txt, and read literal "[CLS]" in
    # the data as text: data must not be able to forge structure tokens.
    tok.add_special_tokens([t for t in BERT_SPECIALS if t in ids])
    tok.encode_special_tokens = True
    tok.no_truncation()
    tok.no_padding()
    specials = set(ids.values()) | {
        i for i, t in tok.get_added_tokens_decoder().items() if t.special
    }
    return LoadedTokenizer(
        tokenizer=tok,
        path=path,
        vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
        ids=ids,
        special_ids=tuple(sorted(int(i) for i in specials)),
        digest=hashlib.blake2b(raw + repr(lowercase).encode(), digest_size=16).hexdigest(),
    )


# ---- ragged token arrays -----------------------------------------------------------------------
@dataclass(frozen=True)
class Ragged:
    """Sequences as one flat array and offsets: sequence i is flat[offsets[i]:offsets[i+1]]."""

    flat: np.ndarray
    offsets: np.ndarray  # int64, len = number of sequences + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def starts(self) -> np.ndarray:
        return self.offsets[:-1]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]], dtype: Any = np.int32) -> Ragged:
        lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=dtype, count=int(offsets[-1]))
        return cls(flat, offsets)

    def without_empty(self) -> Ragged:
        """The same sequences less the empty ones (an empty one only repeats an offset)."""
        return Ragged(self.flat, np.unique(self.offsets))


def read_lines(paths: Sequence[Path]) -> list[str]:
    """The non-blank lines of text files, stripped, in order."""
    lines: list[str] = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines.extend(s for line in f if (s := line.strip()))
    return lines


def encode_texts(tok: LoadedTokenizer, texts: Sequence[str]) -> Ragged:
    """Token ids of each text, without special tokens."""
    # encode_batch_fast skips character offsets, which nothing here needs (tokenizers >= 0.21).
    encode = getattr(tok.tokenizer, "encode_batch_fast", tok.tokenizer.encode_batch)
    ids: list[list[int]] = []
    for lo in range(0, len(texts), _ENCODE_CHUNK):
        chunk = encode(list(texts[lo : lo + _ENCODE_CHUNK]), add_special_tokens=False)
        ids.extend(e.ids for e in chunk)
    return Ragged.from_lists(ids)


def encode_words(tok: LoadedTokenizer, sentences: Sequence[Sequence[str]]) -> tuple[Ragged, Ragged]:
    """Subword ids of each pre-split sentence, and for each subword the index of its word."""
    ids: list[list[int]] = []
    words: list[list[int]] = []
    for lo in range(0, len(sentences), _ENCODE_CHUNK):
        chunk = [list(s) for s in sentences[lo : lo + _ENCODE_CHUNK]]
        for enc in tok.tokenizer.encode_batch(
            chunk, is_pretokenized=True, add_special_tokens=False
        ):
            ids.append(enc.ids)
            words.append(enc.word_ids)
    return Ragged.from_lists(ids), Ragged.from_lists(words)


# ---- cached arrays --------------------------------------------------------------------------------
def file_identity(path: Path) -> tuple[str, int, int]:
    """What a cache key needs to notice that a file changed: its path, size and mtime."""
    st = Path(path).stat()
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def cache_key(kind: str, *parts: object) -> str:
    return f"{kind}-{hashlib.blake2b(repr(parts).encode(), digest_size=10).hexdigest()}"


def cached_arrays(
    root: Path, key: str, build: Callable[[], tuple[dict[str, np.ndarray], dict[str, Any]]]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and JSON info saved under root/key, building and saving them if absent.

    Arrays come back memory-mapped read-only, so worker processes share the page cache. The
    directory is written under a temp name and renamed into place, so a reader never sees a
    half-written cache and two processes racing to build it both end with the same one.
    """
    final = Path(root) / key
    if not (final / "info.json").is_file():
        arrays, info = build()
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, arr in arrays.items():
            with open(tmp / f"{name}.npy", "wb") as f:
                np.save(f, np.ascontiguousarray(arr))
                f.flush()
                os.fsync(f.fileno())
        (tmp / "info.json").write_text(json.dumps(info, sort_keys=True))
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "info.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process published it first
    info = json.loads((final / "info.json").read_text())
    arrays = {p.stem: np.load(p, mmap_mode="r") for p in sorted(final.glob("*.npy"))}
    return arrays, info


def load_artifacts(
    dataset_dir: Path,
    key_now: str,
    pinned: str | None,
    build: Callable[[], tuple[dict[str, np.ndarray], dict[str, Any]]],
) -> tuple[str, dict[str, np.ndarray], dict[str, Any]]:
    """(key, arrays, info) of a provider's cached inputs.

    build_meta passes pinned=None and gets the cache for the inputs as they are now (key_now);
    it records the key in meta["artifacts"]. Workers pass that key as `pinned` and load
    exactly what meta describes, even if an input file changed since. If the pinned cache is
    gone it is rebuilt, but only while the inputs still hash to it.
    """
    root = Path(dataset_dir) / ARTIFACTS_DIR
    key = pinned or key_now
    if pinned and pinned != key_now and not (root / pinned / "info.json").is_file():
        raise MetaError(
            f"{root / pinned} is gone and the inputs changed since meta was built (they now "
            f"hash to {key_now}): restart the server so meta is built again"
        )
    arrays, info = cached_arrays(root, key, build)
    return key, arrays, info


# ---- fixed-width rows --------------------------------------------------------------------------
# What each position of a row holds.
ROLE_PAD, ROLE_CLS, ROLE_A, ROLE_SEP, ROLE_B, ROLE_SEP_B = range(6)


@dataclass(frozen=True)
class RowLayout:
    """Where each position of a batch of rows comes from: `src` indexes the flat array at
    content positions (ROLE_A, ROLE_B) and is 0 elsewhere."""

    role: torch.Tensor  # [B, W] int64
    src: torch.Tensor  # [B, W] int64

    @property
    def content(self) -> torch.Tensor:
        return (self.role == ROLE_A) | (self.role == ROLE_B)

    def gather(self, flat: np.ndarray) -> torch.Tensor:
        """flat[src] as int64 (garbage where not content; callers mask it)."""
        return torch.from_numpy(np.asarray(flat[self.src.numpy()], dtype=np.int64))

    def input_ids(self, flat: np.ndarray, *, cls: int, sep: int, pad: int) -> torch.Tensor:
        ids = self.gather(flat)
        ids = torch.where(self.role == ROLE_CLS, cls, ids)
        ids = torch.where((self.role == ROLE_SEP) | (self.role == ROLE_SEP_B), sep, ids)
        return torch.where(self.role == ROLE_PAD, pad, ids)

    def labels(self, flat: np.ndarray) -> torch.Tensor:
        """flat[src] at content positions, IGNORE_INDEX elsewhere."""
        return torch.where(self.content, self.gather(flat), IGNORE_INDEX)

    def attention_mask(self) -> torch.Tensor:
        return (self.role != ROLE_PAD).long()

    def token_type_ids(self) -> torch.Tensor:
        return ((self.role == ROLE_B) | (self.role == ROLE_SEP_B)).long()


def single_rows(starts: torch.Tensor, lengths: torch.Tensor, width: int) -> RowLayout:
    """[CLS] seq [SEP] [PAD]...: each seq truncated to width-2, keeping its start."""
    p = torch.arange(width).unsqueeze(0)
    n = lengths.long().clamp(max=width - 2).unsqueeze(1)
    role = torch.full(p.shape, ROLE_PAD).expand(len(starts), width)
    role = torch.where(p == n + 1, ROLE_SEP, role)
    role = torch.where((p >= 1) & (p <= n), ROLE_A, role)
    role = torch.where(p == 0, ROLE_CLS, role)
    src = torch.where(role == ROLE_A, starts.long().unsqueeze(1) + p - 1, 0)
    return RowLayout(role, src)


def pair_rows(
    a_starts: torch.Tensor,
    a_lengths: torch.Tensor,
    b_starts: torch.Tensor,
    b_lengths: torch.Tensor,
    width: int,
) -> RowLayout:
    """[CLS] a [SEP] b [SEP] [PAD]...: truncated longest-first to width-3 content tokens."""
    m = width - 3
    la, lb = a_lengths.long(), b_lengths.long()
    over = la + lb > m
    # Longest-first: trim the longer one until the pair fits; ties trim b.
    la_cut = torch.minimum(la, torch.maximum(torch.full_like(la, (m + 1) // 2), m - lb))
    la = torch.where(over, la_cut, la).unsqueeze(1)
    lb = torch.where(over, m - la.squeeze(1), lb).unsqueeze(1)
    p = torch.arange(width).unsqueeze(0)
    role = torch.full(p.shape, ROLE_PAD).expand(len(a_starts), width)
    role = torch.where(p == la + lb + 2, ROLE_SEP_B, role)
    role = torch.where((p >= la + 2) & (p <= la + lb + 1), ROLE_B, role)
    role = torch.where(p == la + 1, ROLE_SEP, role)
    role = torch.where((p >= 1) & (p <= la), ROLE_A, role)
    role = torch.where(p == 0, ROLE_CLS, role)
    src = torch.where(role == ROLE_A, a_starts.long().unsqueeze(1) + p - 1, 0)
    src = torch.where(role == ROLE_B, b_starts.long().unsqueeze(1) + p - la - 2, src)
    return RowLayout(role, src)


# ---- label maps ---------------------------------------------------------------------------------
def parse_label_map(raw: Any, *, who: str) -> dict[str, int] | None:
    """A config label_map: a list of labels (id = position) or a table label -> id, with ids
    exactly 0..n-1. None passes through (the map is then derived from the data)."""
    if raw is None:
        return None
    if isinstance(raw, (list, tuple)):
        labels = [str(x) for x in raw]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ConfigError(f"{who}: label_map lists {dupes} more than once")
        result = {label: i for i, label in enumerate(labels)}
    elif isinstance(raw, Mapping):
        result = {}
        for label, idx in raw.items():
            if not isinstance(idx, int) or isinstance(idx, bool):
                raise ConfigError(f"{who}: label_map[{label!r}] = {idx!r}; ids must be ints")
            result[str(label)] = idx
        if sorted(result.values()) != list(range(len(result))):
            raise ConfigError(
                f"{who}: label_map ids must be exactly 0..{len(result) - 1}, each once; got {sorted(result.values())}"
            )
    else:
        raise ConfigError(
            f"{who}: label_map must be a list of labels or a table label -> id, got {raw!r}"
        )
    if not result:
        raise ConfigError(f"{who}: label_map is empty")
    return result


def derive_label_map(labels: Iterable[str]) -> dict[str, int]:
    """Labels sorted (numerically when all are integers, so "0".."n-1" keep their ids)."""
    unique = set(labels)
    if unique and all(_INT_RE.fullmatch(x) for x in unique):
        ordered = sorted(unique, key=int)
    else:
        ordered = sorted(unique)
    return {label: i for i, label in enumerate(ordered)}


def split_indices(n: int, train_fraction: float, *, who: str) -> tuple[np.ndarray, np.ndarray]:
    """A fixed pseudo-random train/val split of n examples.

    Labeled files are often sorted by label, so a contiguous split would put whole classes in
    val. The permutation's seed is a constant, not the config seed, so the val set stays the
    same across runs that sample with different seeds.
    """
    if not 0.0 < train_fraction < 1.0:
        raise ConfigError(f"{who}: train_fraction must lie in (0, 1), got {train_fraction!r}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).numpy()
    n_train = round(n * train_fraction)
    if n_train == 0 or n_train == n:
        raise ConfigError(
            f"{who}: {n} examples with train_fraction={train_fraction} leaves a split empty; "
            "add examples, change train_fraction or give val_input"
        )
    return np.sort(perm[:n_train]), np.sort(perm[n_train:])


def as_paths(value: str | Sequence[str], *, key: str, who: str) -> list[Path]:
    """A config value that is one path or a list of paths, each an existing file."""
    items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    if not items:
        raise ConfigError(f"{who}: {key} is empty")
    paths = [Path(p).expanduser() for p in items]
    for p in paths:
        if not p.is_file():
            raise ConfigError(f"{who}: {key} {str(p)!r} is not a file")
    return paths


def check_block_size(block_size: Any, *, minimum: int, who: str) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < minimum:
        raise ConfigError(f"{who}: block_size must be an int >= {minimum}, got {block_size!r}")
    return block_size
