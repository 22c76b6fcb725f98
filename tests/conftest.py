"""Shared fixtures: a real queue-server process on a free port or a unix socket.

ServerProcess and wait_until come from queue_server.testing (the benchmarks use them too) and
are re-exported here for the test files that import them from conftest."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import warm_forkserver
from client_process import ClientProcess

from queue_server.testing import ServerProcess, unexpected_exits
from queue_server.testing import wait_until as wait_until  # re-exported for the tests

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = Path(__file__).resolve().parent / "support"
pytest_plugins = ["ray_cluster"]  # the session's two-node Ray cluster fixture


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the tests that share a module-scoped fixture (servers started once
    for the module) run in one worker process, so the fixture is built once per run, not
    once per worker that happens to get one of them. Tests already in a group (the Ray
    ones) stay there.

    tryfirst: xdist reads the groups in its own pytest_collection_modifyitems, which runs
    before a trylast one; groups marked after it are silently ignored."""
    if not items:
        return
    uses_ray = items[0].config.pluginmanager.get_plugin("ray_cluster").uses_ray
    for item in items:
        if item.get_closest_marker("xdist_group") is not None or uses_ray(item):
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d[-1].scope == "module" for d in defs if d):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report names every test server that ended on its own meanwhile (a
    module's shared one included), with its exit status and the end of its log."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for text in unexpected_exits():
            report.sections.append(("queue-server that ended on its own", text))


@pytest.fixture(scope="session", autouse=True)
def warm_forkservers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The servers that tests start fork their workers' forkserver from a process that has
    torch imported already (warm_forkserver.py): a server start then costs a fork, not a
    second or more of CPU. Every process a test starts inherits it through the environment."""
    saved = {name: os.environ.get(name) for name in (*warm_forkserver.ENV_NAMES, "PYTHONPATH")}
    zygote = warm_forkserver.Zygote(tmp_path_factory.mktemp("warm-forkserver"))
    os.environ.update(zygote.env)
    yield
    zygote.close()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def cold_forkserver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked cold_forkserver (about a server's process tree, its forkserver's start
    or its processes' memory) gets servers whose forkserver is a fresh interpreter."""
    if request.node.get_closest_marker("cold_forkserver") is not None:
        for name in warm_forkserver.ENV_NAMES:
            monkeypatch.delenv(name, raising=False)


def train_losses(
    client: Any, params: Any, loss_of: Callable[[Any], Any], lr: float, steps: int = 30
) -> list[float]:
    """Adam on `params` over `steps` train batches of `client`, each checked against the
    split's schema first; the losses, to show a tiny model learns through the queue."""
    import torch

    from queue_client.format.schema import check_tensors

    opt = torch.optim.Adam(params, lr=lr)
    names = [f.name for f in client.schema("train")]
    losses = []
    for _ in range(steps):
        batch = client.get_batch("train")
        fields = dict(zip(names, batch, strict=True)) if isinstance(batch, tuple) else batch
        check_tensors(client.schema("train"), fields, (client.batch_size,))
        loss = loss_of(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# For a queue-server started by hand: a free port, and no metrics listener on the fixed default
# port (tests run side by side).
NO_METRICS_LISTEN = ("--listen", "127.0.0.1:0", "--metrics-listen", "")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "providers"), str(SUPPORT)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    env.setdefault("GRPC_VERBOSITY", "ERROR")
    env.update(extra)
    return env


def tiny_corpus(path: Path, chars: int = 40_000) -> Path:
    """A small deterministic text corpus, written by the test itself."""
    words = ["alpha", "beta", "gamma", "delta", "queue", "batch", "lease", "file", "rank", "seq"]
    out: list[str] = []
    size, i = 0, 0
    while size < chars:
        word = words[(i * 7 + i // 3) % len(words)]
        out.append(word)
        size += len(word) + 1
        i += 1
    path.write_text(" ".join(out) + "\n", encoding="utf-8")
    return path


def skewed_corpus(path: Path, *, segments: int, seed: int) -> Path:
    """Zipf-skewed letters in 300-letter segments, each heavy in four letters of its own, so
    that a window of text (one batch row) is far from the corpus average: a curriculum then
    has something to pick."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    rng = random.Random(seed)
    base = [1 / (i + 1) ** 1.2 for i in range(len(letters))]
    parts = []
    for _ in range(segments):
        topic = set(rng.sample(range(len(letters)), 4))
        weights = [w * (20 if i in topic else 1) for i, w in enumerate(base)]
        parts.append("".join(rng.choices(letters, weights=weights, k=300)))
    path.write_text("".join(parts), encoding="utf-8")
    return path


def char_config(
    corpus: Path,
    *,
    name: str = "chars",
    batch_size: int = 4,
    block_size: int = 16,
    batches_per_file: int = 5,
    extra: str = "",
    server: str | None = "lease_ttl_s = 30",
) -> str:
    """A char_lm dataset over `corpus`; with server=None the dataset's tables alone, to join
    to another config."""
    head = "" if server is None else f"[server]\n{server}\n"
    return head + textwrap.dedent(
        f"""
        [datasets.{name}]
        provider = "char_lm"
        batch_size = {batch_size}
        batches_per_file = {batches_per_file}
        {extra}
        [datasets.{name}.args]
        input = "{corpus.as_posix()}"
        block_size = {block_size}
        """
    )


class ServerFactory:
    """Starts real queue-server processes under tmp_path; close() kills every one."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.servers: list[ServerProcess] = []
        self._n = 0

    def __call__(
        self,
        config_text: str | None = None,
        *,
        data_root: Path | None = None,
        listen: str = "127.0.0.1:0",
        wait_serving: bool = True,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> ServerProcess:
        self._n += 1
        server = ServerProcess(
            self.tmp_path / f"server{self._n}",
            data_root=data_root or self.tmp_path / "data",
            config_text=config_text,
            listen=listen,
            args=("--metrics-listen", "127.0.0.1:0", *args),
            env=subprocess_env(**(env or {})),
        )
        self.servers.append(server)
        if wait_serving:
            server.wait_serving(timeout_s)
        else:
            server.wait_bound(timeout_s)
        return server

    def close(self) -> None:
        for server in self.servers:
            try:
                server.kill(signal.SIGKILL)
            except Exception:
                pass


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """start_server(config_text) -> ServerProcess; every server is killed at teardown."""
    factory = ServerFactory(tmp_path)
    yield factory
    factory.close()


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return tiny_corpus(tmp_path / "corpus.txt")


def run_client_script(
    code: str, *, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a client in its own process (a real trainer would be one, forked with torch
    imported: client_process.py); fails the test on error."""
    proc = ClientProcess(code=textwrap.dedent(code), env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode != 0:
        raise AssertionError(f"client process failed ({proc.returncode}):\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(["-c", code], int(proc.returncode), stdout, stderr)


def process_tree(root: int) -> set[int]:
    """`root` and every process descended from it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie nobody has reaped yet counts as exited). A
    process can end between the open of its /proc file and the read (ESRCH)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "\nState:\tZ" in status


def kill_leftovers(pids: set[int]) -> None:
    """SIGKILL whichever of `pids` (processes this test started) a failure left running."""
    for pid in pids:
        if not process_gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # ended meanwhile
                pass


def assert_root_serves_again(workdir: Path, root: Path, config_text: str) -> None:
    """A new server on `root` serves: the data-root lock is free and the root is as a
    restarted server expects it."""
    again = ServerProcess(workdir, data_root=root, config_text=config_text)
    try:
        again.wait_serving(120)
    finally:
        again.stop()
