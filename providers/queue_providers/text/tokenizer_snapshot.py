"""The snapshot that pins a dataset's tokenizer: written when meta is first built, loaded by
every worker.

The snapshot (the dataset's tokenizer/ directory, layout.tokenizer_dir) holds snapshot.json and,
for hf and tiktoken, a copy of the tokenizer's file, so a restart tokenizes identically even if
the corpus or the tokenizer file changed meanwhile; a tokenizer_path whose content differs from
the snapshot is refused rather than silently ignored (for tiktoken: ranks, pattern or special
tokens other than the snapshot's). Meta keeps the snapshot's sha256: a snapshot changed since
meta was built is refused too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError, MetaError
from queue_client.format.layout import TOKENIZER_DIR, DatasetLayout, atomic_write
from queue_providers.text.tiktoken_tokenizer import TiktokenTokenizer
from queue_providers.text.tokenizer import (
    KINDS,
    WHO,
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    TextTokenizer,
    hf_file,
    tiktoken_spec,
)
from queue_providers.tokenizer_sources import TiktokenSpec, ranks_bytes, read_ranks

INFO_FILE = "snapshot.json"
HF_FILE = "tokenizer.json"
RANKS_FILE = "ranks.tiktoken"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _info_of(tok: TextTokenizer, digest: str) -> dict[str, Any]:
    return {
        **tok.describe(),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "sha256": digest,
        "snapshot": TOKENIZER_DIR,
    }


_SNAPSHOT_FILES = {"hf": HF_FILE, "tiktoken": RANKS_FILE}


def _snapshot_digest(snap: Path, kind: str) -> str:
    h = hashlib.sha256((snap / INFO_FILE).read_bytes())
    if kind in _SNAPSHOT_FILES:
        h.update((snap / _SNAPSHOT_FILES[kind]).read_bytes())
    return h.hexdigest()


def _record(tok: TextTokenizer) -> dict[str, Any]:
    """What snapshot.json keeps to build the tokenizer again, beside the snapshot's file."""
    if isinstance(tok, TiktokenTokenizer):
        return {**tok.describe(), "pat_str": tok.pat_str}
    return {k: v for k, v in tok.describe().items() if k != "special_tokens"}


def _tiktoken_of(spec: TiktokenSpec, eos_token: str | None) -> TiktokenTokenizer:
    return TiktokenTokenizer(
        spec.name,
        pat_str=spec.pat_str,
        mergeable_ranks=spec.mergeable_ranks,
        special_tokens=spec.special_tokens,
        eos_token=eos_token,
    )


def _refuse_changed(
    snap: Path, kind: str, record: Mapping[str, Any], ref: str | None, **kw: Any
) -> None:
    """ConfigError when the configured tokenizer is not the one snapshotted."""
    if kind == "hf" and ref is not None:
        path = hf_file(ref)
        if _sha256(path.read_bytes()) != _sha256((snap / HF_FILE).read_bytes()):
            raise ConfigError(
                f"tokenizer {ref!r} ({path}) differs from the snapshot {snap / HF_FILE} that "
                f"this dataset's batches were made with; delete {snap} to adopt the new file"
            )
    if kind == "tiktoken" and ref is not None:
        spec = tiktoken_spec(ref, kw.get("eos_token"), kw.get("pattern"))
        same = (
            ranks_bytes(spec.mergeable_ranks) == (snap / RANKS_FILE).read_bytes()
            and spec.pat_str == record.get("pat_str")
            and spec.special_tokens == record.get("special_tokens")
        )
        if not same:
            raise ConfigError(
                f"tiktoken tokenizer {ref!r} differs from the snapshot in {snap} (ranks, pattern "
                "or special tokens) that this dataset's batches were made with; delete "
                f"{snap} to adopt it"
            )


