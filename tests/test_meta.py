"""meta.pkl: plain-data-only loading, atomic writing, strict validation, the JSON wire form."""

from __future__ import annotations

import collections
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_client.errors import MetaError
from queue_client.format.meta import (
    REQUIRED_KEYS,
    TrainingType,
    dump_meta,
    load_meta,
    loads_plain,
    meta_from_json,
    meta_to_json,
    split_schema,
    validate_meta,
)
from queue_client.format.schema import FieldSpec


class _TouchOnUnpickle:
    """Unpickling this runs Path.touch(marker): a stand-in for arbitrary code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


class _Plain:
    """An ordinary class instance: harmless, but still a global reference in a pickle."""

    def __init__(self) -> None:
        self.value = 1


def _good_meta(**overrides: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "dataset_name": "chars",
        "training_type": "LM",
        "batch_size": 4,
        "vocab_size": 65,
        "block_size": 8,
        "batch_schema": [
            {"name": "x", "dtype": "int64", "shape": [8], "role": "input"},
            {"name": "y", "dtype": "int64", "shape": [8], "role": "target"},
        ],
        "split_info": {"train": {"tokens": 100}, "val": {"tokens": 10}},
        "stoi": {"a": 0, "b": 1},
        "itos": {0: "a", 1: "b"},
    }
    meta.update(overrides)
    return meta


# ---- refusing code ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        os.system,
        pickle.loads,
        _Plain(),
        {"vocab": collections.OrderedDict(a=1)},
        {"n": complex(1, 2)},
        {"b": bytearray(b"x")},
    ],
    ids=["os.system", "pickle.loads", "class-instance", "OrderedDict", "complex", "bytearray"],
)
def test_globals_are_refused(tmp_path: Path, obj: object) -> None:
    """Any pickle that references a global, however innocent, is refused with MetaError."""
    data = pickle.dumps(obj, protocol=4)
    with pytest.raises(pickle.UnpicklingError, match="only plain data"):
        loads_plain(data)
    path = tmp_path / "meta.pkl"
    path.write_bytes(data)
    with pytest.raises(MetaError, match="not a plain-data pickle") as info:
        load_meta(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_code_in_meta_is_not_executed(tmp_path: Path, protocol: int) -> None:
    """A meta.pkl whose unpickling would run code raises MetaError, and the code never runs."""
    marker = tmp_path / "pwned"
    path = tmp_path / "meta.pkl"
    path.write_bytes(
        pickle.dumps({"dataset_name": "x", "evil": _TouchOnUnpickle(marker)}, protocol=protocol)
    )
    with pytest.raises(MetaError):
        load_meta(path)
    assert not marker.exists()
    # Control: the same bytes do run code under an unrestricted unpickler.
    pickle.loads(path.read_bytes())
    assert marker.exists()


def test_missing_meta_is_meta_error(tmp_path: Path) -> None:
    """A missing meta.pkl raises MetaError naming the path."""
    path = tmp_path / "meta.pkl"
    with pytest.raises(MetaError, match="missing") as info:
        load_meta(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("data", [b"", b"not a pickle", pickle.dumps({"a": 1})[:-3]])
def test_garbage_meta_is_meta_error(tmp_path: Path, data: bytes) -> None:
    """Empty, garbage and truncated files raise MetaError, not a raw unpickling error."""
    path = tmp_path / "meta.pkl"
    path.write_bytes(data)
    with pytest.raises(MetaError):
        load_meta(path)


def test_non_dict_meta_is_refused(tmp_path: Path) -> None:
    """A plain-data pickle that is not a dict is refused, naming the type found."""
    path = tmp_path / "meta.pkl"
    path.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(MetaError, match="list"):
        load_meta(path)


# ---- plain data round trip ----------------------------------------------------------------


def test_dump_load_round_trip_and_atomic(tmp_path: Path) -> None:
    """Plain data survives dump_meta/load_meta exactly, and no temp file is left behind."""
    meta = _good_meta(
        blob=b"\x00\xff",
        ratio=0.25,
        flags=(True, False, None),
        tags={"a", "b"},
        frozen=frozenset({1, 2}),
        nested={"deep": [{"k": -1}]},
    )
    path = tmp_path / "meta.pkl"
    dump_meta(path, meta)
    assert os.listdir(tmp_path) == ["meta.pkl"]
    assert load_meta(path) == meta


def test_dump_meta_overwrites_atomically(tmp_path: Path) -> None:
    """A second dump replaces the first in full; still no temp file."""
    path = tmp_path / "meta.pkl"
    dump_meta(path, {"v": 1})
    dump_meta(path, {"v": 2})
    assert load_meta(path) == {"v": 2}
    assert os.listdir(tmp_path) == ["meta.pkl"]


def test_dump_meta_refuses_non_plain_data(tmp_path: Path) -> None:
    """The writer applies the reader's check: a class instance fails before anything is written."""
    with pytest.raises(pickle.UnpicklingError):
        dump_meta(tmp_path / "meta.pkl", {"obj": _Plain()})
    assert os.listdir(tmp_path) == []


# ---- validation ---------------------------------------------------------------------------


def test_valid_meta_returns_schema() -> None:
    """A complete meta validates and yields its parsed batch schema."""
    schema = validate_meta(_good_meta())
    assert schema == (
        FieldSpec("x", "int64", (8,), "input"),
        FieldSpec("y", "int64", (8,), "target"),
    )


