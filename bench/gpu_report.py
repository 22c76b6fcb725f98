"""The GPU session's figures as markdown tables: one per part, the machine named above them."""

from __future__ import annotations

from typing import Any

FEED_NAMES = {
    "synthetic": "synthetic batch on the device",
    "nanogpt": "nanoGPT get_batch (pinned, non_blocking)",
    "batchqueue": "batchqueue get_batch",
    "batchqueue_fetch_process": "batchqueue, fetch_process=True",
    "batchqueue_mixture": "batchqueue, mixture of 3 token_shards",
}


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _environment(env: dict[str, Any]) -> list[str]:
    gpu = env.get("cuda") or "no GPU"
    lines = [
        f"- device: {gpu}" + (" (CPU dry run: figures mean nothing)" if env.get("dry_run") else ""),
        f"- torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), python {env.get('python')}, "
        f"{env.get('cpu_count')} CPUs ({env.get('processor')}), driver {env.get('driver')}",
        f"- {env.get('date')}, commit {env.get('commit')}",
    ]
    if env.get("missing"):
        lines.append(f"- **missing modules: {', '.join(env['missing'])}**")
    if env.get("error"):
        lines.append(f"- environment not read: {env['error']}")
    return lines


def _h2d(figures: dict[str, Any]) -> list[str]:
    lines = [
        f"Goal: get_batch at >= {figures['goal']:g}x the speed of a plain pinned int64 copy "
        "(ratio = copy time / our time). µs per batch, medians of interleaved repeats.",
        "",
        "| shape | get_batch | pinned int64 .to() | ratio | met | Transfer.deliver alone "
        "| ratio | deliver_into | copy_ into | ratio | bytes over the link / served | waits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["shapes"]:
        lines.append(
            f"| {r['shape']} | {_f(r['get_batch_us'])} | {_f(r['reference_us'])} "
            f"| {_f(r['ratio'], 3)} | {'yes' if r['met'] else '**no**'} "
            f"| {_f(r['transfer_us'])} | {_f(r['transfer_ratio'], 3)} | {_f(r['into_us'])} "
            f"| {_f(r['copy_us'])} | {_f(r['into_ratio'], 3)} "
            f"| {r['staged_bytes']:,} / {r['served_bytes']:,} | {r['waits']} |"
        )
    return lines


def _train(figures: dict[str, Any]) -> list[str]:
    m = figures["model"]
    lines = [
        f"{figures['shape']}; GPT {m['n_layer']} layers, {m['n_head']} heads, {m['n_embd']} wide, "
        f"vocab {m['vocab']}, {m['params'] / 1e6:.1f}M parameters, {m['dtype']} autocast; "
        f"{figures['steps']} timed steps after {figures['warmup']} warm-up, per round.",
        "",
        "| feed | ms/step | tokens/s | vs synthetic | GPU waiting on data | data call CPU µs |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in figures["feeds"].items():
        lines.append(
            f"| {FEED_NAMES.get(name, name)} | {_f(r['ms_per_step'], 2)} "
            f"| {_f(r['tokens_per_s'], 0)} | {_f(r['vs_synthetic'], 4)} "
            f"| {r['data_wait_share'] * 100:.3f}% | {_f(r['data_cpu_us'])} |"
        )
    return lines


def _tests(figures: dict[str, Any]) -> list[str]:
    counts = ", ".join(f"{n} {w.lower()}" for w, n in sorted(figures["counts"].items()))
    lines = [f"pytest exit code {figures['exit_code']}: {counts or 'no outcome read'}", ""]
    lines += ["| test | outcome |", "|---|---|"]
    lines += [f"| {t} | {o} |" for t, o in figures["outcomes"].items()]
    return lines


RENDER = {"h2d": _h2d, "train_gpt2_small": _train, "train_char_gpt": _train, "cuda_tests": _tests}
TITLES = {
    "h2d": "Row 7: get_batch to the GPU vs a pinned int64 copy",
    "train_gpt2_small": "Training, GPT-2 small sizes",
    "cuda_tests": "The CUDA tests",
    "train_char_gpt": "Training, shakespeare_char sizes",
}


def markdown(report: dict[str, Any]) -> str:
    lines = ["# GPU session", "", *_environment(report["environment"])]
    lines.append(f"- session took {report.get('seconds', 0):.0f} s")
    for name, part in report["parts"].items():
        lines += ["", f"## {TITLES.get(name, name)}", ""]
        status = part.get("status")
        if status != "ok" and "figures" not in part:
            lines.append(f"**{status}** after {part.get('seconds', 0):.0f} s")
            if part.get("error"):
                lines += ["", "```", part["error"], "```"]
            continue
        if status != "ok":
            lines += [f"**{status}**", ""]
        lines += RENDER[name](part["figures"])
        lines.append(f"\n({part.get('seconds', 0):.0f} s)")
    return "\n".join(lines) + "\n"
