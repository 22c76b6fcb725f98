"""Test servers' workers' forkservers, forked warm instead of started cold.

Every `queue-server` starts a multiprocessing forkserver for its provider workers, a fresh
interpreter that imports torch and the providers: over a second of CPU, and the suite starts
a few hundred servers. Here the tests keep one process per test process, the zygote, that has
that import done (it is forked from the test process's own forkserver, as client_process.py's
trainers are). A server of the tests still execs its forkserver as multiprocessing does, but
the executable it runs is a small shim (`sitecustomize` in warm_site/ points multiprocessing
at it): the shim hands the forkserver's descriptors, environment and working directory to
the zygote, which forks a child that becomes that forkserver, running multiprocessing's own
`forkserver.main` with what a fresh one would have. The shim stays as the server's child and
exits as that forkserver does, with its status, so the server sees its forkserver as before.

What differs from a cold start: the forkserver and its workers are the zygote's children, not
the server's, and what a library read from the environment when it was imported (torch's
OpenMP settings) is what the test process had; workers set their threads themselves. A test about the server's process tree, its forkserver's start or the memory of
its processes is marked `cold_forkserver` and gets real ones. The shim runs the real
interpreter for anything else (the resource tracker, spawn children) and wherever the zygote
could not stand in: another namespace, another user, interpreter flags, no zygote.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

SITE = Path(__file__).resolve().parent / "warm_site"
SHIM_ENV = "BATCHQUEUE_TESTS_FORKSERVER_SHIM"
ADDRESS_ENV = "BATCHQUEUE_TESTS_ZYGOTE"
PID_ENV = "BATCHQUEUE_TESTS_ZYGOTE_PID"
ENV_NAMES = (SHIM_ENV, ADDRESS_ENV, PID_ENV)
# The forkserver's listener, its alive pipe and stdio; its command names the first two.
_MAX_FDS = 5
_FORKSERVER_CMD = "from multiprocessing.forkserver import main; main("
# Linux reads at most this much of a #! line.
_SHEBANG_MAX = 255

_SHIM = '''\
#!{python} -IS
"""A test server's forkserver, forked warm by the tests' zygote (tests/warm_forkserver.py)."""
import json, os, signal, socket, sys

REAL = {python!r}
NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user")
args = sys.argv[1:]


def run_real():
    os.execv(REAL, [REAL, *args])


def same_place(zygote):
    try:
        if os.stat(f"/proc/{{zygote}}").st_uid != os.getuid():
            return False
        return all(
            os.readlink(f"/proc/self/ns/{{ns}}") == os.readlink(f"/proc/{{zygote}}/ns/{{ns}}")
            for ns in NAMESPACES
        )
    except OSError:
        return False


address, zygote = os.environ.get({address_env!r}), os.environ.get({pid_env!r})
# Interpreter flags come first; -B (PYTHONDONTWRITEBYTECODE) is the only one the child takes.
flags, cmd = args[:-2], args[-1] if args[-2:-1] == ["-c"] else ""
if set(flags) - {{"-B"}}:
    run_real()
if not (address and zygote and cmd.startswith({cmd!r}) and same_place(zygote)):
    run_real()
listener_fd, alive_fd = (int(n) for n in cmd[len({cmd!r}):].split(",", 2)[:2])
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as the forkserver itself does
umask = os.umask(0o022)
os.umask(umask)
request = json.dumps(
    {{"cmd": cmd, "fds": [0, 1, 2, listener_fd, alive_fd], "env": dict(os.environ),
      "cwd": os.getcwd(), "umask": umask, "no_bytecode": "-B" in flags}}
).encode()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)


def read8():
    got = b""
    while len(got) < 8:
        try:
            chunk = sock.recv(8 - len(got))
        except OSError:
            return None
        if not chunk:
            return None
        got += chunk
    return got


try:
    sock.connect(address)
    header = len(request).to_bytes(8, "big")
    socket.send_fds(sock, [header], [0, 1, 2, listener_fd, alive_fd])
    sock.sendall(request)
    pid = read8()
except OSError:
    pid = None
if pid is None:
    sock.close()
    run_real()  # the zygote refused it (or ended): nothing was forked
os.close(listener_fd)
os.close(alive_fd)
status = read8()
if status is None:
    sys.exit(1)  # the zygote ended before its child
code = int.from_bytes(status, "big", signed=True)
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''


class Zygote:
    """This test process's zygote, and the environment that makes the servers started with it
    fork their forkservers from it (empty where no #! line can name this interpreter)."""

    def __init__(self, workdir: Path) -> None:
        from queue_server.production.forkserver_start import forkserver_context

        self.env: dict[str, str] = {}
        self._process: Any = None
        self._socket_dir = ""
        if len(f"#!{sys.executable} -IS") > _SHEBANG_MAX or " " in sys.executable:
            return  # every server starts its forkserver cold
        shim = workdir / "forkserver-shim"
        shim.write_text(
            _SHIM.format(
                python=sys.executable,
                address_env=ADDRESS_ENV,
                pid_env=PID_ENV,
                cmd=_FORKSERVER_CMD,
            )
        )
        shim.chmod(0o755)
        self._socket_dir = tempfile.mkdtemp(prefix="bq-zygote-")  # AF_UNIX: 107 bytes at most
        address = os.path.join(self._socket_dir, "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(64)
        self._process = forkserver_context().Process(target=serve, args=(listener,), daemon=True)
        try:
            self._process.start()
        finally:
            listener.close()
        pythonpath = os.environ.get("PYTHONPATH", "")
        self.env = {
            SHIM_ENV: str(shim),
            ADDRESS_ENV: address,
            PID_ENV: str(self._process.pid),
            "PYTHONPATH": os.pathsep.join(p for p in (str(SITE), pythonpath) if p),
        }

    def close(self) -> None:
        """End the zygote; forkservers it forked end with their servers."""
        if self._process is not None:
            self._process.kill()
            self._process.join(30)
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)


def serve(listener: socket.socket) -> None:
    """The zygote: fork a forkserver for each shim that connects, tell it the child's pid,
    then its exit status. Ends when the test process (its forkserver's parent) is gone."""
    parent = os.getppid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    waiting: dict[int, socket.socket] = {}
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while os.getppid() == parent:
            for key, _ in selector.select(timeout=1.0):
                if key.fileobj is listener:
                    _fork_one(listener, waiting, (selector, wake_r, wake_w))
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
            _reap(waiting)


def _reap(waiting: dict[int, socket.socket]) -> None:
    while True:  # every child, also one whose shim is gone
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(os.waitstatus_to_exitcode(status).to_bytes(8, "big", signed=True))
            conn.close()


def _fork_one(
    listener: socket.socket,
    waiting: dict[int, socket.socket],
    own: tuple[selectors.BaseSelector, int, int],
) -> None:
    conn, _ = listener.accept()
    conn.settimeout(30)
    fds: list[int] = []
    try:
        header, fds, _, _ = socket.recv_fds(conn, 8, _MAX_FDS)
        size = int.from_bytes(header, "big")
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise ConnectionError("the shim hung up")
            data += chunk
        request = json.loads(data)
        if len(fds) != len(request["fds"]):
            raise ConnectionError("descriptors missing")
    except (OSError, ValueError, KeyError, ConnectionError):
        for fd in fds:
            os.close(fd)
        conn.close()  # the shim then runs the real interpreter
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            selector, wake_r, wake_w = own
            signal.set_wakeup_fd(-1)
            selector.close()
            listener.close()
            conn.close()
            for sock in waiting.values():
                sock.close()
            os.close(wake_r)
            os.close(wake_w)
            code = _become_forkserver(request, fds)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(code)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(pid.to_bytes(8, "big", signed=True))
    except OSError:
        conn.close()  # the shim is gone; the forkserver ends with its server
        return
    waiting[pid] = conn


def _become_forkserver(request: dict[str, object], received: list[int]) -> int:
    """In the forked child: take the shim's descriptors at the numbers its command names,
    drop every other one, take its environment, then run multiprocessing's forkserver."""
    targets = [int(fd) for fd in request["fds"]]  # type: ignore[attr-defined]
    above = max(targets) + 1
    moved = [_dup_above(fd, above) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target)
    low = 0
    for fd in sorted(set(targets)):
        if fd > low:  # os.closerange(0, 0) closes every descriptor (its last, -1, wraps)
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])  # type: ignore[arg-type]
    os.chdir(str(request["cwd"]))
    os.umask(int(request["umask"]))  # type: ignore[call-overload]
    cmd = str(request["cmd"])
    call = ast.parse(cmd).body[1].value  # type: ignore[attr-defined]
    data: dict[str, object] = {}
    for keyword in call.keywords:  # main(..., **{"sys_path": [...], ...})
        value = ast.literal_eval(keyword.value)
        data.update(value if keyword.arg is None else {keyword.arg: value})
    sys.argv = ["-c"]
    sys.dont_write_bytecode = bool(request.get("no_bytecode"))  # type: ignore[attr-defined]
    if "sys_path" in data:  # a fresh forkserver's path is the server's, from its environment
        sys.path[:] = [str(p) for p in data["sys_path"] if p]  # type: ignore[attr-defined]
    try:
        exec(compile(cmd, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as end:
        return end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    return 0


def _dup_above(fd: int, low: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD, low)
