"""Every read of an object is pinned to the version listed for it: an object rewritten with the
same size and a new ETag in the middle of a read fails that read, naming the URL and both
ETags, and never hands back bytes of two versions. Over a real HTTP server (a thread here)
that honours If-Match or ignores it, and over moto's S3 server in its own process, with and
without bucket versioning."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.object_http import ObjectServer, etag_of
from support.s3_server import CREDENTIALS, NO_AMBIENT_CREDENTIALS, S3Server

from queue_client.errors import ConfigError
from queue_providers.remote import RemoteSettings, RemoteStore

BLOCK = 4096
VERSION_A = bytes(range(256)) * 64  # 16 KiB: four blocks
VERSION_B = bytes(reversed(range(256))) * 64  # the same size, other bytes


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server.start(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {**CREDENTIALS, **NO_AMBIENT_CREDENTIALS}.items():
        monkeypatch.setenv(key, value)


def store(tmp_path: Path, **options: object) -> RemoteStore:
    """A store with blocks of 4 KiB and a cache, so a read takes several requests."""
    settings = RemoteSettings(
        dict(options), tmp_path / "cache", cache_bytes=1 << 20, block_bytes=BLOCK
    )
    return RemoteStore(settings)


@pytest.mark.parametrize("honour_if_match", [True, False], ids=["if-match", "ignored"])
def test_an_https_object_rewritten_mid_read_fails_the_read_naming_both_etags(
    tmp_path: Path, honour_if_match: bool
) -> None:
    """The server swaps the object after the first ranged GET: the read fails with the URL
    and both ETags, whether the server answers the If-Match with 412 or ignores it (then the
    answer's ETag gives it away)."""
    with ObjectServer({"c.bin": VERSION_A}) as http:
        http.honour_if_match = honour_if_match
        url = http.url("c.bin")
        obj = store(tmp_path).stat(url)
        http.swap_after("c.bin", 1, VERSION_B)
        with pytest.raises(ConfigError) as err, obj.open() as f:
            f.read()
        message = str(err.value)
        assert f"input {url!r} changed while being read" in message, message
        assert etag_of(VERSION_A) in message and etag_of(VERSION_B) in message, message
        assert http.requests[-1][2] == (412 if honour_if_match else 206)
        # Read again from the start: the cached block of A, then the server's B refused.
        with pytest.raises(ConfigError, match="changed while being read"), obj.open() as f:
            f.read()


def test_an_s3_object_rewritten_mid_read_fails_the_read_naming_both_etags(
    s3: S3Server, aws_env: None, tmp_path: Path
) -> None:
    """The first block is read, the object is put again with other bytes of the same size:
    the next block's request (IfMatch the listed ETag) fails, naming the URL and both ETags."""
    bucket = f"bq-{uuid.uuid4().hex[:12]}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    tag_a = client.put_object(Bucket=bucket, Key="c.bin", Body=VERSION_A)["ETag"]
    url = f"s3://{bucket}/c.bin"
    obj = store(tmp_path, endpoint_url=s3.endpoint, skip_instance_cache=True).stat(url)
    assert obj.identity == f"etag:{tag_a}"
    with obj.open() as f:
        assert f.read(BLOCK) == VERSION_A[:BLOCK]
        tag_b = client.put_object(Bucket=bucket, Key="c.bin", Body=VERSION_B)["ETag"]
        with pytest.raises(ConfigError) as err:
            f.read()
    message = str(err.value)
    assert f"input {url!r} changed while being read" in message, message
    assert tag_a in message and tag_b in message, message


@pytest.mark.parametrize("version_aware", [True, False], ids=["version-aware", "plain"])
def test_a_versioned_s3_object_is_read_from_the_version_listed_or_refused(
    s3: S3Server, aws_env: None, tmp_path: Path, version_aware: bool
) -> None:
    """In a versioned bucket the listed version id pins every block: with version_aware the
    old version is asked for, so a rewrite mid-read changes nothing of what this read returns
    (all of version A); without it (no s3:GetObjectVersion needed) the answer's version id
    gives the rewrite away and the read fails naming both versions."""
    bucket = f"bq-{uuid.uuid4().hex[:12]}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    version_a = client.put_object(Bucket=bucket, Key="c.bin", Body=VERSION_A)["VersionId"]
    options = {"endpoint_url": s3.endpoint, "skip_instance_cache": True}
    url = f"s3://{bucket}/c.bin"
    obj = store(tmp_path, version_aware=version_aware, **options).stat(url)
    assert obj.identity == f"version:{version_a}"
    with obj.open() as f:
        first = f.read(BLOCK)
        version_b = client.put_object(Bucket=bucket, Key="c.bin", Body=VERSION_B)["VersionId"]
        if version_aware:
            assert first + f.read() == VERSION_A
            return
        with pytest.raises(ConfigError) as err:
            f.read()
    message = str(err.value)
    assert f"input {url!r} changed while being read" in message, message
    assert version_a in message and version_b in message, message
