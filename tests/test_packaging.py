"""What `docker compose up provider` and a fresh clone rely on, checked without a Docker engine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, char_config, subprocess_env


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_validates_with_docker_compose() -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed; .ci/run installs Debian's package")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    proc = subprocess.run(
        [exe, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr


def test_provider_service_contract() -> None:
    provider = _compose()["services"]["provider"]
    assert provider["build"] == "."
    assert "127.0.0.1:50051:50051" in provider["ports"]  # published on the host's loopback only
    assert "127.0.0.1:50052:50052" in provider["ports"]  # HTTP /metrics and /healthz
    volume, _, target = provider["volumes"][0].partition(":")
    assert (
        volume in _compose()["volumes"] and target == "/data"
    )  # a named volume holds the data root
    assert "queue_server.healthcheck" in provider["healthcheck"]["test"]
    assert provider["restart"] == "unless-stopped"


def test_dockerfile_pins_torch_and_runs_the_server() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'TORCH_SPEC="torch==2.13.0"' in text
    assert "EXPOSE 50051 50052" in text and "queue-server" in text and "HEALTHCHECK" in text
    assert "USER batchqueue" in text  # the server does not run as root


def test_healthcheck_command_against_a_real_server(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus))
    ok = subprocess.run(
        [sys.executable, "-m", "queue_server.healthcheck", "--address", server.address],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "queue_server.healthcheck",
            "--address",
            server.address,
            "--service",
            "batchqueue.v1.BatchQueue/chars",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert one.returncode == 0
    server.stop()
    down = subprocess.run(
        [
            sys.executable,
            "-m",
            "queue_server.healthcheck",
            "--address",
            server.address,
            "--timeout",
            "1",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert down.returncode == 1 and server.address in down.stderr
