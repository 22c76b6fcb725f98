"""Real Ray clusters on this machine for the tests (Ray starts in seconds, not free).

`ray_cluster`: one two-node cluster for the whole pytest run. Both nodes are raylet processes
with node ids of their own; the second carries the label PINNED_LABEL, so tests can pin actors
to it. A test may add a node of its own (`add_node`) and remove it again: Ray connects drivers
to the head node, so an added node runs actors only and can go away under a live server.

`RayHead`: a one-node cluster of a test's own, `ray start --head --block` in a process group
of its own at a fixed GCS port, so the test can end the whole cluster (every process of the
group, SIGKILL, as a lost machine) and start it again at the same address.

Without Ray installed every test that uses them skips, saying how to install it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"
PINNED_LABEL = ("batchqueue-test", "pinned")
# Logical CPUs per node: each actor reserves one, and a pinned test runs two on one node.
NODE_CPUS = 2
INSTALL_HINT = "Ray is not installed: pip install 'batchqueue[ray]' (make setup does)"


def without_token_auth() -> None:
    """Test clusters, their drivers and the servers started here run without Ray's token
    auth: otherwise a ~/.ray/auth_token left by any earlier `ray.init()` turns it on for a
    new head but not for a driver joining it, and every join fails with InvalidAuthToken.
    An explicit RAY_AUTH_MODE is kept."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@contextlib.contextmanager
def support_on_pythonpath() -> Iterator[None]:
    """Raylets started meanwhile hand PYTHONPATH to their workers: actors import the test
    providers from tests/support."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT), saved) if p)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@dataclass(frozen=True)
class RayCluster:
    address: str
    head_node_id: str
    pinned_node_id: str
    cluster: Any = field(repr=False, compare=False)

    @property
    def node_ids(self) -> set[str]:
        return {self.head_node_id, self.pinned_node_id}

    def add_node(self, num_cpus: int = NODE_CPUS, labels: Mapping[str, str] | None = None) -> Any:
        """A further node, up and registered when this returns; remove it with remove_node."""
        node = start_node(self.cluster, num_cpus=num_cpus, labels=dict(labels or {}))
        self.cluster.wait_for_nodes()
        return node

    def is_dead(self, node: Any) -> bool:
        """Whether the head has declared the node dead (a raylet that starts on starved
        cores can miss the head's health checks, and a dead node never comes back)."""
        import ray

        return any(n["NodeID"] == node.node_id and not n["Alive"] for n in ray.nodes())

    def remove_node(self, node: Any, graceful: bool = True) -> None:
        """End the node's raylet and every worker on it (its actors die with it); not
        graceful: SIGKILL, as a machine that is lost (the head learns it by its health
        checks, not from the raylet)."""
        self.cluster.remove_node(node, allow_graceful=graceful)


RAY_FIXTURES = ("ray_cluster", "ray_head")
# Ray gives a new raylet 30 s to register with the head (a constant in ray._private.node);
# one that starts on starved cores can take longer, and the attempt is made again.
NODE_START_ATTEMPTS = 3


def _child_raylets() -> set[int]:
    """Pids of this process's raylet children (ray.cluster_utils starts them directly)."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        if name == "raylet" and int(rest.split()[1]) == me:
            found.add(int(entry))
    return found


def start_node(cluster: Any, **node_args: Any) -> Any:
    """cluster.add_node, made again when the raylet misses Ray's 30 s to register: the late
    raylet is killed first, so that it cannot join afterwards as a node nobody removes."""
    for attempt in range(1, NODE_START_ATTEMPTS + 1):
        before = _child_raylets()
        try:
            with support_on_pythonpath():
                return cluster.add_node(**node_args)
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == NODE_START_ATTEMPTS:
                raise
            for pid in _child_raylets() - before:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    raise AssertionError("unreachable")


def uses_ray(item: pytest.Item) -> bool:
    """Whether a test uses one of the Ray cluster fixtures."""
    return any(name in getattr(item, "fixturenames", ()) for name in RAY_FIXTURES)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs -n N --dist loadgroup) every test that uses a
    Ray cluster runs in one worker process, so the run starts one session cluster, not one per
    worker, and two clusters never compete for the same cores."""
    for item in items:
        if uses_ray(item):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """Start the cluster once, connect this process to it, shut both down at the end."""
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        pytest.skip(INSTALL_HINT)
    from queue_server.production.ray.ray_connect import connect

    without_token_auth()
    with support_on_pythonpath():
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False}
        )
        pinned = start_node(cluster, num_cpus=NODE_CPUS, labels=dict([PINNED_LABEL]))
        cluster.wait_for_nodes()
    try:
        connect(cluster.address)
        yield RayCluster(cluster.address, cluster.head_node.node_id, pinned.node_id, cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayHead:
    """A one-node Ray cluster in a process group of its own, at a fixed GCS port.

    head = RayHead(port, env)   # started; head.address is "127.0.0.1:PORT"
    head.kill()                 # the whole cluster is gone
    head.start()                # and back, at the same address
    head.close()
    """

    def __init__(self, port: int, env: Mapping[str, str], num_cpus: int = NODE_CPUS) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self._env = {**env, "RAY_USAGE_STATS_ENABLED": "0"}
        self._num_cpus = num_cpus
        # Short: Ray's unix socket paths live under it and must stay under 108 bytes.
        self._temp_dir = tempfile.mkdtemp(prefix="bqray-")
        self.log_path = Path(self._temp_dir) / "head.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, timeout_s: float = 60.0) -> None:
        assert self._proc is None, "the head runs already"
        command = [
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--head",
            f"--port={self.port}",
            f"--num-cpus={self._num_cpus}",
            f"--temp-dir={self._temp_dir}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--block",
        ]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self._env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while True:  # the GCS port answers once the head is up
            if self._proc.poll() is not None:
                raise RuntimeError(f"`ray start --head` exited:\n{self.log_path.read_text()}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray head at {self.address} did not listen in {timeout_s}s")
            time.sleep(0.1)  # poll interval of the wait above, bounded by its deadline

    def kill(self) -> None:
        """SIGKILL to every process of the head's group: GCS, raylet and their helpers.
        Actor workers leave the group; they end on their own once their raylet is gone."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait(timeout=30)
        self._proc = None

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._temp_dir, ignore_errors=True)


@pytest.fixture
def ray_head() -> Iterator[type[RayHead]]:
    """RayHead, skipped without Ray; every head made through it is killed at teardown."""
    pytest.importorskip("ray", reason=INSTALL_HINT)
    without_token_auth()
    heads: list[RayHead] = []

    class Tracked(RayHead):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            heads.append(self)
            super().__init__(*args, **kwargs)

    try:
        yield Tracked
    finally:
        for head in heads:
            head.close()
