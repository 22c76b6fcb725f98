"""The server says what it does, stops cleanly, and treats a failed dataset like a config error.

- Without -v it logs one line per dataset once that serves (splits, workers per split, backend,
  address) and progress lines while a worker prepares a dataset.
- Ctrl-C (SIGINT to the whole process group, workers included) or SIGTERM to the server: exit
  code 0 within seconds, no traceback from any process, no temp file left in the data root,
  and a last line saying it stopped.
- A dataset that fails exits the server with code 2, naming the dataset and the error; with
  --keep-serving (or server.keep_serving) the others serve on and the failed one is
  NOT_SERVING with its reason in GetStats.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from conftest import ServerFactory, char_config, process_gone, subprocess_env, wait_until
from queue_client.format.layout import is_temp_name
from queue_server.app import health_name
from queue_server.production.preparation import Preparation
from queue_server.testing import ServerProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
METRICS = ("--metrics-listen", "127.0.0.1:0")
# What a Python process prints when an exception ends it: the server's or a worker's
# (multiprocessing heads a worker's traceback with "Process NAME:").
NOISE = re.compile(r"Traceback|^Process .*:$|KeyboardInterrupt", re.M)


def table(name: str, provider: str, args: str = "") -> str:
    return textwrap.dedent(
        f"""
        [datasets.{name}]
        provider = "{provider}"
        batch_size = 2
        batches_per_file = 3
        max_worker_restarts = 0
        [datasets.{name}.args]
        """
    ) + textwrap.dedent(args)


def temp_files(root: Path) -> list[str]:
    """Every temp name (queue_client.format.layout's) anywhere under `root`."""
    return [
        os.path.join(here, name)
        for here, dirs, files in os.walk(root)
        for name in [*files, *dirs]
        if is_temp_name(name)
    ]


# ---- saying what it does ------------------------------------------------------------------


def test_each_dataset_logs_what_it_serves_without_v(
    start_server, corpus: Path, tmp_path: Path
) -> None:
    """One line per dataset once it serves: name, splits with their workers, backend, and the
    unix socket it listens on; and the meta build announced with the size of its inputs."""
    sock = tmp_path / "bq.sock"
    server = start_server(
        char_config(corpus, extra="workers = 2"), listen=f"unix:{sock}", args=METRICS
    )
    line = wait_until(
        lambda: next((x for x in server.log().splitlines() if "dataset chars serving" in x), ""),
        10,
        "the dataset's serving line",
    )
    assert line.endswith(
        f"INFO queue_server: dataset chars serving on unix:{sock}: "
        "splits train (2 workers), val (1 worker, started on its first lease); backend local"
    ), line
    log = server.log()
    assert re.search(
        r"INFO queue_server\.prepare: dataset chars: building meta \(inputs: 3\d\.\d KiB\)", log
    ), log
    assert f"batchqueue listening on unix:{sock}" in log
    assert "produced seq" not in log  # one line per file still needs -v


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a FIFO, and /proc/self/io")
def test_a_long_meta_build_reports_progress_every_few_seconds(start_server, tmp_path: Path) -> None:
    """A meta build that runs on (held open by a FIFO the test owns) logs progress lines,
    the stage and the time so far, at most one per interval, then how long it took."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    config = table("gated", "bq_operability_providers:GatedMetaProvider", f'gate = "{gate}"\n')
    server = start_server(config, wait_serving=False, args=METRICS)
    progress = re.compile(
        r"dataset gated: building meta: tokenizer, indexes and the rest of meta, (\d+) s so far"
    )
    wait_until(lambda: progress.search(server.log()), 30, "a progress line of the meta build")
    with open(gate, "wb"):
        pass  # the build goes on once the FIFO closes
    server.wait_serving(60)
    log = server.log()
    seconds = [int(s) for s in progress.findall(log)]
    assert seconds[0] >= 4, log  # the first after the interval, not at once
    assert all(b - a >= 4 for a, b in itertools.pairwise(seconds)), log  # never more often
    assert re.search(r"dataset gated: building meta: done in \d+ s", log), log
    assert not NOISE.search(log), log


def test_preparation_lines_name_the_stage_and_the_bytes_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The progress object itself, with a short interval: lines come only while the step
    runs, name its stage and the bytes read so far, and a quiet one says nothing."""
    data = tmp_path / "input.bin"
    data.write_bytes(os.urandom(3 << 20))
    caplog.set_level(logging.INFO, logger="queue_server.prepare")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "queue_server.prepare"]

    progress = re.compile(
        r"dataset d: building meta: reading, \d+ s so far, \d+\.\d MiB read \(inputs: 3\.0 MiB\)"
    )
    prep = Preparation(
        "dataset d: building meta", announce=True, total_bytes=3 << 20, interval_s=0.05
    )
    prep.stage = "reading"
    with prep:
        data.read_bytes()
        if sys.platform.startswith("linux"):  # bytes read come from /proc/self/io
            wait_until(lambda: any(map(progress.fullmatch, lines())), 10, "a line with MiB read")
        else:
            wait_until(lambda: len(lines()) >= 2, 10, "a progress line")
    said = lines()
    assert said[0] == "dataset d: building meta (inputs: 3.0 MiB)"
    assert all(x.startswith("dataset d: building meta: reading, ") for x in said[1:-1]), said
    assert re.fullmatch(r"dataset d: building meta: done in \d+ s", said[-1]), said
    caplog.clear()
    with Preparation("quiet", quiet=True, announce=True, interval_s=0.01):
        pass
    with Preparation("quick", interval_s=60):
        pass
    assert lines() == []


