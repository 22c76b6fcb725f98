"""meta.pkl: the strict dataset contract, read without running code.

meta.pkl stays a pickle for nanoGPT compatibility (its train.py and sample.py read it), but it
is only ever loaded by `load_meta`, whose unpickler refuses every global: only plain data
(str, bytes, int, float, bool, None, list, tuple, dict, set) comes back.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from queue_client.errors import MetaError
from queue_client.schema import FieldSpec, parse_schema


class TrainingType(str, Enum):
    LM = "LM"
    MLM = "MLM"
    CLASSIFICATION = "CLASSIFICATION"
    TOKEN_CLASSIFICATION = "TOKEN_CLASSIFICATION"
    SEQUENCE_SCORING = "SEQUENCE_SCORING"


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
    """Read meta.pkl safely. Raises MetaError naming the file on any failure."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise MetaError(f"{path} is missing: the provider writes it before serving") from None
    try:
        meta = loads_plain(data)
    except Exception as exc:
        raise MetaError(f"{path} is not a plain-data pickle: {exc}") from None
    if not isinstance(meta, dict):
        raise MetaError(f"{path} holds a {type(meta).__name__}, expected a dict")
    return meta


def dump_meta(path: Path, meta: Mapping[str, Any]) -> None:
    """Write meta.pkl atomically (tmp, fsync, rename), refusing anything but plain data."""
    data = pickle.dumps(dict(meta), protocol=4)
    loads_plain(data)  # the same check readers apply, so a bad meta fails at the writer
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def meta_to_json(meta: Mapping[str, Any]) -> str:
    """JSON for the wire; dicts with non-string keys (itos) keep their keys' types."""
    return json.dumps(_encode(dict(meta)), sort_keys=True)


def meta_from_json(text: str) -> dict[str, Any]:
    return _decode(json.loads(text))
