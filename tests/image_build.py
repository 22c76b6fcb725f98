"""The image test's machinery: a podman that runs here, a stand-in for python:3.11-slim, and
the image built from the unchanged Dockerfile, each made once per machine and content.

Where no registry can be reached, the base image is Debian's own: `debootstrap --variant=minbase`
of bookworm with python3 (3.11, as python:3.11-slim), a venv in it on PATH (so `pip install`
works as in the official image), imported with `podman import`. The Dockerfile takes it as
the build arg BASE_IMAGE. pip inside the build uses this machine's pip settings (its indexes,
find-links and CA bundle, read with `pip config list`), mounted as /etc/pip.conf with the
local paths they name: the Dockerfile needs no knowledge of them.

Everything lives in its own podman storage under CACHE (~/.cache/batchqueue-image-test), so a
rerun builds nothing and a rebuild reuses podman's layer cache (torch's layer survives source
changes); removing that folder removes it all. A lock file keeps two test runs from building
at once.
"""

from __future__ import annotations

import ast
import configparser
import contextlib
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchqueue-image-test"
# Runtime state (mounts, locks) belongs where it goes away at a reboot, apart from the system's.
RUN_DIR = Path("/run/batchqueue-image-test")
REPO = "localhost/batchqueue-image-test"

# The stand-in for python:3.11-slim: what it is made of names its tag.
SUITE = "bookworm"
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
BASE_VENV = "/opt/python"
BASE_PATH = f"{BASE_VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# runc: crun refuses some cgroup v1 layouts. The ulimits: podman's defaults (1048576) are
# above what root may set inside some sandboxes, and a container then fails to start.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=20000:20000"]

