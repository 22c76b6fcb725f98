"""Write constraints.txt from what is installed: batchqueue's dependencies with every extra
pyproject.toml declares (as `make setup` installs them), and theirs, each pinned to its
installed version.

Why: a fresh `pip install -e ".[every extra]"` must search s3fs, aiobotocore, boto3 and fsspec
releases against datasets' fsspec cap and gives up (resolution-too-deep); with every version
pinned it resolves at once. Run by `make lock` after upgrading a package in .venv.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEADER = """\
# The versions `make setup` installs (pip install -c constraints.txt): every package that
# batchqueue and all its extras pull in, pinned, so a fresh clone resolves at once and the same
# way every time. Without pins pip must search s3fs/aiobotocore/boto3/fsspec releases against
# datasets' fsspec cap and gives up (resolution-too-deep). pyproject.toml keeps the ranges a
# user's own install resolves against. `make lock` rewrites this file from .venv after an upgrade.
"""


def required_closure(root: str, extras: frozenset[str]) -> dict[str, metadata.Distribution]:
    """Every installed distribution that `root[extras]` needs here, by canonical name."""
    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}
    found: dict[str, metadata.Distribution] = {}
    visited: set[tuple[str, frozenset[str]]] = set()
    pending = [(canonicalize_name(root), extras)]
    while pending:
        name, wanted = pending.pop()
        if (name, wanted) in visited:
            continue
        visited.add((name, wanted))
        dist = installed.get(name)
        if dist is None:
            raise SystemExit(
                f"lock_constraints: {name} is required but not installed; run make setup"
            )
        found[name] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            environments = [{"extra": extra} for extra in wanted] or [{"extra": ""}]
            if requirement.marker is None or any(
                requirement.marker.evaluate(env) for env in environments
            ):
                pending.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return found


def pinned_lines(root: str, extras: frozenset[str]) -> list[str]:
    """`name==version` for each needed distribution but the root, local labels (+cpu) dropped:
    `torch==2.13.0` matches the CPU and the CUDA builds alike."""
    closure = required_closure(root, extras)
    lines = []
    for name, dist in sorted(closure.items()):
        if name == canonicalize_name(root):
            continue
        version = dist.version.split("+", 1)[0]
        lines.append(f"{dist.metadata['Name']}=={version}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", help="comma-separated (default: every extra of pyproject)")
    args = parser.parse_args(argv)
    if args.extras is None:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        extras = frozenset(tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"])
    else:
        extras = frozenset(e.strip() for e in args.extras.split(",") if e.strip())
    sys.stdout.write(HEADER + "".join(f"{line}\n" for line in pinned_lines("batchqueue", extras)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
