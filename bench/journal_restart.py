"""Row 13: a server's restart after a long run, against a start on a fresh root.

A long run leaves a long journal: 200,000 files produced and consumed (about 160 bytes per
produced record, a consumed record beside each). The journal is written through journal/records.py's
own writer and compacted as a server compacts it while it serves (every
journal_compact_records records; the tail since the last compaction is left as it is, the
most a restart can find). The row times the real `queue-server` from its start to SERVING on
that data root, against the same start on a fresh root (meta built, nothing journaled). Goal:
within 10% of the fresh start. Beside it, for reference, the same journal left uncompacted (a
server that never compacted: its start replays every record, then compacts).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from bench.data import Tokens
from bench.harness import Result, Settings, fmt, median
from bench.servers import Server, ServerSpec, child_env, dataset_toml, server_toml
from queue_client.format.batchfile import BatchFileName
from queue_client.format.layout import DatasetLayout
from queue_server.journal import compaction
from queue_server.journal.file import Journal
from queue_server.journal.reconcile import fill_state
from queue_server.journal.records import Consumed, Produced, encode
from queue_server.split.state import SplitState
from queue_server.testing import ServerProcess

DATASET = "journal_restart"
BATCHES = 100
GOAL = 1.10


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    return []  # it starts its own, on roots it prepares


def _config(tokens: Tokens) -> str:
    table = dataset_toml(DATASET, text=tokens.text_path, batch_size=4, block_size=64)
    return server_toml([table])


def _start(config: str, home: Path, root: Path) -> float:
    """Seconds from the start of a queue-server to SERVING on `root`; then it is stopped."""
    began = time.monotonic()
    server = ServerProcess(home, data_root=root, config_text=config, env=child_env())
    try:
        server.wait_serving(180)
        return time.monotonic() - began
    finally:
        server.stop()


def write_long_journal(path: Path, files: int, compact_every: int, tail_records: int) -> None:
    """`files` files produced and consumed in order by one rank, as a server journals them
    (journal.encode's lines); compacted like a server that compacts every `compact_every`
    records, leaving the last `tail_records` records after the last compaction."""
    compact_at = max(0, files - tail_records // 2) if compact_every else files
    with open(path, "wb") as out:
        for seq in range(compact_at):
            out.write(_lines(seq))
    if compact_every:
        with Journal(path) as journal:
            _compact(journal)
    with open(path, "ab") as out:
        for seq in range(compact_at, files):
            out.write(_lines(seq))


def _lines(seq: int) -> bytes:
    name = BatchFileName(1_700_000_000_000 + seq, seq, BATCHES)
    made = Produced(seq, str(name), 2_621_987, 3_735_928_559 - seq, 0, True)
    return encode(made) + encode(Consumed(seq, 1))


def _compact(journal: Journal) -> None:
    """What a server's compaction leaves: a snapshot and the records it keeps."""
    summary = journal.replay()
    journal.open()
    state = SplitState()
    fill_state(summary, state)
    facts = compaction.Facts(summary.world_size, dict(summary.last_consumed))
    floor = compaction.settled_floor(1, facts.last_consumed, range(1), 0)
    compaction.compact_now(journal, state, facts, floor=floor, keep_seqs=0, slots=1)


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    files = settings.pick(200_000, 20_000)
    compact_every = 10_000
    base = settings.workdir / "journal_restart"
    config = _config(tokens)
    # A root whose dataset was built once; the journals below are put into copies of it.
    built = base / "built"
    _start(config, base / "build-home", built)
    # The files of that first start go: in the long run every file was read.
    shutil.rmtree(DatasetLayout(built, DATASET).queue_dir("train"), ignore_errors=True)
    compacted, whole = base / "compacted.jsonl", base / "whole.jsonl"
    write_long_journal(compacted, files, compact_every, tail_records=compact_every - 2)
    write_long_journal(whole, files, 0, 0)
    samples: dict[str, list[float]] = {"fresh": [], "compacted": [], "whole": []}
    for r in range(settings.repeats):
        for case in samples:
            root = base / f"{case}-{r}"
            if case != "fresh":
                shutil.copytree(built, root)
                journal = DatasetLayout(root, DATASET).journal_file("train")
                shutil.copyfile(compacted if case == "compacted" else whole, journal)
            samples[case].append(_start(config, base / f"home-{case}-{r}", root))
            shutil.rmtree(root, ignore_errors=True)
    fresh, long_run, uncompacted = (median(samples[k]) for k in ("fresh", "compacted", "whole"))
    ratio = long_run / fresh
    sizes = f"{compacted.stat().st_size:,} vs {whole.stat().st_size:,} bytes"
    return [
        Result(
            "13",
            f"start to SERVING after {files:,} files, journal compacted",
            long_run,
            "s",
            "fresh root",
            fresh,
            "s",
            ratio,
            "x fresh",
            goal=f"<= {GOAL:.2f}x (within 10%)",
            met=ratio <= GOAL,
            note=(
                f"uncompacted: {fmt(uncompacted)} s ({fmt(uncompacted / fresh)}x fresh); "
                f"journal {sizes}"
            ),
        )
    ]
