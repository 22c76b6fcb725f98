"""The code that runs inside a provider worker process, driven over a socket by the server.

Workers are forked from a forkserver that imported this module (and torch, where a dataset's
provider needs it: worker_imports.py) once, so a worker starts in milliseconds rather than
seconds, and no worker inherits the server's gRPC threads.
The server writes one JSON request per line and reads one JSON reply per line. Requests:

    {"op": "init", "dataset": ..., "provider": ..., "args": {...}, ...}   -> {"ok": true}
    {"op": "meta"}                                      -> {"ok": true, "meta_json": ..., "inputs": {...}}
    {"op": "check_inputs", "inputs": {...}, "fingerprint": f}          -> {"ok": true, "fingerprint": f}
    {"op": "set_meta", "meta_json": ..., "state": {...} | null}         -> {"ok": true}
    {"op": "produce", "split": s, "seq": n, "state": {...} | null}      -> {"ok": true, "name": ..., ...}
    {"op": "provenance", "split": s, "seq": n, "rows": [...]}          -> {"ok": true, "rows": [{...}]}
    {"op": "curriculum_init" | "curriculum_stream" | "compose" | "materialize", ...}
                                                                        see curriculum/host.py

A produce with "into": "candidates" publishes into the split's candidates dir (curriculum).
A produce with "publish": false makes the file's batches and drops them: the stream moves past
the seq and the reply has the states, with name "" (another node's seq, docs/multi-node.md).

A produce with a state produces that seq again from the journaled state and then restores
the worker's forward stream, so re-producing an old seq never disturbs the next new one.
Errors come back as {"ok": false, "error": "...", "errno": n}; the process keeps running.

A worker ignores SIGINT and SIGTERM: a Ctrl-C in a terminal reaches the whole process group,
as does a SIGTERM to the group (`timeout`, `kill -- -PGID`, systemd stopping a unit), and the
server, not the signal, stops its workers (it closes their sockets). So a Ctrl-C prints no
worker traceback, and a stopping server never sees its workers die under it and restarts
them. Long preparation steps (building meta, checking inputs, loading indexes)
log progress lines (preparation.py) on the worker's stderr, which is the server's.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import threading
import traceback
from pathlib import Path
from typing import Any

from queue_client.format.layout import DatasetLayout
from queue_client.format.meta import meta_from_json, meta_to_json
from queue_providers import DataProviderBase
from queue_providers.inputs import check_inputs, describe_inputs
from queue_server.logs import configure_logging
from queue_server.mixture.epochs import record_epoch_starts
from queue_server.production.preparation import Preparation, input_bytes
from queue_server.production.priority import apply_worker_priority
from queue_server.production.provider_init import (
    build_provider,
    check_own_inputs,
    one_torch_thread,
    set_weight_changes,
)
from queue_server.production.replies import produced_reply


def run_over_socket(sock: socket.socket, cwd: str) -> None:
    """The worker's entry point: serve requests on `sock` until it closes."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server stops us, not the signal
        signal.signal(sig, signal.SIG_IGN)
    configure_logging()
    _exit_when_server_goes(sock)
    os.chdir(cwd)  # relative paths in provider args are relative to the config file
    requests, replies = sock.makefile("rb"), sock.makefile("wb")
    try:
        _serve(requests, replies)
    except KeyboardInterrupt:  # a SIGINT that came before it was ignored: exit quietly
        pass
    finally:
        for stream in (requests, replies, sock):
            with contextlib.suppress(OSError):
                stream.close()


def _exit_when_server_goes(sock: socket.socket) -> None:
    """Exit the moment the server closes its end, even in the middle of a file.

    A worker holds the forkserver open, so it is never orphan-killed with the server. Left to
    finish, a worker of a SIGKILLed server would publish its file, or show its temp file, after
    a restarted server has swept the queue directory. A thread parked in poll() costs nothing.
    """
    hangup = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR | select.POLLNVAL

    def watch() -> None:
        poller = select.poll()
        poller.register(sock.fileno(), hangup)
        while True:
            for _fd, events in poller.poll():
                if events & hangup:
                    os._exit(0)

    threading.Thread(target=watch, name="server-watch", daemon=True).start()


def _serve(requests: Any, replies: Any) -> None:
    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        replies.flush()

    try:
        _loop(requests, reply)
    except (BrokenPipeError, ConnectionResetError):
        return  # the server is gone (stopped or killed): nobody to tell, exit quietly


def _loop(requests: Any, reply: Any) -> None:
    session = WorkerSession()
    for line in requests:
        req = json.loads(line)
        one_torch_thread()
        answer = session.answer(req)
        one_torch_thread()  # the provider may have imported it (init)
        reply(answer)
        if req.get("op") == "stop" and answer.get("ok"):
            return


def error_reply(exc: Exception) -> dict[str, Any]:
    """A request that failed, as the server's side reads it (WorkerError)."""
    return {
        "ok": False,
        "error": f"{type(exc).__name__}: {exc}",
        "kind": type(exc).__name__,
        "errno": getattr(exc, "errno", None) or 0,
    }


