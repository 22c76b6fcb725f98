"""`python -m bench`: run the suite and print one table (`make bench` runs the same).

    python -m bench                        # every row, on generated text (3-4 minutes on 2 cores)
    python -m bench --text input.txt       # on a text of your own (tinyshakespeare: shakespeare_char)
    python -m bench --only 1,2 --json out.json
    python -m bench --only providers       # rows by their module's name
    python -m bench --quick                # the smoke version CI runs: a few iterations per row

Rows (the issue's numbering): 1 get_batch vs nanoGPT and a DataLoader, 2 copy vs memcpy,
3 first batch of a file, 4 lease RPCs vs a bare echo, 5 trainer loop, 6 memory, 7 CUDA H2D,
8 get_batch with curriculum selection vs FIFO, 9 batch files over the network,
10 each provider's tokens per second per worker process, 11 production on Ray actors against
a local worker process and 2 actors against 1, 12 text_lm with tiktoken against a Hugging Face
BPE of the same vocabulary, each beside its raw encoder, 13 a restart after 200,000 files
served against a start on a fresh root, 14 token_shards beside a numpy read of its windows and
its start at 1 TiB beside 100 MB, 15 launch to SERVING and to the first batch and the
loader's PSS, beside Grain with 2 workers (extra `peers`), 16 a mixture of three
pre-tokenized corpora making its files beside one of them alone.
The suite starts and stops its own servers, in a temp directory it removes at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import (
    cuda,
    curriculum,
    data,
    first_batch,
    journal_restart,
    memory,
    mixture,
    providers,
    ray_production,
    rpc,
    startup,
    steady,
    token_shards,
    tokenizer_speed,
    trainer_loop,
    transport,
)
from bench.harness import Result, Settings
from bench.report import machine, progress, table, write_json
from bench.servers import start_all, stop_all

# Each module measures the rows listed beside it, in this order.
MODULES = [
    (("1", "2"), steady, "get_batch on CPU vs nanoGPT, DataLoader and memcpy"),
    (("3",), first_batch, "first batch of a new file"),
    (("4",), rpc, "lease RPCs vs a bare echo"),
    (("5",), trainer_loop, "trainer loop with 1, 2, 4 ranks"),
    (("6",), memory, "client and server memory"),
    (("7",), cuda, "CUDA H2D bandwidth"),
    (("8",), curriculum, "get_batch with curriculum selection vs FIFO"),
    (("9",), transport, "batch files over the network vs a raw socket, files and nanoGPT"),
    (("10",), providers, "each provider's tokens per second per worker process"),
    (("11",), ray_production, "production on Ray actors vs a local worker, 2 actors vs 1"),
    (("12",), tokenizer_speed, "text_lm with tiktoken vs a Hugging Face BPE, each vs raw"),
    (("13",), journal_restart, "restart after 200k files served vs a fresh root"),
    (("14",), token_shards, "token_shards: tokens/s per worker vs a numpy read; start at 1 TiB"),
    (("15",), startup, "launch to first batch and loader PSS vs Grain"),
    (("16",), mixture, "a mixture of pre-tokenized corpora: make_file vs one source alone"),
]
ALL_ROWS = [row for rows, _, _ in MODULES for row in rows]
# --only also takes a module's name for its rows.
BY_NAME = {mod.__name__.rsplit(".", 1)[-1]: rows for rows, mod, _ in MODULES}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="batchqueue's benchmark suite: one table, every row beside its alternative or limit.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the smoke version: a few iterations per row, figures not meaningful",
    )
    p.add_argument(
        "--text",
        type=Path,
        help="a UTF-8 text for the token data (default: about 1 MB of generated text)",
    )
    p.add_argument("--only", help=f"comma-separated rows to run, of {','.join(ALL_ROWS)}")
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    p.add_argument(
        "--repeats", type=int, help="interleaved repeats per comparison (default 9, quick 2)"
    )
    p.add_argument(
        "--workdir", type=Path, help="where servers keep their files (default: the system temp dir)"
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the work directory (server logs, configs)"
    )
    args = p.parse_args(argv)
    rows = ALL_ROWS if not args.only else [r.strip() for r in args.only.split(",") if r.strip()]
    rows = [row for r in rows for row in BY_NAME.get(r, (r,))]
    unknown = sorted(set(rows) - set(ALL_ROWS))
    if unknown:
        p.error(f"--only: unknown row(s) {unknown}; rows are {','.join(ALL_ROWS)}")
    args.rows = rows
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    began = time.monotonic()
    # The machine may be shared: its load average goes into the header, to judge the noise.
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bqbench-", dir=args.workdir))
    settings = Settings(
        quick=args.quick,
        text=args.text,
        workdir=workdir,
        repeats=args.repeats or (2 if args.quick else 9),
    )
    selected = [(rows, mod, what) for rows, mod, what in MODULES if set(rows) & set(args.rows)]
    results: list[Result] = []
    failed = False
    try:
        tokens = data.prepare(args.text, workdir / "tokens", args.quick)
        progress(
            f"token data: {tokens.source}, vocab {tokens.vocab_size}, {tokens.train_tokens:,} train tokens; work dir {workdir}"
        )
        with contextlib.ExitStack() as stack:
            prestarted = {}
            if args.quick:  # nothing is timed for real: start every server at once
                specs = [spec for _, mod, _ in selected for spec in mod.servers(settings, tokens)]
                prestarted = start_all(specs, workdir, merge=True)
                stack.callback(stop_all, prestarted)
            for rows, mod, what in selected:
                progress(f"rows {','.join(rows)}: {what}")
                t0 = time.monotonic()
                try:
                    if args.quick:
                        found = prestarted
                    else:
                        found = start_all(mod.servers(settings, tokens), workdir)
                    try:
                        got = mod.run(settings, tokens, found)
                    finally:
                        if not args.quick:
                            stop_all(found)
                except Exception as exc:
                    failed = True
                    traceback.print_exc()
                    got = [
                        Result(
                            row,
                            f"row {row} failed",
                            None,
                            "",
                            note=f"error: {type(exc).__name__}: {exc}".splitlines()[0],
                        )
                        for row in rows
                    ]
                results += [r for r in got if r.row in args.rows]
                progress(f"rows {','.join(rows)} took {time.monotonic() - t0:.0f} s")
        # Stable: each row's cases keep their order.
        results.sort(key=lambda r: ALL_ROWS.index(r.row))
        failed = failed or any(r.value is None and not r.skipped for r in results)
        meta = {
            **machine(),
            "load_at_start": load_at_start,
            "text": tokens.source,
            "quick": args.quick,
            "repeats": settings.repeats,
            "rows": args.rows,
            "elapsed_s": time.monotonic() - began,
        }
        print(table(results, meta))
        if args.json is not None:
            write_json(args.json, results, meta)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