[engine]
runtime = "runc"
"""

# pip settings that say where packages come from and how to trust it; the rest (user,
# target, break-system-packages, ...) is this machine's business, not the build's.
PIP_KEYS = {
    "index-url",
    "extra-index-url",
    "find-links",
    "cert",
    "client-cert",
    "trusted-host",
    "proxy",
    "timeout",
    "default-timeout",
    "retries",
}
# What the Dockerfile copies into the image, and what .dockerignore keeps out of it.
CONTEXT = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "constraints.txt")
CONTEXT_DIRS = ("proto", "client", "server", "providers")
IGNORED_PARTS = {"__pycache__", "data", "queue_data"}


class Unavailable(Exception):
    """This machine cannot build or run the image; the message says why (the test skips)."""


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """podman with the test's own storage and settings."""
    cmd = [
        "podman",
        "--root",
        str(CACHE / "storage"),
        "--runroot",
        str(RUN_DIR / "storage"),
        "--tmpdir",
        str(RUN_DIR / "libpod"),
        *args,
    ]
    env = {**os.environ, "CONTAINERS_CONF": str(CACHE / "containers.conf")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def check_usable() -> None:
    """Raise Unavailable naming what is missing: Linux, root, podman, runc, debootstrap."""
    if sys.platform != "linux":
        raise Unavailable(f"podman and debootstrap need Linux, not {sys.platform}")
    if os.geteuid() != 0:
        raise Unavailable("debootstrap and rootful podman need root")
    for exe in ("podman", "runc", "debootstrap"):
        if shutil.which(exe) is None:
            raise Unavailable(f"{exe} is not installed (apt-get install podman runc debootstrap)")
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "containers.conf").write_text(CONTAINERS_CONF)
    proc = podman("info", check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Unavailable(f"podman cannot run here: {last}")


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    with open(CACHE / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _exists(image: str) -> bool:
    return podman("image", "exists", image, check=False).returncode == 0


def base_image() -> str:
    """The stand-in for python:3.11-slim, made once per recipe."""
    recipe = f"{SUITE} {BASE_PACKAGES} {BASE_VENV} {BASE_PATH}".encode()
    tag = f"{REPO}/base:{SUITE}-{hashlib.sha256(recipe).hexdigest()[:12]}"
    if _exists(tag):
        return tag
    rootfs, tarball = CACHE / "rootfs.partial", CACHE / "rootfs.tar"
    shutil.rmtree(rootfs, ignore_errors=True)
    try:
        steps = [
            ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, str(rootfs)],
            ["chroot", str(rootfs), "python3", "-m", "venv", BASE_VENV],
        ]
        for step in steps:
            proc = subprocess.run(step, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise Unavailable(
                    f"{shlex.join(step)} exited {proc.returncode}: {proc.stdout[-2000:]}"
                    f"{proc.stderr[-2000:]}"
                )
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
        changes = [f"ENV PATH={BASE_PATH}", "ENV LANG=C.UTF-8", 'CMD ["python3"]']
        podman(
            "import", *(a for c in changes for a in ("--change", c)), str(tarball), tag, timeout=600
        )
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
        tarball.unlink(missing_ok=True)
    return tag


def dockerfile_arg(name: str) -> str:
    """The default of one of the Dockerfile's build args."""
    text = (ROOT / "Dockerfile").read_text()
    match = re.search(rf"^ARG {name}=(.*)$", text, re.M)
    if match is None:
        raise AssertionError(f"the Dockerfile has no ARG {name}=...")
    return shlex.split(match.group(1))[0]


def pip_settings() -> dict[str, str]:
    """This machine's pip settings that say where packages come from (files and environment)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    settings: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        name = key.rpartition(".")[2]
        if sep and name in PIP_KEYS:
            settings[name] = ast.literal_eval(value)
    return settings


def _local_paths(value: str) -> list[str]:
    """The files and folders on this machine that a pip setting names. A local index's
    pages (.../simple/NAME/) link to files beside it (../../files/...): its parent goes too."""
    paths = []
    for item in value.split():
        path = item.removeprefix("file://").rstrip("/")
        if path.startswith("/") and os.path.exists(path):
            paths.append(str(Path(path).parent) if Path(path).name == "simple" else path)
    return paths


def pip_mounts(settings: dict[str, str]) -> list[str]:
    """`podman build -v` arguments: the settings as /etc/pip.conf, and the paths they name.
    podman leaves their mount points in the image, empty: it is the test's image only."""
    conf = configparser.ConfigParser(interpolation=None)
    conf["global"] = settings
    path = CACHE / "pip.conf"
    with open(path, "w") as f:
        conf.write(f)
    mounts = [f"{path}:/etc/pip.conf:ro"]
    for value in settings.values():
        mounts += [f"{p}:{p}:ro" for p in _local_paths(value)]
    return [a for m in sorted(set(mounts)) for a in ("--volume", m)]


def torch_index(settings: dict[str, str]) -> str:
    """The Dockerfile's torch index where it answers, else "" (the build's own pip settings),
    where those have the pinned CPU build; Unavailable where neither has it."""
    index = dockerfile_arg("TORCH_INDEX_URL")
    spec = dockerfile_arg("TORCH_SPEC")
    try:
        with urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=10):
            return index
    except OSError:
        pass
    name, _, version = spec.partition("==")
    env = {**os.environ, **{"PIP_" + k.upper().replace("-", "_"): v for k, v in settings.items()}}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    if version not in re.split(r"[\s,]+", proc.stdout):
        raise Unavailable(f"{index} cannot be reached and this machine's pip indexes lack {spec}")
    return ""


def context_digest(base: str, build_args: dict[str, str]) -> str:
    """A digest of everything the build reads: the files it copies, its base and its args."""
    h = hashlib.sha256(f"{base} {sorted(build_args.items())}".encode())
    files = [ROOT / name for name in CONTEXT]
    for top in CONTEXT_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            parts = set(path.relative_to(ROOT).parts)
            if path.is_file() and not parts & IGNORED_PARTS and path.suffix != ".pyc":
                if not any(p.endswith(".egg-info") for p in parts):
                    files.append(path)
    for path in files:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def built_image() -> str:
    """The image of this tree's Dockerfile and sources, built once per content."""
    check_usable()
    with build_lock():
        base = base_image()
        settings = pip_settings()
        build_args = {"BASE_IMAGE": base, "TORCH_INDEX_URL": torch_index(settings)}
        tag = f"{REPO}/batchqueue:{context_digest(base, build_args)}"
        if _exists(tag):
            return tag
        args = [a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")]
        # --format docker: the OCI format has no HEALTHCHECK, and podman drops it.
        podman(
            "build",
            "--format",
            "docker",
            "--network=host",
            "--layers",
            *args,
            *pip_mounts(settings),
            "--tag",
            tag,
            "--file",
            str(ROOT / "Dockerfile"),
            str(ROOT),
            timeout=1200,
        )
        _forget_older(tag)
    return tag


def _forget_older(tag: str) -> None:
    """Remove the images of older trees (the layers the new one shares stay)."""
    listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", REPO + "/batchqueue")
    for old in listed.stdout.split():
        if old != tag:
            podman("rmi", old, check=False)
    podman("image", "prune", "--force", check=False, timeout=300)
