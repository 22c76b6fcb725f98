"""Provider inputs at URLs: a real S3-compatible server (moto's server mode, in its own
process) and a real HTTP server that answers 503 when told to, read by real queue-server
processes. text_lm over s3:// or https:// serves the same batches as over the local file; a
changed object is refused at the next start; a transient error is retried; every bad URL fails
fast with a message naming it; and no credential is ever written or logged."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support.flaky_http import FlakyFileServer
from support.s3_server import CREDENTIALS, NO_AMBIENT_CREDENTIALS, S3Server, free_port

from conftest import ROOT, subprocess_env, wait_until
from queue_client import QueueClient
from queue_client.errors import ConfigError
from queue_client.format.meta import load_meta
from queue_providers import ProviderContext, create
from queue_providers.inputs import describe_inputs
from queue_providers.remote import (
    BlockCache,
    RemoteSettings,
    RemoteStore,
    redact,
    scrub,
)
from queue_providers.text.files import discover
from queue_providers.text.readers import ReadOptions, iter_docs
from queue_server.testing import ServerProcess

SECRETS = (CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
QUERY_SECRET = "sigQ8w2Zr7TqLp"
BATCHES = {"train": 6, "val": 3}


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto S3 server for the whole session; each test makes buckets of its own."""
    server = S3Server.start(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test credentials in this process's environment, for stores made in-process."""
    for key, value in {**CREDENTIALS, **NO_AMBIENT_CREDENTIALS}.items():
        monkeypatch.setenv(key, value)


def new_bucket(s3: S3Server) -> str:
    name = f"bq-{uuid.uuid4().hex[:12]}"
    s3.client().create_bucket(Bucket=name)
    return name


def corpus_bytes(n: int = 300, tag: str = "doc") -> bytes:
    words = "quartz basalt marble slate granite flint shale chalk jasper onyx agate opal".split()
    lines = []
    for i in range(n):
        text = f"{tag} {i}: " + " ".join(words[(i * 7 + k) % len(words)] for k in range(i % 40 + 3))
        lines.append(json.dumps({"text": text, "id": i}))
    return ("\n".join(lines) + "\n").encode()


def config(source: str, remote: str = "") -> str:
    return textwrap.dedent(
        f"""
        [server]
        lease_ttl_s = 30
        [datasets.web]
        provider = "text_lm"
        batch_size = 2
        batches_per_file = 3
        workers = 1
        max_worker_restarts = 0
        [datasets.web.args]
        source = {json.dumps(source)}
        seq_len = 32
        micro_batch_size = 2
        eval_take = 20
        shuffle_buffer = 64
        {remote}
        """
    )


def remote_table(endpoint: str | None = None, **extra: Any) -> str:
    parts = [f'storage_options = {{ endpoint_url = "{endpoint}" }}'] if endpoint else []
    parts += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return f"remote = {{ {', '.join(parts)} }}"


def server_env(**extra: str) -> dict[str, str]:
    """This environment without any AWS_* variable of its own, plus `extra`."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("AWS_")}
    return {**env, **NO_AMBIENT_CREDENTIALS, **extra}


def start(workdir: Path, config_text: str, env: dict[str, str]) -> ServerProcess:
    server = ServerProcess(
        workdir,
        data_root=workdir / "data",
        config_text=config_text,
        args=("--metrics-listen", "127.0.0.1:0"),
        env=env,
    )
    try:
        server.wait_serving(90)
    except BaseException:
        server.kill()
        raise
    return server


def batch_hashes(server: ServerProcess) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    with QueueClient(server.address, "web") as client:
        for split, n in BATCHES.items():
            hashes = []
            for _ in range(n):
                batch = client.get_batch(split)
                h = hashlib.sha256()
                for name in sorted(batch):
                    h.update(name.encode() + batch[name].contiguous().numpy().tobytes())
                hashes.append(h.hexdigest())
            out[split] = hashes
    return out


def serve_once(workdir: Path, config_text: str, env: dict[str, str]) -> tuple[int, str, float]:
    """A server start expected to end by itself: (exit code, stderr, seconds it took)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.toml").write_text(config_text, encoding="utf-8")
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "queue_server", "--config", str(workdir / "config.toml"),
         "--data-root", str(workdir / "data"), "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, env=env, cwd=workdir,
    )  # fmt: skip
    return proc.returncode, proc.stderr + proc.stdout, time.monotonic() - began


