"""A restarted server checks the inputs of a provider that names them one by one (char_lm on a
local file: meta's inputs_fixed) by itself, by size and mtime as a worker would, and serves
the files on disk before any worker has started. Here no worker can start at all: the
workers' forkserver never gets past its interpreter's start."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from conftest import ServerFactory, char_config, subprocess_env, wait_until
from queue_client import QueueClient
from queue_client.errors import NoBatchReady
from queue_client.format.meta import load_meta


def _built_root(start_server: ServerFactory, corpus: Path) -> str:
    """A root with meta built and files waiting on disk; the server stopped."""
    config = char_config(corpus)
    first = start_server(config)
    first.wait_ready_files("chars", 2)
    first.stop()
    return config


def _forkserver_never_starts(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment of a server whose workers' forkserver never starts (a sitecustomize
    that holds it at its interpreter's start, until the server is gone), and the file that
    says it got there. char_lm's workers import no torch, so a stand-in torch would not do."""
    site = tmp_path / "never-site"
    site.mkdir()
    arrived = tmp_path / "forkserver-held"
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            f"""
            import os, pathlib, sys, time
            if any("multiprocessing.forkserver import main" in a for a in sys.orig_argv):
                pathlib.Path({str(arrived)!r}).touch()
                parent = os.getppid()
                while os.getppid() == parent:  # held until the server is gone
                    time.sleep(0.05)
                os._exit(0)
            """
        )
    )
    path = os.pathsep.join([str(site), subprocess_env()["PYTHONPATH"]])
    return {"PYTHONPATH": path}, arrived


@pytest.mark.cold_forkserver  # the server's own forkserver, held at its start
def test_a_restarted_server_serves_its_backlog_before_any_worker_starts(
    start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    config = _built_root(start_server, corpus)
    assert load_meta(tmp_path / "data" / "chars" / "meta.pkl")["inputs_fixed"] is True
    env, held = _forkserver_never_starts(tmp_path)
    server = start_server(config, env=env)
    with QueueClient(server.address, "chars", rank=0, world_size=1, timeout_s=60) as client:
        x, y = client.get_batch("train")
    assert x.shape == (4, 16) and bool((x[:, 1:] == y[:, :-1]).all())
    # The forkserver is held at its start (it got there, on a busy machine maybe only now):
    # no worker ran.
    wait_until(held.exists, 60, "the forkserver held at its start")
    assert server.split_stats("chars")["worker_restarts"] == 0


@pytest.mark.cold_forkserver
def test_a_fixed_input_that_moved_on_waits_for_a_worker_to_check_it(
    start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    """The same bytes with another mtime: only a worker's hash can tell, so nothing is served
    while no worker can start."""
    config = _built_root(start_server, corpus)
    st = corpus.stat()
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    env, held = _forkserver_never_starts(tmp_path)
    server = start_server(config, env=env)
    with QueueClient(server.address, "chars", rank=0, world_size=1, timeout_s=3) as client:
        with pytest.raises(NoBatchReady):
            client.get_batch("train")
    wait_until(held.exists, 60, "the forkserver held at its start")


def test_a_provider_whose_inputs_are_a_listing_records_none_as_fixed(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    """char_lm's default text is a listing of the standard library: a new file there would be
    a new input, which only the provider can see, so its records are not the whole set."""
    server = start_server(
        """
[datasets.stdlib]
provider = "char_lm"
batch_size = 2
batches_per_file = 2
[datasets.stdlib.args]
block_size = 8
"""
    )
    server.stop()
    assert "inputs_fixed" not in load_meta(tmp_path / "data" / "stdlib" / "meta.pkl")


def test_the_servers_check_trusts_only_exact_local_records(tmp_path: Path) -> None:
    """Every way a record can fail to prove its file unchanged sends the check to a worker:
    no records, an input at a URL, a file gone, another size or mtime, and records that are
    not meta's (an edited inputs.json)."""
    from queue_providers.input_records import inputs_fingerprint, local_files_unchanged
    from queue_providers.inputs import describe_inputs
    from queue_server.dataset import _fixed_inputs_unchanged

    text = tmp_path / "text.txt"
    text.write_text("some text\n")
    records = describe_inputs([text])
    fingerprint = inputs_fingerprint(records)
    assert _fixed_inputs_unchanged(records, fingerprint, tmp_path)
    relative = {"text.txt": records[str(text)]}  # as a provider names it from its config dir
    assert local_files_unchanged(relative, tmp_path)
    assert not local_files_unchanged(relative, tmp_path / "elsewhere")
    assert not local_files_unchanged({}, tmp_path)
    url = {"s3://bucket/text.txt": {"size": 10, "version": "etag:1"}}
    assert not local_files_unchanged(url, tmp_path)
    edited = {str(text): {**records[str(text)], "sha256": "0" * 64}}
    assert local_files_unchanged(edited, tmp_path)  # sizes and mtimes alone cannot tell...
    assert not _fixed_inputs_unchanged(edited, fingerprint, tmp_path)  # ...meta's fingerprint can
    st = text.stat()
    os.utime(text, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not _fixed_inputs_unchanged(records, fingerprint, tmp_path)
    text.write_text("some text, longer\n")
    assert not local_files_unchanged(records, tmp_path)
    text.unlink()
    assert not local_files_unchanged(records, tmp_path)
