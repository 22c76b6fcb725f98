"""meta.pkl: the strict dataset contract, read without running code.

meta.pkl stays a pickle for nanoGPT compatibility (its train.py and sample.py read it), but it
is only ever loaded by `load_meta`, whose unpickler refuses every global: only plain data
(str, bytes, int, float, bool, None, list, tuple, dict, set) comes back.

Plain data can still be a bomb: a pickle stores a shared object once and refers to it by
memo, so an 819-byte file of lists holding the same list twice, 25 levels deep, expands to
gigabytes when it is walked (as JSON writes it). `load_meta` therefore refuses a file over
MAX_META_FILE_BYTES, and `check_meta_size` (called by `load_meta` and `meta_to_json`) sizes
the value as written out, every use of a shared object counted, and raises a MetaError when
it passes MAX_META_NODES values, about MAX_META_JSON_BYTES bytes of JSON, or MAX_META_DEPTH
levels of nesting (a reference cycle is infinitely deep). It measures each distinct object
once, so it costs time linear in the file, never in what the file expands to. None of these
functions keeps state: they are safe to call in a thread.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import pickle
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, NoReturn

from queue_client.errors import MetaError
from queue_client.format.layout import atomic_write
from queue_client.format.schema import FieldSpec, parse_schema


class TrainingType(str, Enum):
    LM = "LM"
    MLM = "MLM"
    CLASSIFICATION = "CLASSIFICATION"
    TOKEN_CLASSIFICATION = "TOKEN_CLASSIFICATION"
    SEQUENCE_SCORING = "SEQUENCE_SCORING"


# Generous for a real meta (a 256k-token vocab as itos is ~1M values and ~5 MB), and below
# the 64 MiB a GetMeta reply may carry.
MAX_META_FILE_BYTES = 32 * 1024 * 1024
MAX_META_NODES = 4_000_000
MAX_META_JSON_BYTES = 48 * 1024 * 1024
MAX_META_DEPTH = 64

REQUIRED_KEYS = ("dataset_name", "training_type", "batch_size", "batch_schema", "split_info")
# Keys that must be present for a training type, because the trainer sizes its model by them.
REQUIRED_BY_TYPE: dict[TrainingType, tuple[str, ...]] = {
    TrainingType.LM: ("vocab_size", "block_size"),
    TrainingType.MLM: ("vocab_size", "block_size"),
    TrainingType.CLASSIFICATION: ("num_classes",),
    TrainingType.TOKEN_CLASSIFICATION: ("vocab_size", "num_labels"),
    TrainingType.SEQUENCE_SCORING: (),
}


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"meta.pkl refers to {module}.{name}; only plain data (dict, list, str, numbers) is allowed"
        )


def loads_plain(data: bytes) -> Any:
    """Unpickle bytes that may hold only plain data; anything that names a class is refused."""
    return _PlainDataUnpickler(io.BytesIO(data)).load()


def load_meta(path: Path) -> dict[str, Any]:
    """Read meta.pkl safely. Raises MetaError naming the file on any failure, also when the
    file or what it expands to passes the limits above."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_META_FILE_BYTES + 1)
    except FileNotFoundError:
        raise MetaError(f"{path} is missing: the provider writes it before serving") from None
    except OSError as exc:
        raise MetaError(f"{path} cannot be read: {exc.strerror}") from None
    if len(data) > MAX_META_FILE_BYTES:
        raise MetaError(
            f"{path} is larger than MAX_META_FILE_BYTES = {MAX_META_FILE_BYTES} bytes: "
            "meta.pkl holds the dataset's contract, not its data"
        )
    try:
        meta = loads_plain(data)
    except Exception as exc:
        raise MetaError(f"{path} is not a plain-data pickle: {exc}") from None
    if not isinstance(meta, dict):
        raise MetaError(f"{path} holds a {type(meta).__name__}, expected a dict")
    check_meta_size(meta, where=str(path))
    return meta


def check_meta_size(meta: Any, *, where: str = "meta") -> None:
    """Refuse a meta whose expanded form passes MAX_META_NODES values, about
    MAX_META_JSON_BYTES bytes of JSON, or MAX_META_DEPTH levels (a cycle is infinitely deep).

    A shared object counts once per use, as it is written out, but is measured only once, so
    the check costs time linear in the pickle, not in what it expands to. The MetaError names
    `where`, the limit, and the size counted when it stopped.
    """
    if isinstance(meta, (dict, list, tuple, set, frozenset)):
        _measure(meta, 1, {}, where)


