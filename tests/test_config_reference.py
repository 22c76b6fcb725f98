"""docs/config-reference.md stays true: every config key with its type and default, and
nothing documented that the config schema (ServerConfig, DatasetConfig) lacks."""

from __future__ import annotations

import sys
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT
from queue_client.errors import ConfigError
from queue_server.config.server import (
    CURRICULUM_KEYS,
    CurriculumConfig,
    DatasetConfig,
    ServerConfig,
    parse_config,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DOC = ROOT / "docs" / "config-reference.md"
SERVER, DATASET, NOT_KEYS = "[server]", "[datasets.NAME]", "Schema fields that are not keys"
# A field's annotation, as written in config.py, and the type the reference gives (TOML's words).
DOC_TYPES = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "Path": "string (path)",
    "str | None": "string",
    "dict[str, Any]": "table",
    "list[list[float]]": "array of [number, number]",
    "list[str]": "array of strings",
    "tuple[str, ...]": "array of strings",
    "tuple[tuple[float, float], ...]": "array of [number, number]",
}
REQUIRED = object()


def sections() -> dict[str, list[list[str]]]:
    """The table rows under each '## ' heading (backticks stripped from it), header row dropped."""
    out: dict[str, list[list[str]]] = {}
    heading = ""
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            heading = line[3:].strip().strip("`")
            out[heading] = []
        elif line.startswith("|") and heading and not set(line) <= set("|-: "):
            out[heading].append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return {h: rows[1:] for h, rows in out.items()}


def key_rows(section: str) -> dict[str, list[str]]:
    rows = sections()[section]
    assert rows, f"{DOC.name} has no table under '## `{section}`'"
    out: dict[str, list[str]] = {}
    for row in rows:
        assert len(row) >= 4 and row[0].startswith("`") and row[0].endswith("`"), (
            f"malformed row {row} under {section}"
        )
        key = row[0].strip("`")
        assert key not in out, f"{section}: `{key}` is documented twice"
        out[key] = row
    return out


def not_keys(cls: type) -> set[str]:
    """Fields the reference lists as set some other way than by a key of their table."""
    names = {row[0].strip("`") for row in sections()[NOT_KEYS]}
    return {n.partition(".")[2] for n in names if n.startswith(f"{cls.__name__}.")}


def key_fields(cls: type) -> list[tuple[str, Field[Any], Any]]:
    """(TOML key, schema field, how to read its value off a parsed config) for each key of
    the class's table. DatasetConfig's nested CurriculumConfig is set by keys of the
    dataset's own table (CURRICULUM_KEYS)."""
    out: list[tuple[str, Field[Any], Any]] = []
    for f in fields(cls):
        if cls is DatasetConfig and f.name == "curriculum":
            continue
        out.append((f.name, f, lambda obj, name=f.name: getattr(obj, name)))
    if cls is DatasetConfig:
        key_of = {name: key for key, name in CURRICULUM_KEYS.items()}
        for f in fields(CurriculumConfig):
            out.append((key_of[f.name], f, lambda obj, name=f.name: getattr(obj.curriculum, name)))
    return out


def _plain(value: Any) -> Any:
    """Tuples as TOML arrays read back: lists."""
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def expected_default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return str(f.default) if isinstance(f.default, Path) else _plain(f.default)
    if f.default_factory is not MISSING:
        return _plain(f.default_factory())
    return REQUIRED


def documented_default(cell: str) -> Any:
    if cell == "required":
        return REQUIRED
    if cell == "unset":
        return None
    assert cell.startswith("`") and cell.endswith("`"), (
        f"default {cell!r} is not a `TOML value`, 'required' or 'unset'"
    )
    return tomllib.loads(f"v = {cell.strip('`')}")["v"]


CASES = [(ServerConfig, SERVER), (DatasetConfig, DATASET)]


@pytest.mark.parametrize(("cls", "section"), CASES)
def test_every_field_is_documented_and_nothing_else(cls: type, section: str) -> None:
    names = {key for key, _, _ in key_fields(cls)}
    documented, other = set(key_rows(section)), not_keys(cls)
    if cls is DatasetConfig:
        names.add("curriculum")  # a field set by the curriculum keys, listed as not a key
    assert not (other - names), (
        f"{DOC.name} lists {sorted(other - names)} as {cls.__name__} fields; there are none"
    )
    assert not (documented - names), (
        f"{DOC.name} documents {sorted(documented - names)} under {section}; {cls.__name__} has no such field"
    )
    missing = names - documented - other
    assert not missing, (
        f"{cls.__name__} fields {sorted(missing)} are missing from {DOC.name} under {section}"
    )
    assert not (documented & other), (
        f"{sorted(documented & other)} are documented both as keys and as not keys"
    )


@pytest.mark.parametrize(("cls", "section"), CASES)
def test_types_and_defaults_match_the_schema(cls: type, section: str) -> None:
    rows = key_rows(section)
    for key, f, _ in key_fields(cls):
        if key not in rows:
            continue
        _, type_cell, default_cell, meaning = rows[key][:4]
        assert str(f.type) in DOC_TYPES, (
            f"{cls.__name__}.{f.name} has annotation {f.type!r}: add its TOML type to DOC_TYPES"
        )
        assert type_cell == DOC_TYPES[str(f.type)], (
            f"{section} `{key}`: type {type_cell!r}, the schema says {DOC_TYPES[str(f.type)]!r}"
        )
        want, have = expected_default(f), documented_default(default_cell)
        assert have == want and type(have) is type(want), (
            f"{section} `{key}`: default {default_cell}, the schema says {want!r}"
        )
        assert len(meaning) > 10, f"{section} `{key}` has no meaning"


def test_documented_keys_are_accepted_and_not_keys_refused(tmp_path: Path) -> None:
    """A config that sets every documented key to its documented default parses to those
    defaults; a schema field documented as not a key is refused as a key."""
    samples = {"string": '"x"', "integer": "4"}
    lines: list[str] = []
    for section, table in ((SERVER, "[server]"), (DATASET, "[datasets.d]")):
        lines.append(table)
        for key, row in key_rows(section).items():
            default = row[2]
            if default in ("required", "unset"):
                literal = '"char_lm"' if key == "provider" else samples[row[1]]
            else:
                literal = default.strip("`")
            lines.append(f"{key} = {literal}")
    config = parse_config(tomllib.loads("\n".join(lines)), config_dir=tmp_path)
    dataset = config.dataset("d")
    for cls, obj, section in ((ServerConfig, config, SERVER), (DatasetConfig, dataset, DATASET)):
        rows = key_rows(section)
        for key, _, read in key_fields(cls):
            if key in rows and rows[key][2] not in ("required", "unset") and key != "data_root":
                assert _plain(read(obj)) == documented_default(rows[key][2]), f"{section} `{key}`"
    assert config.data_root == tmp_path / "data"  # relative to the config file's directory

    for cls, table in (
        (ServerConfig, "[server]"),
        (DatasetConfig, '[datasets.d]\nprovider = "char_lm"\nbatch_size = 4'),
    ):
        for name in not_keys(cls):
            with pytest.raises(ConfigError, match=name):
                parse_config(tomllib.loads(f"{table}\n{name} = true"), config_dir=tmp_path)