class WorkerSession:
    """What a worker holds between requests (its provider; the composer of a curriculum
    split) and the answer to each one. A worker process reads requests from its socket; a
    Ray composer actor (curriculum/composer_actor.py) gets them as calls: same ops, same
    replies. `whole_process`: worker_priority applies to every thread of the process (a
    worker process's own), else to the calling one (a Ray actor's, beside Ray's threads)."""

    def __init__(self, whole_process: bool = True) -> None:
        self.whole_process = whole_process
        self.provider: DataProviderBase | None = None
        self.host: Any = None  # the curriculum composer, in the one worker that composes
        self.root: Path | None = None
        self.dataset = ""
        self.first_worker = True  # worker 0 of its split speaks for the split's loading steps

    def answer(self, req: dict[str, Any]) -> dict[str, Any]:
        """The reply to one request; a failure is an error reply, and the worker goes on."""
        try:
            return self._handle(req)
        except Exception as exc:  # reported to the server, which decides to retry or fail
            if os.environ.get("BATCHQUEUE_WORKER_TRACEBACK"):
                traceback.print_exc()
            return error_reply(exc)

    def _handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        provider, root, dataset = self.provider, self.root, self.dataset
        if op == "init":
            apply_worker_priority(  # before the provider loads
                req.get("priority", "normal"), this_thread_only=not self.whole_process
            )
            root, dataset = Path(req["data_root"]), req["dataset"]
            self.root, self.dataset = root, dataset
            self.first_worker = req.get("worker_index", 0) == 0
            with Preparation(
                f"dataset {dataset}: starting provider {req['provider']}",
                quiet=not self.first_worker,
            ):
                provider = build_provider(req)
                provider.on_start()
                check_own_inputs(provider, req)
            self.provider = provider
            stateful = provider.streams
            return {"ok": True, "stateful": stateful}
        if op == "meta":
            assert provider is not None, "init first"
            files = provider.input_files()
            with Preparation(
                f"dataset {dataset}: building meta",
                announce=True,
                total_bytes=input_bytes(files),
            ) as prep:
                prep.stage = "fingerprinting its input files"
                inputs = describe_inputs(files)
                prep.stage = "tokenizer, indexes and the rest of meta"
                meta_json = meta_to_json(provider.complete_meta(inputs))
            return {"ok": True, "meta_json": meta_json, "inputs": inputs}
        if op == "check_inputs":  # a ConfigError naming the changed file if one changed
            assert provider is not None, "init first"
            files = provider.input_files()
            with Preparation(
                f"dataset {dataset}: checking its inputs against meta",
                total_bytes=input_bytes(files),
            ):
                check_inputs(files, req["inputs"], req["fingerprint"], dataset=dataset)
            return {"ok": True, "fingerprint": req["fingerprint"]}
        if op == "set_meta":
            assert provider is not None, "init first"
            where = f"dataset {dataset}" + (f" split {req['split']}" if req.get("split") else "")
            with Preparation(
                f"{where}: loading meta, tokenizer and indexes", quiet=not self.first_worker
            ):
                provider.set_meta(meta_from_json(req["meta_json"]))
                if req.get("split") and req.get("state"):
                    provider.load_state_dict(req["split"], req["state"])
            return {"ok": True}
        if op == "produce":
            assert provider is not None and root is not None, "init first"
            return _produce(provider, DatasetLayout(root, dataset), req)
        if op == "provenance":  # where rows of a file came from (queue_server/provenance.py)
            assert provider is not None, "init first"
            set_weight_changes(provider, req["split"], req.get("overrides"))
            rows = provider.provenance(req["split"], req["seq"], req["rows"])
            return {"ok": True, "rows": rows}
        if op in ("curriculum_init", "curriculum_stream", "compose", "materialize"):
            assert provider is not None and root is not None, "init first"
            if self.host is None:
                from queue_server.curriculum.host import ComposerHost

                self.host = ComposerHost(provider, root, dataset)
            if op == "curriculum_init":
                with Preparation(f"dataset {dataset}: starting its curriculum composer"):
                    return dict(self.host.handle(req))
            return dict(self.host.handle(req))
        if op == "stop":
            if provider is not None:
                provider.on_stop()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}


def _produce(
    provider: DataProviderBase, layout: DatasetLayout, req: dict[str, Any]
) -> dict[str, Any]:
    split, seq, state = req["split"], req["seq"], req.get("state")
    set_weight_changes(provider, split, req.get("overrides"))
    forward = None
    if state is not None:
        forward = provider.state_dict(split)
        provider.load_state_dict(split, state)
    before = provider.state_dict(split)
    published = None
    if req.get("publish", True):
        directory = layout.files_dir(split, candidates=req.get("into") == "candidates")
        published = provider.produce_file(split, seq, directory)
        epoch_starts = published.epoch_starts
    else:  # the stream moves past seq; bytes dropped
        epoch_starts = provider.make_file(split, seq).epoch_starts
    # A mixture's epoch starts are facts of its sources' streams: recorded for an advance too.
    record_epoch_starts(layout, split, seq, epoch_starts)
    after = provider.state_dict(split)
    if forward is not None:
        provider.load_state_dict(split, forward)
    if published is None:
        return {
            "ok": True,
            "seq": seq,
            "name": "",
            "bytes": 0,
            "crc": 0,
            "before": before,
            "after": after,
        }
    return produced_reply(seq, published, before, after)
