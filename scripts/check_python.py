"""Refuse, in one line, a Python too old for `make setup`: the pinned development set
(constraints.txt: numpy 2.4, torchtitan, transformers and others) needs 3.11 or newer, and pip
would otherwise fail later with a resolver error that names none of this. The package itself
(pyproject's requires-python) still installs on 3.10."""

from __future__ import annotations

import sys

MINIMUM = (3, 11)


def problem(version: tuple[int, ...], executable: str) -> str | None:
    """Why this Python cannot set up the development environment, or None."""
    if tuple(version[:2]) >= MINIMUM:
        return None
    found = ".".join(map(str, version[:3]))
    return (
        f"make setup needs Python {MINIMUM[0]}.{MINIMUM[1]} or newer (the pinned tools and "
        f"frameworks of constraints.txt); {executable} is Python {found}: run "
        "`make setup PYTHON=python3.11` (or newer)"
    )


if __name__ == "__main__":
    message = problem(tuple(sys.version_info), sys.executable)
    if message:
        print(message, file=sys.stderr)
        sys.exit(2)
