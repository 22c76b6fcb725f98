"""The image, built from the Dockerfile and run as docker-compose.yml's `provider` service says.

podman stands in for Docker and a debootstrapped Debian for python:3.11-slim (image_build.py);
the image is built once per content and cached. Skipped, saying why, where podman, runc or
debootstrap cannot run (`make test-image`; .ci/run installs them).
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import image_build
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from image_build import podman

from conftest import ROOT, wait_until
from queue_client import QueueClient

pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]

DATASET = "stdlib_char"  # what the embedded default config serves
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def image() -> str:
    try:
        return image_build.built_image()
    except image_build.Unavailable as why:
        pytest.skip(str(why))


@pytest.fixture
def volume() -> Iterator[str]:
    """A named volume, new, as compose's `batchqueue-data` is at a first `up`."""
    name = f"batchqueue-data-{uuid.uuid4().hex[:8]}"
    podman("volume", "create", name)
    yield name
    podman("volume", "rm", "--force", name, check=False)


@pytest.fixture
def container() -> Iterator[str]:
    name = f"batchqueue-test-{uuid.uuid4().hex[:8]}"
    yield name
    logs = podman("logs", name, check=False)
    print(f"--- {name} log ---\n{logs.stdout}{logs.stderr}")
    podman("rm", "--force", "--volumes", "--time", "0", name, check=False)


def _defaults(value: str) -> str:
    """Compose's `${NAME:-default}` with nothing set in the environment."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _seconds(value: str) -> str:
    assert re.fullmatch(r"\d+s", value), value
    return value


def compose_provider() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["provider"]


def compose_healthcheck() -> list[str]:
    return list(compose_provider()["healthcheck"]["test"])


def compose_provider_args(volume: str) -> tuple[list[str], dict[str, int], list[str]]:
    """`podman run` options and command for the compose file's provider service, its
    defaults resolved: user, ports (each on a free host port, so tests run side by side),
    volumes (the named one replaced by `volume`), restart policy and healthcheck."""
    service = compose_provider()
    opts = ["--user", _defaults(service["user"]), "--restart", service["restart"]]
    ports = {}
    for entry in service["ports"]:
        host_ip, _, container_port = entry.split(":")
        ports[container_port] = _free_port()
        opts += ["--publish", f"{host_ip}:{ports[container_port]}:{container_port}"]
    for entry in service["volumes"]:
        source, target, *mode = _defaults(entry).split(":")
        source = str((ROOT / source).resolve()) if source.startswith(".") else volume
        opts += ["--volume", ":".join([source, target, *mode])]
    check = service["healthcheck"]
    kind, *argv = check["test"]
    assert kind == "CMD", check["test"]
    opts += [
        # podman 4 takes the exec form as a JSON array without "CMD" (with it, it splits the
        # text at spaces).
        "--health-cmd",
        json.dumps(argv),
        "--health-interval",
        _seconds(check["interval"]),
        "--health-timeout",
        _seconds(check["timeout"]),
        "--health-retries",
        str(check["retries"]),
        "--health-start-period",
        _seconds(check["start_period"]),
    ]
    return opts, ports, [_defaults(arg) for arg in service["command"]]


def health(address: str, service: str = "") -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status)
        except grpc.RpcError:
            return None


def container_healthy(name: str) -> bool:
    """`podman healthcheck run`: the container's own healthcheck, run now."""
    return podman("healthcheck", "run", name, check=False).returncode == 0


def volume_path(volume: str) -> Path:
    return Path(podman("volume", "inspect", "--format", "{{.Mountpoint}}", volume).stdout.strip())


def stop(name: str) -> tuple[float, int]:
    """`podman stop` (SIGTERM, SIGKILL after 30 s): the seconds from the request until the
    server's process ended (podman's own clean-up after it is not the server's), and the
    container's exit code (137 where SIGKILL ended it)."""
    asked = time.time()
    podman("stop", "--time", "30", name)
    state = podman(
        "inspect", "--format", "{{.State.ExitCode}} {{.State.FinishedAt.UnixNano}}", name
    )
    code, finished_ns = state.stdout.split()
    return int(finished_ns) / 1e9 - asked, int(code)


def test_compose_provider_serves_a_host_trainer_and_stops_cleanly(
    image: str, volume: str, container: str
) -> None:
    """The provider service as compose runs it: gRPC health SERVING on the published port
    (server-wide and the dataset's own name), its healthcheck passing, /healthz on the
    metrics port, a trainer here reading batches over gRPC and from the volume's files, and
    `podman stop` ending the server in under a second with exit code 0."""
    opts, ports, command = compose_provider_args(volume)
    podman("run", "--pull", "never", "--detach", "--name", container, *opts, image, *command)
    given = podman("inspect", "--format", "{{json .Config.Healthcheck.Test}}", container)
    assert json.loads(given.stdout) == compose_healthcheck()
    address = f"127.0.0.1:{ports['50051']}"
    wait_until(lambda: health(address) == SERVING, 120, f"health SERVING at {address}")
    assert health(address, DATASET) == SERVING
    assert health(address, f"batchqueue.v1.BatchQueue/{DATASET}") == SERVING
    wait_until(lambda: container_healthy(container), 60, "the compose healthcheck to pass")
    healthz = f"http://127.0.0.1:{ports['50052']}/healthz"
    with urllib.request.urlopen(healthz, timeout=10) as reply:
        assert reply.status == 200

    with QueueClient(address, DATASET) as streamed:
        assert streamed.transport == "grpc"
        x, y = streamed.get_batch("train")
        assert x.shape == y.shape == (12, 256)
    with QueueClient(address, DATASET, data_root=volume_path(volume)) as local:
        assert local.transport == "file"
        x, y = local.get_batch("train")
        assert x.shape == y.shape == (12, 256)

    took, code = stop(container)
    assert code == 0 and took < 1.0, (took, code)
    logs = podman("logs", container)
    assert "stopped (exit code 0)" in logs.stdout + logs.stderr


def test_the_image_alone_serves_with_its_own_cmd_and_healthcheck(
    image: str, volume: str, container: str
) -> None:
    """`docker run` of the image with nothing but a port and the data volume: its CMD serves
    the embedded default as the unprivileged user, its HEALTHCHECK (kept by --format docker)
    is the compose file's and passes, torch is the CPU build, and it stops with exit code 0."""
    port = _free_port()
    (meta,) = json.loads(podman("image", "inspect", image).stdout)
    assert meta["Healthcheck"]["Test"] == compose_healthcheck()
    assert meta["Config"]["User"] == "batchqueue"
    assert meta["Size"] < 2.5e9, f"{meta['Size'] / 1e9:.1f} GB: CUDA libraries in a CPU image?"

    publish, data = f"127.0.0.1:{port}:50051", f"{volume}:/data"
    podman(
        "run", "--pull", "never", "--detach", "--name", container, "-p", publish, "-v", data, image
    )
    address = f"127.0.0.1:{port}"
    wait_until(lambda: health(address) == SERVING, 120, f"health SERVING at {address}")
    wait_until(lambda: container_healthy(container), 60, "the image's healthcheck to pass")
    probe = "import os, torch; print(os.getuid(), torch.__version__, torch.version.cuda)"
    uid, version, cuda = podman("exec", container, "python", "-c", probe).stdout.split()
    assert (uid, cuda) == ("10001", "None") and version.endswith("+cpu"), (uid, version, cuda)
    with QueueClient(address, DATASET, data_root=volume_path(volume)) as client:
        assert client.get_batch("train")[0].shape == (12, 256)

    took, code = stop(container)
    assert code == 0 and took < 1.0, (took, code)
