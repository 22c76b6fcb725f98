"""Import boundaries, checked in fresh interpreters, and the committed gRPC stubs' freshness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "providers")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    return env


def _modules_after(statement: str) -> set[str]:
    """Top-level package names in sys.modules after running `statement` in a fresh interpreter."""
    code = textwrap.dedent(
        f"""
        import json, sys
        {statement}
        print(json.dumps(sorted({{name.partition(".")[0] for name in sys.modules}})))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    ("statement", "forbidden"),
    [
        ("import queue_client", {"queue_server", "uvloop", "torch", "queue_providers"}),
        (
            "from queue_client import World, FieldSpec, CorruptBatchFile",
            {"queue_server", "uvloop", "torch"},
        ),
        (
            "import queue_client.format.batchfile, queue_client.format.meta",
            {"queue_server", "uvloop", "torch"},
        ),
        ("from queue_client import QueueClient", {"queue_server", "uvloop"}),
        # The frameworks' shared part: each framework comes with its own module only.
        (
            "import queue_client.integrations.trainer_stream, queue_client.integrations.reweight",
            {"lightning", "transformers", "accelerate", "torchtitan", "queue_server"},
        ),
        ("import queue_server.app", {"torch"}),
        ("import queue_server.config.server", {"torch", "uvloop"}),
        # A server starts its forkserver before anything else: nothing may delay that.
        (
            "from queue_server.production.forkserver_start import start_forkserver",
            {"asyncio", "grpc", "torch", "numpy", "queue_client", "queue_providers"},
        ),
        # Every server start preloads this in its forkserver: no gRPC, no event loop.
        ("import queue_server.production.worker_main", {"grpc", "uvloop"}),
    ],
)
def test_import_does_not_pull_in(statement: str, forbidden: set[str]) -> None:
    """Each import leaves the forbidden packages unimported (checked in a fresh process)."""
    loaded = _modules_after(statement)
    assert statement.split()[1].partition(".")[0] in loaded  # the probe itself worked
    assert not (loaded & forbidden), f"{statement!r} imported {sorted(loaded & forbidden)}"


@pytest.mark.parametrize("provider", ["char_lm", "nanogpt_bin", "token_shards"])
@pytest.mark.parametrize("histograms", [False, True], ids=["fifo", "curriculum"])
def test_a_window_provider_worker_makes_files_without_torch(
    tmp_path: Path, provider: str, histograms: bool
) -> None:
    """What a char_lm, nanogpt_bin or token_shards (window order) dataset's worker runs (its preload, the provider's meta
    and a file, with a curriculum's token histograms too) never imports torch: its forkserver
    then preloads none (production/worker_imports.py), a second or more of a first start."""
    import numpy as np

    if provider == "char_lm":
        (tmp_path / "corpus.txt").write_text("to be or not to be, that is the question\n" * 50)
        args: dict[str, object] = {"input": str(tmp_path / "corpus.txt"), "block_size": 8}
    else:
        for split in ("train", "val"):
            np.arange(2_000, dtype=np.uint16).__mod__(300).tofile(tmp_path / f"{split}.bin")
        args = {"data_dir": str(tmp_path), "block_size": 8, "vocab_size": 300}
        if provider == "token_shards":  # window order, both samplings' code: epoch here
            args = {"inputs": [str(tmp_path / "train.bin")], "block_size": 8, "vocab_size": 300}
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
        import queue_server.production.worker_main
        from pathlib import Path
        from queue_providers import ProviderContext, create
        ctx = ProviderContext("ds", Path({str(tmp_path / "ds")!r}), batch_size=3,
                              batches_per_file=4, histogram_field={"x" if histograms else ""!r})
        p = create({provider!r}, ctx, {args!r})
        p.set_meta(p.complete_meta())
        Path({str(tmp_path / "q")!r}).mkdir()
        assert p.produce_file("train", 0, Path({str(tmp_path / "q")!r})).size_bytes > 0
        """
        )
    )
    loaded = _modules_after(f"exec(open({str(script)!r}).read())")
    assert "queue_providers" in loaded and "torch" not in loaded


def test_a_mixture_of_window_sources_makes_files_without_torch(tmp_path: Path) -> None:
    """A mixture whose sources are window providers copies their stored rows with numpy:
    its worker imports no torch either, nor text_lm (which a mixture checks tokenizers of)."""
    import numpy as np

    np.arange(3_000, dtype=np.uint16).__mod__(300).tofile(tmp_path / "a.bin")
    np.arange(5, 3_005, dtype=np.uint16).__mod__(300).tofile(tmp_path / "train.bin")
    sources = [
        {"name": "a", "provider": "token_shards", "weight": 0.5,
         "args": {"inputs": [str(tmp_path / "a.bin")], "block_size": 8, "vocab_size": 300}},
        {"name": "b", "provider": "token_shards", "weight": 0.5,
         "args": {"inputs": [str(tmp_path / "train.bin")], "block_size": 8, "vocab_size": 300,
                  "sampling": "random"}},
    ]  # fmt: skip
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
        import queue_server.production.worker_main
        from pathlib import Path
        from queue_providers import ProviderContext, create
        ctx = ProviderContext("mix", Path({str(tmp_path / "mix")!r}), batch_size=3,
                              batches_per_file=4)
        p = create("mixture", ctx, {{"sources": {sources!r}}})
        p.set_meta(p.complete_meta())
        assert p.copies_stored_rows("train")
        Path({str(tmp_path / "q")!r}).mkdir()
        for seq in range(3):
            assert p.produce_file("train", seq, Path({str(tmp_path / "q")!r})).size_bytes > 0
        import sys
        assert "queue_providers.text_lm" not in sys.modules
        """
        )
    )
    loaded = _modules_after(f"exec(open({str(script)!r}).read())")
    assert "queue_providers" in loaded and "torch" not in loaded


def test_probe_detects_forbidden_imports() -> None:
    """Control: the probe does report a forbidden package when something imports it."""
    assert {"uvloop", "queue_server"} <= _modules_after("import queue_client, uvloop, queue_server")


def test_a_config_error_exits_before_the_server_and_grpc_are_imported(tmp_path: Path) -> None:
    """A config error answers in a tenth of a second: the command reads its config before it
    imports the server and gRPC, and the workers' forkserver (started first) gives up its torch
    import once the command is gone. Every misconfigured start paid for both before."""
    config = tmp_path / "bad.toml"
    config.write_text('[datasets.a]\nprovider = "char_lm"\nno_such_key = 1\n', encoding="utf-8")
    statement = (
        "from queue_server.cli import main; "
        f"assert main(['--config', {str(config)!r}, '--data-root', {str(tmp_path)!r}]) == 2"
    )
    loaded = _modules_after(statement)
    assert "queue_server" in loaded
    assert not loaded & {"grpc", "uvloop", "torch"}, sorted(loaded & {"grpc", "uvloop", "torch"})


def test_generated_stubs_match_proto() -> None:
    """scripts/gen_proto.py --check passes: the committed gRPC stubs match the .proto."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
