"""Everything a GPU is needed for, measured in one command that fits a short GPU lease:

    python -m bench.gpu_session --out DIR            # on a machine with a CUDA GPU (~8 min)
    python -m bench.gpu_session --out DIR --cpu-dry-run   # the same plumbing on a CPU, tiny

Parts, in this order, each in a process of its own with a time budget, so that one part that
fails, hangs or breaks the CUDA context is recorded and the others still run:
- h2d: row 7 per shape (B=12 T=1024, B=64 T=256): get_batch(device="cuda") against a plain
  pinned int64 copy of the same rows (bench/gpu_h2d.py);
- train_gpt2_small: examples/train.py's GPT at GPT-2 small's sizes (124M, B=12 T=1024,
  bf16) fed by a synthetic batch, nanoGPT's get_batch, batchqueue, batchqueue with
  fetch_process=True and a mixture of three token_shards sources (bench/gpu_train.py);
- cuda_tests: the tests marked gpu (tests/test_cuda.py, tests/test_transport.py);
- train_char_gpt: the same feeds at nanoGPT's shakespeare_char sizes (B=64 T=256, 6 layers
  of 384), where a step is short and data costs show first.
Each part starts its own queue server on a unix socket, over corpora written once into a
temp dir. DIR gets gpu_session.json (every figure), gpu_session.md (the tables) and
gpu_session.log (every part's output). It runs from a checkout without installing it: the
source roots are put on the path here and for every process it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ROOTS = [REPO, REPO / "client", REPO / "server", REPO / "providers"]
for _root in reversed(ROOTS):  # a checkout that is not installed (a GPU box without network)
    if str(_root) not in sys.path:
        sys.path.insert(0, str(_root))

# name -> seconds it may take on the GPU; the order is the order they run in.
PARTS = {"h2d": 90, "train_gpt2_small": 150, "cuda_tests": 170, "train_char_gpt": 80}
# What the package and its tests import beyond torch and numpy: missing ones are named first.
NEEDS = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "zlib_ng", "pytest_asyncio")
GPU_TESTS = ("tests/test_cuda.py", "tests/test_transport.py")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(p) for p in ROOTS] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("GRPC_VERBOSITY", "ERROR")
    return env


# ---- one part, in its own process -------------------------------------------------------------
def run_part(name: str, workdir: Path, dry: bool) -> dict[str, Any]:
    import torch

    from bench import gpu_h2d, gpu_train
    from bench.gpu_data import DRY_SIZES, GPU_SIZES, write_corpora

    if not dry and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run with --cpu-dry-run to check the plumbing")
    device = torch.device("cpu" if dry else "cuda")
    sizes = DRY_SIZES if dry else GPU_SIZES
    corpora = write_corpora(workdir / "corpora", sizes)
    home = workdir / name
    if name == "h2d":
        return gpu_h2d.run(home, corpora, sizes, device, repeats=1 if dry else 5)
    tiny = {"n_layer": 1, "n_head": 2, "n_embd": 32}
    if name == "train_gpt2_small":
        model = tiny if dry else {"n_layer": 12, "n_head": 12, "n_embd": 768}
        shape, rounds, warmup, steps = sizes.shapes[0], 2, 5, 25
    elif name == "train_char_gpt":
        model = tiny if dry else {"n_layer": 6, "n_head": 6, "n_embd": 384}
        shape, rounds, warmup, steps = sizes.shapes[1], 2, 5, 40
    else:
        raise ValueError(f"unknown part {name!r}; parts are {list(PARTS)}")
    if dry:
        rounds, warmup, steps = 1, 1, 2
    return gpu_train.run(
        home, corpora, sizes, device, shape=shape, model_sizes=model,
        rounds=rounds, warmup=warmup, steps=steps,
    )  # fmt: skip


def run_tests(log: Any, budget_s: float) -> dict[str, Any]:
    """The gpu-marked tests, each outcome read from pytest's verbose lines (so a run cut off
    by its budget still reports the tests that finished)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:randomly", "-p",
           "no:cacheprovider", "-m", "gpu", *GPU_TESTS]  # fmt: skip
    code, out, timed_out = _spawn(cmd, budget_s, log)
    outcomes: dict[str, str] = {}
    for line in out.splitlines():
        head, _, rest = line.partition(" ")
        word = rest.split(" ", 1)[0] if rest else ""
        if "::" in head and word in ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS"):
            outcomes[head] = word
    counts = {w: sum(1 for v in outcomes.values() if v == w) for w in set(outcomes.values())}
    return {"exit_code": code, "timed_out": timed_out, "outcomes": outcomes, "counts": counts}


