"""Requests to a store, each bounded in time, and range reads pinned to one object version.

`bounded` runs one fsspec call within the time given: fsspec's async filesystems (http, s3,
gs) get the call cancelled when the time runs out, so neither a silent endpoint nor one that
trickles bytes holds a read past it. A filesystem without an async core (hf://) is called on a
thread that is abandoned when the time runs out.

`read_range` reads bytes of the one version of an object its identity names. Over http(s) it
sends `If-Match: <ETag>` and checks the ETag of the answer; over s3 it asks for the version id
(with version_aware) or checks the answer's, or sends IfMatch and checks the answer's ETag. A server that has since replaced the object
answers 412 or with another ETag, and the read raises ObjectChanged: a file made of two
versions is never possible, whether or not the server honours If-Match.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from queue_providers.remote.failures import ObjectChanged, chain, status_of
from queue_providers.remote.identity import etag_of, same_etag, version_of

# Protocols whose every read is pinned to the recorded version (the others are checked once
# per opened file, before its first fetch).
PINNED_PROTOCOLS = frozenset({"http", "s3"})


def bounded(fs: Any, method: str, *args: Any, seconds: float, **kwargs: Any) -> Any:
    """fs.<method>(*args, **kwargs) within `seconds`: cancelled where fs is async; else run
    on a thread of its own and abandoned (TimeoutError) when the time is up."""
    if getattr(fs, "async_impl", False) and hasattr(fs, f"_{method}"):
        from fsspec.asyn import sync

        return sync(fs.loop, getattr(fs, f"_{method}"), *args, timeout=seconds, **kwargs)
    return _on_a_thread(lambda: getattr(fs, method)(*args, **kwargs), seconds)


def _on_a_thread(call: Callable[[], Any], seconds: float) -> Any:
    """call() on a daemon thread, waited for `seconds`. A sync client cannot be cancelled, so
    one that never returns is left behind (its own socket timeouts end it eventually)."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="remote-request", daemon=True).start()
    if not done.wait(seconds):
        raise TimeoutError(f"no answer within {seconds:.1f}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def read_range(
    fs: Any, protocol: str, path: str, start: int, end: int, identity: str, seconds: float
) -> bytes:
    """Bytes [start, end) of the object at `path` as `identity` names it, within `seconds`."""
    if getattr(fs, "async_impl", False):
        from fsspec.asyn import sync

        if protocol == "http":
            return sync(fs.loop, _http_range, fs, path, start, end, identity, timeout=seconds)
        if protocol == "s3":
            return sync(fs.loop, _s3_range, fs, path, start, end, identity, timeout=seconds)
    return bytes(bounded(fs, "cat_file", path, start=start, end=end, seconds=seconds))


async def _http_range(fs: Any, url: str, start: int, end: int, identity: str) -> bytes:
    kwargs = dict(fs.kwargs)
    headers = dict(kwargs.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    etag = etag_of(identity)
    if etag:
        headers["If-Match"] = etag
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **kwargs) as answer:
        found = answer.headers.get("ETag", "")
        if answer.status == 412:
            raise ObjectChanged(identity, f"etag:{found}" if found else "")
        if answer.status == 404:
            raise FileNotFoundError(url)
        answer.raise_for_status()
        if etag and not (found and same_etag(found, etag)):
            raise ObjectChanged(identity, f"etag:{found}" if found else "no ETag")
        modified = identity.partition(":")[2] if identity.startswith("modified:") else None
        now = answer.headers.get("Last-Modified")
        if modified and now and now != modified:
            raise ObjectChanged(identity, f"modified:{now}")
        return bytes(await answer.read())


async def _s3_range(fs: Any, path: str, start: int, end: int, identity: str) -> bytes:
    bucket, key, listed_version = fs.split_path(path)
    request: dict[str, Any] = {"Range": f"bytes={start}-{end - 1}"}
    version = version_of(identity) or listed_version
    etag = etag_of(identity)
    if version and getattr(fs, "version_aware", False):
        # Asking for an old version needs s3:GetObjectVersion: only where the user chose
        # version_aware; otherwise the answer's version id is checked below.
        request["VersionId"] = version
    if etag:
        request["IfMatch"] = etag
    # s3fs's public reads take no IfMatch; its _call_s3 keeps its client, region and
    # credentials handling (the one private name of another package used here).
    try:
        answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, **request)
    except Exception as exc:
        if any(status_of(e) == 412 or "PreconditionFailed" in str(e) for e in chain(exc)):
            raise ObjectChanged(identity, "") from None
        raise
    try:
        data = await answer["Body"].read()
    finally:
        answer["Body"].close()
    found = answer.get("ETag") or ""
    if etag and found and not same_etag(found, etag):
        raise ObjectChanged(identity, f"etag:{found}")
    found_version = answer.get("VersionId")
    if version and found_version and found_version != version:
        raise ObjectChanged(identity, f"version:{found_version}")
    return bytes(data)
