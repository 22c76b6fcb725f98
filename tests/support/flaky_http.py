"""A real HTTP file server for the tests, that answers 503 to the first requests it is told to.

    with FlakyFileServer({"corpus.jsonl": data}, fail_first=2) as server:
        url = server.url("corpus.jsonl")   # http://127.0.0.1:PORT/corpus.jsonl
        ...
        server.statuses                    # [503, 503, 200, 206, ...], one per request

It serves HEAD and GET with byte ranges (206) and a strong ETag per file, as object stores
and CDNs do, from a thread of the test process; queue-server processes reach it over TCP.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import urlsplit


class FlakyFileServer:
    def __init__(self, files: Mapping[str, bytes], fail_first: int = 0) -> None:
        self.files = dict(files)
        self.fail_left = fail_first
        self.statuses: list[int] = []
        self.paths: list[str] = []  # each request's path and query, as the client sent it
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def fail_next(self, n: int) -> None:
        with self._lock:
            self.fail_left = n

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)

    def __enter__(self) -> FlakyFileServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        with self._lock:
            self.paths.append(handler.path)
            failing = self.fail_left > 0
            if failing:
                self.fail_left -= 1
        name = urlsplit(handler.path).path.lstrip("/")
        data = self.files.get(name)
        if failing:
            status, payload, headers = 503, b"busy", {}
        elif data is None:
            status, payload, headers = 404, b"not found", {}
        else:
            etag = '"' + hashlib.sha256(data).hexdigest()[:20] + '"'
            headers = {"ETag": etag, "Accept-Ranges": "bytes"}
            status, payload = 200, data
            wanted = handler.headers.get("Range")
            if wanted and wanted.startswith("bytes="):
                first, _, last = wanted[6:].partition("-")
                start = int(first)
                stop = min(int(last) + 1 if last else len(data), len(data))
                status, payload = 206, data[start:stop]
                headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
        with self._lock:
            self.statuses.append(status)
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        if body:
            handler.wfile.write(payload)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self) -> None:
                server._answer(self, body=False)

            def do_GET(self) -> None:
                server._answer(self, body=True)

            def log_message(self, format: str, *args: object) -> None:
                pass  # the statuses list is the log

        return Handler