def assert_no_secret(*texts: str, data_root: Path | None = None) -> None:
    """No credential value in the texts, nor in any file under the data root."""
    blobs = [t.encode() for t in texts]
    if data_root is not None:
        blobs += [p.read_bytes() for p in data_root.rglob("*") if p.is_file()]
    for secret in (*SECRETS, QUERY_SECRET):
        for blob in blobs:
            assert secret.encode() not in blob, f"{secret!r} was written or logged"


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, list[str]]]:
    """The corpus, and the batches a server makes of it from a local file."""
    workdir = tmp_path_factory.mktemp("local")
    data = corpus_bytes()
    corpus = workdir / "corpus.jsonl"
    corpus.write_bytes(data)
    server = start(workdir / "server", config(corpus.as_posix()), server_env())
    try:
        return data, batch_hashes(server)
    finally:
        server.stop()


# ---- the same batches from wherever the data lives ------------------------------------------
def test_text_lm_over_s3_serves_the_local_files_batches_and_writes_no_credential(
    s3: S3Server, local_run: tuple[bytes, dict[str, list[str]]], tmp_path: Path
) -> None:
    """Read from a bucket through 4 KiB blocks and a 16 KiB cache (so blocks are evicted and
    fetched again), the server gives byte-identical batches to the local file's. inputs.json
    records the URL, size and ETag; no credential shows in the log, the stats or any file
    under the data root."""
    data, want = local_run
    bucket = new_bucket(s3)
    s3.client().put_object(Bucket=bucket, Key="web/corpus.jsonl", Body=data)
    url = f"s3://{bucket}/web/corpus.jsonl"
    text = config(url, remote_table(s3.endpoint, block_bytes=4096, cache_bytes=16384))
    server = start(tmp_path, text, server_env(**CREDENTIALS))
    try:
        assert batch_hashes(server) == want
        stats = json.dumps(server.stats("web"))
    finally:
        server.stop()
    root = server.data_root
    cache = BlockCache(root / "web" / "input-cache", 16384)
    assert 0 < cache.total_bytes() <= 16384
    inputs = json.loads((root / "web" / "inputs.json").read_text())
    assert inputs == {url: {"size": len(data), "version": inputs[url]["version"]}}
    assert inputs[url]["version"].startswith("etag:")
    assert_no_secret(server.log(), stats, data_root=root)


def test_a_changed_object_is_refused_at_the_next_start_naming_the_url(
    s3: S3Server, tmp_path: Path
) -> None:
    """The object is overwritten after the dataset was built: the next start exits 2, naming
    the URL, its old and new size and ETag, both fingerprints and `queue-server reset`."""
    data = corpus_bytes(120)
    bucket = new_bucket(s3)
    s3.client().put_object(Bucket=bucket, Key="corpus.jsonl", Body=data)
    url = f"s3://{bucket}/corpus.jsonl"
    text = config(url, remote_table(s3.endpoint))
    env = server_env(**CREDENTIALS)
    server = start(tmp_path, text, env)
    server.stop()
    old = load_meta(server.data_root / "web" / "meta.pkl")["inputs_fingerprint"]
    s3.client().put_object(Bucket=bucket, Key="corpus.jsonl", Body=corpus_bytes(120, tag="new"))
    code, err, _ = serve_once(tmp_path, text, env)
    assert code == 2, err
    assert f"input {url!r} changed: {len(data)} bytes, etag:" in err, err
    assert f"was {old} when it was built and is " in err and "queue-server reset" in err, err
    assert_no_secret(err)


