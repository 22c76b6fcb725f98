# One entry point for people and CI. `make run` serves the default dataset; `make test` runs
# the suite; `make check` (what CI runs) lints, type-checks, checks the stubs and tests. All set
# up .venv first (torch pinned to the CPU-friendly 2.13.0).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup lock run test test-all test-image check lint types proto proto-check bench clean

# Every extra pyproject.toml declares, so every test runs on a fresh clone; every version from
# constraints.txt: unpinned, pip's search over s3fs, aiobotocore, boto3 and fsspec against
# datasets' cap runs for many minutes and gives up (resolution-too-deep).
$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) scripts/check_python.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,text,ray,remote,hf,dedup,peers,lightning,hf-trainer,torchtitan]"
	touch $(STAMP)

setup: $(STAMP)

# After upgrading a package in .venv (pip install -U NAME): pin what is installed now.
lock:
	$(PY) scripts/lock_constraints.py > constraints.txt.new
	mv constraints.txt.new constraints.txt

run: setup
	$(VENV)/bin/queue-server $(ARGS)

# Tests run in parallel processes (pytest-xdist: one more than the usable cores, at most 4,
# since each test starts servers with worker processes of their own; TEST_WORKERS=0 for one
# process). A test waits on its servers more than it computes (the suite keeps about one core
# of two busy at -n 2), so one more process than cores finished sooner: 7 min 46 s against
# 9 min 48 s on 2 cores, measured before test servers forked their forkservers warm. The Ray
# tests share one of them and one cluster.
TEST_WORKERS ?= $(shell python3 -c "import os; print(min(4, len(os.sched_getaffinity(0)) + 1))")
XDIST = -n $(TEST_WORKERS) --dist loadgroup

test: setup
	$(PY) -m pytest -q -m "not slow and not gpu and not image" $(XDIST) $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The image built from the Dockerfile with podman (a debootstrapped Debian standing in for
# python:3.11-slim) and run as docker-compose.yml's provider service (tests/test_image.py):
# root, podman, runc and debootstrap, or it skips saying which is missing. The first run
# builds for some minutes; reruns reuse ~/.cache/batchqueue-image-test. CI runs it after check.
test-image: setup
	$(PY) -m pytest -q -m image -n 0 tests/test_image.py $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The packages and settings are in pyproject.toml's [tool.mypy].
types: setup
	$(PY) -m mypy

proto: setup
	$(PY) scripts/gen_proto.py

proto-check: setup
	$(PY) scripts/gen_proto.py --check

check: lint types proto-check test

bench: setup
	$(PY) -m bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
