"""Safe rebuilds: a dataset whose inputs changed is refused at start, `queue-server reset`
rebuilds it deliberately, and no provider can write an id >= vocab_size."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from conftest import char_config, subprocess_env, tiny_corpus, wait_until
from queue_client import QueueClient
from queue_client.format.meta import load_meta
from queue_providers.inputs import describe_inputs, inputs_fingerprint

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def queue_server(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """The queue-server command, run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "queue_server", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )


def serve_once(config: Path, root: Path) -> subprocess.CompletedProcess[str]:
    """A server start that is expected to end by itself (a refused dataset exits it)."""
    return queue_server(
        "--config", config, "--data-root", root, "--listen", "127.0.0.1:0",
        "--metrics-listen", "127.0.0.1:0",
    )  # fmt: skip


def tree(directory: Path) -> dict[str, bytes]:
    """Every file under `directory`, by relative path, with its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def fingerprint_now(*paths: Path) -> str:
    return inputs_fingerprint(describe_inputs(list(paths)))


def assert_refused(proc: subprocess.CompletedProcess[str], path: Path, old: str, new: str) -> None:
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert f"input {str(path)!r} changed" in err, err
    assert f"was {old} when it was built and is {new} now" in err, err
    assert "queue-server reset" in err, err


def reset(dataset: str, config: Path, root: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return queue_server("reset", dataset, "--config", config, "--data-root", root, *more)


def test_char_lm_changed_text_is_refused_until_reset_then_rebuilt(
    start_server, tmp_path: Path
) -> None:
    """The reported defect: char_lm served ids up to 91 with vocab_size 65 after its text
    changed. Now the start is refused (exit 2) naming the file and both fingerprints, nothing
    in the dataset dir is touched, and after `reset` the rebuilt dataset serves ids below its
    new, larger vocab_size."""
    corpus = tiny_corpus(tmp_path / "corpus.txt")
    root = tmp_path / "root"
    server = start_server(char_config(corpus), data_root=root)
    config = server.config_path
    with QueueClient(server.address, "chars") as client:
        old_vocab = client.meta["vocab_size"]
        client.get_batch("train")
    server.stop()
    dataset = root / "chars"
    before = tree(dataset)
    old = load_meta(dataset / "meta.pkl")["inputs_fingerprint"]

    with open(corpus, "a", encoding="utf-8") as f:
        f.write("QUEUE BATCH LEASE! 0123456789 {}[]\n" * 200)  # characters outside the vocab
    assert_refused(serve_once(config, root), corpus, old, fingerprint_now(corpus))
    assert tree(dataset) == before, "a refused start must not change the dataset dir"

    done = reset("chars", config, root)
    assert done.returncode == 0, done.stderr
    (aside,) = [p for p in root.iterdir() if p.name.startswith("chars.reset-")]
    assert str(aside) in done.stdout and "rm -r" in done.stdout
    assert tree(aside) == before, "reset moves the old dataset aside whole"
    assert not dataset.exists()

    server = start_server(char_config(corpus), data_root=root)
    with QueueClient(server.address, "chars") as client:
        vocab = client.meta["vocab_size"]
        assert vocab > old_vocab and "Q" in client.meta["stoi"]
        for _ in range(40):
            x, y = client.get_batch("train")
            assert int(torch.cat([x, y]).max()) < vocab


def write_vocab(path: Path, words: list[str]) -> Path:
    path.write_text("".join(f"{t}\n" for t in [*SPECIALS, *words]), encoding="utf-8")
    return path


def bert_config(corpus: Path, vocab: Path) -> str:
    return textwrap.dedent(
        f"""
        [datasets.mlm]
        provider = "bert_mlm"
        batch_size = 4
        batches_per_file = 5
        [datasets.mlm.args]
        input = "{corpus.as_posix()}"
        tokenizer = "{vocab.as_posix()}"
        block_size = 16
        """
    )


def test_bert_mlm_replaced_tokenizer_is_refused_until_reset_then_rebuilt(
    start_server, tmp_path: Path
) -> None:
    """The reported defect: bert_mlm kept its old tokenized ids and vocab_size after its
    vocab file was replaced. Now the start is refused naming the vocab file, and after
    `reset` every served id lies below the new tokenizer's vocab_size."""
    words = ["alpha", "beta", "gamma", "delta", "queue", "batch", "lease", "file", "rank", "seq"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "".join(f"{' '.join(words[(i + k) % 10] for k in range(12))}\n" for i in range(300)),
        encoding="utf-8",
    )
    vocab = write_vocab(tmp_path / "vocab.txt", [*words, *(f"w{k}" for k in range(200))])
    root = tmp_path / "root"
    server = start_server(bert_config(corpus, vocab), data_root=root)
    config = server.config_path
    with QueueClient(server.address, "mlm") as client:
        assert client.meta["vocab_size"] == 215
        client.get_batch("train")
    server.stop()
    dataset = root / "mlm"
    before = tree(dataset)
    old = load_meta(dataset / "meta.pkl")["inputs_fingerprint"]

    write_vocab(vocab, words[:6])  # a smaller vocab: the old ids reach past it
    assert_refused(serve_once(config, root), vocab, old, fingerprint_now(corpus, vocab))
    assert tree(dataset) == before

    assert reset("mlm", config, root).returncode == 0
    server = start_server(bert_config(corpus, vocab), data_root=root)
    with QueueClient(server.address, "mlm") as client:
        assert client.meta["vocab_size"] == 11
        for _ in range(40):
            batch = client.get_batch("train")
            assert int(batch["input_ids"].max()) < 11 and int(batch["labels"].max()) < 11


