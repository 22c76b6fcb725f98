"""constraints.txt pins every package make setup installs, within pyproject.toml's ranges.

Why it matters: unpinned, a fresh clone's `pip install -e ".[every extra]"` searched s3fs,
aiobotocore, boto3 and fsspec releases against datasets' fsspec cap for a quarter of an hour and
gave up (resolution-too-deep). A dependency added to pyproject.toml but not to the pins would
bring that search back; a pin outside pyproject's range would make make setup fail.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the suite runs on 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _setup_extras() -> list[str]:
    """The extras `make setup` installs, read off the Makefile's install line."""
    found = re.search(r'-e "\.\[([^\]]+)\]"', (ROOT / "Makefile").read_text())
    assert found, "the Makefile installs no extras"
    return found.group(1).split(",")


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep, f"constraints.txt: {line!r} is not name==version"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in _setup_extras():
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def test_make_setup_installs_through_the_pins() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert '-m pip install --quiet -c constraints.txt -e ".[' in makefile
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # Every extra, so that no test skips for want of its package on a fresh clone.
    assert sorted(_setup_extras()) == sorted(declared["optional-dependencies"])
    assert "$(STAMP): pyproject.toml constraints.txt" in makefile


def test_every_dependency_of_make_setup_is_pinned_within_its_range() -> None:
    pins = _pins()
    assert len(pins) > 100  # the whole tree, not only the direct dependencies
    unpinned, outside = [], []
    for requirement in _requirements():
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # another platform's or Python's (tomli on 3.10)
        version = pins.get(canonicalize_name(requirement.name))
        if version is None:
            unpinned.append(str(requirement))
        elif not requirement.specifier.contains(version, prereleases=True):
            outside.append(f"{requirement} (pinned {version})")
    assert not unpinned, f"add to constraints.txt (make lock): {unpinned}"
    assert not outside, f"pins outside pyproject.toml's ranges: {outside}"


def test_torch_is_pinned_as_make_setup_installs_it() -> None:
    assert _pins()["torch"] == Version("2.13.0")  # matches the CPU (+cpu) and CUDA builds alike


def test_the_image_installs_through_the_pins_but_triton() -> None:
    """The image pins what make setup pins, but triton: a CUDA build of torch pins its own."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY pyproject.toml README.md constraints.txt ./" in dockerfile
    assert "grep -v '^triton==' constraints.txt > /tmp/constraints.txt" in dockerfile
    assert 'pip install -c /tmp/constraints.txt ".[${EXTRAS}]"' in dockerfile


def test_make_setup_refuses_a_python_too_old_for_the_pins_in_one_line() -> None:
    """The pins need 3.11 (numpy 2.4, torchtitan, transformers): an older python3 is refused
    before a venv is made, naming the version and the way out, not by pip's resolver."""
    import importlib.util
    import subprocess

    spec = importlib.util.spec_from_file_location("check_python", ROOT / "scripts/check_python.py")
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.problem((3, 10, 14), "/usr/bin/python3") == (
        "make setup needs Python 3.11 or newer (the pinned tools and frameworks of "
        "constraints.txt); /usr/bin/python3 is Python 3.10.14: run `make setup "
        "PYTHON=python3.11` (or newer)"
    )
    assert check.problem((3, 11, 0), "python3") is None
    run = subprocess.run([sys.executable, str(ROOT / "scripts/check_python.py")], timeout=60)
    assert run.returncode == 0
    makefile = (ROOT / "Makefile").read_text()
    setup = makefile[makefile.index("$(STAMP): pyproject.toml") :]
    assert setup.index("scripts/check_python.py") < setup.index("-m venv")
