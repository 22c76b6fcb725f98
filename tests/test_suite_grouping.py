"""The suite's own grouping under pytest-xdist holds with the pytest and xdist installed.

`make test` runs `-n N --dist loadgroup`, and conftest.py puts the tests that share a
module-scoped server (and ray_cluster.py the Ray tests) into one group each, so such a
server, or the session's Ray cluster, starts once per run. Some pytest and xdist releases
together drop the groups without a word (pytest 9.2 with xdist 3.8: pytest-dev/pytest-xdist
#1386), and the suite then starts those servers once per worker and a Ray cluster in every
worker. This runs a tiny suite of the same shape in a pytest of its own and fails if the
grouped tests ran on more than one worker.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import subprocess_env

TESTS_PER_GROUP = 6


def test_grouped_tests_run_in_one_worker(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.hookimpl(tryfirst=True)  # as tests/conftest.py groups its tests
            def pytest_collection_modifyitems(items):
                for item in items:
                    if item.module.__name__ == "test_grouped":
                        item.add_marker(pytest.mark.xdist_group("grouped"))
            """
        )
    )
    body = textwrap.dedent(
        f"""
        import os
        import pytest

        @pytest.mark.parametrize("i", range({TESTS_PER_GROUP}))
        def test_records_its_worker(i):
            out = os.path.join(os.environ["GROUPING_OUT"], "workers-" + __name__ + ".txt")
            with open(out, "a") as f:
                f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
        """
    )
    for name in ("test_grouped", "test_free"):
        (suite / f"{name}.py").write_text(body)
    # Without the outer run's PYTEST_* variables: the inner run is a pytest of its own.
    env = {k: v for k, v in subprocess_env(GROUPING_OUT=str(tmp_path)).items()
           if not k.startswith("PYTEST_")}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
         "no:cacheprovider", "--basetemp", str(tmp_path / "base"), str(suite)],
        capture_output=True, text=True, timeout=120, cwd=suite, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    grouped = (tmp_path / "workers-test_grouped.txt").read_text().split()
    assert len(grouped) == TESTS_PER_GROUP, grouped
    assert len(set(grouped)) == 1, (
        f"the tests of one xdist_group ran on the workers {sorted(set(grouped))}: this pytest "
        "and pytest-xdist pair ignores --dist loadgroup's groups (see pyproject.toml's pin)"
    )
