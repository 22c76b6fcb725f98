"""A ServerConfig back to the plain tables a TOML config parses to, so that a config built in
Python (or a TOML string) can cross to a server process: `parse_config(server_tables(c),
config_dir=c.config_dir) == c` for every config that parse_config can make.

Only JSON-able values travel (what TOML holds, less its dates and times); a provider arg that
is not one is a ConfigError naming the key.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError
from queue_server.config.server import CURRICULUM_KEYS, DatasetConfig, ServerConfig

# ServerConfig fields that are not [server] keys.
_NOT_KEYS = {"datasets", "config_dir", "verbose", "served"}
# DatasetConfig fields that are not [datasets.NAME] keys (curriculum's are, by other names).
_NOT_DATASET_KEYS = {"name", "curriculum"}


def _plain(value: Any) -> Any:
    """Tuples as lists and paths as strings, recursively: the types TOML parses to."""
    if isinstance(value, Path):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def dataset_table(d: DatasetConfig) -> dict[str, Any]:
    """One [datasets.NAME] table, the curriculum keys under their TOML names."""
    table = {
        f.name: _plain(getattr(d, f.name))
        for f in fields(DatasetConfig)
        if f.name not in _NOT_DATASET_KEYS
    }
    for key, name in CURRICULUM_KEYS.items():
        table[key] = _plain(getattr(d.curriculum, name))
    return table


def server_tables(config: ServerConfig) -> dict[str, Any]:
    """{"server": {...}, "datasets": {NAME: {...}}}, unset optional keys left out."""
    server = {
        f.name: _plain(getattr(config, f.name))
        for f in fields(ServerConfig)
        if f.name not in _NOT_KEYS and getattr(config, f.name) is not None
    }
    tables = {"server": server, "datasets": {d.name: dataset_table(d) for d in config.datasets}}
    check_json(tables)
    return tables


def check_json(tables: dict[str, Any]) -> None:
    """ConfigError naming the first value JSON cannot carry (a TOML date, an object)."""

    def walk(value: Any, where: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{where}.{k}" if where else str(k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")
        elif value is not None and not isinstance(value, (str, int, float, bool)):
            raise ConfigError(
                f"{where} = {value!r} ({type(value).__name__}) cannot be passed to a server "
                "process: use strings, numbers, booleans, arrays and tables"
            )

    walk(tables, "")
    json.dumps(tables)
