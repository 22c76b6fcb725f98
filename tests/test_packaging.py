"""What `docker compose up provider` and a fresh clone rely on, checked without a Docker engine."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, char_config, subprocess_env, tiny_corpus, wait_until
from queue_client import QueueClient
from queue_server.config.server import load_config

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _compose_exe() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed; .ci/run installs Debian's package")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    return exe


def _compose_config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`docker-compose config`: validates the file and prints it with variables resolved."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BATCHQUEUE_")}
    return subprocess.run(
        [_compose_exe(), "-f", str(ROOT / "docker-compose.yml"), "config", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**clean, **(env or {})},
    )


def _resolved(env: dict[str, str] | None = None) -> dict:
    proc = _compose_config(env=env)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def _mounts(service: dict) -> dict[str, tuple[str, str]]:
    """target -> (source, mode) of a resolved service's volumes."""
    out = {}
    for entry in service["volumes"]:
        source, target, *mode = entry.split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


def test_compose_file_validates_with_docker_compose() -> None:
    proc = _compose_config("-q")
    assert proc.returncode == 0, proc.stderr


def test_provider_service_contract() -> None:
    provider = _compose()["services"]["provider"]
    assert provider["build"] == "."  # the CPU image
    assert "127.0.0.1:50051:50051" in provider["ports"]  # published on the host's loopback only
    assert "127.0.0.1:50052:50052" in provider["ports"]  # HTTP /metrics and /healthz
    assert "queue_server.healthcheck" in provider["healthcheck"]["test"]
    assert provider["restart"] == "unless-stopped"
    command = provider["command"]
    assert command[command.index("--data-root") + 1] == "/data"
    assert command[command.index("--config") + 1].startswith("/config/")


def test_compose_defaults_serve_the_embedded_config_on_a_named_volume() -> None:
    """With nothing set, `docker compose up provider` serves what it always did."""
    provider = _resolved()["services"]["provider"]
    mounts = _mounts(provider)
    assert mounts["/data"] == ("batchqueue-data", "rw")
    assert mounts["/config"] == (str(ROOT / "server" / "queue_server"), "ro")
    config = provider["command"][provider["command"].index("--config") + 1]
    assert config == "/config/default_config.toml"
    assert (ROOT / "server" / "queue_server" / "default_config.toml").is_file()


