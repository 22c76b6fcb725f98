"""Where a tokenizer named in a config comes from: a file, a folder, the local Hugging Face
cache, or tiktoken's cache. Nothing here touches the network.

A server starts its datasets unattended, so a tokenizer is found on this machine or not at
all: `"gpt2"` is looked up in the Hugging Face hub cache ($HF_HUB_CACHE, else huggingface_hub's
default) with huggingface_hub's own cache lookup, and `"tiktoken:cl100k_base"` in tiktoken's
cache ($TIKTOKEN_CACHE_DIR, else $DATA_GYM_CACHE_DIR, else tiktoken's temp folder). A name that
is not there is a ConfigError that names it and says how to put it there.

Every resolver also returns the files the tokenizer was read from, so that a provider can
list them among its inputs: their content is part of the dataset's fingerprint.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError

TIKTOKEN_PREFIX = "tiktoken:"
HF_PREFIX = "hf:"
RANKS_SUFFIX = ".tiktoken"
HF_FILE = "tokenizer.json"

# A hub repo id ("gpt2", "org/name") and a revision: plain names only, so that no value can
# lead a cache lookup out of the cache folder.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+)?")
_REVISION = re.compile(r"[A-Za-z0-9_.-]+")
_ENCODING_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# A value ending so names a file, never a hub repo.
_FILE_SUFFIXES = (".json", ".txt", ".tiktoken", ".model")


# ---- Hugging Face -------------------------------------------------------------------------


def hf_cache_dir() -> str | None:
    """$HF_HUB_CACHE when set now (read at each call, unlike huggingface_hub's constant)."""
    return os.environ.get("HF_HUB_CACHE") or None


def resolve_hf_file(value: str, filenames: Sequence[str] = (HF_FILE,), *, who: str) -> Path:
    """The local file a Hugging Face tokenizer value names: the value itself when it is a file,
    the first of `filenames` inside it when it is a folder, else the first of `filenames`
    cached for the hub repo it names ("NAME", "ORG/NAME", either with "@REVISION"; "hf:" may
    prefix it). Raises ConfigError naming the value and what was looked for."""
    name = value[len(HF_PREFIX) :] if value.startswith(HF_PREFIX) else value
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        for filename in filenames:
            if (path / filename).is_file():
                return path / filename
        raise ConfigError(
            f"{who}: tokenizer {value!r} is a folder without {' or '.join(filenames)}"
        )
    return _hf_cached(value, name, filenames, who=who)


def _hf_cached(value: str, name: str, filenames: Sequence[str], *, who: str) -> Path:
    repo_id, _, revision = name.partition("@")
    looks_like_path = (
        name.startswith((".", "/", "~")) or name.endswith(_FILE_SUFFIXES) or name.count("/") > 1
    )
    if looks_like_path:
        raise ConfigError(
            f"{who}: tokenizer {value!r} is not a file (expected {' or '.join(filenames)}, a "
            "folder holding one, or a Hugging Face repo id such as 'gpt2')"
        )
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id:
        raise ConfigError(
            f"{who}: tokenizer {value!r} is not a file, a folder or a Hugging Face repo id "
            "(such as 'gpt2' or 'org/name'); it can also be 'byte', 'char', "
            "'tiktoken:ENCODING' or a .tiktoken file"
        )
    if revision and (not _REVISION.fullmatch(revision) or ".." in revision):
        raise ConfigError(f"{who}: tokenizer {value!r} has an invalid revision {revision!r}")
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        raise ConfigError(
            f"{who}: tokenizer {value!r} is not a file or folder, and looking it up in the "
            "Hugging Face cache needs the huggingface_hub package: pip install 'batchqueue[text]'"
        ) from None
    cache = hf_cache_dir()
    for filename in filenames:
        found = try_to_load_from_cache(
            repo_id, filename, cache_dir=cache, revision=revision or None
        )
        if isinstance(found, str) and Path(found).is_file():
            return Path(found)
    from huggingface_hub import constants

    where = cache or constants.HF_HUB_CACHE
    raise ConfigError(
        f"{who}: tokenizer {value!r} is not a file or folder, and the Hugging Face cache "
        f"({where}) holds no {' or '.join(filenames)} of {repo_id!r}"
        f"{f' at revision {revision!r}' if revision else ''}. batchqueue never downloads: "
        f"fetch it once with `huggingface-cli download {repo_id} {filenames[0]}` (or point "
        "HF_HUB_CACHE at a cache that has it), or give the path of the file"
    )


# ---- tiktoken -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TiktokenSpec:
    """What a tiktoken Encoding is built from, read from local files only."""

    name: str
    pat_str: str
    mergeable_ranks: dict[bytes, int]
    special_tokens: dict[str, int]
    files: tuple[Path, ...]  # where the ranks were read from


def is_tiktoken(value: str) -> bool:
    """A tokenizer value that names a tiktoken encoding or ranks file."""
    return value.startswith(TIKTOKEN_PREFIX) or value.endswith(RANKS_SUFFIX)


def tiktoken_target(value: str) -> str:
    """The encoding name or ranks file path of a tiktoken value ("tiktoken:" dropped)."""
    return value[len(TIKTOKEN_PREFIX) :] if value.startswith(TIKTOKEN_PREFIX) else value


def _is_ranks_path(target: str) -> bool:
    return target.endswith(RANKS_SUFFIX) or "/" in target or os.sep in target


def read_ranks(path: Path, *, who: str) -> dict[bytes, int]:
    """A tiktoken ranks file: one `BASE64TOKEN RANK` per line. Plain data, checked: tokens and
    ranks unique, every single byte present (tiktoken cannot encode a byte it lacks)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{who}: tiktoken ranks file {str(path)!r}: {exc.strerror}") from None
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    for line_no, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected two fields")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except ValueError:
            raise ConfigError(
                f"{who}: {path}:{line_no} is not 'BASE64TOKEN RANK': {line[:80]!r}"
            ) from None
        if token in ranks or rank in seen or rank < 0:
            raise ConfigError(f"{who}: {path}:{line_no}: token or rank {rank} repeats (or < 0)")
        ranks[token] = rank
        seen.add(rank)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ConfigError(
            f"{who}: tiktoken ranks file {str(path)!r} lacks {len(missing)} of the 256 single "
            f"bytes (first: {missing[:8]}); every byte needs a rank"
        )
    return ranks


def ranks_bytes(ranks: Mapping[bytes, int]) -> bytes:
    """Ranks in tiktoken's file format, ordered by rank: the canonical form a snapshot keeps."""
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    return b"".join(base64.b64encode(tok) + b" %d\n" % rank for tok, rank in ordered)


def ranks_digest(ranks: Mapping[bytes, int]) -> str:
    return hashlib.sha256(ranks_bytes(ranks)).hexdigest()


def gpt2_pattern() -> str:
    """GPT-2's pre-tokenizer regex, as tiktoken ships it (byte-level BPE's usual split)."""
    try:
        from tiktoken_ext.openai_public import r50k_pat_str
    except ImportError:
        raise ConfigError(
            "tiktoken tokenizers need the tiktoken package: pip install 'batchqueue[hf]'"
        ) from None
    return str(r50k_pat_str)


def resolve_tiktoken(
    value: str, *, eos_token: str | None, pattern: str | None, who: str
) -> TiktokenSpec:
    """The encoding a tiktoken value names, from local files only.

    "tiktoken:NAME" is a registered encoding (cl100k_base, o200k_base, ...) whose files must
    already be in tiktoken's cache; "tiktoken:PATH" or a PATH ending in .tiktoken is a ranks
    file, split by `pattern` (default GPT-2's) and given `eos_token` (default <|endoftext|>)
    as its one special token, right after the last rank."""
    target = tiktoken_target(value)
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise ConfigError(f"{who}: tiktoken_pattern must be a regex string, got {pattern!r}")
    if not target:
        raise ConfigError(f"{who}: tokenizer {value!r} names no tiktoken encoding or file")
    if _is_ranks_path(target) or Path(target).expanduser().is_file():
        path = Path(target).expanduser()
        if not path.is_file():
            raise ConfigError(f"{who}: tiktoken ranks file {target!r} is not a file")
        ranks = read_ranks(path, who=who)
        eos = eos_token or "<|endoftext|>"
        return TiktokenSpec(
            name=path.stem,
            pat_str=pattern or gpt2_pattern(),
            mergeable_ranks=ranks,
            special_tokens={eos: max(ranks.values()) + 1},
            files=(path,),
        )
    if pattern is not None:
        raise ConfigError(
            f"{who}: tiktoken_pattern applies to a .tiktoken ranks file; the encoding "
            f"{target!r} has its own"
        )
    if not _ENCODING_NAME.fullmatch(target):
        raise ConfigError(f"{who}: {target!r} is not a tiktoken encoding name")
    params, files = _load_registered(target, who=who)
    return TiktokenSpec(
        name=str(params.get("name", target)),
        pat_str=params["pat_str"],
        mergeable_ranks=params["mergeable_ranks"],
        special_tokens=dict(params["special_tokens"]),
        files=tuple(files),
    )


class _NotCached(Exception):
    def __init__(self, blobpath: str, cache_path: str) -> None:
        super().__init__(blobpath)
        self.blobpath, self.cache_path = blobpath, cache_path


_TIKTOKEN_LOCK = threading.Lock()
# tiktoken's cache folder in the temp dir when neither of its variables is set.
_TIKTOKEN_TEMP_CACHE = "data-gym-cache"


def _tiktoken_cache_dir() -> str:
    """The folder tiktoken caches downloads in, by tiktoken's own rule."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    import tempfile

    return os.path.join(tempfile.gettempdir(), _TIKTOKEN_TEMP_CACHE)


@contextlib.contextmanager
def _offline_reads(files: list[Path]) -> Iterator[None]:
    """tiktoken's file reads, served from its cache (files named by sha1 of the URL, as
    tiktoken names them) or from local paths, never fetched; each file read is noted."""
    import tiktoken.load as tl

    def read_cached(blobpath: str, expected_hash: str | None = None) -> bytes:
        if "://" not in blobpath:
            path = Path(blobpath)
        else:
            cache_dir = _tiktoken_cache_dir()
            key = hashlib.sha1(blobpath.encode()).hexdigest()
            path = Path(cache_dir, key)
            if not cache_dir or not path.is_file():
                raise _NotCached(blobpath, str(path))
        data = path.read_bytes()
        if expected_hash and hashlib.sha256(data).hexdigest() != expected_hash:
            raise _NotCached(blobpath, f"{path} (its content does not match tiktoken's hash)")
        files.append(path)
        return data

    with _TIKTOKEN_LOCK:
        saved = tl.read_file_cached
        tl.read_file_cached = read_cached
        try:
            yield
        finally:
            tl.read_file_cached = saved


def _load_registered(name: str, *, who: str) -> tuple[dict[str, Any], list[Path]]:
    try:
        import tiktoken.registry as registry
    except ImportError:
        raise ConfigError(
            f"{who}: tokenizer 'tiktoken:{name}' needs the tiktoken package: "
            "pip install 'batchqueue[hf]'"
        ) from None
    known = registry.list_encoding_names()  # finds the plugins' constructors once
    constructors = registry.ENCODING_CONSTRUCTORS or {}
    if name not in known:
        raise ConfigError(
            f"{who}: tokenizer 'tiktoken:{name}': tiktoken has no encoding {name!r}; it has "
            f"{sorted(constructors)} (or give a .tiktoken ranks file)"
        )
    files: list[Path] = []
    try:
        with _offline_reads(files):
            params = constructors[name]()
    except _NotCached as missing:
        raise ConfigError(
            f"{who}: tokenizer 'tiktoken:{name}' is not available offline: tiktoken's cache "
            f"has no {missing.cache_path} (a copy of {missing.blobpath}). batchqueue never "
            'downloads: run `python -c "import tiktoken; tiktoken.get_encoding('
            f"'{name}')\"` once where the network is reachable, with TIKTOKEN_CACHE_DIR set to "
            "a folder the server then uses, or give a .tiktoken ranks file"
        ) from None
    return params, files
