"""queue-prepare over objects in a real S3-compatible server (moto's server mode): the shards
are the bytes the same files give on local disk, with 2 worker processes that each list and
read the bucket themselves, and no credential is written into the output folder."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from support.s3_server import CREDENTIALS, NO_AMBIENT_CREDENTIALS, S3Server

from conftest import subprocess_env
from queue_providers.prepare.layout import MANIFEST_FILE


def documents(n: int, tag: str) -> bytes:
    words = "quartz basalt marble slate granite flint shale chalk jasper onyx agate opal".split()
    rows = [
        json.dumps(
            {"text": f"{tag} {i}: " + " ".join(words[(i * 5 + k) % 12] for k in range(i % 30 + 2))}
        )
        for i in range(n)
    ]
    return ("\n".join(rows) + "\n").encode()


def prepare(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "queue_providers.prepare", "--shard-tokens", "2048", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_objects_at_s3_urls_give_the_shards_their_local_copies_give(tmp_path: Path) -> None:
    objects = {"part-0.jsonl": documents(400, "first"), "part-1.jsonl": documents(300, "second")}
    local = tmp_path / "local"
    local.mkdir()
    for name, data in objects.items():
        (local / name).write_bytes(data)
    env = {
        **{k: v for k, v in subprocess_env().items() if not k.startswith("AWS_")},
        **NO_AMBIENT_CREDENTIALS,
        **CREDENTIALS,
    }
    server = S3Server.start(tmp_path / "moto.log")
    try:
        bucket = f"bq-{uuid.uuid4().hex[:12]}"
        server.client().create_bucket(Bucket=bucket)
        for name, data in objects.items():
            server.client().put_object(Bucket=bucket, Key=f"web/{name}", Body=data)
        remote = json.dumps({"storage_options": {"endpoint_url": server.endpoint}})
        prepare(["--input", f"s3://{bucket}/web/*.jsonl", "--remote", remote,
                 "--out", str(tmp_path / "s3"), "--workers", "2"], env)  # fmt: skip
    finally:
        server.stop()
    prepare(["--input", str(local), "--out", str(tmp_path / "disk")], env)

    s3_files = sorted(p.name for p in (tmp_path / "s3").iterdir())
    assert s3_files == sorted(p.name for p in (tmp_path / "disk").iterdir())
    assert len(s3_files) > 3
    for name in s3_files:
        if name != MANIFEST_FILE:
            assert (tmp_path / "s3" / name).read_bytes() == (tmp_path / "disk" / name).read_bytes()
    manifest = (tmp_path / "s3" / MANIFEST_FILE).read_text()
    assert f"s3://{bucket}/web/part-0.jsonl" in manifest
    assert not any(secret in manifest for secret in CREDENTIALS.values() if len(secret) > 10)