def test_https_input_retries_transient_503s_and_never_shows_its_query_secret(
    local_run: tuple[bytes, dict[str, list[str]]], tmp_path: Path
) -> None:
    """An HTTP server that answers 503 to its first three requests: the start retries and
    serves the local file's batches. The URL's query carries a signature, which the server
    is sent but which appears in no log, stats or file under the data root."""
    data, want = local_run
    with FlakyFileServer({"corpus.jsonl": data}, fail_first=3) as http:
        url = f"{http.url('corpus.jsonl')}?X-Signature={QUERY_SECRET}"
        server = start(tmp_path / "http", config(url, remote_table()), server_env())
        try:
            assert batch_hashes(server) == want
            stats = json.dumps(server.stats("web"))
        finally:
            server.stop()
        assert http.statuses[:3] == [503, 503, 503] and 206 in http.statuses
        assert all(QUERY_SECRET in path for path in http.paths)  # the server was sent it
    inputs = json.loads((server.data_root / "web" / "inputs.json").read_text())
    assert list(inputs) == [redact(url)] and redact(url).endswith("X-Signature=***")
    assert_no_secret(server.log(), stats, data_root=server.data_root)


# ---- bad URLs fail fast, naming the URL -----------------------------------------------------
BAD = ["unknown scheme", "missing bucket", "no credentials", "unreachable endpoint"]


def test_bad_remote_inputs_fail_the_start_naming_each_url_and_write_nothing(
    s3: S3Server, tmp_path: Path
) -> None:
    """One server (kept up with --keep-serving), no credentials in its environment, five
    datasets with one fault each: each fails with an error in its stats that names its URL (or
    the refused key) and what is wrong; no dataset dir holds meta, inputs.json or a temp file;
    the credential written into the config is refused without being echoed."""
    bucket = new_bucket(s3)
    s3.client().put_object(Bucket=bucket, Key="corpus.jsonl", Body=corpus_bytes(50))
    ok = f"s3://{bucket}/corpus.jsonl"
    cases = {  # dataset: (source, storage_options, what the message says)
        "scheme": ("nosuch://bucket/corpus.jsonl", "", "fsspec knows no URL scheme 'nosuch'"),
        "bucket": ("s3://bq-no-such-bucket/c.jsonl", "anon = true", "it does not exist"),
        "credentials": (ok, "", "no credentials were found"),
        "endpoint": (ok, "anon = true", "no answer"),
        "secret": (ok, f'secret = "{SECRETS[1]}"', "storage_options.secret looks like a"),
    }
    text = ""
    for name, (url, options, _) in cases.items():
        endpoint = f"http://127.0.0.1:{free_port()}" if name == "endpoint" else s3.endpoint
        extra = f", {options}" if options else ""
        text += textwrap.dedent(
            f"""
            [datasets.{name}]
            provider = "text_lm"
            batch_size = 2
            [datasets.{name}.args]
            source = {json.dumps(url)}
            seq_len = 32
            micro_batch_size = 2
            remote = {{ storage_options = {{ endpoint_url = "{endpoint}"{extra} }}, retry_seconds = 5 }}
            """
        )
    server = ServerProcess(
        tmp_path / "server",
        data_root=tmp_path / "data",
        config_text=text,
        args=("--metrics-listen", "127.0.0.1:0", "--keep-serving"),
        env=server_env(),
    )
    try:
        server.wait_bound(60)
        errors = wait_until(
            lambda: (
                all(server.stats(n)["state"] == "failed" for n in cases)
                and {n: server.stats(n)["last_error"] for n in cases}
            ),
            60,
            "every dataset to fail",
        )
    finally:
        server.stop()
    for name, (url, _, expect) in cases.items():
        assert expect in errors[name], (name, errors[name])
        assert f"input {url!r}" in errors[name] or name == "secret", (name, errors[name])
        dataset = tmp_path / "data" / name
        left = sorted(p.name for p in dataset.rglob("*")) if dataset.exists() else []
        assert not {"meta.pkl", "inputs.json"} & set(left), left
        assert not [n for n in left if n.startswith(".tmp-")], left
    assert "environment" in errors["secret"]
    assert_no_secret(server.log(), json.dumps(errors))


