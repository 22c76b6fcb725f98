"""An input at a URL rewritten while a real server makes files from it (same size, a new
ETag): the file being made fails, the server reports the URL and both versions, and no batch
it serves holds a byte of the new version while inputs.json records the old one.

The object is served over HTTP from a thread of this process (support/object_http.py); the
queue-server is a real process reading it through 4 KiB blocks and a cache too small to keep
the corpus, so each new file fetches blocks again. Version A's text is lower case and version
B's the same text upper case: with the byte tokenizer an upper-case letter in a batch is a
byte of B.

Once, a worker restarted after the failed read listed the object again, found B, and served
B's batches to the end (inputs.json still recording A): every worker now checks the inputs
its provider listed against inputs.json when it starts (provider_init.check_own_inputs)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from support.object_http import ObjectServer, etag_of

from conftest import subprocess_env
from queue_client import QueueClient, errors
from queue_server.testing import ServerProcess

WORDS = "quartz basalt marble slate granite flint shale chalk jasper onyx agate opal".split()
UPPER = np.arange(ord("A"), ord("Z") + 1)
# Far more batches than the corpus gives before the failure: the loop ends by the error.
MOST_BATCHES = 1000


def texts(n: int = 400) -> list[str]:
    return [" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(i % 30 + 5)) for i in range(n)]


def jsonl(lines: list[str]) -> bytes:
    return ("\n".join(json.dumps({"text": t}) for t in lines) + "\n").encode()


VERSION_A = jsonl(texts())
VERSION_B = jsonl([t.upper() for t in texts()])  # the same size, other bytes in every text


def config(url: str) -> str:
    return textwrap.dedent(
        f"""
        [datasets.web]
        provider = "text_lm"
        batch_size = 2
        batches_per_file = 2
        workers = 1
        # Restarts allowed, yet a changed input fails the dataset at once: no restart mends
        # it (and a restarted worker must never read version B).
        max_worker_restarts = 2
        [datasets.web.args]
        source = {json.dumps(url)}
        seq_len = 32
        micro_batch_size = 2
        eval_take = 4
        shuffle_buffer = 1
        remote = {{ block_bytes = 4096, cache_bytes = 8192 }}
        """
    )


def test_an_object_rewritten_while_files_are_made_fails_them_and_no_batch_holds_version_b(
    tmp_path: Path,
) -> None:
    assert len(VERSION_A) == len(VERSION_B) and etag_of(VERSION_A) != etag_of(VERSION_B)
    assert not np.isin(np.frombuffer(VERSION_A, np.uint8), UPPER).any()
    with ObjectServer({"c.jsonl": VERSION_A}) as http:
        url = http.url("c.jsonl")
        server = ServerProcess(
            tmp_path,
            data_root=tmp_path / "data",
            config_text=config(url),
            args=("--metrics-listen", "127.0.0.1:0"),
            env=subprocess_env(),
        )
        try:
            server.wait_serving(90)
            served = []
            # The server exits when the dataset fails: the client's closing release gives up
            # after a short reconnect, not the default 30 s.
            with QueueClient(server.address, "web", timeout_s=60, reconnect_timeout_s=2) as client:
                served += [client.get_batch("train") for _ in range(4)]
                # Meta is built and files are being made: the next block fetched is B's.
                http.swap_after("c.jsonl", 1, VERSION_B)
                with pytest.raises(errors.BatchQueueError) as err:
                    for _ in range(MOST_BATCHES):
                        served.append(client.get_batch("train"))
            code = server.wait_exit(60)
        finally:
            server.kill()
    log = server.log()
    tag_a, tag_b = f"etag:{etag_of(VERSION_A)}", f"etag:{etag_of(VERSION_B)}"
    # The file being made failed, naming the URL and both versions...
    assert f"input {url!r} changed while being read: it was {len(VERSION_A)} bytes, " in log
    assert f"{tag_a} when listed, and the server now answers for {tag_b}" in log, log
    # ...and it failed the dataset at once, without a restart of its worker: the client was
    # told and the server exited 2, naming the URL and both versions.
    said = str(err.value)
    assert isinstance(err.value, errors.ProviderFailed), said
    for text in (said, server.log_tail(3)):
        assert "failed with an error no restart mends" in text, text
        assert f"input {url!r} changed while being read" in text, text
        assert tag_a in text and tag_b in text and "queue-server reset" in text, text
    assert "restarting it" not in log and "worker_restarts" not in log, log
    assert code == 2, server.log_tail()
    # No batch served holds a byte of B, and inputs.json still records A.
    with_b = [i for i, b in enumerate(served) if np.isin(b["input_ids"].numpy(), UPPER).any()]
    assert with_b == [], f"batches {with_b} of {len(served)} hold version B's bytes"
    inputs = json.loads((server.data_root / "web" / "inputs.json").read_text())
    assert inputs == {url: {"size": len(VERSION_A), "version": tag_a}}