# ---- the session ------------------------------------------------------------------------------
def _spawn(cmd: list[str], budget_s: float, log: Any) -> tuple[int | None, str, bool]:
    """Run `cmd` in a process group of its own, its output appended to `log`; the group is
    killed at the budget. Returns (exit code or None, output, timed out)."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=max(1.0, budget_s))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out = True
    log.write(out)
    log.flush()
    return (None if timed_out else proc.returncode), out, timed_out


def _part(name: str, workdir: Path, dry: bool, budget_s: float, log: Any) -> dict[str, Any]:
    log.write(f"\n===== {name} (budget {budget_s:.0f} s) =====\n")
    log.flush()
    began = time.monotonic()
    if name == "cuda_tests":
        figures = run_tests(log, budget_s)
        ok = figures["exit_code"] in (0, 5) and not figures["timed_out"]  # 5: none collected
        status = "ok" if ok else ("timed out" if figures["timed_out"] else "failed")
        return {"status": status, "seconds": time.monotonic() - began, "figures": figures}
    result = workdir / f"{name}.json"
    cmd = [sys.executable, "-m", "bench.gpu_session", "--part", name, "--workdir", str(workdir),
           "--result", str(result)] + (["--cpu-dry-run"] if dry else [])  # fmt: skip
    code, out, timed_out = _spawn(cmd, budget_s, log)
    entry: dict[str, Any] = {"seconds": time.monotonic() - began}
    if result.exists() and code == 0:
        entry.update(status="ok", figures=json.loads(result.read_text()))
    else:
        entry["status"] = "timed out" if timed_out else "failed"
        entry["error"] = "\n".join(out.strip().splitlines()[-15:])
    return entry


def environment(dry: bool) -> dict[str, Any]:
    info: dict[str, Any] = {"dry_run": dry}
    try:
        import torch

        from bench.report import machine

        info.update(machine())
        info["torch_cuda"] = torch.version.cuda
    except Exception as exc:  # recorded, not fatal: the parts say what they lack
        info["error"] = f"{type(exc).__name__}: {exc}"
    info["missing"] = [m for m in NEEDS if not _importable(m)]
    info["driver"] = _quiet(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    )
    info["commit"] = _quiet(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    return info


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _quiet(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def session(out: Path, dry: bool, budget_s: float, only: list[str]) -> int:
    from bench.gpu_report import markdown

    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="bq-gpu-"))
    report: dict[str, Any] = {"environment": environment(dry), "parts": {}}
    try:
        with open(out / "gpu_session.log", "w", encoding="utf-8") as log:
            for name, own in PARTS.items():
                if only and name not in only:
                    continue
                left = budget_s - (time.monotonic() - began)
                if left < 20:
                    report["parts"][name] = {"status": "not run: the session's budget is spent"}
                    continue
                report["parts"][name] = _part(name, workdir, dry, min(own, left), log)
                print(f"{name}: {report['parts'][name]['status']}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["seconds"] = time.monotonic() - began
    (out / "gpu_session.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    text = markdown(report)
    (out / "gpu_session.md").write_text(text, encoding="utf-8")
    print(text)
    return 0 if all(p.get("status") == "ok" for p in report["parts"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_session", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, help="where the JSON, the tables and the log go")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on the CPU: the plumbing")
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole session's seconds")
    p.add_argument("--only", default="", help=f"comma-separated parts, of {','.join(PARTS)}")
    p.add_argument("--part", help=argparse.SUPPRESS)  # one part, in the process run_part runs
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        try:
            figures = run_part(args.part, args.workdir, args.cpu_dry_run)
        except Exception:
            traceback.print_exc()
            return 1
        args.result.write_text(json.dumps(figures, indent=2), encoding="utf-8")
        return 0
    if args.out is None:
        p.error("--out DIR is required")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        p.error(f"--only: unknown part(s) {unknown}; parts are {','.join(PARTS)}")
    return session(args.out, args.cpu_dry_run, args.budget_s, only)


if __name__ == "__main__":
    sys.exit(main())