@pytest.mark.parametrize("case", BAD[:4])
def test_each_bad_remote_input_is_reported_within_15_seconds(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The time a fault itself costs, without a server's start around it: the provider is
    refused within 15 s (an unreachable endpoint: after its bounded retries, default
    settings), with the URL in the message."""
    bucket = new_bucket(s3)
    s3.client().put_object(Bucket=bucket, Key="corpus.jsonl", Body=corpus_bytes(50))
    url = f"s3://{bucket}/corpus.jsonl"
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in {**CREDENTIALS, **NO_AMBIENT_CREDENTIALS}.items():
        monkeypatch.setenv(key, value)
    # A filesystem of its own (fsspec would hand back one made earlier with other credentials).
    options: dict[str, Any] = {"endpoint_url": s3.endpoint, "skip_instance_cache": True}
    if case == "unknown scheme":
        url = "nosuch://bucket/corpus.jsonl"
    elif case == "missing bucket":
        url = "s3://bq-no-such-bucket/corpus.jsonl"
    elif case == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    else:
        options["endpoint_url"] = f"http://127.0.0.1:{free_port()}"
    ctx = ProviderContext("web", tmp_path / "web", batch_size=1)
    began = time.monotonic()
    with pytest.raises(ConfigError, match=re.escape(f"input {url!r}")):
        create("text_lm", ctx, {"source": url, "remote": {"storage_options": options}})
    assert time.monotonic() - began < 15


# ---- the pieces, in this process -------------------------------------------------------------
def test_parquet_at_a_url_is_read_a_row_group_at_a_time(
    s3: S3Server, aws_env: None, tmp_path: Path
) -> None:
    """pyarrow reads the footer and only the row groups a range needs: reading 100 rows of
    100,000 fetches a small part of the object, and the rows equal the local file's."""
    rows = [f"row {i} " + "x" * (i % 97) for i in range(100_000)]
    local = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": rows}), local, row_group_size=5_000, compression="none")
    bucket = new_bucket(s3)
    s3.client().put_object(Bucket=bucket, Key="rows.parquet", Body=local.read_bytes())
    settings = RemoteSettings(
        {"endpoint_url": s3.endpoint}, tmp_path / "cache", cache_bytes=1 << 30, block_bytes=65536
    )
    (remote,) = discover(f"s3://{bucket}/rows.parquet", store=RemoteStore(settings))
    (here,) = discover(str(local))
    assert remote.extent == here.extent == 100_000
    opts = ReadOptions()
    docs = list(iter_docs(remote, 52_000, 52_100, opts))
    assert docs == list(iter_docs(here, 52_000, 52_100, opts)) and len(docs) == 100
    fetched = BlockCache(tmp_path / "cache", 1 << 30).total_bytes()
    assert fetched < local.stat().st_size / 5, (fetched, local.stat().st_size)


def test_an_object_changed_while_being_read_is_refused(
    s3: S3Server, aws_env: None, tmp_path: Path
) -> None:
    """Blocks of two versions are never mixed: the first block fetched after the object
    changed finds its ETag moved, and the read fails naming the URL."""
    bucket = new_bucket(s3)
    s3.client().put_object(Bucket=bucket, Key="c.jsonl", Body=corpus_bytes(200))
    store = RemoteStore(RemoteSettings({"endpoint_url": s3.endpoint}, block_bytes=4096))
    (sf,) = discover(f"s3://{bucket}/c.jsonl", store=store)
    s3.client().put_object(Bucket=bucket, Key="c.jsonl", Body=corpus_bytes(200, tag="other"))
    with pytest.raises(ConfigError, match=f"input 's3://{bucket}/c.jsonl' changed while being"):
        list(iter_docs(sf, 0, sf.extent, ReadOptions()))


def test_retries_stop_within_the_time_limit_naming_the_url(tmp_path: Path) -> None:
    """A server that only answers 503: the store gives up inside retry_seconds (not after
    all its attempts) with the URL and the answer in the message; with two 503s first, it
    succeeds."""
    with FlakyFileServer({"c.jsonl": b'{"text": "x"}\n'}, fail_first=10_000) as http:
        store = RemoteStore(RemoteSettings(attempts=50, retry_seconds=1.5))
        began = time.monotonic()
        with pytest.raises(ConfigError) as err:
            store.stat(http.url("c.jsonl"))
        assert time.monotonic() - began < 3.5
        assert f"input {http.url('c.jsonl')!r} cannot be read: the server answered 503" in str(
            err.value
        )
        http.fail_next(2)
        assert store.stat(http.url("c.jsonl")).size == 14
        assert http.statuses[-3:-1] == [503, 503]


def test_the_cache_keeps_the_most_recently_used_within_its_bytes(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path / "cache", max_bytes=3000)
    for name in ("a", "b", "c"):
        cache.put(name, name.encode() * 1000)
        time.sleep(0.01)  # distinct mtimes: recency is the file's mtime
    assert cache.get("a", 1000) == b"a" * 1000  # a is now the most recent
    time.sleep(0.01)
    cache.put("d", b"d" * 1000)
    assert cache.get("b", 1000) is None and cache.get("a", 1000) is not None
    assert cache.total_bytes() <= 3000
    cache.put("huge", b"h" * 5000)  # larger than the whole cache: not kept
    assert cache.get("huge", 5000) is None


def test_urls_are_shown_without_their_secrets() -> None:
    url = "https://alice:pa55word@example.com/data/c.jsonl?X-Amz-Signature=abc123&v=2"
    assert redact(url) == "https://***@example.com/data/c.jsonl?X-Amz-Signature=***&v=***"
    message = f"failed to GET {url} (user alice, password pa55word)"
    shown = scrub(message, url)
    assert "pa55word" not in shown and "abc123" not in shown and redact(url) in shown


@pytest.mark.parametrize(
    "options",
    [
        {"key": "AKIA"},
        {"secret": "s"},
        {"client_kwargs": {"aws_secret_access_key": "s"}},
        {"token": "t"},
        {"headers": {"Authorization": "Bearer t"}},
    ],
)
def test_storage_options_refuse_credentials(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"looks like a credential.*environment"):
        RemoteSettings.from_config({"storage_options": options}, cache_dir=None, who="text_lm")


def test_storage_options_take_endpoint_and_anon_and_per_protocol_tables() -> None:
    settings = RemoteSettings.from_config(
        {"storage_options": {"anon": True, "s3": {"endpoint_url": "http://x"}}},
        cache_dir=None,
        who="text_lm",
    )
    s3 = settings.options_for("s3")
    assert s3["anon"] is True and s3["endpoint_url"] == "http://x"
    assert "endpoint_url" not in settings.options_for("gs")
    with pytest.raises(ConfigError, match="unknown key"):
        RemoteSettings.from_config({"cache_size": 1}, cache_dir=None, who="text_lm")


def test_a_url_without_fsspec_installed_names_the_extra() -> None:
    """Where fsspec is not installed (hidden from this subprocess's imports), a URL input
    fails with the pip command that installs it; local paths need nothing of it."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["fsspec"] = None  # as if not installed: importing it raises ImportError
        from queue_providers.text.files import discover
        try:
            discover("s3://bucket/corpus.jsonl")
        except Exception as exc:
            print(type(exc).__name__, exc)
        """
    )
    env = subprocess_env()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
        cwd=ROOT,
    )  # fmt: skip
    assert "ConfigError" in out.stdout and "pip install 'batchqueue[remote]'" in out.stdout, (
        out.stdout + out.stderr
    )
    assert "'s3://bucket/corpus.jsonl'" in out.stdout