def test_a_touched_input_with_the_same_bytes_is_accepted(start_server, tmp_path: Path) -> None:
    """Only content counts: a new mtime on unchanged bytes starts as before, same meta."""
    corpus = tiny_corpus(tmp_path / "corpus.txt")
    root = tmp_path / "root"
    server = start_server(char_config(corpus), data_root=root)
    server.stop()
    meta = (root / "chars" / "meta.pkl").read_bytes()
    st = corpus.stat()
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 3_600 * 10**9))
    server = start_server(char_config(corpus), data_root=root)
    with QueueClient(server.address, "chars") as client:
        client.get_batch("train")
    assert (root / "chars" / "meta.pkl").read_bytes() == meta


def test_an_id_at_vocab_size_is_refused_at_write_time(start_server, tmp_path: Path) -> None:
    """A provider that makes id 1000 with vocab_size 1000 publishes nothing: the dataset
    fails with an error naming the field, the id and vocab_size."""
    config = textwrap.dedent(
        """
        [datasets.bad]
        provider = "bq_test_providers:OutOfVocabProvider"
        batch_size = 2
        batches_per_file = 3
        max_worker_restarts = 1
        """
    )
    server = start_server(config, wait_serving=False, args=("--keep-serving",))
    wait_until(lambda: server.stats("bad")["state"] == "failed", what="the dataset to fail")
    error = server.stats("bad")["last_error"]
    assert "field 'y' holds id 1000" in error and "vocab_size is 1000" in error, error
    for split in ("train", "val"):
        assert list((server.data_root / "bad" / "queue" / split).iterdir()) == []


def test_reset_refuses_while_a_server_holds_the_root_and_deletes_only_when_asked(
    start_server, tmp_path: Path
) -> None:
    """reset takes the data root's lock, so it cannot pull a dataset from under a running
    server; --delete removes the dir (nothing is left aside), and a second reset says there
    is nothing to reset."""
    corpus = tiny_corpus(tmp_path / "corpus.txt")
    root = tmp_path / "root"
    server = start_server(char_config(corpus), data_root=root)
    config = server.config_path
    meta = (root / "chars" / "meta.pkl").read_bytes()
    refused = reset("chars", config, root)
    assert refused.returncode == 2
    assert f"data root {root} is in use by another queue-server (pid {server.pid})" in (
        refused.stderr
    )
    assert (root / "chars" / "meta.pkl").read_bytes() == meta  # the live server's, untouched
    assert not [p for p in root.iterdir() if p.name.startswith("chars.reset-")]
    server.stop()

    deleted = reset("chars", config, root, "--delete")
    assert deleted.returncode == 0, deleted.stderr
    assert not (root / "chars").exists()
    assert not [p for p in root.iterdir() if p.name.startswith("chars.reset-")]
    nothing = reset("chars", config, root)
    assert nothing.returncode == 1 and "nothing to reset" in nothing.stderr