def prepare_tokenizer(
    kind: str,
    layout: DatasetLayout,
    *,
    tokenizer_path: str | None,
    eos_token: str | None,
    corpus_texts: Callable[[], Iterable[str]],
    pattern: str | None = None,
) -> tuple[TextTokenizer, dict[str, Any]]:
    """The tokenizer for `kind`, from the snapshot if there is one, else built and snapshotted.

    `tokenizer_path` is the reference parse_tokenizer_arg gave (a path, a hub repo id, a
    tiktoken encoding name or ranks file). Returns the tokenizer and its plain-data description
    for meta (vocab_size, special ids, the snapshot's sha256). `corpus_texts` is called only to
    build a char vocabulary; `pattern` is the split regex of a tiktoken ranks file.
    """
    if kind not in KINDS:
        raise ConfigError(f"tokenizer must be one of {list(KINDS)}, got {kind!r}")
    snap = layout.tokenizer_dir
    info_path = snap / INFO_FILE
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("kind") != kind:
            raise ConfigError(
                f"{snap} holds a {info.get('kind')!r} tokenizer snapshot but the config asks for "
                f"{kind!r}: the queued batches were made with the old one; delete {snap} (and the "
                "queued files) to change tokenizers"
            )
        _refuse_changed(snap, kind, info, tokenizer_path, eos_token=eos_token, pattern=pattern)
        pinned = _from_snapshot(snap, info)
        return pinned, _info_of(pinned, _snapshot_digest(snap, kind))

    tok: TextTokenizer
    payload: bytes | None = None
    if kind == "byte":
        tok = ByteTokenizer()
    elif kind == "char":
        chars: set[str] = set()
        for text in corpus_texts():
            chars.update(text)
        tok = CharTokenizer("".join(chars))
    elif kind == "hf":
        path = hf_file(tokenizer_path)
        payload = path.read_bytes()
        tok = HFTokenizer(path, eos_token)
    else:
        spec = tiktoken_spec(tokenizer_path, eos_token, pattern)
        tok = _tiktoken_of(spec, eos_token)
        payload = ranks_bytes(spec.mergeable_ranks)
    snap.mkdir(parents=True, exist_ok=True)
    if payload is not None:
        atomic_write(snap / _SNAPSHOT_FILES[kind], payload)
    atomic_write(info_path, json.dumps(_record(tok), sort_keys=True).encode())
    return tok, _info_of(tok, _snapshot_digest(snap, kind))


def _from_snapshot(snap: Path, record: Mapping[str, Any]) -> TextTokenizer:
    kind = record.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer(record["chars"])
    if kind == "hf":
        return HFTokenizer(snap / HF_FILE, record.get("eos_token"))
    if kind == "tiktoken":
        return TiktokenTokenizer(
            record["name"],
            pat_str=record["pat_str"],
            mergeable_ranks=read_ranks(snap / RANKS_FILE, who=WHO),
            special_tokens=record["special_tokens"],
            eos_token=record["eos_token"],
        )
    raise MetaError(f"{snap / INFO_FILE}: unknown tokenizer kind {kind!r}")


def load_tokenizer(layout: DatasetLayout, info: Mapping[str, Any]) -> TextTokenizer:
    """The snapshotted tokenizer that meta describes; refuses a snapshot changed since."""
    snap = layout.tokenizer_dir
    if info.get("snapshot", TOKENIZER_DIR) != TOKENIZER_DIR:
        raise MetaError(
            f"meta names tokenizer snapshot {info['snapshot']!r}; text_lm keeps it in "
            f"{TOKENIZER_DIR!r} of the dataset: rebuild meta"
        )
    try:
        record = json.loads((snap / INFO_FILE).read_text())
        digest = _snapshot_digest(snap, info["kind"])
    except FileNotFoundError as exc:
        raise MetaError(
            f"tokenizer snapshot {snap} is incomplete ({exc.filename} is missing): rebuild meta"
        ) from None
    if digest != info.get("sha256"):
        raise MetaError(f"tokenizer snapshot {snap} changed since meta.pkl was built: rebuild meta")
    tok = _from_snapshot(snap, record)
    if tok.vocab_size != info.get("vocab_size") or tok.eos_id != info.get("eos_id"):
        raise MetaError(f"tokenizer snapshot {snap} does not match meta's vocab_size/eos_id")
    return tok