# ---- the other providers' inputs at URLs ----------------------------------------------------
def same_batches(a: Any, b: Any, split: str = "train", n: int = 3) -> bool:
    """Whether two providers draw equal batches from equal seeds."""
    for seed in range(n):
        x = a.sample_batch(split, torch.Generator().manual_seed(seed))
        y = b.sample_batch(split, torch.Generator().manual_seed(seed))
        if not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


def provider_pair(
    name: str, tmp_path: Path, local_args: dict[str, Any], remote_args: dict[str, Any]
) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """The same provider over local inputs and over URLs, meta built and set for each."""
    out = []
    for tag, args in (("local", local_args), ("remote", remote_args)):
        ctx = ProviderContext(name, tmp_path / tag / name, batch_size=4, batches_per_file=2)
        p = create(name, ctx, args)
        meta = p.complete_meta()
        p.set_meta(meta)
        out += [p, meta]
    return out[0], out[2], out[1], out[3]


def upload(s3: S3Server, bucket: str, files: dict[str, bytes]) -> None:
    for key, body in files.items():
        s3.client().put_object(Bucket=bucket, Key=key, Body=body)


def test_char_lm_and_nanogpt_bin_read_urls_as_they_read_paths(
    s3: S3Server, aws_env: None, tmp_path: Path
) -> None:
    """char_lm's input and nanogpt_bin's data_dir as s3:// URLs: the same vocab and the same
    batches as from the local files; nanogpt's .bin is memory-mapped from one local copy in
    the input cache; the inputs are recorded by URL."""
    import pickle

    bucket = new_bucket(s3)
    remote = {"storage_options": {"endpoint_url": s3.endpoint}}
    text = ("To be, or not to be, that is the question:\r\n" * 400).encode()
    (tmp_path / "input.txt").write_bytes(text)
    tokens = np.random.default_rng(0).integers(0, 65, 20_000, dtype=np.uint16)
    nano = tmp_path / "nano"
    nano.mkdir()
    tokens[:16_000].tofile(nano / "train.bin")
    tokens[16_000:].tofile(nano / "val.bin")
    chars = [chr(ord("!") + i) for i in range(65)]
    meta_pkl = pickle.dumps({"vocab_size": 65, "stoi": {c: i for i, c in enumerate(chars)}})
    (nano / "meta.pkl").write_bytes(meta_pkl)
    upload(
        s3,
        bucket,
        {"input.txt": text, **{f"nano/{p.name}": p.read_bytes() for p in nano.iterdir()}},
    )

    a, b, ma, mb = provider_pair(
        "char_lm",
        tmp_path,
        {"input": str(tmp_path / "input.txt"), "block_size": 16},
        {"input": f"s3://{bucket}/input.txt", "block_size": 16, "remote": remote},
    )
    assert ma["stoi"] == mb["stoi"] and "\r" not in mb["stoi"]  # newlines read as a path's
    assert mb["source"] == f"s3://{bucket}/input.txt" and same_batches(a, b)
    assert [str(x) for x in b.input_files()] == [f"s3://{bucket}/input.txt"]

    a, b, ma, mb = provider_pair(
        "nanogpt_bin",
        tmp_path,
        {"data_dir": str(nano), "block_size": 32},
        {"data_dir": f"s3://{bucket}/nano", "block_size": 32, "remote": remote},
    )
    assert mb["stoi"] == ma["stoi"] and mb["split_info"] == ma["split_info"]
    assert same_batches(a, b) and same_batches(a, b, "val")
    records = describe_inputs(b.input_files())
    assert sorted(records) == [
        f"s3://{bucket}/nano/{n}" for n in ("meta.pkl", "train.bin", "val.bin")
    ]
    copies = sorted(p.name for p in (tmp_path / "remote" / "nanogpt_bin" / "input-cache").iterdir())
    assert sorted(n.rsplit("-", 1)[-1] for n in copies if n.startswith("file-")) == [
        "train.bin",
        "val.bin",
    ]