def test_validate_names_every_missing_required_key() -> None:
    """An empty meta's error lists every required key, not just the first."""
    with pytest.raises(MetaError) as info:
        validate_meta({}, where="here")
    message = str(info.value)
    assert message.startswith("here")
    for key in REQUIRED_KEYS:
        assert repr(key) in message


def test_validate_names_only_the_missing_keys() -> None:
    """Keys that are present are not reported as missing."""
    meta = _good_meta()
    del meta["batch_schema"], meta["split_info"]
    with pytest.raises(MetaError) as info:
        validate_meta(meta)
    message = str(info.value)
    assert "'batch_schema'" in message and "'split_info'" in message
    assert "'dataset_name'" not in message


@pytest.mark.parametrize(
    ("training_type", "needs"),
    [
        ("LM", ["vocab_size", "block_size"]),
        ("MLM", ["vocab_size", "block_size"]),
        ("CLASSIFICATION", ["num_classes"]),
        ("TOKEN_CLASSIFICATION", ["vocab_size", "num_labels"]),
    ],
)
def test_validate_names_keys_required_by_training_type(
    training_type: str, needs: list[str]
) -> None:
    """Each training type's own required keys are named when absent, with the type."""
    meta = _good_meta(training_type=training_type)
    for key in ("vocab_size", "block_size", "num_classes", "num_labels"):
        meta.pop(key, None)
    with pytest.raises(MetaError) as info:
        validate_meta(meta)
    message = str(info.value)
    assert training_type in message
    for key in needs:
        assert repr(key) in message


def test_sequence_scoring_needs_no_extra_keys() -> None:
    """SEQUENCE_SCORING requires none of the sizing keys."""
    meta = _good_meta(training_type="SEQUENCE_SCORING")
    del meta["vocab_size"], meta["block_size"]
    validate_meta(meta)


def test_training_type_accepts_enum_value() -> None:
    """The enum member is accepted as well as its string value."""
    validate_meta(_good_meta(training_type=TrainingType.LM))


@pytest.mark.parametrize("bad", ["GAN", "lm", "", None, 3])
def test_validate_rejects_bad_training_type(bad: object) -> None:
    """An unknown training_type is refused, naming the key and the value."""
    with pytest.raises(MetaError, match="training_type") as info:
        validate_meta(_good_meta(training_type=bad))
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize(
    "key", ["batch_size", "vocab_size", "block_size", "num_classes", "num_labels"]
)
@pytest.mark.parametrize("bad", [0, -3, True, "12", 2.0, None])
def test_validate_rejects_non_positive_ints_naming_key(key: str, bad: object) -> None:
    """Sizes must be positive ints (not bools, strings or floats); the key and value are named."""
    with pytest.raises(MetaError, match=key) as info:
        validate_meta(_good_meta(**{key: bad}))
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [{}, [], ["train"], "train", None])
def test_validate_rejects_bad_split_info(bad: object) -> None:
    """split_info must be a non-empty dict."""
    with pytest.raises(MetaError, match="split_info"):
        validate_meta(_good_meta(split_info=bad))


def test_validate_rejects_bad_schema() -> None:
    """A malformed batch_schema is reported through the schema parser."""
    with pytest.raises(MetaError, match="batch_schema"):
        validate_meta(_good_meta(batch_schema=[]))


def test_split_schema_prefers_split_override() -> None:
    """A split's own batch_schema wins over the default one; others get the default."""
    meta = _good_meta()
    meta["split_info"]["val"]["batch_schema"] = [{"name": "ids", "dtype": "int32", "shape": [3]}]
    assert split_schema(meta, "val") == (FieldSpec("ids", "int32", (3,)),)
    assert [f.name for f in split_schema(meta, "train")] == ["x", "y"]
    assert [f.name for f in split_schema(meta, "unknown")] == ["x", "y"]


# ---- JSON wire form -----------------------------------------------------------------------


def test_json_round_trip_keeps_int_keys() -> None:
    """itos with int keys comes back with int keys, not strings."""
    meta = _good_meta(itos={0: "a", 1: "b", 65: "\n"}, mixed={1: "one", "1": "string one"})
    back = meta_from_json(meta_to_json(meta))
    assert back == meta
    assert all(isinstance(k, int) for k in back["itos"])
    assert set(map(type, back["mixed"])) == {int, str}


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
_keys = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40),
    st.text(max_size=6).filter(lambda k: k != "__items__"),
)
_json_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_keys, inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None)
@given(meta=st.dictionaries(st.text(max_size=8), _json_values, max_size=5))
def test_json_round_trip_property(meta: dict[str, Any]) -> None:
    """Plain data (lists, dicts with str or int keys, scalars) round-trips exactly, key types too."""
    back = meta_from_json(meta_to_json(meta))
    assert back == meta
    assert _key_types(back) == _key_types(meta)


def _key_types(value: Any) -> Any:
    """The type of every dict key, recursively, in a comparable form."""
    if isinstance(value, dict):
        return sorted((repr(k), type(k).__name__, _key_types(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_key_types(v) for v in value]
    return None


def test_json_turns_tuples_and_sets_into_lists_and_bytes_into_str() -> None:
    """Types JSON lacks come back as their nearest JSON form (documented lossy cases)."""
    back = meta_from_json(meta_to_json({"t": (1, 2), "s": {3}, "b": b"\x00\xff"}))
    assert back == {"t": [1, 2], "s": [3], "b": "\x00\xff"}


def test_json_round_trip_of_dict_keyed_by_items_marker() -> None:
    """A str-keyed dict that happens to use the key '__items__' survives the round trip."""
    meta = {"weird": {"__items__": []}}
    assert meta_from_json(meta_to_json(meta)) == meta
