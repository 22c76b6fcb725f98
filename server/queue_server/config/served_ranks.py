"""Which global ranks one server makes files for: all of them, or one node's share.

One server for the whole job is the default. On a multi-node job a server runs on every node
and serves that node's ranks only (`server.ranks`): it makes only their files, so no file is
made on two nodes, and rank r's stream is the same whichever server serves it, since a file is
a pure function of (config, split, seq). The node's share can be written out ([0, 1], "0-3",
"0,2,5-7") or read from the launcher's environment ("launcher"), as torchrun sets it.

Pure: the environment is passed in, so every rule is testable with a dict.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from queue_client.errors import ConfigError

ALL, LAUNCHER = "all", "launcher"
# The largest world size accepted (the schedule's own bound).
MAX_WORLD_SIZE = 65536
# Where torchrun and common launch scripts put the node's rank and its number of ranks.
NODE_RANK_VARS = ("GROUP_RANK", "NODE_RANK")
LOCAL_WORLD_VARS = ("LOCAL_WORLD_SIZE", "NPROC_PER_NODE")
# A number as a launcher writes one. Python's int() also takes "1_0", " 7", "+3" and other
# scripts' digits: none is a number a launcher wrote, so each is refused, not guessed at.
_DECIMAL = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class ServedRanks:
    """ranks None: every rank of whatever world size the clients bring (world_size 0) or
    start from (world_size > 0). A set of ranks: only those, of exactly world_size ranks."""

    ranks: frozenset[int] | None = None
    world_size: int = 0

    @property
    def all(self) -> bool:
        return self.ranks is None

    def serves(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def describe(self) -> str:
        """ "ranks 2-3 of world_size 4", for messages and logs."""
        if self.ranks is None:
            return "every rank"
        return f"ranks {format_ranks(self.ranks)} of world_size {self.world_size}"


# One server for every rank: the default.
EVERY_RANK = ServedRanks()


def format_ranks(ranks: Iterable[int]) -> str:
    """Sorted ranks with runs folded: {0, 1, 2, 5} -> "0-2,5"."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def spec_text(value: Any, key: str = "server.ranks") -> str:
    """The text form of a ranks value: a TOML array of ints becomes "0,1"; a string stays."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (list, tuple)) and value and all(_is_int(v) for v in value):
        return ",".join(str(v) for v in value)
    raise ConfigError(
        f'{key} = {value!r} is invalid: expected "all", "launcher", a list of ranks such as '
        '[0, 1], or a range such as "0-3"'
    )


def resolve(
    spec: str, world_size: int, environ: Mapping[str, str], key: str = "server.ranks"
) -> ServedRanks:
    """The ranks a server serves, from its `ranks` spec and `world_size` (0: not given)."""
    if not _is_int(world_size) or not 0 <= world_size <= MAX_WORLD_SIZE:
        raise ConfigError(
            f"server.world_size = {world_size!r} is invalid: expected an integer in "
            f'[1, {MAX_WORLD_SIZE}], or 0 when ranks is "all" or "launcher"'
        )
    text = spec_text(spec, key)
    if text == ALL:
        return ServedRanks(None, world_size)
    if text == LAUNCHER:
        ranks, world_size = _from_launcher(environ, world_size, key)
    else:
        ranks = _parse_list(text, key)
        if world_size == 0:
            raise ConfigError(
                f"{key} = {text!r} needs server.world_size (or --world-size): the ranks are "
                "ranks of a world of that many, which the server must know to tell whose "
                "files are whose"
            )
    beyond = sorted(r for r in ranks if r >= world_size)
    if beyond:
        raise ConfigError(
            f"{key} = {text!r} is invalid: ranks {format_ranks(beyond)} lie outside "
            f"[0, world_size={world_size})"
        )
    return ServedRanks(frozenset(ranks), world_size)


def _parse_list(text: str, key: str) -> set[int]:
    """ "0-3", "5", "0,2,5-7" -> the set of ranks."""
    expected = 'ranks such as "0-3", "0,2,5-7" or [0, 1], each an integer >= 0'
    ranks: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not _DECIMAL.fullmatch(low) or (dash and not _DECIMAL.fullmatch(high)):
            raise ConfigError(f"{key} = {text!r} is invalid: expected {expected}")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ConfigError(f"{key} = {text!r} is invalid: the range {part.strip()!r} is empty")
        if last >= MAX_WORLD_SIZE:
            raise ConfigError(f"{key} = {text!r} is invalid: ranks lie below {MAX_WORLD_SIZE}")
        ranks.update(range(first, last + 1))
    return ranks


def _from_launcher(environ: Mapping[str, str], world_size: int, key: str) -> tuple[set[int], int]:
    """This node's ranks: node_rank * local .. node_rank * local + local - 1. Every number is
    checked against its bounds before any set of ranks is built."""
    node_var, node = _env_int(
        environ, NODE_RANK_VARS, key, "the node's rank", 0, MAX_WORLD_SIZE - 1
    )
    local_var, local = _env_int(
        environ, LOCAL_WORLD_VARS, key, "the ranks per node", 1, MAX_WORLD_SIZE
    )
    if world_size == 0:
        if environ.get("WORLD_SIZE"):
            _, world_size = _env_int(
                environ, ("WORLD_SIZE",), key, "the world size", 1, MAX_WORLD_SIZE
            )
        elif environ.get("NNODES"):
            _, nodes = _env_int(environ, ("NNODES",), key, "the number of nodes", 1, MAX_WORLD_SIZE)
            world_size = nodes * local
            if world_size > MAX_WORLD_SIZE:
                raise ConfigError(
                    f'{key} = "launcher": NNODES={nodes} times {local_var}={local} is a world '
                    f"size of {world_size}, above {MAX_WORLD_SIZE}"
                )
        else:
            raise ConfigError(
                f'{key} = "launcher" needs the world size: set WORLD_SIZE or NNODES in the '
                "server's environment, or server.world_size (--world-size)"
            )
    first, last = node * local, node * local + local - 1
    if last >= world_size:
        low = max(first, world_size)
        outside = str(low) if low == last else f"{low}-{last}"
        raise ConfigError(
            f'{key} = "launcher" is invalid: ranks {outside} lie outside [0, world_size='
            f"{world_size}) ({node_var}={node}, {local_var}={local}: this node's ranks would "
            f"be {first}-{last})"
        )
    return set(range(first, last + 1)), world_size


def _env_int(
    environ: Mapping[str, str],
    names: tuple[str, ...],
    key: str,
    what: str,
    minimum: int,
    maximum: int,
) -> tuple[str, int]:
    """The first of `names` that is set, and its value: plain decimal digits, an integer in
    [minimum, maximum]; ConfigError naming the variable and its value otherwise."""
    for name in names:
        raw = environ.get(name, "")
        if raw == "":
            continue
        # Bounded by its length first: int() of a long string of digits costs time.
        if _DECIMAL.fullmatch(raw) and len(raw) <= len(str(maximum)):
            value = int(raw)
            if minimum <= value <= maximum:
                return name, value
        raise ConfigError(
            f'{key} = "launcher": {name}={raw!r} is not {what} (plain decimal digits, an '
            f"integer in [{minimum}, {maximum}])"
        )
    raise ConfigError(
        f'{key} = "launcher" needs {what}: set {" or ".join(names)} in the server\'s '
        "environment (torchrun's names), or list the ranks in server.ranks"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