def _measure(
    value: Any, depth: int, memo: dict[int, tuple[int, int, int] | None], where: str
) -> tuple[int, int, int]:
    """(values, approximate JSON bytes, levels) of `value` written out; recursion is bounded
    by MAX_META_DEPTH."""
    key = id(value)
    if key in memo:
        known = memo[key]
        if known is None:
            raise MetaError(
                f"{where} holds a reference cycle at level {depth}: it would expand forever"
            )
        if depth + known[2] - 1 > MAX_META_DEPTH:
            _too_deep(where, known[0], known[1])
        return known
    if depth > MAX_META_DEPTH:
        _too_deep(where, 0, 0)
    children = itertools.chain(value, value.values()) if isinstance(value, dict) else value
    memo[key] = None  # in progress: meeting it again below is a cycle
    nodes, size, height = 1, 2, 1
    for child in children:
        if isinstance(child, (str, bytes, bytearray)):
            nodes, size = nodes + 1, size + len(child) + 3
        elif isinstance(child, (dict, list, tuple, set, frozenset)):
            n, b, h = _measure(child, depth + 1, memo, where)
            nodes, size, height = nodes + n, size + b, max(height, h + 1)
        elif isinstance(child, int) and child.bit_length() > 64:
            nodes, size = nodes + 1, size + child.bit_length() // 3 + 2  # decimal digits
        else:
            nodes, size = nodes + 1, size + 8  # a number, a separator
        if nodes > MAX_META_NODES or size > MAX_META_JSON_BYTES:
            limit = (
                f"MAX_META_NODES = {MAX_META_NODES} values"
                if nodes > MAX_META_NODES
                else f"MAX_META_JSON_BYTES = {MAX_META_JSON_BYTES} bytes"
            )
            raise MetaError(
                f"{where} expands past {limit}: stopped at {nodes} values and about "
                f"{size} bytes of JSON, {depth} levels deep (objects shared in the pickle "
                "count once per use, as they are written out)"
            )
    memo[key] = (nodes, size, height)
    return nodes, size, height


def _too_deep(where: str, nodes: int, size: int) -> NoReturn:
    raise MetaError(
        f"{where} nests deeper than MAX_META_DEPTH = {MAX_META_DEPTH} levels "
        f"(stopped at {nodes} values and about {size} bytes of JSON below that level)"
    )


def dump_meta(path: Path, meta: Mapping[str, Any]) -> None:
    """Write meta.pkl atomically (layout.atomic_write), refusing anything but plain data."""
    data = pickle.dumps(dict(meta), protocol=4)
    loads_plain(data)  # the same check readers apply, so a bad meta fails at the writer
    atomic_write(path, data)


def validate_meta(meta: Mapping[str, Any], *, where: str = "meta") -> tuple[FieldSpec, ...]:
    """Check the strict contract; return the parsed default batch schema.

    Raises MetaError that names every missing key, or the key whose value is wrong.
    """
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    ttype = None
    if "training_type" in meta:
        try:
            ttype = TrainingType(meta["training_type"])
        except ValueError:
            raise MetaError(
                f"{where}: training_type {meta['training_type']!r} is not one of {[t.value for t in TrainingType]}"
            ) from None
        missing += [k for k in REQUIRED_BY_TYPE[ttype] if k not in meta]
    if missing:
        needed = (
            f" (training_type {ttype.value} needs {list(REQUIRED_BY_TYPE[ttype])})" if ttype else ""
        )
        raise MetaError(f"{where} lacks required keys {missing}{needed}")
    for key in ("batch_size", "vocab_size", "block_size", "num_classes", "num_labels"):
        if key in meta and (
            not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] <= 0
        ):
            raise MetaError(f"{where}: {key} must be a positive int, got {meta[key]!r}")
    if not isinstance(meta["split_info"], dict) or not meta["split_info"]:
        raise MetaError(f"{where}: split_info must be a non-empty dict of split name to info")
    return parse_schema(meta["batch_schema"])


def split_schema(meta: Mapping[str, Any], split: str) -> tuple[FieldSpec, ...]:
    """A split's schema: split_info[split]["batch_schema"] if given, else the default one."""
    info = meta.get("split_info", {}).get(split, {})
    raw = info.get("batch_schema") if isinstance(info, dict) else None
    return parse_schema(raw if raw is not None else meta["batch_schema"])


def token_field(meta: Mapping[str, Any], split: str) -> tuple[str, int]:
    """(the field whose positions count as a sample's tokens, its positions per sample):
    meta's token_field, else "x", else "input_ids", else the first input field, padding
    included. Raises MetaError (or KeyError) for a meta without a usable schema."""
    schema = split_schema(meta, split)
    by_name = {f.name: f for f in schema}
    wanted = meta.get("token_field")
    for name in (wanted, "x", "input_ids"):
        if isinstance(name, str) and name in by_name:
            spec = by_name[name]
            break
    else:
        spec = next((f for f in schema if f.role == "input"), schema[0])
    return spec.name, math.prod(spec.shape)


def _encode(value: Any) -> Any:
    if isinstance(value, dict):
        # A str-keyed dict that looks like the marker itself is encoded as items too.
        if all(isinstance(k, str) for k in value) and set(value) != {"__items__"}:
            return {k: _encode(v) for k, v in value.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_encode(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("latin-1")
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__items__"}:
            return {_hashable(_decode(k)): _decode(v) for k, v in value["__items__"]}
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def meta_to_json(meta: Mapping[str, Any], *, where: str = "meta") -> str:
    """JSON for the wire; dicts with non-string keys (itos) keep their keys' types.
    Raises MetaError naming `where` for a meta past the size limits (check_meta_size)."""
    check_meta_size(meta, where=where)
    return json.dumps(_encode(dict(meta)), sort_keys=True)


def meta_from_json(text: str) -> dict[str, Any]:
    return _decode(json.loads(text))
