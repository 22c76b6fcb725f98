"""A mixture's config and sources, checked without a server: every mistake a user can make is
refused with a message naming the key, the source or the fields."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from queue_client.errors import ConfigError
from queue_providers.base import ProviderContext
from queue_providers.mixture import MixtureProvider
from queue_server.config.server import parse_config, tomllib


def parse(text: str, tmp: Path):
    return parse_config(tomllib.loads(textwrap.dedent(text)), config_dir=tmp)


def nanogpt_dir(tmp: Path, name: str, vocab: int = 300) -> Path:
    d = tmp / name
    d.mkdir(exist_ok=True)
    for split in ("train", "val"):
        np.arange(0, 200, dtype=np.uint16).tofile(d / f"{split}.bin")
    return d


BASE = """
[datasets.mix]
batch_size = 2
{extra}
[datasets.mix.sources.a]
provider = "char_lm"
weight = {a}
[datasets.mix.sources.b]
provider = "char_lm"
"""


def test_sources_become_the_mixture_provider_in_table_order(tmp_path: Path) -> None:
    config = parse(BASE.format(extra="", a=0.25), tmp_path).datasets[0]
    assert config.provider == "mixture"
    assert [(s["name"], s["weight"]) for s in config.args["sources"]] == [("a", 0.25), ("b", 1.0)]


@pytest.mark.parametrize(
    ("extra", "a", "match"),
    [
        ('provider = "char_lm"', 1, r"datasets\.mix\.provider: a dataset with sources"),
        ('selection = "curriculum"', 1, "curriculum selection does not work with a mixture"),
        ("", -1, r"weight\(s\) \{'a': -1\}"),
        ("", "nan", r"'a': nan"),
        ("", 0, "are all zero: one must be > 0"),
        ("mixture_schedule = [[10, { c = 1.0 }]]", 1, r"unknown source\(s\) \['c'\]"),
        ("mixture_schedule = [[10, { a = 1.0 }], [5, { b = 1.0 }]]", 1, "must increase"),
        ('mixture_schedule_unit = "step"', 1, r"mixture_schedule_unit = 'step' is invalid"),
        ('provider = "mixture"', 1, r"datasets\.mix\.provider = \"mixture\": remove this line"),
    ],
)
def test_config_mistakes_name_the_key(tmp_path: Path, extra: str, a: object, match: str) -> None:
    text = BASE.format(extra=extra, a=a)
    if a == 0:
        text += "weight = 0\n"  # source b's too: all zero
    with pytest.raises(ConfigError, match=match):
        parse(text, tmp_path)


def test_a_streaming_source_beside_x_y_rows_is_refused_naming_the_fields(tmp_path: Path) -> None:
    """text_lm streams (it is a source like any other now) but serves packed rows, not x/y."""
    text = tmp_path / "t.txt"
    text.write_text("hello world\n\n" * 50, encoding="utf-8")
    context = ProviderContext("mix", tmp_path / "mix", batch_size=2, batches_per_file=2)
    d = nanogpt_dir(tmp_path, "d")
    sources = [
        {"name": "web", "provider": "text_lm", "weight": 1.0,
         "args": {"source": str(text), "seq_len": 8, "micro_batch_size": 2, "eval_take": 5,
                  "separator": ""}},
        {"name": "bin", "provider": "nanogpt_bin", "weight": 1.0,
         "args": {"data_dir": str(d), "block_size": 8, "vocab_size": 257}},
    ]  # fmt: skip
    mixture = MixtureProvider(context, sources=sources)
    assert mixture.streams
    with pytest.raises(ConfigError, match=r"'web' and 'bin' have different batch schemas"):
        mixture.build_meta()


def test_sources_of_different_batches_are_refused_naming_the_difference(tmp_path: Path) -> None:
    context = ProviderContext("mix", tmp_path / "mix", batch_size=2, batches_per_file=2)
    d = nanogpt_dir(tmp_path, "d")

    def source(name: str, block: int, vocab: int = 300) -> dict:
        args = {"data_dir": str(d), "block_size": block, "vocab_size": vocab}
        return {"name": name, "provider": "nanogpt_bin", "weight": 1.0, "args": args}

    with pytest.raises(ConfigError, match=r"sources 'a' and 'b' differ in \['block_size'\]"):
        MixtureProvider(context, sources=[source("a", 8), source("b", 16)]).build_meta()
    with pytest.raises(ConfigError, match=r"'a' and 'c' differ in \['vocab_size'\]"):
        MixtureProvider(context, sources=[source("a", 8), source("c", 8, 70000)]).build_meta()
    meta = MixtureProvider(context, sources=[source("a", 8), source("b", 8)]).build_meta()
    assert [f["name"] for f in meta["batch_schema"]] == ["x", "y", "source"]
    assert meta["mixture"]["sources"] == ["a", "b"]


def test_text_lm_sources_share_one_tokenizer(tmp_path: Path) -> None:
    """The same tokenizer file at two paths is one tokenizer; another file, another kind, or
    'char' (a vocabulary of its own corpus) beside another text_lm source is refused."""
    from queue_providers.tokenizer_training.train_bpe import train_bpe

    corpus = tmp_path / "t.txt"
    corpus.write_text("hello world, the queue serves\n\n" * 50, encoding="utf-8")
    tok = train_bpe([str(corpus)], tmp_path / "a" / "tokenizer.json", vocab_size=270)
    copy = tmp_path / "b" / "tokenizer.json"
    copy.parent.mkdir()
    copy.write_bytes(tok.read_bytes())
    other = train_bpe([str(corpus)], tmp_path / "c" / "tokenizer.json", vocab_size=280)
    context = ProviderContext("mix", tmp_path / "mix", batch_size=2, batches_per_file=2)

    def mix(a: str, b: str) -> MixtureProvider:
        args = {"source": str(corpus), "seq_len": 8, "micro_batch_size": 2, "separator": ""}
        sources = [
            {"name": "web", "provider": "text_lm", "weight": 1.0, "args": args | {"tokenizer": a}},
            {"name": "code", "provider": "text_lm", "weight": 1.0, "args": args | {"tokenizer": b}},
        ]
        return MixtureProvider(context, sources=sources)

    assert mix(str(tok), str(copy)).streams  # same bytes: one tokenizer
    assert mix("byte", "byte").streams
    with pytest.raises(ConfigError, match=r"'web' \(tokenizer 'hf .*a/tokenizer.json'\) and "
                       r"'code' \(tokenizer 'hf .*c/tokenizer.json'\) use different"):  # fmt: skip
        mix(str(tok), str(other))
    with pytest.raises(ConfigError, match=r"'code' \(tokenizer 'byte'\) use different"):
        mix(str(tok), "byte")
    with pytest.raises(ConfigError, match=r"source 'web' has tokenizer 'char'.*\['code'\]"):
        mix("char", "char")
