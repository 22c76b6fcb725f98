"""`queue-prepare verify FOLDER`: what token_shards leaves unchecked at start (every shard's
sha256, every document start) checked against manifest.json, each fault named on its own
line (exit 1); a sound corpus says so (exit 0), a folder that is no prepared corpus exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import subprocess_env
from queue_providers.prepare import main
from queue_providers.prepare.layout import MANIFEST_FILE, PROGRESS_FILE, sha256_of


def prepared(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    docs = [f"document {i} " + "words " * (i % 29) for i in range(400)]
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    args = ["--input", str(corpus), "--separator", "", "--out", str(out), "--no-progress"]
    assert main([*args, "--shard-tokens", "1024"]) == 0
    return out


def verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["verify", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_verify_names_every_file_whose_sha256_differs_and_every_lying_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = prepared(tmp_path)
    capsys.readouterr()
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    shards = len(manifest["shards"])
    assert shards >= 4
    code, said, err = verify(capsys, str(out))
    assert code == 0 and err == "", err
    assert f"{shards} shard(s), {manifest['total_tokens']:,} tokens" in said, said
    proc = subprocess.run(  # the same through the command a user runs
        [sys.executable, "-m", "queue_providers.prepare", "verify", str(out)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout == said, proc.stderr

    # Two damaged files, the same size as before: a shard's ids and a shard's starts.
    tokens = out / "shard-000001.npy"
    original = tokens.read_bytes()
    tokens.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    starts = np.load(out / "shard-000002.docs.npy")
    np.save(out / "shard-000002.docs.npy", starts[::-1].copy())
    code, said, err = verify(capsys, str(out), "--workers", "2")
    assert code == 1 and said == "", said
    lines = err.splitlines()
    assert sum("sha256 is" in line for line in lines) == 2, err
    assert any(f"{tokens}: sha256 is {sha256_of(tokens)}" in line for line in lines), err
    assert any("shard-000002.docs.npy: sha256 is" in line for line in lines), err
    # The served form of the reversed starts is refused as token_shards refuses it.
    assert any("shard-000002.docs.npy: entry 1 is" in line for line in lines), err
    assert lines[-1].endswith(f"3 fault(s) in {out / MANIFEST_FILE}"), err

    # Starts that lie under a manifest edited to their sha256 are still named.
    tokens.write_bytes(original)
    manifest["shards"][2]["docs_sha256"] = sha256_of(out / "shard-000002.docs.npy")
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    code, said, err = verify(capsys, str(out / MANIFEST_FILE))
    assert code == 1 and "sha256" not in err, err
    assert "shard-000002.docs.npy: entry 1 is" in err and "must be sorted" in err, err


def test_verify_refuses_a_link_out_of_the_folder_and_a_folder_that_is_no_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = prepared(tmp_path)
    capsys.readouterr()
    (out / "shard-000000.npy").rename(tmp_path / "moved.npy")
    (out / "shard-000000.npy").symlink_to(tmp_path / "moved.npy")
    code, _, err = verify(capsys, str(out))
    assert code == 1, err
    assert f"shard-000000.npy is a symlink to {tmp_path / 'moved.npy'}, outside" in err, err

    (out / MANIFEST_FILE).rename(tmp_path / "kept.json")
    (out / PROGRESS_FILE).write_text("{}")
    code, _, err = verify(capsys, str(out))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{out} holds no manifest.json" in err and "unfinished" in err, err
    code, _, err = verify(capsys, str(tmp_path / "nowhere"))
    assert code == 2 and "not a prepared corpus" in err, err
