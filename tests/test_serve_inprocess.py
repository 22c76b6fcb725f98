"""`with serve(config) as address:` starts a real queue-server child process for the block:
from a plain script, from inside a running event loop (sync and async forms), with every
config form (TOML path, TOML string, ServerConfig, DatasetConfig); it leaves the data root as
a restarted server expects it, and a config or data error raises in the caller with the
server's own message."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import char_config, run_client_script, subprocess_env, wait_until
from queue_client import QueueClient
from queue_client.errors import ConfigError
from queue_client.format.batchfile import scan_queue
from queue_client.format.layout import DatasetLayout, is_temp_name
from queue_server import DatasetConfig, ServeError, ServerConfig, parse_config, serve, serve_async
from queue_server.config.tables import server_tables
from queue_server.host.root_lock import DataRootLock
from queue_server.inprocess import CHILD_COMMAND
from queue_server.journal.file import Journal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_batches(address: str, n: int = 3) -> list[tuple[int, ...]]:
    with QueueClient(address, "chars", rank=0, world_size=1) as client:
        return [tuple(client.get_batch("train")[0].shape) for _ in range(n)]


def test_a_plain_script_serves_a_toml_file_and_reads_batches(corpus: Path, tmp_path: Path) -> None:
    config = tmp_path / "cfg" / "queue.toml"
    config.parent.mkdir()
    (config.parent / "corpus.txt").write_bytes(corpus.read_bytes())
    # Relative paths of a config file are relative to it, whatever the script's folder.
    config.write_text(
        char_config(Path("corpus.txt")).replace("lease_ttl_s = 30", 'data_root = "qdata"')
    )
    proc = run_client_script(
        f"""
        from queue_client import QueueClient
        from queue_server import serve

        with serve({str(config)!r}) as address:
            with QueueClient(address, "chars", rank=0, world_size=1) as client:
                for _ in range(3):
                    x, y = client.get_batch("train")
                print("shape", tuple(x.shape), "address", address)
        print("stopped")
        """
    )
    assert "shape (4, 16) address 127.0.0.1:" in proc.stdout
    assert proc.stdout.rstrip().endswith("stopped")
    assert (config.parent / "qdata" / "chars" / "meta.pkl").is_file()


@pytest.mark.parametrize("form", ["toml string", "ServerConfig", "DatasetConfig"])
def test_each_config_form_serves(
    form: str, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a TOML string's relative paths resolve from here
    text = char_config(Path("corpus.txt")) + '[server]\ndata_root = "from-config"\n'
    text = text.replace("[server]\nlease_ttl_s = 30", "", 1)
    parsed = parse_config(tomllib.loads(text), config_dir=tmp_path)
    config = {
        "toml string": text,
        "ServerConfig": parsed,
        "DatasetConfig": parsed.datasets[0],
    }[form]
    with serve(config, data_root=tmp_path / "root") as address:
        assert read_batches(address) == [(4, 16)] * 3
    assert (tmp_path / "root" / "chars" / "meta.pkl").is_file()
    assert not (tmp_path / "from-config").exists()  # data_root= wins over the config's


def test_config_tables_round_trip_to_the_same_config(tmp_path: Path) -> None:
    text = textwrap.dedent(
        """
        [server]
        lease_ttl_s = 12.5
        world_size = 4
        auth_token = "s3cret"
        tls_cert_file = "cert.pem"
        tls_key_file = "key.pem"
        [datasets.c]
        provider = "char_lm"
        batch_size = 3
        selection = "curriculum"
        curriculum_schedule = [[0, 1.0], [100, 0.5]]
        curriculum_splits = ["train"]
        [datasets.c.args]
        input = "x.txt"
        nested = {a = [1, 2], b = "c"}
        """
    )
    config = parse_config(tomllib.loads(text), config_dir=tmp_path)
    assert parse_config(server_tables(config), config_dir=tmp_path) == config


def test_inside_a_running_event_loop_sync_and_async(corpus: Path, tmp_path: Path) -> None:
    config = char_config(corpus)

    async def main() -> tuple[list[tuple[int, ...]], int]:
        # The synchronous API inside a running loop (a notebook cell): no asyncio.run inside.
        with serve(config, data_root=tmp_path / "sync") as address:
            shapes = read_batches(address, 2)
        # The async form keeps the loop running while the server starts and stops.
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        async with serve_async(config, data_root=tmp_path / "async", unix_socket=True) as address:
            assert address.startswith("unix:")
            shapes += await asyncio.to_thread(read_batches, address, 1)
        ticker.cancel()
        return shapes, ticks

    shapes, ticks = asyncio.run(main())
    assert shapes == [(4, 16)] * 3
    assert ticks > 10  # the loop ran all along the start (seconds)


def test_the_data_root_is_consistent_after_exit_and_serves_again(
    corpus: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    config = char_config(corpus, batches_per_file=2)
    with serve(config, data_root=root, unix_socket=True) as address:
        sock = Path(address.removeprefix("unix:"))
        assert sock.exists()
        # Left open: the server stops with this lease held, and files being produced.
        threads_before = set(threading.enumerate())
        client = QueueClient(address, "chars", rank=0, world_size=1, reconnect_timeout_s=0.5)
        for _ in range(5):  # into the third file: two consumed, one still leased
            client.get_batch("train")

        def consumed() -> int:
            (train,) = [s for s in client.stats()["splits"] if s["split"] == "train"]
            return int(train["consumed_files"])

        # Releases go in the background: stop once the server has taken the first one.
        wait_until(lambda: consumed() >= 1, 30, "the first file's release")
    client.close()
    # Closed after its server was gone (it cannot give its leases back), the client still
    # ends every thread it started.
    left = [t.name for t in set(threading.enumerate()) - threads_before]
    assert not [name for name in left if name.startswith("queue-client")], left
    assert not sock.exists()
    # Nothing half-written anywhere, and the root is free for the next server.
    assert [p for p in root.rglob("*") if is_temp_name(p.name)] == []
    lock = DataRootLock(root)
    lock.acquire()
    lock.release()
    # The journal replays, and nothing is lost: every file journaled as produced and not
    # consumed is on disk.
    layout = DatasetLayout(root, "chars")
    with Journal(layout.journal_file("train")) as journal:
        summary = journal.replay()
    names = scan_queue(layout.queue_dir("train"))
    on_disk = {n.seq for n in names}
    waiting = set(summary.produced) - summary.consumed
    assert summary.consumed_count >= 1 and waiting  # releases are sent in the background
    assert waiting <= on_disk
    # A file on disk that the journal does not know is NOT a lost one, and may be there: the
    # stop cancels the files in production, and a worker that renamed its file into place
    # just before the server closed its socket leaves it published but never journaled
    # (journal first, memory after: the line comes after the worker's reply). Such a file is
    # only ever a seq the server was making past every journaled one, and the next start
    # removes it (journal/reconcile.py) and makes that seq again, identically. A consumed file whose
    # deletion the stop overtook is on disk too, and goes the same way. (One worker here, so
    # seqs are made in order and the one in flight is past every journaled one.)
    journaled = set(summary.produced) | summary.consumed
    unjournaled = [n for n in names if n.seq not in journaled]
    assert all(n.seq > max(journaled) for n in unjournaled), (unjournaled, summary.produced)
    with serve(config, data_root=root) as address:
        assert read_batches(address, 2) == [(4, 16)] * 2
        left = {str(n) for n in scan_queue(layout.queue_dir("train"))}
        assert not left & {str(n) for n in unjournaled}, left  # removed by the start


def test_a_bad_config_raises_in_the_caller_with_the_message(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Refused before any process starts: the key is named.
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"datasets\.chars\.batch_size"):
        with serve(char_config(corpus, batch_size=0), data_root=tmp_path / "a"):
            pass
    assert time.monotonic() - began < 5
    with pytest.raises(ConfigError, match="not valid TOML"):
        with serve("[datasets.x\nprovider = 1", data_root=tmp_path / "a"):
            pass
    with pytest.raises(ConfigError, match=r"cannot read config .*missing\.toml"):
        with serve(str(tmp_path / "missing.toml")):
            pass
    # A data error found by the server while starting: its message, as a ConfigError.
    with pytest.raises(ConfigError, match=r"datasets\.chars: .*no-such-corpus\.txt"):
        with serve(char_config(tmp_path / "no-such-corpus.txt"), data_root=tmp_path / "b"):
            pass
    # A dataset that fails (its provider's meta is incomplete): ServeError with its reason.
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    bad = textwrap.dedent(
        """
        [datasets.bad]
        provider = "bq_test_providers:MissingMetaProvider"
        batch_size = 2
        max_worker_restarts = 0
        """
    )
    with pytest.raises(ServeError, match=r"(?s)'?bad'?.*split_info"):
        with serve(bad, data_root=tmp_path / "c"):
            pass
    assert os.listdir(tmp_path / "c")  # the server ran, and was stopped before the raise
    lock = DataRootLock(tmp_path / "c")
    lock.acquire()
    lock.release()


def test_config_objects_built_in_python(corpus: Path, tmp_path: Path) -> None:
    dataset = DatasetConfig(
        name="chars",
        provider="char_lm",
        batch_size=4,
        batches_per_file=5,
        args={"input": str(corpus), "block_size": 16},
    )
    server = ServerConfig(data_root=tmp_path / "root", datasets=(dataset,))
    with serve(server) as address:
        assert read_batches(address, 1) == [(4, 16)]
    assert (tmp_path / "root" / "chars" / "meta.pkl").is_file()


@pytest.mark.parametrize(
    "entry, argv",
    [
        (CHILD_COMMAND[-1], ["--spec", "missing.json"]),  # serve()'s child, as serve() runs it
        ("queue_server.entry", ["--config", "missing.toml"]),  # queue-server's entry point
    ],
)
def test_a_server_process_starts_the_workers_forkserver_before_it_imports_grpc(
    entry: str, argv: list[str], tmp_path: Path
) -> None:
    """The forkserver's torch import is what a first batch waits for: both entry points start
    it before their own imports (gRPC first of them), so that it runs beside them. serve()'s
    child once started it only after them, and its first batch came that much later."""
    script = textwrap.dedent(
        f"""
        import runpy, sys
        import queue_server.production.forkserver_start as workers
        seen = []
        workers.start_forkserver = lambda torch: seen.append(("grpc" in sys.modules, torch))
        sys.argv = ["server", *{argv!r}]
        try:
            if {entry!r} == "queue_server.entry":
                from queue_server.entry import main
                main()
            else:
                runpy.run_module({entry!r}, run_name="__main__")
        except BaseException:
            pass  # the missing config: only the order before it matters here
        print("STARTS", seen)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        cwd=tmp_path, env=subprocess_env(),
    )  # fmt: skip
    # Before gRPC; with torch, since the config cannot be read (test_worker_imports.py).
    assert "STARTS [(False, True)]" in proc.stdout, proc.stdout + proc.stderr
