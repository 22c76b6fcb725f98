"""Check a text_lm dataset's batches for repetition and train/val leakage.

    python -m queue_providers.verify.verify_diversity --data-dir DATA --dataset web --batches 100
    python -m queue_providers.verify.verify_diversity --address localhost:50051 --dataset web

It reads the split's queued batch files in seq order, straight from the data root (with
--address, the root the server reports, or $BATCHQUEUE_DATA_ROOT): it consumes nothing, so it
is safe beside a running trainer, and it checks what is on disk, as many batches as that holds
up to N. Over those first N batches of each split it reports:
  - the duplicate-window rate: the share of [T] windows whose tokens (and mask) equal a window
    seen before in the same split;
  - the train/val document overlap: documents found in both splits. A document is recognised
    by a hash of its tokens: a segment that ends a document (its last label is -100, the EOS
    rule of text_lm) and, in sequential packing, does not start at position 0 of its window
    (there it may be the tail of a document begun earlier). In bin packing every such segment
    is a whole document or the fixed last piece of a long one, so all are hashed. Segments
    shorter than --min-doc-tokens are left out: short lines ("Exeunt.") recur in any corpus;
  - the share of padding tokens;
  - with --near-duplicates, documents that differ by a few words: MinHash over shingles of
    --shingle-size token ids, LSH for candidate pairs (near_duplicates.py; needs the extra
    `dedup`), each pair reported with its estimated similarity and where both were read
    (split, file seq, batch, row, and the rank with --world-size), within and across splits.
It exits 1 when train's duplicate rate or the overlap exceeds its threshold, 2 when it cannot
read the batches. val is a fixed set that repeats every epoch, so its windows repeat as soon as
N batches exceed it: its rate is shown, and judged only with --judge-val-duplicates.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from queue_client.errors import BatchQueueError
from queue_client.format.batchfile import load_batch_file, scan_queue
from queue_client.format.layout import DatasetLayout
from queue_client.format.meta import load_meta
from queue_providers.verify.near_duplicates import MissingExtra, NearDuplicates, Place

IGNORE = -100


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass
class SplitStats:
    batches: int = 0
    windows: int = 0
    duplicate_windows: int = 0
    tokens: int = 0
    padding_tokens: int = 0
    repeated_documents: int = 0
    window_hashes: set[bytes] = field(default_factory=set)
    documents: set[bytes] = field(default_factory=set)

    def summary(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "windows": self.windows,
            "duplicate_windows": self.duplicate_windows,
            "duplicate_window_rate": self.duplicate_windows / self.windows if self.windows else 0.0,
            "padding_share": self.padding_tokens / self.tokens if self.tokens else 0.0,
            "documents": len(self.documents),
            "repeated_documents": self.repeated_documents,
        }


class DiversityCheck:
    """Accumulates batches of any split; `report()` compares them."""

    def __init__(
        self,
        *,
        packing: str = "sequential",
        min_doc_tokens: int = 16,
        near: NearDuplicates | None = None,
        world_size: int | None = None,
    ) -> None:
        self.packing = packing
        self.min_doc_tokens = min_doc_tokens
        self.splits: dict[str, SplitStats] = {}
        self.near = near  # also looks for near-duplicate documents when set
        self.world_size = world_size

    def add(
        self, split: str, batch: Mapping[str, torch.Tensor], where: tuple[int, int] = (-1, -1)
    ) -> None:
        """One batch: input_ids, labels, attention_mask, segment_ids, any leading shape;
        `where` is (the file's seq, the batch's index in it), for near-duplicate reports."""
        stats = self.splits.setdefault(split, SplitStats())
        ids = batch["input_ids"].cpu().numpy()
        t = ids.shape[-1]
        ids = ids.reshape(-1, t)
        labels = batch["labels"].cpu().numpy().reshape(-1, t)
        mask = batch["attention_mask"].cpu().numpy().reshape(-1, t).astype(bool)
        segs = batch["segment_ids"].cpu().numpy().reshape(-1, t)
        stats.batches += 1
        stats.windows += ids.shape[0]
        stats.tokens += ids.size
        stats.padding_tokens += int(ids.size - mask.sum())
        for row in range(ids.shape[0]):
            h = _digest(ids[row].tobytes() + mask[row].tobytes())
            if h in stats.window_hashes:
                stats.duplicate_windows += 1
            stats.window_hashes.add(h)
            for s, e in self._spans(labels[row], segs[row]):
                doc = _digest(ids[row, s:e].tobytes())
                if doc in stats.documents:
                    stats.repeated_documents += 1
                stats.documents.add(doc)
                if self.near is not None:
                    self.near.add(ids[row, s:e], doc, Place(split, *where, row))

    def _documents(self, ids: np.ndarray, labels: np.ndarray, segs: np.ndarray) -> Iterator[bytes]:
        for s, e in self._spans(labels, segs):
            yield _digest(ids[s:e].tobytes())

    def _spans(self, labels: np.ndarray, segs: np.ndarray) -> Iterator[tuple[int, int]]:
        """[start, end) of each segment of a row that counts as a document (module doc)."""
        cuts = np.flatnonzero(np.diff(segs)) + 1
        starts = np.concatenate([[0], cuts]).tolist()
        ends = np.concatenate([cuts, [len(segs)]]).tolist()
        for s, e in zip(starts, ends, strict=True):
            if segs[s] == 0 or labels[e - 1] != IGNORE or e - s < self.min_doc_tokens:
                continue
            if s == 0 and self.packing == "sequential":
                continue
            yield s, e

    def report(self, near_pairs_shown: int = 20) -> dict[str, Any]:
        out: dict[str, Any] = {"splits": {name: s.summary() for name, s in self.splits.items()}}
        train, val = self.splits.get("train"), self.splits.get("val")
        out["overlap_documents"] = len(train.documents & val.documents) if train and val else 0
        out["compared"] = bool(train and val)
        if self.near is not None:
            out["near_duplicates"] = self.near.report(self.world_size, near_pairs_shown)
        return out


def _meta_packing(meta: Mapping[str, Any] | None) -> str:
    packing = (meta or {}).get("packing")
    return packing if packing in ("sequential", "bin") else "sequential"


def _read_queue(
    layout: DatasetLayout, splits: Sequence[str], batches: int, check: DiversityCheck
) -> None:
    """The first `batches` batches of each split's queued files, in seq order."""
    for split in splits:
        qdir = layout.queue_dir(split)
        seen = 0
        for name in sorted(scan_queue(qdir), key=lambda n: n.seq):
            try:
                bf = load_batch_file(qdir / str(name))
            except FileNotFoundError:  # consumed by a running server meanwhile
                continue
            nb = next(iter(bf.tensors.values())).shape[0]
            for i in range(nb):
                if seen >= batches:
                    break
                check.add(split, {k: v[i] for k, v in bf.tensors.items()}, (name.seq, i))
                seen += 1
            if seen >= batches:
                break


