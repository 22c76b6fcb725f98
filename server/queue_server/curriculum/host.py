"""The composer's side of the worker protocol: it runs in a provider worker process, which
holds the provider (to estimate the corpus distribution) and a Composer per curriculum stream
(streams.py) that the split composes here.

Ops (JSON lines, see queue_server.worker):
    {"op": "curriculum_init", "split", "settings", "field", "n_tokens", "shard", "shards"}
        -> {"ok": true}
    {"op": "curriculum_stream", "stream", "snapshot"}
        -> {"held": [...], "needed": [...], "stats": {...}}   (the stream anew, or restored)
    {"op": "compose", "seq", "world_size", "overrides", "paths", "publish"}
        -> a produce reply, plus "retired", "held", "needed", "stats"   (one composer: the
           whole file, composed by stream seq mod streams; publish false: the stream moves
           past seq, its snapshot is saved, and no file is written: name "")
    {"op": "materialize", "seq", "picks", "alphas", "paths"} -> a produce reply

Several composers of a split (shards.py) compose a served file step by step, every step sent
to every composer, each answering for its share of the buffer:
    {"op": "compose", "step": "begin", "seq", "world_size", "overrides", "paths", "publish"}
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

from queue_client.format.layout import (
    DatasetLayout,
    composer_snapshot_name,
    composer_snapshot_seq,
    remove_temp_files,
)
from queue_client.format.meta import meta_from_json
from queue_providers import DataProviderBase
from queue_server.curriculum.candidate_files import CandidateFile, write_served
from queue_server.curriculum.composer import Composer, ComposerSettings, Composition
from queue_server.curriculum.corpus import cache_key, kl_divergence, load_or_estimate
from queue_server.production.replies import produced_reply

_SNAPSHOTS_KEPT = 3  # per stream


class ComposerHost:
    def __init__(self, provider: DataProviderBase, data_root: Path, dataset: str) -> None:
        self.provider = provider
        self.dataset = dataset
        self.layout = DatasetLayout(data_root, dataset)
        self.settings: ComposerSettings | None = None
        self.corpus = np.zeros(0)
        self.shard, self.shards = 0, 1
        self.streams: dict[int, Composer] = {}
        self.split = ""
        self._current = 0  # the stream composing step by step, and whether it publishes
        self._publishing = True

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "curriculum_init":
            return self._init(req)
        assert self.settings is not None, "curriculum_init first"
        if op == "curriculum_stream":
            return self._start_stream(int(req["stream"]), req.get("snapshot"))
        if op == "compose":
            step = req.get("step")
            return self._compose(req) if step is None else self._step(step, req)
        if op == "materialize":
            return self._materialize(req)
        raise ValueError(f"unknown op {op!r}")

    def _init(self, req: dict[str, Any]) -> dict[str, Any]:
        self.split = req["split"]
        settings = self.settings = ComposerSettings.from_json(req["settings"])
        field, n_tokens = req["field"], int(req["n_tokens"])
        meta = meta_from_json(req["meta_json"])
        key = cache_key(self.provider.data_identity(), n_tokens, self.split, field, meta)

        def count(advance: Any) -> np.ndarray:
            counts = self.provider.corpus_token_counts(
                self.split, n_tokens, field, settings.vocab_size, advance
            )
            return counts.numpy()

        self.corpus = load_or_estimate(
            self.layout.corpus_cache_file(key), count, n_tokens, f"{self.dataset}/{self.split}"
        )
        self.shard, self.shards = int(req.get("shard", 0)), int(req.get("shards", 1))
        self.streams = {}
        self._snapshots().mkdir(parents=True, exist_ok=True)
        if self.shard == 0:
            # The one that writes snapshots and served files: any temp there is a dead one's
            # (a worker process, or a Ray actor of any node, killed mid-write).
            remove_temp_files(self._snapshots())
            remove_temp_files(self._queue())
        return {"ok": True}

    def _start_stream(self, stream: int, snapshot: str | None) -> dict[str, Any]:
        """Stream `stream` anew, or from its snapshot (the last file its journal holds)."""
        assert self.settings is not None
        composer = Composer(self.settings, self.corpus, self.shard, self.shards, stream)
        if snapshot:
            path = self.layout.composer_snapshot_file(self.split, snapshot)
            if not path.exists():
                raise FileNotFoundError(
                    f"composer snapshot {path} is missing: the curriculum of "
                    f"{self.dataset}/{self.split} cannot carry on where it stopped"
                )
            composer.restore(path)
        self.streams[stream] = composer
        return {"ok": True, **self._status(stream)}

    def _stream(self, seq: int) -> Composer:
        assert self.settings is not None
        stream = seq % self.settings.streams
        if stream not in self.streams:
            raise ValueError(f"curriculum stream {stream} (of served seq {seq}) was not started")
        return self.streams[stream]

    def _status(self, stream: int) -> dict[str, Any]:
        composer = self.streams[stream]
        return {"held": composer.held(), "needed": composer.needed(), "stats": self._stats(stream)}

    def _stats(self, stream: int) -> dict[str, Any]:
        """The figures of every stream composed here (alpha: the one that composed last)."""
        composers = list(self.streams.values())
        alpha = self.streams[stream].alpha
        served = np.sum([c.served for c in composers], axis=0).astype(np.float64)
        return {
            "alpha": alpha,
            "kl_to_target": kl_divergence(served, composers[0].target(alpha)),
            "buffer_batches": sum(len(c.cand) for c in composers),
            "served_tokens": sum(c.served_tokens for c in composers),
            "candidates_ingested": sum(c.ingested for c in composers),
            "candidates_culled": sum(c.culled for c in composers),
            "streams": len(composers),
        }

    def _compose(self, req: dict[str, Any]) -> dict[str, Any]:
        seq = int(req["seq"])
        composer = self._stream(seq)
        composer.attach({int(c): p for c, p in req["paths"].items()})
        result = composer.compose(seq, int(req["world_size"]), req.get("overrides", []))
        return self._publish(composer, seq, result, bool(req.get("publish", True)))

    def _step(self, step: str, req: dict[str, Any]) -> dict[str, Any]:
        if step == "begin":
            seq = int(req["seq"])
            composer = self._stream(seq)
            self._current, self._publishing = composer.stream, bool(req.get("publish", True))
            composer.attach({int(c): p for c, p in req["paths"].items()})
            composer.begin(seq, int(req["world_size"]), req.get("overrides", []))
            return {"ok": True, "proposal": composer.propose()}
        composer = self.streams[self._current]
        if step == "accept":
            composer.accept(int(req["position"]))
            if composer.picks_left():
                return {"ok": True, "proposal": composer.propose()}
            return {"ok": True, "scored": composer.cull_scores()}
        if step == "finish":
            seq = composer.next_seq
            result = composer.finish(req["scored"])
            if self.shard == 0:
                return self._publish(composer, seq, result, self._publishing)
            composer.detach_unheld()
            return {"ok": True, **self._status(composer.stream)}
        raise ValueError(f"unknown compose step {step!r}")

    def _publish(
        self, composer: Composer, seq: int, result: Composition, publish: bool
    ) -> dict[str, Any]:
        """Write served file `seq` (unless it is passed over) and the snapshot after it; the
        produce reply."""
        before = {"picks": result.picks, "alphas": [round(a, 6) for a in result.alphas]}
        name = composer_snapshot_name(seq)
        if publish:
            published = composer.write(self._queue(), seq, result.picks, result.alphas)
            reply = produced_reply(seq, published, before, {"snapshot": name})
        else:
            reply = {"ok": True, "seq": seq, "name": "", "bytes": 0, "crc": 0}
            reply |= {"before": before, "after": {"snapshot": name}}
        composer.detach_unheld()
        composer.save(self.layout.composer_snapshot_file(self.split, name))
        self._prune_snapshots(seq)
        return {
            **reply,
            "retired": result.retired,
            "culled": result.culled,
            **self._status(composer.stream),
        }

    def _materialize(self, req: dict[str, Any]) -> dict[str, Any]:
        """Write an old served file again from its journaled picks: no stream's state moves."""
        assert self.settings is not None
        vocab = self.settings.vocab_size
        files = {int(c): CandidateFile.load(Path(p), vocab) for c, p in req["paths"].items()}
        seq = int(req["seq"])
        picks = [(files[int(c)], int(i)) for c, i in req["picks"]]
        published = write_served(self._queue(), seq, picks, req["alphas"])
        return produced_reply(seq, published, {"picks": req["picks"], "alphas": req["alphas"]}, {})

    def _queue(self) -> Path:
        return self.layout.queue_dir(self.split)

    def _snapshots(self) -> Path:
        return self.layout.composer_snapshot_dir(self.split)

    def _prune_snapshots(self, seq: int) -> None:
        """Keep the last few snapshots of seq's stream (the others' are theirs to prune)."""
        assert self.settings is not None
        streams = self.settings.streams
        for path in self._snapshots().iterdir():
            old = composer_snapshot_seq(path.name)
            if old is not None and old % streams == seq % streams:
                if old <= seq - _SNAPSHOTS_KEPT * streams:
                    path.unlink(missing_ok=True)
