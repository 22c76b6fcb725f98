"""server.ranks and server.world_size: which ranks a server serves, from the config, the
command line or the launcher's environment; every refusal names the key or the variable."""

from __future__ import annotations

import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from queue_client.errors import ConfigError
from queue_server.cli import _parse_args, build_config
from queue_server.config.served_ranks import EVERY_RANK, ServedRanks, format_ranks, resolve
from queue_server.config.server import parse_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def served(ranks: set[int], world_size: int) -> ServedRanks:
    return ServedRanks(frozenset(ranks), world_size)


@pytest.mark.parametrize(
    ("spec", "world_size", "environ", "expected"),
    [
        # (ranks, world_size, the server's environment, what it serves)
        ("all", 0, {}, EVERY_RANK),
        ("all", 8, {}, ServedRanks(None, 8)),  # every rank, production starting at 8
        ("0-3", 8, {}, served({0, 1, 2, 3}, 8)),
        (" 5 ", 8, {}, served({5}, 8)),
        ("0,2,5-7", 8, {}, served({0, 2, 5, 6, 7}, 8)),
        ([6, 7], 8, {}, served({6, 7}, 8)),
        # torchrun's names in its workers; a launch script's names; the world from NNODES
        ("launcher", 0, {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"},
         served({2, 3}, 4)),
        ("launcher", 0, {"NODE_RANK": "2", "NPROC_PER_NODE": "4", "NNODES": "3"},
         served({8, 9, 10, 11}, 12)),
        ("launcher", 16, {"NODE_RANK": "0", "NPROC_PER_NODE": "8"}, served(set(range(8)), 16)),
    ],
)  # fmt: skip
def test_rank_specs(spec: object, world_size: int, environ: dict, expected: ServedRanks) -> None:
    assert resolve(spec, world_size, environ) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "world_size", "environ", "message"),
    [
        ("0-3", 0, {}, "server.ranks = '0-3' needs server.world_size"),
        ("3-1", 4, {}, "the range '3-1' is empty"),
        ("two", 4, {}, "server.ranks = 'two' is invalid: expected ranks such as"),
        ("1-", 4, {}, "server.ranks = '1-' is invalid"),
        ("2-4", 4, {}, "ranks 4 lie outside [0, world_size=4)"),
        ([], 4, {}, "server.ranks = [] is invalid"),
        ([0, "1"], 4, {}, "server.ranks = [0, '1'] is invalid"),
        ("all", -1, {}, "server.world_size = -1 is invalid"),
        ("launcher", 0, {}, "needs the node's rank: set GROUP_RANK or NODE_RANK"),
        ("launcher", 0, {"NODE_RANK": "0"}, "set LOCAL_WORLD_SIZE or NPROC_PER_NODE"),
        ("launcher", 0, {"NODE_RANK": "0", "NPROC_PER_NODE": "2"}, "set WORLD_SIZE or NNODES"),
        ("launcher", 0, {"NODE_RANK": "x", "NPROC_PER_NODE": "2"}, "NODE_RANK='x' is not the"),
        ("launcher", 0, {"GROUP_RANK": "2", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"},
         "ranks 4-5 lie outside [0, world_size=4)"),
        ("0-\u00b2", 4, {}, "server.ranks = '0-\u00b2' is invalid"),  # a digit int() refuses
        # Only plain decimal digits: int() would read each of these as a number.
        ("launcher", 0, {"NODE_RANK": "1_0", "NPROC_PER_NODE": "2", "WORLD_SIZE": "40"},
         "NODE_RANK='1_0' is not the node's rank (plain decimal digits"),
        ("launcher", 0, {"NODE_RANK": " 1", "NPROC_PER_NODE": "2", "WORLD_SIZE": "4"},
         "NODE_RANK=' 1' is not"),
        ("launcher", 0, {"NODE_RANK": "+1", "NPROC_PER_NODE": "2", "WORLD_SIZE": "4"},
         "NODE_RANK='+1' is not"),
        ("launcher", 0, {"NODE_RANK": "\u0661", "NPROC_PER_NODE": "2", "WORLD_SIZE": "4"},
         "NODE_RANK='\u0661' is not"),  # ARABIC-INDIC DIGIT ONE
        ("launcher", 0, {"NODE_RANK": "0", "LOCAL_WORLD_SIZE": "2_0", "WORLD_SIZE": "40"},
         "LOCAL_WORLD_SIZE='2_0' is not the ranks per node"),
        ("launcher", 0, {"NODE_RANK": "0", "NPROC_PER_NODE": "2", "WORLD_SIZE": "1_6"},
         "WORLD_SIZE='1_6' is not the world size"),
        # Numbers past their bounds are refused before any set of ranks is built.
        ("launcher", 0, {"NODE_RANK": "0", "LOCAL_WORLD_SIZE": "100000000", "WORLD_SIZE": "4"},
         "LOCAL_WORLD_SIZE='100000000' is not the ranks per node (plain decimal digits, an "
         "integer in [1, 65536])"),
        ("launcher", 0, {"NODE_RANK": "0", "LOCAL_WORLD_SIZE": "9" * 5000, "WORLD_SIZE": "4"},
         "LOCAL_WORLD_SIZE='999"),
        ("launcher", 0, {"NODE_RANK": "65536", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "4"},
         "NODE_RANK='65536' is not the node's rank (plain decimal digits, an integer in "
         "[0, 65535])"),
        ("launcher", 0, {"NODE_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "65537"},
         "WORLD_SIZE='65537' is not the world size"),
        ("launcher", 0, {"NODE_RANK": "0", "LOCAL_WORLD_SIZE": "65536", "NNODES": "2"},
         "NNODES=2 times LOCAL_WORLD_SIZE=65536 is a world size of 131072, above 65536"),
        ("launcher", 0, {"NODE_RANK": "65535", "LOCAL_WORLD_SIZE": "65536", "WORLD_SIZE": "8"},
         "ranks 4294901760-4294967295 lie outside [0, world_size=8) (NODE_RANK=65535, "
         "LOCAL_WORLD_SIZE=65536"),
    ],
)  # fmt: skip
def test_bad_rank_specs_name_the_key_or_the_variable(
    spec: object, world_size: int, environ: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(spec, world_size, environ)  # type: ignore[arg-type]


def test_a_huge_launcher_world_is_refused_at_once() -> None:
    """Checked before anything is built: no time or memory goes to a set of 10^8 ranks."""
    began = time.perf_counter()
    for local in ("10000000", "100000000"):
        with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
            resolve("launcher", 0, {"NODE_RANK": "0", "LOCAL_WORLD_SIZE": local, "NNODES": "1"})
    with pytest.raises(ConfigError, match="lie outside"):
        resolve("launcher", 8, {"NODE_RANK": "65535", "LOCAL_WORLD_SIZE": "65536"})
    assert time.perf_counter() - began < 1.0


def test_ranks_are_shown_folded() -> None:
    assert format_ranks({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert served({2, 3}, 4).describe() == "ranks 2-3 of world_size 4"


def _toml(server: str, dataset: str = "") -> dict:
    return tomllib.loads(
        textwrap.dedent(
            f"""
            [server]
            {server}
            [datasets.d]
            provider = "char_lm"
            batch_size = 2
            {dataset}
            """
        )
    )


def test_a_toml_list_of_ranks_is_served(tmp_path: Path) -> None:
    config = parse_config(_toml("ranks = [0, 1]\nworld_size = 4"), config_dir=tmp_path)
    assert config.served == served({0, 1}, 4) and config.ranks == "0,1"
    assert parse_config(_toml(""), config_dir=tmp_path).served == EVERY_RANK


def test_node_local_serving_refuses_what_one_node_cannot_make_alone(tmp_path: Path) -> None:
    dataset, message = 'mode = "best_effort"', "datasets.d, which has mode = 'best_effort'"
    raw = _toml('ranks = "0-1"\nworld_size = 4', dataset)
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw, config_dir=tmp_path)
    parse_config(_toml("", dataset), config_dir=tmp_path)  # fine from one server


def test_a_curriculum_is_served_node_local(tmp_path: Path) -> None:
    """Each node composes its ranks' curriculum streams (docs/curriculum.md, "Node-local
    servers"); tests/test_curriculum_node_local.py serves one."""
    dataset = 'selection = "curriculum"\ncurriculum_streams = 4'
    config = parse_config(_toml('ranks = "0-1"\nworld_size = 4', dataset), config_dir=tmp_path)
    assert config.served == served({0, 1}, 4) and config.datasets[0].curriculum.streams == 4


def test_the_command_line_overrides_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[server]\nranks = [0, 1]\nworld_size = 4\n", encoding="utf-8")
    config = build_config(_parse_args(["--config", str(path), "--ranks", "3", "--world-size", "8"]))
    assert config.served == served({3}, 8)
    for name, value in {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    config = build_config(_parse_args(["--config", str(path), "--ranks", "launcher"]))
    assert config.served == served({2, 3}, 4)  # world_size 4 from the config, as WORLD_SIZE says
