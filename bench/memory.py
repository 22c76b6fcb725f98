"""Row 6: memory. The client's RSS against its cache window, and the server's with full backlogs.

The client maps the file it reads and the prefetch_files (2) prefetched next ones; at a file
boundary the finished file is unmapped by the background release job, so for a moment four
files are mapped. Its window is therefore four files (counted at their served int64 size,
four times what a format-2 file maps: no file is decoded whole). Each client runs in
its own process, reads every byte of every batch (as a copy to the GPU would) and samples its
RSS at each file boundary: bounded means its peak RSS (VmHWM) above the baseline stays within
the window, and the RSS floor does not rise with the number of files read. The prefetched file
counts while the background thread crc-checks it through its own map.

The server keeps ready files on disk, not in memory: its RSS is printed beside the bytes its
backlogs hold on disk, before and after the clients read their files. Provider workers hold one
file's tensors while they write it, so their RSS follows the file size, not the backlog.

Last, a text_lm worker with a byte-level BPE of 8,192 ids trained on the same text, 2 workers
per split, read from the server's own stats (worker_rss_bytes) once both have filled their
windows. Goal: at most 350 MiB each. RSS counts the pages a worker shares with the forkserver
(torch, the providers), so its PSS is in the note too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import procs
from bench.data import Tokens
from bench.harness import Result, Settings, fmt, memory_mb
from bench.servers import Server, ServerSpec, child_env, dataset_toml, server_toml
from queue_server.testing import ServerProcess, wait_until

B, T = 12, 1024
BACKLOG, DEEP_BACKLOG = 2, 8
_WINDOW_FILES = 4  # the file read, 2 prefetched (QueueClient's prefetch_files), 1 finished
_SLACK_MB = 16.0  # allocator and Python noise allowed above the window
TEXT_WORKER_GOAL_MB = 350.0
BPE_VOCAB = 8192


def _file_counts(settings: Settings) -> list[int]:
    return settings.pick([25, 100, 400], [8])


def _file_mb(nb: int) -> float:
    return 2 * B * T * 8 * nb / 2**20


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    datasets = [
        dataset_toml(
            f"mem_nb{nb}",
            text=tokens.text_path,
            batch_size=B,
            block_size=T,
            batches_per_file=nb,
            backlog=BACKLOG,
        )
        for nb in _file_counts(settings)
    ]
    deep_nb = settings.pick(100, 4)
    datasets.append(
        dataset_toml(
            "mem_deep",
            text=tokens.text_path,
            batch_size=B,
            block_size=T,
            batches_per_file=deep_nb,
            backlog=settings.pick(DEEP_BACKLOG, 4),
        )
    )
    return [ServerSpec("memory", tuple(datasets))]


def client_main(address: str, dataset: str, nb: int, files: int, out: Any) -> None:
    """A reading client in its own process: RSS (MiB) at start and after each file."""
    try:
        from queue_client import QueueClient

        client = QueueClient(address, dataset, rank=0, world_size=1)
        base = memory_mb()
        after = []
        checksum = 0
        for _ in range(files):
            for _ in range(nb):
                x, y = client.get_batch("train")
                checksum += int(x.sum()) + int(y.sum())  # read every byte
            after.append(memory_mb())
        del x, y
        client.close()
        out.put({"base": base, "after": after, "end": memory_mb(), "checksum": checksum})
    except BaseException as exc:
        out.put({"error": repr(exc)})


def _disk_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.glob("*/queue/*/*.pt")) / 2**20


def _server_memory(server: Server, datasets: list[str]) -> dict[str, float]:
    main = (server.memory() or {}).get("VmRSS", float("nan"))
    workers = [
        (memory_mb(pid) or {}).get("VmRSS", 0.0)
        for ds in datasets
        for pid in server.worker_pids(ds)
    ]
    return {
        "main": main,
        "workers_sum": sum(workers),
        "workers_max": max(workers, default=0.0),
        "workers": len(workers),
        "disk": _disk_mb(server.data_root),
    }


def _wait_full(server: Server, datasets: list[str]) -> None:
    for ds in datasets:
        backlog = server.split_stats(ds)["max_backlog_files"]
        # train only: val starts its worker on its first lease, which this row never makes.
        server.wait_ready_files(ds, backlog + 2, "train", timeout_s=300)


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    server = found["memory"]
    counts = _file_counts(settings)
    datasets = [f"mem_nb{nb}" for nb in counts] + ["mem_deep"]
    _wait_full(server, datasets)
    before = _server_memory(server, datasets)
    files = settings.pick(8, 3)
    ctx = procs.context()
    results = []
    for nb in counts:
        out = ctx.Queue()
        proc = ctx.Process(
            target=client_main, args=(server.address, f"mem_nb{nb}", nb, files, out), daemon=True
        )
        proc.start()
        report = out.get(timeout=600)
        proc.join(timeout=60)
        if "error" in report:
            raise RuntimeError(f"memory client mem_nb{nb}: {report['error']}")
        base = report["base"]["VmRSS"]
        rss = [a["VmRSS"] for a in report["after"]]
        window = _WINDOW_FILES * _file_mb(nb)
        above = max(report["end"]["VmHWM"], *rss) - base  # the peak, not only file ends
        half = max(1, len(rss) // 2)
        # A leak lifts the later floor above everything seen early on; one file more or less
        # mapped at a sampled moment does not.
        growth = min(rss[half:] or rss) - max(rss[:half])
        met = above <= window + _SLACK_MB and growth <= _SLACK_MB
        results.append(
            Result(
                "6",
                f"client RSS above baseline, files of {nb} batches ({_file_mb(nb):.0f} MiB)",
                above,
                "MiB",
                f"cache window ({_WINDOW_FILES} files)",
                window,
                "MiB",
                above / window,
                "x window",
                "bounded",
                met,
                f"baseline {base:.0f} MiB; RSS at each of {files} file ends {', '.join(f'{r:.0f}' for r in rss)}; HWM {report['end']['VmHWM']:.0f}",
            )
        )
    _wait_full(server, datasets)
    after = _server_memory(server, datasets)
    grew = after["main"] - before["main"]
    results.append(
        Result(
            "6",
            f"server RSS, {len(datasets)} datasets with full backlogs",
            before["main"],
            "MiB",
            "backlog files on disk",
            before["disk"],
            "MiB",
            before["main"] / before["disk"],
            "x disk",
            "info",
            None,
            f"{before['workers']} worker processes: {before['workers_sum']:.0f} MiB in all (largest {before['workers_max']:.0f}; shared pages counted in each)",
        )
    )
    results.append(
        Result(
            "6",
            f"server RSS after serving {files * len(counts)} more files",
            after["main"],
            "MiB",
            "before",
            before["main"],
            "MiB",
            after["main"] / before["main"],
            "x before",
            "bounded",
            grew <= _SLACK_MB,
            f"grew {fmt(grew)} MiB; workers {after['workers_sum']:.0f} MiB (largest {after['workers_max']:.0f}); on disk {after['disk']:.0f} MiB",
        )
    )
    results.append(text_lm_worker_rss(settings, tokens))
    return results


def text_lm_worker_rss(settings: Settings, tokens: Tokens) -> Result:
    """The largest text_lm train worker's RSS with an 8k BPE, from GetStats."""
    from queue_providers.tokenizer_training.train_bpe import train_bpe

    home = settings.workdir / "text_lm_rss"
    tokenizer = train_bpe([str(tokens.text_path)], home / "bpe.json", vocab_size=BPE_VOCAB)
    table = (
        "[datasets.text_rss]\n"
        'provider = "text_lm"\n'
        "batch_size = 8\n"
        "batches_per_file = 8\n"
        "max_backlog_files = 4\n"
        "workers = 2\n"
        "[datasets.text_rss.args]\n"
        f"source = {json.dumps(str(tokens.text_path))}\n"
        'separator = ""\n'
        "eval_take = 20\n"
        f"tokenizer = {json.dumps(str(tokenizer))}\n"
        "seq_len = 1024\n"
        "micro_batch_size = 8\n"
    )
    server = ServerProcess(
        home, data_root=home / "data", config_text=server_toml([table]), env=child_env()
    )
    try:
        server.wait_serving(300)
        wait_until(
            lambda: server.split_stats("text_rss")["ready_files"] >= 4,
            300,
            "text_rss's train window to fill",
        )
        stats = server.split_stats("text_rss")
        pids = [int(p) for p in stats["worker_pids"]]
        rss = [int(b) / 2**20 for b in stats["worker_rss_bytes"]]
        pss = [_pss_mb(pid) for pid in pids]
    finally:
        server.stop()
    largest = max(rss)
    return Result(
        "6",
        f"text_lm worker RSS, BPE of {BPE_VOCAB:,} ids, 2 workers (the largest)",
        largest,
        "MiB",
        "goal",
        TEXT_WORKER_GOAL_MB,
        "MiB",
        largest / TEXT_WORKER_GOAL_MB,
        "x goal",
        f"<= {TEXT_WORKER_GOAL_MB:.0f} MiB",
        largest <= TEXT_WORKER_GOAL_MB,
        "each worker: "
        + ", ".join(f"RSS {r:.0f} MiB, PSS {p:.0f} MiB" for r, p in zip(rss, pss, strict=True)),
    )


def _pss_mb(pid: int) -> float:
    """Proportional set size (shared pages split among their sharers); nan where unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return float("nan")
