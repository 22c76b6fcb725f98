"""The composer's side of the worker protocol: it runs in a provider worker process, which
holds the provider (to estimate the corpus distribution) and the Composer.

Ops (JSON lines, see queue_server.worker):
    {"op": "curriculum_init", "split", "settings", "field", "n_tokens", "snapshot",
     "shard", "shards"}
        -> {"held": [...], "needed": [...], "stats": {...}}
    {"op": "compose", "seq", "world_size", "overrides", "paths"}
        -> a produce reply, plus "retired", "needed", "stats"   (one composer: the whole file)
    {"op": "materialize", "seq", "picks", "alphas", "paths"} -> a produce reply

Several composers of a split (shards.py) compose a served file step by step, every step sent
to every composer, each answering for its share of the buffer:
    {"op": "compose", "step": "begin", "seq", "world_size", "overrides", "paths"}
        -> {"proposal": [score, position] | None}
    {"op": "compose", "step": "accept", "position"}
        -> {"proposal": ...} while picks are left, then {"scored": [[position, score], ...]}
    {"op": "compose", "step": "finish", "scored": every composer's scored}
        -> composer 0 (which writes the served file and the snapshot): as "compose" above;
           the others: {"held", "needed", "stats"}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from queue_client.layout import (
    DatasetLayout,
    composer_snapshot_name,
    composer_snapshot_seq,
    remove_temp_files,
)
from queue_client.meta import meta_from_json
from queue_providers import DataProviderBase
from queue_server.curriculum.composer import Composer, ComposerSettings, Composition
from queue_server.curriculum.corpus import cache_key, load_or_estimate
from queue_server.production.replies import produced_reply

_SNAPSHOTS_KEPT = 3


class ComposerHost:
    def __init__(self, provider: DataProviderBase, data_root: Path, dataset: str) -> None:
        self.provider = provider
        self.dataset = dataset
        self.layout = DatasetLayout(data_root, dataset)
        self.composer: Composer | None = None
        self.split = ""

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "curriculum_init":
            return self._init(req)
        assert self.composer is not None, "curriculum_init first"
        if op == "compose":
            step = req.get("step")
            return self._compose(req) if step is None else self._step(step, req)
        if op == "materialize":
            return self._materialize(req)
        raise ValueError(f"unknown op {op!r}")

    def _init(self, req: dict[str, Any]) -> dict[str, Any]:
        self.split = req["split"]
        settings = ComposerSettings.from_json(req["settings"])
        field, n_tokens = req["field"], int(req["n_tokens"])
        meta = meta_from_json(req["meta_json"])
        key = cache_key(self.provider.data_identity(), n_tokens, self.split, field, meta)

        def count(advance: Any) -> np.ndarray:
            counts = self.provider.corpus_token_counts(
                self.split, n_tokens, field, settings.vocab_size, advance
            )
            return counts.numpy()

        corpus = load_or_estimate(
            self.layout.corpus_cache_file(key), count, n_tokens, f"{self.dataset}/{self.split}"
        )
        self.composer = Composer(
            settings, corpus, int(req.get("shard", 0)), int(req.get("shards", 1))
        )
        self._snapshots().mkdir(parents=True, exist_ok=True)
        if self.composer.shard == 0:
            # The one that writes snapshots and served files: any temp there is a dead one's
            # (a worker process, or a Ray actor of any node, killed mid-write).
            remove_temp_files(self._snapshots())
            remove_temp_files(self._queue())
        snapshot = req.get("snapshot")
        if snapshot:
            path = self.layout.composer_snapshot_file(self.split, snapshot)
            if not path.exists():
                raise FileNotFoundError(
                    f"composer snapshot {path} is missing: the curriculum of "
                    f"{self.dataset}/{self.split} cannot carry on where it stopped"
                )
            self.composer.restore(path)
        return {"ok": True, **self._status()}

    def _status(self) -> dict[str, Any]:
        assert self.composer is not None
        return {
            "held": self.composer.held(),
            "needed": self.composer.needed(),
            "stats": self.composer.stats(),
        }

    def _compose(self, req: dict[str, Any]) -> dict[str, Any]:
        composer = self.composer
        assert composer is not None
        seq = int(req["seq"])
        composer.attach({int(c): p for c, p in req["paths"].items()})
        result = composer.compose(seq, int(req["world_size"]), req.get("overrides", []))
        return self._publish(seq, result)

    def _step(self, step: str, req: dict[str, Any]) -> dict[str, Any]:
        composer = self.composer
        assert composer is not None
        if step == "begin":
            composer.attach({int(c): p for c, p in req["paths"].items()})
            composer.begin(int(req["seq"]), int(req["world_size"]), req.get("overrides", []))
            return {"ok": True, "proposal": composer.propose()}
        if step == "accept":
            composer.accept(int(req["position"]))
            if composer.picks_left():
                return {"ok": True, "proposal": composer.propose()}
            return {"ok": True, "scored": composer.cull_scores()}
        if step == "finish":
            seq = composer.plans
            result = composer.finish(req["scored"])
            if composer.shard == 0:
                return self._publish(seq, result)
            composer.detach_unheld()
            return {"ok": True, **self._status()}
        raise ValueError(f"unknown compose step {step!r}")

    def _publish(self, seq: int, result: Composition) -> dict[str, Any]:
        """Write served file `seq` and the snapshot after it; the produce reply."""
        composer = self.composer
        assert composer is not None
        published = composer.write(self._queue(), seq, result.picks, result.alphas)
        composer.detach_unheld()
        name = composer_snapshot_name(seq)
        composer.save(self.layout.composer_snapshot_file(self.split, name))
        self._prune_snapshots(seq)
        before = {"picks": result.picks, "alphas": [round(a, 6) for a in result.alphas]}
        return {
            **produced_reply(seq, published, before, {"snapshot": name}),
            "retired": result.retired,
            "culled": result.culled,
            **self._status(),
        }

    def _materialize(self, req: dict[str, Any]) -> dict[str, Any]:
        composer = self.composer
        assert composer is not None
        seq = int(req["seq"])
        composer.attach({int(c): p for c, p in req["paths"].items()})
        published = composer.write(self._queue(), seq, req["picks"], req["alphas"])
        composer.detach_unheld()
        return produced_reply(seq, published, {"picks": req["picks"], "alphas": req["alphas"]}, {})

    def _queue(self) -> Path:
        return self.layout.queue_dir(self.split)

    def _snapshots(self) -> Path:
        return self.layout.composer_snapshot_dir(self.split)

    def _prune_snapshots(self, seq: int) -> None:
        for path in self._snapshots().iterdir():
            old = composer_snapshot_seq(path.name)
            if old is not None and old <= seq - _SNAPSHOTS_KEPT:
                path.unlink(missing_ok=True)