# ---- stopping cleanly ----------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.cold_forkserver  # the server's own workers, in its process group
@pytest.mark.parametrize(
    "how", ["sigint-to-the-group", "sigterm-to-the-group", "sigterm-to-the-server"]
)
def test_ctrl_c_or_sigterm_mid_file_stops_cleanly(tmp_path: Path, how: str) -> None:
    """Workers caught with half-written temp files: SIGINT to the whole process group (as a
    terminal's Ctrl-C), SIGTERM to it (as `timeout` or systemd sends it) or SIGTERM to the
    server alone. The server exits 0 within the deadline, no process prints a traceback or
    an error (no worker died under it, none was restarted), no temp file is left, the
    workers are gone, and the last line says it stopped."""
    config = table("half", "bq_operability_providers:HalfWrittenProvider", "hold_s = 600.0\n")
    # Two train workers: val starts its worker on its first lease, which never comes here.
    config = config.replace("max_worker_restarts = 0\n", "max_worker_restarts = 0\nworkers = 2\n")
    server = ServerProcess(
        tmp_path / "server",
        data_root=tmp_path / "data",
        config_text=config,
        args=METRICS,
        env=subprocess_env(),
        own_process_group=True,
    )
    try:
        server.wait_serving(60)
        wait_until(lambda: len(temp_files(server.data_root)) >= 2, 60, "both workers mid-file")
        pids = [int(p) for s in server.stats("half")["splits"] for p in s["worker_pids"]]
        server.close_channel()
        assert all(os.getpgid(p) == server.pid for p in pids)  # the group's, not the tests'
        if how == "sigint-to-the-group":
            server.signal_group(signal.SIGINT)
        elif how == "sigterm-to-the-group":
            server.signal_group(signal.SIGTERM)
        else:
            server.proc.send_signal(signal.SIGTERM)
        code = server.wait_exit(30)
    finally:
        server.kill()
    log = server.log()
    assert code == 0, log
    assert not NOISE.search(log), log
    assert " ERROR " not in log and "restart" not in log, log
    assert temp_files(server.data_root) == [], log
    assert all(process_gone(p) for p in pids), pids
    assert log.splitlines()[-1].endswith("INFO queue_server: stopped (exit code 0)"), log
    name = "SIGINT" if how.startswith("sigint") else "SIGTERM"
    assert f"shutting down ({name})" in log


