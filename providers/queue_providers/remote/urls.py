"""URLs as config values, and as text may show them: without their secrets.

A URL may carry user info or a pre-signed query (X-Amz-Security-Token, X-Amz-Signature, a SAS
token, ...). It is used as given, but every text batchqueue makes of it (errors, logs, stats,
inputs.json, meta) shows user info and query values as `***`. The text of an error often comes
from a client library, which writes the URL as *it* sent it: aiohttp and yarl decode `%2F` to
`/`, botocore quotes again. So `scrub` looks for each secret in its raw, decoded and re-encoded
forms, and then, whatever the encoding, replaces the query of any URL in the text that points at
the same host.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qsl, quote, quote_plus, unquote, unquote_plus, urlsplit, urlunsplit

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# What ends a URL inside a message: white space, quotes, brackets.
_URL_END = r"\s'\"<>()\[\]{}|\\,"
# A query value shorter than this is too common a string to hunt for in text (v=2); the
# query-of-the-host rule still hides it.
_MIN_SECRET_CHARS = 3
_UNPARSABLE = "<a URL that cannot be parsed>"


def is_url(value: object) -> bool:
    """Whether a config value names a URL (scheme://...) rather than a local path; file://
    URLs count as local (see local_path)."""
    return isinstance(value, str) and bool(_URL_RE.match(value)) and not _is_file_url(value)


def looks_like_url(name: str) -> bool:
    """Whether `name` starts with a scheme:// (file:// included)."""
    return bool(_URL_RE.match(name))


def _is_file_url(value: str) -> bool:
    return value[:7].lower() == "file://"


def local_path(value: str) -> Path:
    """A config path as a local Path: ~ expanded, file:// stripped."""
    return Path(value[7:] if _is_file_url(value) else value).expanduser()


def protocol_of(url: str) -> str:
    """The URL's scheme, lower case, with the aliases fsspec treats alike folded together."""
    scheme = url.split("://", 1)[0].lower()
    return {"s3a": "s3", "gcs": "gs", "https": "http"}.get(scheme, scheme)


def redact(url: str) -> str:
    """`url` as it may be shown or stored: user info and every query value replaced by ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _UNPARSABLE
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = parts.query
    if query:
        names = [name for name, _ in parse_qsl(query, keep_blank_values=True)]
        query = "&".join(f"{name}=***" for name in names) if names else "***"
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _encodings(secret: str) -> set[str]:
    """`secret` as a client may write it: raw, percent-decoded, and quoted again."""
    found = set()
    for base in {secret, unquote(secret), unquote_plus(secret)}:
        found.add(base)
        for safe in ("", "/", "/=", "/+=", "/:=+@", "=+"):
            found.add(quote(base, safe=safe))
        found.add(quote_plus(base))
        found.add(quote_plus(base, safe="/"))
        found.add(quote_plus(base, safe="/="))
    return {s for s in found if len(s) >= _MIN_SECRET_CHARS}


def secrets_of(url: str) -> set[str]:
    """Every string `url`'s secrets (its user info, its query and each query value) may appear
    as in a message."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return {url}
    raw: set[str] = set()
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        raw |= {userinfo, *userinfo.split(":", 1)}
    if parts.query:
        raw.add(parts.query)
        for pair in parts.query.split("&"):
            raw.add(pair.partition("=")[2])
        raw |= {v for _, v in parse_qsl(parts.query, keep_blank_values=True)}
    found: set[str] = set()
    for secret in raw:
        if len(secret) >= _MIN_SECRET_CHARS:
            found |= _encodings(secret)
    return found


def _hidden_query(query: str) -> str:
    """A query as shown: kept when every value already reads ***, else *** whole."""
    pairs = parse_qsl(query, keep_blank_values=True)
    if pairs and all(value == "***" for _, value in pairs):
        return query
    return "***"


def scrub(text: str, url: str) -> str:
    """`text` (a library's error message) with `url`'s secrets replaced, in any encoding:
    the URL itself by its redacted form, each secret by ***, and then the query of any URL of
    the same host (as a client may have rewritten it) by ***."""
    shown = redact(url)
    text = text.replace(url, shown)
    for secret in sorted(secrets_of(url), key=len, reverse=True):
        if secret not in shown:
            text = text.replace(secret, "***")
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return text
    if not host:
        return text
    host_re = re.escape(host)
    if parts.query:
        # Any URL of this host in the text: its query hidden, whatever encoding it is in.
        text = re.sub(
            rf"({host_re}[^{_URL_END}?]*)\?([^{_URL_END}]*)",
            lambda m: f"{m.group(1)}?{_hidden_query(m.group(2))}",
            text,
            flags=re.IGNORECASE,
        )
    if "@" in parts.netloc:
        text = re.sub(rf"[^{_URL_END}/@]+@({host_re})", r"***@\1", text, flags=re.IGNORECASE)
    return text