def test_a_tokenized_provider_reads_its_inputs_at_urls(
    s3: S3Server, aws_env: None, tmp_path: Path
) -> None:
    """bert_mlm's input and val_input as URLs: the same vocab, cached arrays and batches as
    from local files, and a cache key that follows the objects' ETags."""
    words = ["alpha", "beta", "gamma", "delta", "queue", "batch", "lease", "file", "rank", "seq"]
    lines = "".join(f"{' '.join(words[(i + k) % 10] for k in range(12))}\n" for i in range(200))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    (tmp_path / "train.txt").write_text(lines)
    (tmp_path / "val.txt").write_text(lines[: len(lines) // 4])
    bucket = new_bucket(s3)
    upload(s3, bucket, {n: (tmp_path / n).read_bytes() for n in ("train.txt", "val.txt")})
    common = {"tokenizer": str(vocab), "block_size": 16}
    a, b, ma, mb = provider_pair(
        "bert_mlm",
        tmp_path,
        {**common, "input": str(tmp_path / "train.txt"), "val_input": str(tmp_path / "val.txt")},
        {
            **common,
            "input": f"s3://{bucket}/train.txt",
            "val_input": f"s3://{bucket}/val.txt",
            "remote": {"storage_options": {"endpoint_url": s3.endpoint}},
        },
    )
    assert ma["split_info"] == mb["split_info"] and ma["vocab_size"] == mb["vocab_size"]
    assert same_batches(a, b) and same_batches(a, b, "val")
    key = mb["artifacts"]
    upload(s3, bucket, {"train.txt": lines.replace("alpha", "beta").encode()})
    ctx = ProviderContext("bert_mlm", tmp_path / "again" / "bert_mlm", batch_size=4)
    again = create(
        "bert_mlm",
        ctx,
        {
            **common,
            "input": f"s3://{bucket}/train.txt",
            "remote": {"storage_options": {"endpoint_url": s3.endpoint}},
        },
    )
    assert again.complete_meta()["artifacts"] != key


def test_the_remote_table_is_not_part_of_the_config_fingerprint(tmp_path: Path) -> None:
    """How URL inputs are fetched (cache size, endpoint, retries) may change without a
    rebuild; the inputs themselves may not."""
    from queue_server.config.server import parse_config

    def fingerprint(args: dict[str, Any]) -> str:
        table = {"datasets": {"d": {"provider": "text_lm", "batch_size": 1, "args": args}}}
        return parse_config(table, config_dir=tmp_path).dataset("d").fingerprint()

    base = {"source": "s3://bucket/c.jsonl", "seq_len": 64}
    remote = {"cache_bytes": 5, "storage_options": {"endpoint_url": "http://x"}}
    assert fingerprint(base) == fingerprint({**base, "remote": remote})
    assert fingerprint(base) != fingerprint({**base, "source": "s3://bucket/d.jsonl"})


def test_a_listed_object_is_checked_by_the_identity_its_listing_gave(
    s3: S3Server, aws_env: None, tmp_path: Path
) -> None:
    """In a versioned bucket a listing gives ETags and a HEAD also a version id: reading a
    folder's objects compares like with like, so nothing unchanged counts as changed."""
    bucket = new_bucket(s3)
    s3.client().put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    upload(s3, bucket, {"dir/a.jsonl": corpus_bytes(30), "dir/b.jsonl": corpus_bytes(30, "b")})
    store = RemoteStore(RemoteSettings({"endpoint_url": s3.endpoint}, block_bytes=1024))
    files = discover(f"s3://{bucket}/dir/", store=store)
    assert [f.path.name for f in files] == ["a.jsonl", "b.jsonl"]
    assert all(f.path.identity.startswith("etag:") for f in files)
    docs = [d for f in files for d in iter_docs(f, 0, f.extent, ReadOptions())]
    assert len(docs) == 60
