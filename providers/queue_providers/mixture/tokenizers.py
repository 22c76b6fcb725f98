"""One tokenizer for a mixture's text_lm sources.

Token ids of two vocabularies cannot share one model's embedding table, and text_lm pins its
tokenizer in one snapshot per dataset dir (text/tokenizer_snapshot.py), which a mixture's
sources share. So a mixture whose text_lm sources name different tokenizers is refused when
it starts, naming the sources and their tokenizers, before either writes a snapshot. Two
'hf' or 'tiktoken' tokenizers are the same when their files hold the same bytes (and the
same eos_token and pattern), wherever they lie. A 'char' tokenizer builds its vocabulary
from its own corpus, so two text_lm sources cannot share one.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from queue_client.errors import ConfigError
from queue_providers.base import DataProviderBase
from queue_providers.text.tokenizer import tokenizer_files

if TYPE_CHECKING:
    from queue_providers.text_lm import TextLMProvider


def _shown(p: TextLMProvider) -> str:
    """The tokenizer as the config names it."""
    out = p.tokenizer_kind + (f" {p.tokenizer_path}" if p.tokenizer_path else "")
    if p.eos_token is not None:
        out += f", eos_token {p.eos_token!r}"
    if p.tiktoken_pattern is not None:
        out += f", tiktoken_pattern {p.tiktoken_pattern!r}"
    return repr(out)


def _identity(p: TextLMProvider) -> tuple[object, ...]:
    """What makes two configured tokenizers give the same ids: the kind, the bytes of its
    files, the end-of-document token and the split pattern."""
    files = tokenizer_files(
        p.tokenizer_kind, p.tokenizer_path, eos_token=p.eos_token, pattern=p.tiktoken_pattern
    )
    digests = tuple(hashlib.sha256(f.read_bytes()).hexdigest() for f in files)
    return p.tokenizer_kind, digests, p.eos_token, p.tiktoken_pattern


def check_one_tokenizer(
    names: Sequence[str], providers: Sequence[DataProviderBase], where: str
) -> None:
    """ConfigError naming two text_lm sources whose tokenizers differ (or share 'char')."""
    # A text_lm source imported text_lm to be made: with none, nothing here is one (and a
    # mixture of window sources never imports text_lm, nor the torch it uses).
    text_lm = sys.modules.get("queue_providers.text_lm")
    if text_lm is None:
        return
    text = [
        (n, p)
        for n, p in zip(names, providers, strict=True)
        if isinstance(p, text_lm.TextLMProvider)
    ]
    if len(text) < 2:
        return
    (first, base), rest = text[0], text[1:]
    if any(p.tokenizer_kind == "char" for _, p in text):
        name = next(n for n, p in text if p.tokenizer_kind == "char")
        raise ConfigError(
            f"{where}: text_lm source {name!r} has tokenizer 'char', whose vocabulary is built "
            f"from its own corpus, beside the text_lm sources {[n for n, _ in text if n != name]}"
            ": their ids would not share one vocabulary; give every text_lm source the same "
            "'byte', 'hf' or 'tiktoken' tokenizer"
        )
    want = _identity(base)
    for name, p in rest:
        if _identity(p) != want:
            raise ConfigError(
                f"{where}: text_lm sources {first!r} (tokenizer {_shown(base)}) and {name!r} "
                f"(tokenizer {_shown(p)}) use different tokenizers: ids of two vocabularies "
                "cannot share one model's embedding table (nor the dataset's one tokenizer "
                "snapshot); give every text_lm source the same tokenizer"
            )