def server_data_root(address: str, dataset: str) -> Path:
    """The data root of the server at `address` ($BATCHQUEUE_DATA_ROOT wins, as for clients)."""
    from queue_client.wire import batchqueue_pb2 as pb
    from queue_client.wire.rpc import Rpc

    rpc = Rpc(address)
    try:
        reply = rpc.call("GetMeta", pb.GetMetaRequest(dataset=dataset))
    finally:
        rpc.close()
    return Path(os.environ.get("BATCHQUEUE_DATA_ROOT") or reply.data_root)


def check_dataset(
    layout: DatasetLayout,
    splits: Sequence[str] | None,
    batches: int,
    min_doc_tokens: int,
    near: NearDuplicates | None = None,
    world_size: int | None = None,
) -> DiversityCheck:
    """A DiversityCheck over the queued files of `layout`'s dataset (every split by default),
    looking for near-duplicates too when `near` is given."""
    if not layout.meta_file.is_file():
        raise BatchQueueError(
            f"{layout.meta_file} is not there: the data root {layout.root} holds no dataset "
            f"{layout.dataset!r} (a server's root must be visible here; see --data-dir)"
        )
    meta = load_meta(layout.meta_file)
    check = DiversityCheck(
        packing=_meta_packing(meta),
        min_doc_tokens=min_doc_tokens,
        near=near,
        world_size=world_size,
    )
    _read_queue(layout, splits or list(meta["split_info"]), batches, check)
    return check


def format_report(report: Mapping[str, Any], verdict: Sequence[str]) -> str:
    lines = []
    for name, s in report["splits"].items():
        lines.append(
            f"split {name}: {s['batches']} batches, {s['windows']} windows, "
            f"{s['duplicate_windows']} duplicate windows ({s['duplicate_window_rate']:.3%}), "
            f"padding {s['padding_share']:.2%}, {s['documents']} documents hashed "
            f"({s['repeated_documents']} seen again within the split)"
        )
    if report["compared"]:
        val_docs = report["splits"]["val"]["documents"]
        lines.append(
            f"train/val document overlap: {report['overlap_documents']} of {val_docs} val documents"
        )
    else:
        lines.append(
            "train/val document overlap: not checked (needs batches of both train and val)"
        )
    if "near_duplicates" in report:
        lines += format_near_duplicates(report["near_duplicates"])
    lines.append("verdict: " + ("OK" if not verdict else "FAIL: " + "; ".join(verdict)))
    return "\n".join(lines)


