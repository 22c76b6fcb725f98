"""HTTP endpoints that misbehave on purpose, served from threads of the test process.

    with ObjectServer({"c.jsonl": data}) as http:
        http.status = 403                      # every answer from now on: 403
        http.status_of["c.jsonl"] = 401        # every answer about c.jsonl: 401
        http.swap_after("c.jsonl", 1, other)   # after 1 ranged GET, the object is `other`
        http.trickle = True                    # GET bodies arrive one byte per 0.2 s
        http.honour_if_match = False           # If-Match ignored, as some servers do

    with silent_endpoint() as url: ...         # accepts TCP connections and never answers

ObjectServer serves HEAD and GET with byte ranges (206) and a strong ETag per version of each
file, as object stores and CDNs do, and answers 412 to an If-Match naming another version.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import urlsplit

TRICKLE_PAUSE_S = 0.2


def etag_of(data: bytes) -> str:
    return '"' + hashlib.sha256(data).hexdigest()[:20] + '"'


class ObjectServer:
    def __init__(self, files: Mapping[str, bytes]) -> None:
        self.files = dict(files)
        self.status: int | None = None  # every answer, when set
        self.status_of: dict[str, int] = {}  # the answer for one file, when set
        self.trickle = False
        self.honour_if_match = True
        self.requests: list[tuple[str, str, int]] = []  # (method, path and query, status)
        self._swaps: dict[str, tuple[int, bytes]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def swap_after(self, name: str, gets: int, data: bytes) -> None:
        """Replace `name` by `data` once `gets` more ranged GETs of it have been answered."""
        with self._lock:
            self._swaps[name] = (gets, data)

    def stop(self) -> None:
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)

    def __enter__(self) -> ObjectServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        name = urlsplit(handler.path).path.lstrip("/")
        with self._lock:
            data = self.files.get(name)
            forced = self.status_of.get(name, self.status)
        headers: dict[str, str] = {}
        if forced is not None:
            status, payload = forced, b"<Error><Code>AccessDenied</Code></Error>"
        elif data is None:
            status, payload = 404, b"not found"
        else:
            etag = etag_of(data)
            headers = {"ETag": etag, "Accept-Ranges": "bytes"}
            status, payload = 200, data
            wanted = handler.headers.get("Range")
            match = handler.headers.get("If-Match")
            if match and self.honour_if_match and match != etag:
                status, payload = 412, b"precondition failed"
            elif wanted and wanted.startswith("bytes="):
                first, _, last = wanted[6:].partition("-")
                start = int(first)
                stop = min(int(last) + 1 if last else len(data), len(data))
                status, payload = 206, data[start:stop]
                headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
                self._count_get(name)
        with self._lock:
            self.requests.append((handler.command, handler.path, status))
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        if not body:
            return
        if self.trickle and status in (200, 206):
            for i in range(len(payload)):
                if self._stopping.wait(TRICKLE_PAUSE_S):
                    return
                try:
                    handler.wfile.write(payload[i : i + 1])
                    handler.wfile.flush()
                except OSError:
                    return
        else:
            handler.wfile.write(payload)

    def _count_get(self, name: str) -> None:
        with self._lock:
            swap = self._swaps.get(name)
            if swap is None:
                return
            left, data = swap
            if left <= 1:
                self.files[name] = data
                del self._swaps[name]
            else:
                self._swaps[name] = (left - 1, data)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self) -> None:
                server._answer(self, body=False)

            def do_GET(self) -> None:
                server._answer(self, body=True)

            def log_message(self, format: str, *args: object) -> None:
                pass  # `requests` is the log

        return Handler


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """An http:// base URL whose port completes TCP handshakes (the kernel's backlog) and
    never sends a byte."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
