"""Row 8's big-vocabulary case: the composer alone, in this process, on GPT-2-sized ids.

Candidate files of Zipf-distributed ids (vocabulary 50,257, B x T tokens per batch) are
written to the work dir with their histograms, as a provider writes them; the composer then
composes served files from a buffer of `capacity` batches at alpha 1.0 and 0.0. Beside it,
in the same run and on the same buffer: one full rescoring of every buffered batch by
np.bincount, which is what each pick would cost without the composer's lazy bounds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.harness import Result, Settings, fmt, median

if TYPE_CHECKING:
    from queue_server.curriculum.composer import Composer

VOCAB = 50_257
ZIPF = 1.1


def _candidates(directory: Path, count: int, batches: int, b: int, t: int) -> dict[int, Path]:
    import torch

    from queue_client.batchfile import write_batch_file
    from queue_providers.base import token_histograms

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF
    p /= p.sum()
    paths = {}
    for c in range(count):
        x = torch.from_numpy(rng.choice(VOCAB, size=(batches, b, t), p=p).astype(np.int64))
        meta = {
            "dataset": "bench",
            "split": "train",
            "batch_size": b,
            "schema": [{"name": "x", "dtype": "int64", "shape": [t]}],
        }
        published = write_batch_file(
            directory,
            seq=c,
            tensors={"x": x},
            metadata=meta,
            extras=token_histograms({"x": x}, "x"),
        )
        paths[c] = directory / str(published.name)
    return paths


def _full_rescoring_ms(composer: Composer, repeats: int) -> float:
    """One pick's cost without lazy bounds: every buffered batch scored by np.bincount."""
    hists = composer.buffered_histograms()
    ids = np.concatenate([h[0] for h in hists])
    counts = np.concatenate([h[1] for h in hists])
    rows = np.repeat(np.arange(len(hists)), [len(h[0]) for h in hists])
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        g = 1.0 / (composer.served + 1e-9 * (composer.served_tokens + 1))
        weights = composer.target(composer.alpha) * g
        np.bincount(rows, weights=counts * weights[ids], minlength=len(hists))
        samples.append((time.perf_counter() - began) * 1e3)
    return median(samples)


def run(settings: Settings) -> list[Result]:
    from queue_server.curriculum.composer import Composer, ComposerSettings
    from queue_server.curriculum.schedule import AlphaSchedule

    b, t = settings.pick((12, 1024), (4, 256))
    per_file = settings.pick(50, 8)
    capacity = settings.pick(1000, 64)
    plans = settings.pick(8, 2)
    cfg = ComposerSettings(VOCAB, per_file, per_file, capacity, 2.0, AlphaSchedule(1.0))
    needed = cfg.initial_files + cfg.files_per_plan * (plans + 1)
    paths = _candidates(settings.workdir / "composer-scale", needed, per_file, b, t)
    p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF
    corpus = p / p.sum()
    results = []
    for alpha in (1.0, 0.0):
        composer = Composer(
            ComposerSettings(VOCAB, per_file, per_file, capacity, 2.0, AlphaSchedule(alpha)), corpus
        )
        per_pick = []
        for seq in range(plans):
            composer.attach({c: paths[c] for c in composer.held() + composer.needed()})
            began = time.perf_counter()
            composer.compose(seq, 1, [])
            per_pick.append((time.perf_counter() - began) * 1e3 / per_file)
            if seq < plans - 1:
                composer.detach_unheld()
        pick_ms = median(per_pick[1:] or per_pick)  # the first file also fills the buffer
        full_ms = _full_rescoring_ms(composer, settings.pick(5, 2))
        tokens_s = b * t / (pick_ms / 1e3)
        results.append(
            Result(
                "8",
                f"composer, vocab {VOCAB:,}, buffer {capacity}, B={b} T={t}, alpha {alpha:g}",
                pick_ms,
                "ms/batch",
                "one full rescoring",
                full_ms,
                "ms",
                full_ms / pick_ms,
                "x faster",
                "info",
                None,
                f"composes {fmt(1e3 / pick_ms)} batches/s = {fmt(tokens_s / 1e6)} M tokens/s on one core",
            )
        )
    return results
