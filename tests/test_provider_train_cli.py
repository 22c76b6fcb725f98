"""train_bpe and train_wordpiece share one command line: the same core flags, the same exit
codes and messages, and --out written whole (never a temp file or half a tokenizer left)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from queue_providers.tokenizer_training import train_bpe, train_wordpiece

TOOLS: dict[str, Callable[[list[str] | None], int]] = {
    "train_bpe": train_bpe.main,
    "train_wordpiece": train_wordpiece.main,
}
WORDS = "serving served server batches batching queued queues leasing leased ranks".split()


def corpus(tmp_path: Path) -> Path:
    rnd = random.Random(0)
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(rnd.choices(WORDS, k=12)) for _ in range(500)))
    return path


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_a_trained_tokenizer_is_written_whole_into_a_new_folder(
    tmp_path: Path, tool: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new" / "tokenizer.json"
    argv = ["--input", str(corpus(tmp_path)), "--vocab-size", "300", "--out", str(out)]
    assert TOOLS[tool]([*argv, "--min-frequency", "1", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert [p.name for p in out.parent.iterdir()] == ["tokenizer.json"]
    assert Tokenizer.from_file(str(out)).get_vocab_size() > len(WORDS)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_a_missing_input_exits_2_naming_the_tool(
    tmp_path: Path, tool: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.txt"
    out = tmp_path / "tokenizer.json"
    assert TOOLS[tool](["--input", str(missing), "--vocab-size", "300", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{tool}: error: ") and str(missing) in err
    assert not out.exists()


@pytest.mark.parametrize(("tool", "smallest"), [("train_bpe", 257), ("train_wordpiece", 6)])
def test_a_vocabulary_too_small_is_a_usage_error(
    tmp_path: Path, tool: str, smallest: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--input", str(corpus(tmp_path)), "--out", str(tmp_path / "t.json")]
    with pytest.raises(SystemExit) as info:
        TOOLS[tool]([*argv, "--vocab-size", str(smallest - 1)])
    assert info.value.code == 2
    assert f"--vocab-size must be at least {smallest}" in capsys.readouterr().err