def format_near_duplicates(near: Mapping[str, Any]) -> list[str]:
    """The near-duplicate section: counts, then one line per pair shown."""

    def at(doc: Mapping[str, Any]) -> str:
        where = doc["at"]
        rank = f" rank {where['rank']}" if "rank" in where else ""
        return (
            f"{where['split']} seq {where['seq']} batch {where['batch']} row {where['row']}"
            f"{rank} ({doc['tokens']} tokens)"
        )

    lines = [
        f"near-duplicates (similarity >= {near['threshold']}, shingles of {near['shingle']} "
        f"tokens): {near['pairs']} pairs among {near['documents']} distinct documents, "
        f"{near['pairs_across_splits']} across splits"
        + (
            f", {near['pairs_across_ranks']} across ranks"
            if near.get("pairs_across_ranks") is not None
            else ""
        )
    ]
    lines += [
        f"  {pair['similarity']:.3f}  {at(pair['a'])}  ~  {at(pair['b'])}" for pair in near["shown"]
    ]
    if near["pairs"] > len(near["shown"]):
        lines.append(f"  ... and {near['pairs'] - len(near['shown'])} more (--json lists more)")
    return lines


def judge(
    report: Mapping[str, Any],
    max_duplicate_rate: float,
    max_overlap: int,
    *,
    judge_val: bool = False,
    max_near_duplicate_pairs: int | None = None,
) -> list[str]:
    """The thresholds exceeded, as readable reasons (empty when all is well)."""
    reasons = []
    for name, s in report["splits"].items():
        if name == "val" and not judge_val:
            continue
        if s["duplicate_window_rate"] > max_duplicate_rate:
            reasons.append(
                f"{name} duplicate-window rate {s['duplicate_window_rate']:.3%} > {max_duplicate_rate:.3%}"
            )
    if report["overlap_documents"] > max_overlap:
        reasons.append(f"train/val overlap {report['overlap_documents']} documents > {max_overlap}")
    near = report.get("near_duplicates")
    if near is not None and max_near_duplicate_pairs is not None:
        if near["pairs"] > max_near_duplicate_pairs:
            reasons.append(f"{near['pairs']} near-duplicate pairs > {max_near_duplicate_pairs}")
    return reasons


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m queue_providers.verify.verify_diversity", description=__doc__.split("\n")[0]
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--data-dir", type=Path, help="the server's data root (reads queued files)")
    where.add_argument(
        "--address", help="a running server, host:port: read the queued files of its data root"
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--splits", nargs="+", default=None, help="default: every split in meta")
    parser.add_argument("--batches", type=int, default=100, help="batches per split")
    parser.add_argument("--max-duplicate-rate", type=float, default=0.0)
    parser.add_argument("--max-overlap", type=int, default=0)
    parser.add_argument("--min-doc-tokens", type=int, default=16)
    parser.add_argument(
        "--judge-val-duplicates",
        action="store_true",
        help="fail on val's duplicate windows too (keep --batches below one val epoch)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    near = parser.add_argument_group("near-duplicates (needs the extra: batchqueue[dedup])")
    near.add_argument(
        "--near-duplicates", action="store_true", help="also find documents that differ a little"
    )
    near.add_argument(
        "--threshold", type=float, default=0.8, help="estimated Jaccard similarity of a pair"
    )
    near.add_argument("--shingle-size", type=int, default=5, help="token ids per shingle")
    near.add_argument("--num-perm", type=int, default=128, help="MinHash permutations")
    near.add_argument("--world-size", type=int, default=None, help="name each file's rank")
    near.add_argument("--show-pairs", type=int, default=20, help="pairs listed in the report")
    near.add_argument(
        "--max-near-duplicate-pairs",
        type=int,
        default=None,
        help="fail when more pairs are found (default: report only)",
    )
    args = parser.parse_args(argv)
    finder = None
    if args.near_duplicates:
        try:
            finder = NearDuplicates(
                threshold=args.threshold, shingle=args.shingle_size, num_perm=args.num_perm
            )
        except (MissingExtra, ValueError) as exc:
            print(f"verify_diversity: --near-duplicates: {exc}", file=sys.stderr)
            return 2
    try:
        if args.data_dir is not None:
            root = Path(os.path.expanduser(args.data_dir))
        else:
            root = server_data_root(args.address, args.dataset)
        layout = DatasetLayout(root.expanduser(), args.dataset)
        check = check_dataset(
            layout, args.splits, args.batches, args.min_doc_tokens, finder, args.world_size
        )
    except (BatchQueueError, OSError, KeyError) as exc:
        print(f"verify_diversity: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    report = check.report(args.show_pairs)
    if not any(s["batches"] for s in report["splits"].values()):
        print("verify_diversity: no batches found to check", file=sys.stderr)
        return 2
    verdict = judge(
        report,
        args.max_duplicate_rate,
        args.max_overlap,
        judge_val=args.judge_val_duplicates,
        max_near_duplicate_pairs=args.max_near_duplicate_pairs,
    )
    if args.json:
        print(
            json.dumps({**report, "ok": not verdict, "reasons": verdict}, indent=2, sort_keys=True)
        )
    else:
        print(format_report(report, verdict))
    return 1 if verdict else 0


if __name__ == "__main__":
    sys.exit(main())
