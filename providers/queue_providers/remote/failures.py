"""What a failed request means (worth asking again or not), and the bounded retry loop.

Every request to a store goes through `retry`: each attempt is given only the time left of
`retry_seconds` (fsspec's async filesystems cancel it when that runs out), so an endpoint that
accepts a connection and never answers, or trickles a byte now and then, fails the request
within `retry_seconds` of its first try, naming the URL. Exceptions are recognised by class
name, so no client library is imported to test for them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from queue_client.errors import ConfigError
from queue_providers.remote.urls import protocol_of, redact, scrub

T = TypeVar("T")

_FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0
# Answers worth asking again: the server was busy, overloaded or briefly gone.
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
# Exception classes that mean the request never got an answer: refused, reset or timed-out
# connections, cut-off bodies.
_TRANSIENT_NAMES = frozenset(
    {
        "ConnectionError",
        "TimeoutError",
        "ClientConnectionError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "FSTimeoutError",
        "IncompleteRead",
        "ResponseParserError",
        "HTTPClientError",
        "ConnectError",
        "ReadTimeout",
        "RemoteProtocolError",
    }
)
_TIMEOUT_NAMES = frozenset({"TimeoutError", "FSTimeoutError", "ReadTimeout", "ReadTimeoutError"})
_CREDENTIAL_HINTS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the server's "
    "environment, or ~/.aws/credentials; storage_options.anon = true for a public bucket",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS in the server's environment, or gcloud's application "
    "default credentials; storage_options.token = 'anon' for a public bucket",
    "hf": "HF_TOKEN in the server's environment, or `hf auth login`",
    "http": "credentials in the environment the server's HTTP client reads (e.g. ~/.netrc), "
    "or a pre-signed URL that has not expired",
}


class ObjectChanged(Exception):
    """An answer came from another version of the object than the one pinned (If-Match failed,
    or the answer's ETag or version differs): the file being made must fail, never mix."""

    def __init__(self, pinned: str, found: str) -> None:
        super().__init__(f"pinned {pinned}, the server now has {found or 'another version'}")
        self.pinned = pinned
        self.found = found


def where(url: str) -> str:
    """How an error names an input at a URL."""
    return f"input {redact(url)!r}"


def chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every exception it was raised from or during."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (aiohttp, botocore, requests style), if any."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if isinstance(code, int) else None
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def is_transient(exc: BaseException) -> bool:
    """Whether asking again may succeed: a busy answer, or no answer at all."""
    for e in chain(exc):
        names = _names(e)
        if any("Offline" in n or "Credentials" in n for n in names):
            return False
        status = status_of(e)
        if status is not None:
            return status in _TRANSIENT_STATUS
        if names & _TRANSIENT_NAMES:
            return True
    return False


def explain(exc: BaseException, url: str) -> str:
    """What went wrong, in the library's words (scrubbed of secrets), and what to do."""

    def said(e: BaseException) -> str:
        return f"{type(e).__name__}: {scrub(str(e), url) or 'no message'}"

    found = list(chain(exc))
    names = {n for e in found for n in _names(e)}
    statuses = {s for e in found if (s := status_of(e)) is not None}
    hint = _CREDENTIAL_HINTS.get(protocol_of(url), "the storage client's usual places")
    if "NoCredentialsError" in names or "Unable to locate credentials" in str(exc):
        return f"no credentials were found ({said(exc)}); give them through {hint}"
    if statuses & {401, 403} or "PermissionError" in names:
        code = "/".join(str(s) for s in sorted(statuses & {401, 403}))
        answered = f"the server answered {code}, " if code else ""
        return f"{answered}access was denied ({said(exc)}); check the credentials ({hint})"
    if is_transient(exc):
        busy = [e for e in found if status_of(e) in _TRANSIENT_STATUS]
        if busy:
            return f"the server answered {status_of(busy[0])} ({said(busy[0])})"
        silent = [e for e in found if _names(e) & _TRANSIENT_NAMES]
        return f"no answer ({said(silent[0] if silent else exc)})"
    if "FileNotFoundError" in names or 404 in statuses:
        return f"it does not exist ({said(exc)})"
    return said(exc)


def _timed_out(exc: BaseException) -> bool:
    return any(_names(e) & _TIMEOUT_NAMES for e in chain(exc))


def retry(
    what: str,
    url: str,
    call: Callable[[float], T],
    *,
    attempts: int,
    seconds: float,
) -> T:
    """call(time_left), again after a transient error with exponential backoff, at most
    `attempts` times, and never past `seconds` after the first try: `call` must give up by
    itself when its time_left runs out. ConfigError naming the URL when it gives up; an
    ObjectChanged passes through untouched."""
    began = time.monotonic()
    delay = _FIRST_BACKOFF_S
    attempt = 0
    while True:
        attempt += 1
        try:
            return call(max(0.05, seconds - (time.monotonic() - began)))
        except (ConfigError, ObjectChanged):
            raise
        except Exception as exc:
            spent = time.monotonic() - began
            wait = delay * random.uniform(0.5, 1.0)
            transient = is_transient(exc)
            if not transient or attempt >= attempts or spent + wait > seconds:
                if transient and _timed_out(exc):
                    cause = (
                        f"no answer within the {seconds:g}s of retry_seconds ({type(exc).__name__})"
                    )
                else:
                    cause = explain(exc, url)
                tried = (
                    f" (still failing after {attempt} attempt(s) over {spent:.1f}s)"
                    if transient
                    else ""
                )
                raise ConfigError(f"{where(url)} cannot be {what}: {cause}{tried}") from None
            time.sleep(wait)
            delay = min(delay * 2, _MAX_BACKOFF_S)
