"""What queue-prepare refuses, and how it says so: a changed input or tokenizer when going on
with an output folder (naming the file or the tokenizer), a folder that is not ours, and the
other faults a user can cause. Each is one line on stderr and exit code 2; nothing of the
earlier run is lost unless --overwrite asks for a clean redo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from queue_client.errors import ConfigError
from queue_providers.prepare import main
from queue_providers.prepare.layout import MANIFEST_FILE, token_dtype


def write_corpus(folder: Path, docs: int = 400) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("a.txt", "b.txt"):
        text = "\n\n".join(f"{name} document {i} " + "words " * (i % 17) for i in range(docs))
        (folder / name).write_text(text + "\n", encoding="utf-8")
    return folder


def prepare(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["--separator", "", "--shard-tokens", "1024", "--no-progress", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_changed_input_or_tokenizer_is_refused_and_overwrite_redoes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    args = ("--input", str(corpus), "--out", str(out))
    code, said = prepare(capsys, *args)
    assert code == 0, said
    first = json.loads((out / MANIFEST_FILE).read_text())
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    code, said = prepare(capsys, *args)  # the same command again: checked, nothing rewritten
    assert code == 0 and "already complete" in said, said
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before

    with open(corpus / "b.txt", "a", encoding="utf-8") as f:
        f.write("\none more document\n")
    code, said = prepare(capsys, *args)
    assert code == 2, said
    assert "b.txt" in said and "changed" in said and "--overwrite" in said, said
    assert json.loads((out / MANIFEST_FILE).read_text()) == first  # nothing lost

    code, said = prepare(capsys, *args, "--tokenizer", "char")
    assert code == 2 and "the tokenizer changed" in said and "'byte'" in said, said

    code, said = prepare(capsys, *args, "--overwrite")
    assert code == 0, said
    redone = json.loads((out / MANIFEST_FILE).read_text())
    assert redone["inputs"]["fingerprint"] != first["inputs"]["fingerprint"]
    assert redone["total_documents"] == first["total_documents"] + 1


def test_faults_a_user_can_cause_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_corpus(tmp_path / "corpus", docs=20)
    out = tmp_path / "out"

    code, said = prepare(capsys, "--input", str(tmp_path / "nope.txt"), "--out", str(out))
    assert code == 2 and "nope.txt" in said and "does not exist" in said, said

    code, said = prepare(
        capsys, "--input", str(corpus), "--out", str(out), "--tokenizer", "no-such-tokenizer"
    )
    assert code == 2 and "'no-such-tokenizer'" in said, said

    code, said = prepare(
        capsys, "--input", str(corpus), "--out", str(out), "--tokenizer", "missing.tiktoken"
    )
    assert code == 2 and "missing.tiktoken" in said and "not a file" in said, said

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for extra in ((), ("--overwrite",)):
        code, said = prepare(capsys, "--input", str(corpus), "--out", str(foreign), *extra)
        assert code == 2 and "not empty" in said and "notes.txt" in said, said
    assert (foreign / "notes.txt").read_text() == "mine"

    code, said = prepare(capsys, "--input", str(corpus), "--out", str(out), "--shard-tokens", "100")
    assert code == 2 and "--shard-tokens 100 is too small" in said, said

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("\n   \n\n")
    code, said = prepare(capsys, "--input", str(empty), "--out", str(tmp_path / "o2"))
    assert code == 2 and "hold no documents" in said, said

    assert not out.exists() or not any(out.iterdir())


def test_the_dtype_follows_the_vocabulary() -> None:
    assert token_dtype(257) == "uint16" and token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32" and token_dtype(1 << 32) == "uint32"
    with pytest.raises(ConfigError, match="does not fit the largest shard dtype, uint32"):
        token_dtype((1 << 32) + 1)


def test_the_console_script_and_the_progress_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    root = Path(__file__).resolve().parent.parent
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["queue-prepare"].partition(":")
    assert getattr(importlib.import_module(module), func) is main

    corpus = write_corpus(tmp_path / "corpus", docs=50)
    code = main(["--input", str(corpus), "--separator", "", "--out", str(tmp_path / "o"),
                 "--shard-tokens", "1024", "--progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0 and "100%" in err and "tokens/s" in err and "ETA" in err, err


def test_a_folder_another_run_is_writing_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from queue_providers.prepare.state import locked

    corpus = write_corpus(tmp_path / "corpus", docs=20)
    out = tmp_path / "out"
    with locked(out):  # as a run in progress holds it
        code, said = prepare(capsys, "--input", str(corpus), "--out", str(out))
    assert code == 2 and "another queue-prepare is writing" in said, said
    code, said = prepare(capsys, "--input", str(corpus), "--out", str(out))
    assert code == 0, said


def test_messages_name_the_flags_the_suffixes_and_say_who_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a document with \xff in it\n")
    code, said = prepare(
        capsys, "--input", str(bad), "--utf8-errors", "error", "--out", str(tmp_path / "o1")
    )
    assert code == 2 and "invalid UTF-8 at byte 16" in said, said
    assert "set --utf8-errors replace" in said and "utf8_errors" not in said, said

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "day.log").write_text("a document\n")
    code, said = prepare(capsys, "--input", str(logs), "--out", str(tmp_path / "o2"))
    assert code == 2 and "'" + str(logs) + "' matches no files" in said, said
    assert ".jsonl, .md, .ndjson, .parquet, .text, .txt" in said, said

    code, said = prepare(
        capsys,
        "--input",
        str(bad),
        "--tokenizer",
        "tiktoken:no-such",
        "--out",
        str(tmp_path / "o3"),
    )
    assert code == 2 and "tiktoken has no encoding 'no-such'" in said, said
    assert said.count("queue-prepare") == 1, said