# ---- a failed dataset ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            table("bad", "bq_operability_providers:BrokenMetaProvider"),
            r"queue-server: dataset 'bad' failed to start: RuntimeError: the index of "
            r"BrokenMetaProvider is corrupt; the server stopped with it \(--keep-serving",
        ),
        (
            table("bad", "bq_test_providers:FailingProvider"),
            r"queue-server: dataset 'bad' failed( to start)?: .*boom from FailingProvider; the server "
            r"stopped",
        ),
        (
            table("bad", "char_lm", 'input = "no-such-corpus.txt"\n'),
            r"queue-server: config error: datasets\.bad: (ConfigError: )?char_lm input '.*no-such-corpus\.txt' "
            r"is not a file",
        ),
    ],
    ids=["meta-cannot-be-built", "provider-fails-after-start", "missing-input"],
)
def test_a_failed_dataset_stops_the_server_with_exit_2_naming_it(
    start_server: ServerFactory, corpus: Path, bad: str, message: str
) -> None:
    """By default a data error ends the server like a config error: the usual shutdown, exit
    code 2, and a last line naming the dataset and the error; the good dataset does not keep
    it up."""
    server = start_server(char_config(corpus, name="good") + bad, wait_serving=False, args=METRICS)
    code = server.wait_exit(60)
    log = server.log()
    assert code == 2, log
    assert re.fullmatch(message + ".*", log.splitlines()[-1]), log
    assert not NOISE.search(log), log
    assert temp_files(server.data_root) == [], log


@pytest.mark.parametrize("how", ["flag", "config-key"])
def test_keep_serving_keeps_the_others_up_and_reports_the_failed_one(
    start_server: ServerFactory, corpus: Path, how: str
) -> None:
    """--keep-serving, or keep_serving = true in [server]: the good dataset serves, the
    failed one is NOT_SERVING with its reason in GetStats, and a stop is still exit 0."""
    server_table = "lease_ttl_s = 30" + ("\nkeep_serving = true" if how == "config-key" else "")
    config = char_config(corpus, name="good", server=server_table) + table(
        "bad", "bq_operability_providers:BrokenMetaProvider"
    )
    args = (*METRICS, "--keep-serving") if how == "flag" else METRICS
    server = start_server(config, wait_serving=False, args=args)
    wait_until(lambda: server.stats("bad")["state"] == "failed", 60, "bad to fail")
    wait_until(lambda: server.health(health_name("good")) == SERVING, 60, "good to serve")
    stats = server.stats("bad")
    assert "RuntimeError: the index of BrokenMetaProvider is corrupt" in stats["last_error"]
    assert server.health(health_name("bad")) == NOT_SERVING
    assert server.health() == NOT_SERVING  # the server as a whole is not all right
    assert server.proc.poll() is None
    server.stop()
    assert server.proc.returncode == 0, server.log()


# ---- an address in use ---------------------------------------------------------------------


def test_a_second_server_on_the_same_grpc_address_exits_naming_it(
    start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    """A second queue-server left at the first one's --listen: exit code 1 and one line
    naming the address, the setting and the kernel's reason (no gRPC traceback, no C-core
    log line), while the first one serves on."""
    first = start_server(char_config(corpus))
    second = ServerProcess(
        tmp_path / "second",
        data_root=tmp_path / "second-root",
        config_text=char_config(corpus),
        listen=first.address,
        env=subprocess_env(),
    )
    try:
        assert second.wait_exit(120) == 1, second.log()
    finally:
        second.kill()
    said = second.log().strip()
    assert said.splitlines() == [said], said
    assert f"cannot listen for gRPC on {first.address}" in said, said
    assert "(server.listen, --listen)" in said and "address already in use" in said, said
    assert first.health() == SERVING
