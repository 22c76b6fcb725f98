"""`queue-client`: look at a running batchqueue server from a terminal or a script.

    queue-client stats [DATASET...] [--watch] [--interval S] [--json]
    queue-client meta NAME [--json]
    queue-client schema NAME [--split S] [--json]
    queue-client explain NAME --step S [--rank R] [--world-size W] [--split S] [--json]
    queue-client explain NAME --seq N --offset ROW [--split S] [--json]

The address is --address, else $BATCHQUEUE_ADDRESS, else 127.0.0.1:50051; the auth token is
--token, else $BATCHQUEUE_TOKEN; a TLS server's certificate is trusted with --tls-ca-file,
else $BATCHQUEUE_TLS_CA_FILE. Rates of files produced and consumed are the difference of
two GetStats snapshots taken --interval seconds apart; tokens/s and batches/s are the
server's, over its last minute of consumption, which it keeps across a restart (so a
restarted server that is making its files again does not show 0/s). Epochs and their ETA
are shown where the provider's meta gives the split's size, else "unknown". --watch keeps
going while the server restarts, saying that it is unreachable meanwhile. With --json the
output is JSON (one document; one line per refresh with --watch) for scripts; without it, off a
terminal, the tables are plain and full width (cli_render.py). `rich` is imported only to draw
the tables, so importing queue_client stays light and --json needs no rich at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from queue_client import errors
from queue_client.cli_render import (
    console,
    render_explain,
    render_meta,
    render_schema,
    render_stats,
)
from queue_client.explain import explain_request, explained_rows
from queue_client.format.meta import meta_from_json
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire.rpc import Rpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
ADDRESS_ENV = "BATCHQUEUE_ADDRESS"
# A GetMeta or GetSchema on a dataset that is still starting waits server-side (10 s by default).
_CALL_TIMEOUT_S = 30.0


# ---- the data: plain dicts, the same for --json and for the terminal view ---------------------
def message_to_plain(message: Any) -> dict[str, Any]:
    """A protobuf message as a dict with every field, int64 as int (MessageToDict gives str)."""
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        is_message = fd.message_type is not None
        if fd.is_repeated:
            out[fd.name] = [message_to_plain(v) if is_message else v for v in value]
        elif is_message:
            out[fd.name] = message_to_plain(value) if message.HasField(fd.name) else None
        elif getattr(fd, "has_presence", False) and not message.HasField(fd.name):
            out[fd.name] = None  # an optional scalar left unset: unknown, not 0
        elif fd.enum_type is not None:
            out[fd.name] = fd.enum_type.values_by_number[value].name
        else:
            out[fd.name] = value
    return out


def _rate(after: int, before: int | None, dt: float | None) -> float | None:
    if before is None or not dt or dt <= 0:
        return None
    return max(0, after - before) / dt  # a restarted server resets its counters: no negative rates


def stats_doc(
    address: str,
    after: dict[str, pb.GetStatsResponse],
    before: dict[str, pb.GetStatsResponse] | None,
    dt: float | None,
) -> dict[str, Any]:
    """The stats view: each dataset's splits with backlog, rates and per-rank leases and lag.

    `backlog_files` is the split's ready files; `backlog_limit` is max_backlog_files for each
    rank of the split's world (production pauses there). Rates are None without a previous
    snapshot.
    """
    datasets = []
    for name, reply in after.items():
        prev_splits = {s.split: s for s in before[name].splits} if before and name in before else {}
        splits = []
        for s in reply.splits:
            prev = prev_splits.get(s.split)
            row = message_to_plain(s)
            row["backlog_files"] = s.ready_files
            row["backlog_limit"] = s.max_backlog_files * max(1, s.world_size)
            row["produced_per_s"] = _rate(
                s.produced_files, prev.produced_files if prev else None, dt
            )
            row["consumed_per_s"] = _rate(
                s.consumed_files, prev.consumed_files if prev else None, dt
            )
            splits.append(row)
        datasets.append(
            {
                "dataset": name,
                "state": reply.state,
                "last_error": reply.last_error,
                "splits": splits,
            }
        )
    return {"address": address, "interval_s": dt, "datasets": datasets}


def _jsonable(value: Any) -> Any:
    """meta may hold int or tuple dict keys (itos); JSON objects only have string keys."""
    if isinstance(value, dict):
        return {
            k if isinstance(k, str) else json.dumps(_jsonable(k)): _jsonable(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return value


# ---- calls ------------------------------------------------------------------------------------
class Session:
    """The RPCs the commands make, on one channel."""

    def __init__(
        self, address: str, token: str | None, timeout_s: float, tls_ca_file: str | None = None
    ) -> None:
        self.address = address
        self._rpc = Rpc(
            address, auth_token=token, reconnect_timeout_s=timeout_s, tls_ca_file=tls_ca_file
        )

    def datasets(self, names: Sequence[str]) -> list[str]:
        if names:
            return list(names)
        return list(
            self._rpc.call(
                "ListDatasets", pb.ListDatasetsRequest(), timeout_s=_CALL_TIMEOUT_S
            ).datasets
        )

    def snapshot(self, names: Sequence[str]) -> dict[str, pb.GetStatsResponse]:
        return {
            n: self._rpc.call("GetStats", pb.GetStatsRequest(dataset=n), timeout_s=_CALL_TIMEOUT_S)
            for n in names
        }

    def meta(self, name: str) -> pb.GetMetaResponse:
        return self._rpc.call("GetMeta", pb.GetMetaRequest(dataset=name), timeout_s=_CALL_TIMEOUT_S)

    def schema(self, name: str, split: str) -> pb.GetSchemaResponse:
        return self._rpc.call(
            "GetSchema", pb.GetSchemaRequest(dataset=name, split=split), timeout_s=_CALL_TIMEOUT_S
        )

    def explain(self, request: pb.ExplainStepRequest) -> pb.ExplainStepResponse:
        return self._rpc.call("ExplainStep", request, timeout_s=_CALL_TIMEOUT_S)

    def close(self) -> None:
        self._rpc.close()


def stats_frames(
    session: Session,
    names: Sequence[str],
    interval_s: float,
    count: int | None,
    before: dict[str, pb.GetStatsResponse] | None = None,
    *,
    outlast_restarts: bool = False,
) -> Iterator[dict[str, Any]]:
    """Stats documents: one per interval, rates measured over it; `count` None runs forever.

    With `outlast_restarts` (--watch) a server that cannot be reached gives a document with
    "error" set and no datasets, and the next one that answers starts the rates afresh."""
    prev: dict[str, pb.GetStatsResponse] | None = (
        session.snapshot(names) if before is None else before
    )
    t0 = time.monotonic()
    done = 0
    while count is None or done < count:
        # The measurement window of the rates, not a wait for some condition.
        time.sleep(interval_s)
        done += 1
        try:
            after = session.snapshot(names)
        except errors.ServerUnavailable as exc:
            if not outlast_restarts:
                raise
            prev = None
            yield {
                "address": session.address,
                "interval_s": None,
                "datasets": [],
                "error": str(exc),
            }
            continue
        t1 = time.monotonic()
        yield stats_doc(session.address, after, prev, t1 - t0 if prev is not None else None)
        prev, t0 = after, t1


# ---- commands ---------------------------------------------------------------------------------
def cmd_stats(session: Session, args: argparse.Namespace, out: Callable[[str], None]) -> int:
    if args.interval < 0 or (args.watch and args.interval == 0):
        raise errors.InvalidRequest(
            f"--interval {args.interval} must be > 0 (or 0 without --watch)"
        )
    if args.count is not None and args.count < 1:
        raise errors.InvalidRequest(f"--count {args.count} must be >= 1")
    names = session.datasets(args.datasets)
    if not args.watch:
        if args.interval == 0:
            doc = stats_doc(session.address, session.snapshot(names), None, None)
        else:
            doc = next(stats_frames(session, names, args.interval, 1))
        if args.json:
            out(json.dumps(doc, indent=2))
        else:
            console().print(render_stats(doc))
        return 0
    if args.json:
        for doc in stats_frames(session, names, args.interval, args.count, outlast_restarts=True):
            out(json.dumps(doc))
        return 0
    from rich.live import Live

    first = session.snapshot(names)
    shown = stats_doc(session.address, first, None, None)
    with Live(render_stats(shown), console=console(), auto_refresh=False) as live:
        for doc in stats_frames(
            session, names, args.interval, args.count, first, outlast_restarts=True
        ):
            if doc.get("error"):  # keep the last numbers on screen, under the error
                doc = {**shown, "error": doc["error"]}
            else:
                shown = doc
            live.update(render_stats(doc), refresh=True)
    return 0


def meta_doc(reply: pb.GetMetaResponse) -> dict[str, Any]:
    doc = message_to_plain(reply)
    doc["meta"] = _jsonable(meta_from_json(doc.pop("meta_json")))
    return doc


def cmd_meta(session: Session, args: argparse.Namespace, out: Callable[[str], None]) -> int:
    doc = meta_doc(session.meta(args.name))
    if args.json:
        out(json.dumps(doc, indent=2))
    else:
        console().print(render_meta(doc))
    return 0


def cmd_schema(session: Session, args: argparse.Namespace, out: Callable[[str], None]) -> int:
    splits = [args.split] if args.split else list(session.meta(args.name).splits)
    doc: dict[str, Any] = {"dataset": args.name, "splits": {}}
    for split in splits:
        reply = message_to_plain(session.schema(args.name, split))
        doc["splits"][split] = {"batch_size": reply["batch_size"], "fields": reply["fields"]}
    if args.json:
        out(json.dumps(doc, indent=2))
    else:
        console().print(render_schema(doc))
    return 0


def cmd_explain(session: Session, args: argparse.Namespace, out: Callable[[str], None]) -> int:
    if (args.step is None) == (args.seq is None):
        raise errors.InvalidRequest("explain: give --step (with --rank), or --seq and --offset")
    request = explain_request(
        args.name, args.split, args.step or 0, args.rank, args.world_size, args.seq, args.offset
    )
    reply = session.explain(request)
    doc = {"dataset": args.name, "split": args.split, "step": args.step, "rank": args.rank}
    doc.update(world_size=reply.world_size, rows=explained_rows(reply))
    if args.json:
        out(json.dumps(doc, indent=2))
    else:
        console().print(render_explain(doc))
    return 0


# ---- entry point ------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    # --address and friends are accepted before or after the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--address",
        default=argparse.SUPPRESS,
        help=f"HOST:PORT or unix:PATH (default ${ADDRESS_ENV}, else {DEFAULT_ADDRESS})",
    )
    common.add_argument(
        "--token", default=argparse.SUPPRESS, help="auth token (default $BATCHQUEUE_TOKEN)"
    )
    common.add_argument(
        "--tls-ca-file",
        default=argparse.SUPPRESS,
        help="PEM certificate(s) to trust: talk TLS (default $BATCHQUEUE_TLS_CA_FILE)",
    )
    common.add_argument(
        "--timeout",
        type=float,
        default=argparse.SUPPRESS,
        help="seconds to keep trying an unreachable server (default 5)",
    )
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print JSON for scripts instead of tables",
    )
    p = argparse.ArgumentParser(
        prog="queue-client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    sub = p.add_subparsers(dest="command", required=True)
    stats = sub.add_parser(
        "stats", parents=[common], help="backlog, rates, leases and lag per dataset, split and rank"
    )
    stats.add_argument(
        "datasets", nargs="*", metavar="DATASET", help="datasets to show (default: all served)"
    )
    stats.add_argument(
        "--watch", action="store_true", help="refresh every --interval seconds until Ctrl-C"
    )
    stats.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between the two snapshots that give rates (default 1; 0: no rates)",
    )
    stats.add_argument(
        "--count", type=int, default=None, help="with --watch: stop after this many refreshes"
    )
    meta = sub.add_parser("meta", parents=[common], help="a dataset's meta and serving parameters")
    meta.add_argument("name", metavar="NAME")
    schema = sub.add_parser(
        "schema", parents=[common], help="the fields of a dataset's batches, per split"
    )
    schema.add_argument("name", metavar="NAME")
    schema.add_argument("--split", help="one split (default: every split)")
    explain = sub.add_parser(
        "explain", parents=[common], help="where each row of a step came from (file, offset)"
    )
    explain.add_argument("name", metavar="NAME")
    explain.add_argument("--split", default="train", help="the split (default train)")
    explain.add_argument("--step", type=int, help="the rank's step (get_batch calls before it)")
    explain.add_argument("--rank", type=int, default=0, help="the rank (default 0)")
    explain.add_argument(
        "--world-size", type=int, default=0, help="default: the split's, as the server knows it"
    )
    explain.add_argument("--seq", type=int, help="instead of --step: the batch file ...")
    explain.add_argument("--offset", type=int, default=0, help="... and its row (default 0)")
    return p


_COMMANDS = {"stats": cmd_stats, "meta": cmd_meta, "schema": cmd_schema, "explain": cmd_explain}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    address = getattr(args, "address", None) or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS
    args.json = getattr(args, "json", False)
    try:
        session = Session(
            address,
            getattr(args, "token", None),
            getattr(args, "timeout", 5.0),
            getattr(args, "tls_ca_file", None),
        )
    except errors.BatchQueueError as exc:
        print(f"queue-client {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        return _COMMANDS[args.command](session, args, lambda text: print(text, flush=True))
    except errors.BatchQueueError as exc:
        print(f"queue-client {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130 if not (args.command == "stats" and args.watch) else 0
    finally:
        session.close()


if __name__ == "__main__":
    sys.exit(main())
