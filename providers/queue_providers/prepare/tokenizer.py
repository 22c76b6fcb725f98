"""The tokenizer a prepare run uses: resolved once in the main process, rebuilt in each worker.

`resolve_tokenizer` turns the --tokenizer value (the forms text_lm takes: byte, char, a
tokenizer.json or folder or cached hub name, tiktoken:ENCODING, a .tiktoken ranks file) into a
`TokenizerSpec`: plain data that a worker process rebuilds the very same tokenizer from
(`build`), and the tokenizer's identity for the manifest: kind, name, vocab_size, eos and a
sha256 of what it encodes with (the tokenizer.json's bytes; a tiktoken encoding's ranks,
pattern and special tokens; a char vocabulary's characters). A run resumed with another
identity is refused: its shards would mix two tokenizations.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError
from queue_providers.text.tiktoken_tokenizer import TiktokenTokenizer
from queue_providers.text.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    TextTokenizer,
    parse_tokenizer_arg,
)
from queue_providers.tokenizer_sources import (
    TiktokenSpec,
    ranks_bytes,
    resolve_hf_file,
    resolve_tiktoken,
)

WHO = "queue-prepare"


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to build the tokenizer (picklable), and what the manifest says."""

    kind: str
    eos_token: str | None
    hf_file: Path | None = None
    tiktoken: TiktokenSpec | None = None
    chars: str | None = None

    def build(self) -> TextTokenizer:
        if self.kind == "byte":
            return ByteTokenizer()
        if self.kind == "char":
            assert self.chars is not None
            return CharTokenizer(self.chars)
        if self.kind == "hf":
            assert self.hf_file is not None
            return HFTokenizer(self.hf_file, self.eos_token)
        assert self.tiktoken is not None
        spec = self.tiktoken
        return TiktokenTokenizer(
            spec.name,
            pat_str=spec.pat_str,
            mergeable_ranks=spec.mergeable_ranks,
            special_tokens=spec.special_tokens,
            eos_token=self.eos_token,
        )


def resolve_tokenizer(
    value: str,
    *,
    eos_token: str | None,
    pattern: str | None,
    corpus_texts: Callable[[], Iterable[str]],
) -> tuple[TokenizerSpec, dict[str, Any]]:
    """The spec and the manifest's `tokenizer` table for --tokenizer `value`. ConfigError
    names a tokenizer that is not on this machine or does not load. `corpus_texts` is read
    (one pass) only for a char vocabulary."""
    kind, ref = parse_tokenizer_arg(value, None)
    if kind != "tiktoken" and pattern is not None:
        raise ConfigError(f"--tiktoken-pattern applies to tiktoken tokenizers, not {value!r}")
    spec: TokenizerSpec
    payload: bytes
    if kind == "byte":
        spec, payload = TokenizerSpec(kind, None), b"byte"
    elif kind == "char":
        chars: set[str] = set()
        for text in corpus_texts():
            chars.update(text)
        spec = TokenizerSpec(kind, None, chars="".join(sorted(chars)))
        payload = spec.chars.encode("utf-8", "surrogatepass") if spec.chars else b""
    elif kind == "hf":
        assert ref is not None
        path = resolve_hf_file(ref, who=WHO)
        spec, payload = TokenizerSpec(kind, eos_token, hf_file=path), path.read_bytes()
    else:
        assert ref is not None
        tik = resolve_tiktoken(ref, eos_token=eos_token, pattern=pattern, who=WHO)
        spec = TokenizerSpec(kind, eos_token, tiktoken=tik)
        extra = json.dumps([tik.pat_str, tik.special_tokens], sort_keys=True).encode()
        payload = ranks_bytes(tik.mergeable_ranks) + b"\0" + extra
    tok = spec.build()  # loads it once here, so a bad file fails before any work starts
    identity: dict[str, Any] = {
        "kind": kind,
        "name": value,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    described = tok.describe()
    if "eos_token" in described:
        identity["eos_token"] = described["eos_token"]
    if spec.hf_file is not None:
        identity["file"] = str(spec.hf_file)
    if spec.tiktoken is not None:
        identity["files"] = [str(p) for p in spec.tiktoken.files]
    if spec.chars is not None:
        identity["chars"] = spec.chars
    return spec, identity


def tokenizer_change(recorded: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What differs between the tokenizer the shards were made with and this run's, or None
    when they encode alike (the same content under another path is the same tokenizer)."""
    keys = ("kind", "sha256", "vocab_size", "eos_id")
    if all(recorded.get(k) == now.get(k) for k in keys):
        return None
    return (
        f"the tokenizer changed: the shards were made with {_shown(recorded)}, this run "
        f"asks for {_shown(now)}"
    )


def _shown(identity: dict[str, Any]) -> str:
    return (
        f"{identity.get('kind')} {identity.get('name')!r} (vocab_size "
        f"{identity.get('vocab_size')}, eos_id {identity.get('eos_id')}, sha256 "
        f"{str(identity.get('sha256'))[:16]})"
    )