def test_trainer_service_reserves_a_gpu_and_shared_memory() -> None:
    services = _resolved()["services"]
    trainer = services["trainer"]
    assert trainer["profiles"] == ["train"]
    assert trainer["depends_on"]["provider"]["condition"] == "service_healthy"
    (device,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert trainer["shm_size"] == "2gb"
    assert re.fullmatch(
        r"https://download\.pytorch\.org/whl/cu\d+", trainer["build"]["args"]["TORCH_INDEX_URL"]
    )
    # Any build of the pinned version: the CUDA index's is the CUDA build.
    assert trainer["build"]["args"]["TORCH_SPEC"] == "torch==2.13.0"
    # It reads the batch files of the provider's very data root.
    assert _mounts(trainer)["/data"] == (_mounts(services["provider"])["/data"][0], "ro")


def _dockerfile_args(text: str) -> dict[str, str]:
    args = {}
    for m in re.finditer(r"^ARG (\w+)=(.*)$", text, re.M):
        args[m.group(1)] = shlex.split(m.group(2))[0]
    return args


def _torch_step(text: str, **given: str) -> list[str]:
    """The torch install step as the shell runs it, with the build args at their defaults
    unless given."""
    args = {**_dockerfile_args(text), **given}
    (step,) = [line for line in text.splitlines() if line.startswith("RUN") and "TORCH" in line]
    echo_pip = 'pip() { printf "%s\\n" pip "$@"; }\n'  # prints the words pip would get
    proc = subprocess.run(
        ["sh", "-c", echo_pip + step.removeprefix("RUN ")],
        capture_output=True,
        text=True,
        env={**os.environ, **args},
        check=True,
    )
    return proc.stdout.splitlines()


def test_dockerfile_installs_cpu_torch_from_the_cpu_index() -> None:
    """The install step, with its build args at their defaults, is exactly the CPU build of
    the pinned torch (+cpu: PyPI's is the CUDA one) from the CPU wheel index; it comes before
    the sources, in its own layer. TORCH_INDEX_URL="" drops the index (pip's own settings)."""
    text = (ROOT / "Dockerfile").read_text()
    args = _dockerfile_args(text)
    cpu = ["pip", "install", "--index-url", CPU_INDEX, "torch==2.13.0+cpu"]
    assert _torch_step(text) == cpu
    assert _torch_step(text, TORCH_INDEX_URL="") == ["pip", "install", "torch==2.13.0+cpu"]
    (step,) = [line for line in text.splitlines() if line.startswith("RUN") and "TORCH" in line]
    assert text.index(step) < text.index("COPY client")
    assert "EXPOSE 50051 50052" in text and "queue-server" in text and "HEALTHCHECK" in text
    assert "USER batchqueue" in text  # the server does not run as root
    # Inputs at s3:// or https:// URLs work in the default image.
    assert set(args["EXTRAS"].split(",")) >= {"text", "remote"}


def test_dockerignore_keeps_data_environments_and_caches_out() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in (".git", ".venv", "data", "bench/out", "**/__pycache__", ".pytest_cache"):
        assert needed in patterns, needed
    copied = re.findall(r"^COPY (.+) \S+$", (ROOT / "Dockerfile").read_text(), re.M)
    sources = [src for line in copied for src in line.split()]
    assert sources, "no COPY step found"
    for src in sources:
        for pattern in patterns:
            assert not fnmatch.fnmatch(src, pattern.removeprefix("**/")), (src, pattern)


def test_compose_provider_command_serves_user_data_from_its_mounts(tmp_path: Path) -> None:
    """The provider's resolved command, its container paths mapped back to the host
    directories compose would mount there, serves a user's config and input: relative paths
    resolve beside the config, and the data root is the host directory."""
    mydata, data_root = tmp_path / "mydata", tmp_path / "queue-data"
    mydata.mkdir()
    data_root.mkdir()
    tiny_corpus(mydata / "corpus.txt")
    (mydata / "config.toml").write_text(
        '[datasets.mine]\nprovider = "char_lm"\nbatch_size = 4\nbatches_per_file = 5\n'
        '[datasets.mine.args]\ninput = "corpus.txt"\nblock_size = 16\n'
    )
    env = {
        "BATCHQUEUE_CONFIG_DIR": str(mydata),
        "BATCHQUEUE_CONFIG": "config.toml",
        "BATCHQUEUE_DATA_ROOT": str(data_root),
    }
    provider = _resolved(env)["services"]["provider"]
    mounts = _mounts(provider)
    assert mounts["/config"] == (str(mydata), "ro") and mounts["/data"][0] == str(data_root)

    def on_host(arg: str) -> str:
        for target, (source, _) in mounts.items():
            if arg == target or arg.startswith(target + "/"):
                return source + arg[len(target) :]
        return {"0.0.0.0:50051": "127.0.0.1:0", "0.0.0.0:50052": "127.0.0.1:0"}.get(arg, arg)

    exe, *rest = provider["command"]
    assert exe == "queue-server"
    ready = tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "queue_server", *map(on_host, rest), "--ready-file", str(ready)]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env())
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 60, "the server to bind")
        assert proc.poll() is None, log.read_text()
        address = json.loads(ready.read_text())["address"]
        check = [
            sys.executable if a == "python" else a for a in provider["healthcheck"]["test"][1:]
        ]
        check[check.index("--address") + 1] = address

        def healthy() -> bool:
            run = subprocess.run(check, capture_output=True, env=subprocess_env(), timeout=60)
            return run.returncode == 0

        wait_until(healthy, 120, f"the compose healthcheck to pass\n{log.read_text()}")
        with QueueClient(address, "mine") as client:
            assert client.get_batch("train")[0].shape == (4, 16)
        assert (data_root / "mine" / "meta.pkl").is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


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
    # The dataset's bare name answers too, as a probe's `--service NAME` expects.
    bare = subprocess.run(
        [
            sys.executable,
            "-m",
            "queue_server.healthcheck",
            "--address",
            server.address,
            "--service",
            "chars",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert bare.returncode == 0 and "chars: SERVING" in bare.stdout, bare.stderr
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


def test_ray_profile_runs_a_head_a_ray_provider_and_a_trainer_without_the_data_volume() -> None:
    """`docker compose --profile ray up ray-trainer`: validated by docker-compose itself."""
    proc = _compose_config("-q", env={"COMPOSE_PROFILES": "ray"})
    assert proc.returncode == 0, proc.stderr
    services = _resolved({"COMPOSE_PROFILES": "ray"})["services"]
    head, provider, trainer = (services[n] for n in ("ray-head", "ray-provider", "ray-trainer"))
    for service in (head, provider, trainer):
        assert service["profiles"] == ["ray"]
        assert service["image"] == "batchqueue:ray"
        assert service["build"]["args"]["EXTRAS"] == "text,remote,ray"  # Ray in the image
    assert head["command"][:3] == ["ray", "start", "--head"] and "--block" in head["command"]
    port = next(a for a in head["command"] if a.startswith("--port=")).split("=")[1]

    # The server's container joins the cluster as a node, then serves a dataset on Ray.
    script = provider["command"][-1]
    assert f"ray start --address=ray-head:{port}" in script
    assert script.index("ray start") < script.index("exec queue-server")
    assert provider["depends_on"]["ray-head"]["condition"] == "service_healthy"
    config_file = re.search(r"--config /config/(\S+)", script).group(1)  # type: ignore[union-attr]
    config_dir = Path(_mounts(provider)["/config"][0])
    config = load_config(config_dir / config_file)  # a valid config, as the server reads it
    (dataset,) = config.datasets
    assert (dataset.backend, dataset.ray_address) == ("ray", f"ray-head:{port}")
    # Inputs and the data root at the same paths on every node.
    assert _mounts(head) == _mounts(provider)

    # The trainer reads over gRPC and mounts nothing but the script.
    assert trainer["depends_on"]["ray-provider"]["condition"] == "service_healthy"
    assert [target for target in _mounts(trainer)] == ["/app/examples"]
    command = trainer["command"]
    assert command[command.index("--transport") + 1] == "grpc"
    assert command[command.index("--address") + 1] == "ray-provider:50051"
    assert command[command.index("--dataset") + 1] == dataset.name


def test_ray_profile_runs_with_token_authentication_as_docs_ray_md_says(tmp_path: Path) -> None:
    """docs/ray.md runs every step with RAY_AUTH_MODE=token: so do the head (and its
    healthcheck, which runs with its environment) and the server's node, each reading the
    cluster's token from one compose secret, whose file BATCHQUEUE_RAY_TOKEN_FILE names
    (default ./ray_auth_token, kept out of git and of the image). The trainer talks to no Ray
    and gets no token."""
    token_file = tmp_path / "token"
    resolved = _resolved({"COMPOSE_PROFILES": "ray", "BATCHQUEUE_RAY_TOKEN_FILE": str(token_file)})
    services = resolved["services"]
    for name in ("ray-head", "ray-provider"):
        service = services[name]
        (secret,) = service["secrets"]
        source = secret["source"] if isinstance(secret, dict) else secret
        assert service["environment"] == {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": f"/run/secrets/{source}",
        }, name
        assert Path(resolved["secrets"][source]["file"]) == token_file
    assert "secrets" not in services["ray-trainer"]
    assert "RAY_AUTH_TOKEN_PATH" not in services["ray-trainer"].get("environment", {})
    assert "RAY_AUTH_MODE" not in json.dumps(services["provider"])  # the plain profile: no Ray

    default = _resolved({"COMPOSE_PROFILES": "ray"})["secrets"]["ray_auth_token"]["file"]
    assert Path(default) == ROOT / "ray_auth_token"
    for ignore in (".gitignore", ".dockerignore"):
        assert "ray_auth_token" in (ROOT / ignore).read_text().split(), ignore
    compose = (ROOT / "docker-compose.yml").read_text()
    ray_md = (ROOT / "docs" / "ray.md").read_text()
    assert "secrets.token_hex" in compose and "BATCHQUEUE_RAY_TOKEN_FILE" in ray_md
