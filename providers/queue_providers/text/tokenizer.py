"""Text to token ids, a block of documents at a time, and the snapshot that pins it.

Four kinds:
  - byte: the UTF-8 bytes (ids 0-255) and EOS = 256; vocab_size 257. Needs nothing.
  - char: one id per character of the corpus (sorted by code point), then EOS, then UNK for a
    character the vocabulary lacks; built by one streaming pass over the corpus.
  - hf: a tokenizer.json through the `tokenizers` library, encoded without the
    tokenizer's own special tokens (the provider adds EOS itself). Given as a file, a folder
    holding one, or a hub repo id found in the local Hugging Face cache.
  - tiktoken: a tiktoken encoding (text/tiktoken_tokenizer.py), by name from tiktoken's cache
    or from a .tiktoken ranks file.
Where a named tokenizer's files come from is tokenizer_sources.py's job; nothing is downloaded.

`encode_docs(texts)` returns one flat int32 array holding each document's ids followed by EOS,
and the lengths (EOS included): numpy per document, never a Python loop per token.

The snapshot that pins the tokenizer a dataset's batches were made with, and that every worker
loads, is tokenizer_snapshot.py's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from queue_client.errors import ConfigError
from queue_providers.tokenizer_sources import (
    HF_PREFIX,
    TiktokenSpec,
    is_tiktoken,
    resolve_hf_file,
    resolve_tiktoken,
    tiktoken_target,
)

KINDS = ("byte", "char", "hf", "tiktoken")
WHO = "text_lm"
# Tried in order when eos_token is not given.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class TextTokenizer(Protocol):
    kind: str
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode_docs(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def describe(self) -> dict[str, Any]: ...


def _append_eos(ids: np.ndarray, lengths: np.ndarray, eos: int) -> tuple[np.ndarray, np.ndarray]:
    flat = np.insert(ids.astype(np.int32, copy=False), np.cumsum(lengths), np.int32(eos))
    return flat, lengths + 1


class ByteTokenizer:
    kind = "byte"
    vocab_size = 257
    eos_id = 256
    pad_id = 256

    def encode_docs(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        raw = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw)) + 1
        # A zero byte after each document marks where EOS goes: one join, one widening copy
        # and a scatter of one id per document, instead of np.insert's general machinery.
        flat = np.frombuffer(b"\0".join(raw) + b"\0", dtype=np.uint8).astype(np.int32)
        flat[np.cumsum(lengths) - 1] = self.eos_id
        return flat, lengths

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}


class CharTokenizer:
    kind = "char"

    def __init__(self, chars: str) -> None:
        if not chars:
            raise ConfigError("a char tokenizer needs at least one character")
        self.chars = "".join(sorted(set(chars)))
        self._points = np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)
        self.eos_id = len(self.chars)
        self.unk_id = len(self.chars) + 1
        self.pad_id = self.eos_id
        self.vocab_size = len(self.chars) + 2

    def encode_docs(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        points = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
        idx = np.minimum(np.searchsorted(self._points, points), len(self._points) - 1)
        ids = np.where(self._points[idx] == points, idx, self.unk_id)
        return _append_eos(ids, lengths, self.eos_id)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return "".join(self.chars[i] for i in np.asarray(ids).tolist() if i < len(self.chars))

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "chars": self.chars, "unk_id": self.unk_id}


class HFTokenizer:
    kind = "hf"

    def __init__(self, path: Path, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ConfigError(
                f"tokenizer file {str(path)!r} does not load with `tokenizers`: {exc}"
            ) from None
        self.path = path
        if eos_token is None:
            eos_token = next(
                (t for t in EOS_CANDIDATES if self._tok.token_to_id(t) is not None), None
            )
            if eos_token is None:
                added = sorted(t.content for t in self._tok.get_added_tokens_decoder().values())
                raise ConfigError(
                    f"tokenizer file {str(path)!r} has none of the usual end-of-text tokens "
                    f"{list(EOS_CANDIDATES)}; set eos_token to one of its special tokens {added}"
                )
        eos = self._tok.token_to_id(eos_token)
        if eos is None:
            raise ConfigError(f"eos_token {eos_token!r} is not in the vocabulary of {str(path)!r}")
        self.eos_token = eos_token
        self.eos_id = int(eos)
        self.pad_id = self.eos_id
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode_docs(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        ids = [e.ids for e in encodings]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(
            itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum())
        )
        return _append_eos(flat, lengths, self.eos_id)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False)

    def describe(self) -> dict[str, Any]:
        specials = {t.content: int(i) for i, t in self._tok.get_added_tokens_decoder().items()}
        return {"kind": self.kind, "eos_token": self.eos_token, "special_tokens": specials}


# ---- what the config names ----------------------------------------------------------------


def parse_tokenizer_arg(tokenizer: object, tokenizer_path: str | None) -> tuple[str, str | None]:
    """(kind, reference) from text_lm's `tokenizer` and `tokenizer_path` args, checked for
    form only (nothing is looked up): "byte" and "char" need nothing; "hf" takes
    tokenizer_path; "tiktoken:NAME", "tiktoken:PATH" or a PATH ending in .tiktoken is a tiktoken
    encoding; any other value is a Hugging Face tokenizer (a tokenizer.json, a folder holding
    one, or a hub repo id in the local cache)."""
    if not isinstance(tokenizer, str) or not tokenizer:
        raise ConfigError(
            f"{WHO} tokenizer must be a string such as 'byte', 'char', a tokenizer.json, a "
            f"Hugging Face repo id or 'tiktoken:cl100k_base', got {tokenizer!r}"
        )
    if tokenizer in ("byte", "char"):
        return tokenizer, None
    if tokenizer in ("hf", "tiktoken"):
        if not tokenizer_path:
            raise ConfigError(
                f"{WHO} tokenizer {tokenizer!r} needs tokenizer_path: "
                + (
                    "the path of a tokenizer.json, a folder holding one, or a Hugging Face "
                    "repo id in the local cache (or give that as tokenizer itself)"
                    if tokenizer == "hf"
                    else "an encoding name or a .tiktoken file (or give tokenizer = "
                    "'tiktoken:NAME' itself)"
                )
            )
        return tokenizer, tiktoken_target(tokenizer_path) if tokenizer == "tiktoken" else (
            tokenizer_path
        )
    if tokenizer_path:
        raise ConfigError(
            f"{WHO}: tokenizer = {tokenizer!r} names the tokenizer already; tokenizer_path "
            f"({tokenizer_path!r}) goes with tokenizer = 'hf' or 'tiktoken' only"
        )
    if is_tiktoken(tokenizer):
        return "tiktoken", tiktoken_target(tokenizer)
    return "hf", tokenizer[len(HF_PREFIX) :] if tokenizer.startswith(HF_PREFIX) else tokenizer


def hf_file(ref: str | None) -> Path:
    """The tokenizer.json a configured 'hf' tokenizer reads (tokenizer_sources.py finds it)."""
    if not ref:
        raise ConfigError(
            f"{WHO} tokenizer 'hf' needs tokenizer_path, the path of a tokenizer.json"
        )
    return resolve_hf_file(ref, who=WHO)


def tiktoken_spec(ref: str | None, eos_token: str | None, pattern: str | None) -> TiktokenSpec:
    """The ranks, pattern and special tokens of a configured 'tiktoken' tokenizer."""
    if not ref:
        raise ConfigError(f"{WHO} tokenizer 'tiktoken' needs an encoding name or ranks file")
    return resolve_tiktoken(ref, eos_token=eos_token, pattern=pattern, who=WHO)


def tokenizer_files(
    kind: str, ref: str | None, *, eos_token: str | None = None, pattern: str | None = None
) -> list[Path]:
    """The files a configured tokenizer is read from (none for byte and char): a dataset's
    inputs, so a tokenizer whose content changed is refused like a changed corpus file."""
    if kind == "hf":
        return [hf_file(ref)]
    if kind == "tiktoken":
        return list(tiktoken_spec(ref, eos_token, pattern).files)
    return []
