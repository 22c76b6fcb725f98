"""The WordPiece tokenizer of bert_mlm, classification and token_classification.

A local BERT `vocab.txt` or a `tokenizer.json`, loaded as a `tokenizers.Tokenizer` with BERT's
special tokens checked at start-up rather than discovered mid-run, and read as special even
in a plain vocab.txt, so that text in the data cannot forge a [CLS] or a [SEP].
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError
from queue_providers.tokenizer_sources import HF_FILE, resolve_hf_file

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
BERT_SPECIALS = (PAD, UNK, CLS, SEP, MASK)


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

    `path` may also be a folder holding either, or a hub repo id ("bert-base-uncased") whose
    files are in the local Hugging Face cache (tokenizer_sources.py; nothing is downloaded).
    `lowercase` applies to vocab.txt only (default True, as bert-base-uncased); a tokenizer.json
    carries its own normaliser. Raises ConfigError naming the file and every token of `require`
    the vocab lacks.
    """
    path = resolve_hf_file(os.fspath(path), (HF_FILE, "vocab.txt"), who=who)
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
