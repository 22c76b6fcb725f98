"""Provider inputs where the data lives: fsspec URLs (s3://, gs://, https://, hf://, ...).

A provider input that is a path may also be a URL. This module is the one place that talks to
fsspec, so every reader gets the same four things:

  - open: `RemoteObject.open()` is a seekable binary file that fetches the object in blocks of
    `block_bytes` as they are read (JSONL and text stream through it; pyarrow reads Parquet
    footers and row groups through it), so nothing is downloaded whole unless a provider must
    memory-map it (`RemoteStore.local_copy`).
  - identity: each object's version, ETag or content hash and its size (from fsspec info()),
    which queue_providers.inputs fingerprints like a local file's sha256.
  - cache: blocks and local copies are kept under the dataset's input cache directory
    (layout.input_cache_dir), at most `cache_bytes` of them, least recently used evicted. An
    entry's name carries the object's identity, so a changed object never reads stale blocks.
  - retry: a transient error (a 5xx or 429 answer, a timeout, a refused or reset connection) is
    tried again with exponential backoff, at most `attempts` times within `retry_seconds`.

Credentials come from where each storage's own client finds them (the environment, its config
files), never from batchqueue's config: `storage_options` refuses credential-like keys, and
every URL this module shows (errors, inputs.json, meta) has its user info and query values
replaced by `***`. fsspec is the optional extra `batchqueue[remote]`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, TypeVar
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from queue_client.errors import ConfigError
from queue_client.layout import (
    atomic_write,
    input_cache_file,
    is_temp_name,
    process_alive,
    temp_owner_pid,
    temp_path,
)

T = TypeVar("T")

EXTRA_HINT = "pip install 'batchqueue[remote]'"
DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_BLOCK_BYTES = 4 << 20
DEFAULT_ATTEMPTS = 5
DEFAULT_RETRY_SECONDS = 30.0
# The identity of an object whose server gives no version, ETag or date: its content's sha256.
CONTENT_HASH = "content-sha256:"
SETTINGS_KEYS = ("storage_options", "cache_bytes", "block_bytes", "attempts", "retry_seconds")

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0
# Answers worth asking again: the server was busy, overloaded or briefly gone.
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
# Exception classes (by name, so no client library is imported to test for them) that mean the
# request never got an answer: refused, reset or timed-out connections, cut-off bodies.
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
# Values of a credential key that name a way to find credentials, not a secret (gcsfs's token).
_CREDENTIAL_METHODS = frozenset({"anon", "google_default", "cloud"})
# Key names that hold credentials; storage_options never may (see check_storage_options).
_SECRET_WORDS = (
    "secret",
    "token",
    "password",
    "passwd",
    "credential",
    "private",
    "auth",
    "signature",
    "cookie",
    "access_key",
)
# Defaults a protocol gets unless storage_options sets them: batchqueue does the retrying (so
# the total time stays bounded), and a dead endpoint is noticed in seconds, not minutes.
_S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {
        "connect_timeout": 5,
        "read_timeout": 60,
        "retries": {"total_max_attempts": 1},
    },
}
_CREDENTIAL_HINTS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the server's "
    "environment, or ~/.aws/credentials; storage_options.anon = true for a public bucket",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS in the server's environment, or gcloud's application "
    "default credentials; storage_options.token = 'anon' for a public bucket",
    "hf": "HF_TOKEN in the server's environment, or `hf auth login`",
    "http": "credentials in the environment the server's HTTP client reads (e.g. ~/.netrc)",
}


# ---- URLs -----------------------------------------------------------------------------------
def is_url(value: object) -> bool:
    """Whether a config value names a URL (scheme://...) rather than a local path; file://
    URLs count as local (see local_path)."""
    return isinstance(value, str) and bool(_URL_RE.match(value)) and not _is_file_url(value)


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
        return "<a URL that cannot be parsed>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = parts.query
    if query:
        names = [name for name, _ in parse_qsl(query, keep_blank_values=True)]
        query = "&".join(f"{name}=***" for name in names) if names else "***"
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _secrets_of(url: str) -> list[str]:
    """The parts of `url` that must not be shown: its user info and its query values."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url]
    found = [url]
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        found += [userinfo, *userinfo.split(":", 1)]
    if parts.query:
        found.append(parts.query)
        found += [v for _, v in parse_qsl(parts.query, keep_blank_values=True) if len(v) >= 3]
    return found


def scrub(text: str, url: str) -> str:
    """`text` (a library's error message) with `url` and its secret parts replaced."""
    shown = redact(url)
    for secret in sorted(set(_secrets_of(url)), key=len, reverse=True):
        if secret and secret != shown:
            text = text.replace(secret, shown if secret == url else "***")
    return text


# ---- settings -------------------------------------------------------------------------------
def check_storage_options(options: object, where: str) -> dict[str, Any]:
    """A copy of a storage_options table, refusing any key that looks like a credential."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where} must be a table of fsspec options, got {options!r}")
    _refuse_secrets(options, where)
    return dict(options)


def _refuse_secrets(table: Mapping[Any, Any], where: str) -> None:
    for key, value in table.items():
        name = str(key).lower()
        if isinstance(value, str) and value in _CREDENTIAL_METHODS:
            continue
        if name == "key" or name.endswith("key") or any(w in name for w in _SECRET_WORDS):
            raise ConfigError(
                f"{where}.{key} looks like a credential, and batchqueue takes none in its config "
                "(the config is fingerprinted, copied and logged). Give credentials the way the "
                "storage's own client reads them: the server's environment (e.g. "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, "
                "HF_TOKEN) or its config files (~/.aws/credentials, ...)"
            )
        if isinstance(value, Mapping):
            _refuse_secrets(value, f"{where}.{key}")


@dataclass(frozen=True)
class RemoteSettings:
    """How URL inputs are reached: fsspec options, the cache, the retry budget."""

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    cache_dir: Path | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES
    block_bytes: int = DEFAULT_BLOCK_BYTES
    attempts: int = DEFAULT_ATTEMPTS
    retry_seconds: float = DEFAULT_RETRY_SECONDS

    @classmethod
    def from_config(cls, table: object, *, cache_dir: Path | None, who: str) -> RemoteSettings:
        """Settings from a provider's `remote` table (None: the defaults), checked."""
        where = f"{who} remote"
        if table is None:
            table = {}
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where} must be a table with keys {list(SETTINGS_KEYS)}")
        unknown = sorted(set(table) - set(SETTINGS_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; accepted: {list(SETTINGS_KEYS)}")
        options = check_storage_options(table.get("storage_options"), f"{where}.storage_options")
        ints = {
            k: table.get(k, getattr(cls, k)) for k in ("cache_bytes", "block_bytes", "attempts")
        }
        for key, value in ints.items():
            low = 0 if key == "cache_bytes" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{where}.{key} must be an int >= {low}, got {value!r}")
        seconds = table.get("retry_seconds", DEFAULT_RETRY_SECONDS)
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
            raise ConfigError(f"{where}.retry_seconds must be a number > 0, got {seconds!r}")
        return cls(
            storage_options=options,
            cache_dir=cache_dir,
            cache_bytes=ints["cache_bytes"],
            block_bytes=ints["block_bytes"],
            attempts=ints["attempts"],
            retry_seconds=float(seconds),
        )

    def options_for(self, protocol: str) -> dict[str, Any]:
        """The fsspec options of one protocol: a key that names a protocol holds that
        protocol's own table; every other key applies to all; batchqueue's defaults below."""
        protocols = _known_protocols()
        shared = {k: v for k, v in self.storage_options.items() if k not in protocols}
        own = {}
        for name, value in self.storage_options.items():
            if name in protocols and protocol_of(f"{name}://") == protocol:
                own.update(value if isinstance(value, Mapping) else {})
        merged = _merge(_defaults(protocol), {**shared, **own})
        return merged


def _known_protocols() -> set[str]:
    try:
        import fsspec
    except ImportError:
        return {"s3", "s3a", "gs", "gcs", "http", "https", "hf", "az", "abfs", "file"}
    return set(fsspec.available_protocols())


def _defaults(protocol: str) -> dict[str, Any]:
    if protocol == "s3":
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in _S3_DEFAULTS.items()}
    if protocol == "http":
        try:
            import aiohttp
        except ImportError:
            return {}
        timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_connect=5, sock_read=60)
        return {"client_kwargs": {"timeout": timeout}}
    return {}


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


# ---- errors ---------------------------------------------------------------------------------
def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if isinstance(code, int) else None
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def is_transient(exc: BaseException) -> bool:
    """Whether asking again may succeed: a busy answer, or no answer at all."""
    for e in _chain(exc):
        names = {c.__name__ for c in type(e).__mro__}
        if any("Offline" in n or "Credentials" in n for n in names):
            return False
        status = _status(e)
        if status is not None:
            return status in _TRANSIENT_STATUS
        if names & _TRANSIENT_NAMES:
            return True
    return False


def _explain(exc: BaseException, url: str) -> str:
    """What went wrong, in the library's words (scrubbed of secrets), and what to do."""

    def said(e: BaseException) -> str:
        return f"{type(e).__name__}: {scrub(str(e), url) or 'no message'}"

    chain = list(_chain(exc))
    names = {c.__name__ for e in chain for c in type(e).__mro__}
    statuses = {s for e in chain if (s := _status(e)) is not None}
    hint = _CREDENTIAL_HINTS.get(protocol_of(url), "the storage client's usual places")
    if "NoCredentialsError" in names or "Unable to locate credentials" in str(exc):
        return f"no credentials were found ({said(exc)}); give them through {hint}"
    if statuses & {401, 403} or "PermissionError" in names:
        return f"access was denied ({said(exc)}); check the credentials ({hint}) and their rights"
    if is_transient(exc):
        busy = [e for e in chain if _status(e) in _TRANSIENT_STATUS]
        if busy:
            return f"the server answered {_status(busy[0])} ({said(busy[0])})"
        silent = [e for e in chain if {c.__name__ for c in type(e).__mro__} & _TRANSIENT_NAMES]
        return f"no answer ({said(silent[0] if silent else exc)})"
    if "FileNotFoundError" in names or 404 in statuses:
        return f"it does not exist ({said(exc)})"
    return said(exc)


def _where(url: str) -> str:
    return f"input {redact(url)!r}"


# ---- the store ------------------------------------------------------------------------------
class RemoteStore:
    """URL inputs of one provider: its settings, one fsspec filesystem per protocol, its cache."""

    def __init__(self, settings: RemoteSettings | None = None) -> None:
        self.settings = settings or RemoteSettings()
        self._filesystems: dict[str, Any] = {}
        self._lock = threading.Lock()
        s = self.settings
        self.cache = (
            BlockCache(s.cache_dir, s.cache_bytes) if s.cache_dir and s.cache_bytes > 0 else None
        )

    # ---- fsspec --------------------------------------------------------------------------------
    def filesystem(self, url: str) -> tuple[Any, str]:
        """(fsspec filesystem, path within it) for `url`; ConfigError naming the URL and the
        package to install when fsspec or the protocol's implementation is missing."""
        try:
            import fsspec
            from fsspec.core import split_protocol
        except ImportError:
            raise ConfigError(
                f"{_where(url)} is a URL, and reading URLs needs fsspec: {EXTRA_HINT}"
            ) from None
        protocol = protocol_of(url)
        with self._lock:
            fs = self._filesystems.get(protocol)
            if fs is None:
                scheme = split_protocol(url)[0] or protocol
                try:
                    cls = fsspec.get_filesystem_class(scheme)
                except ValueError:
                    raise ConfigError(
                        f"{_where(url)}: fsspec knows no URL scheme {scheme!r}; use s3://, "
                        "gs://, https://, hf:// or the scheme of another installed fsspec "
                        "implementation"
                    ) from None
                except ImportError as exc:
                    raise ConfigError(
                        f"{_where(url)}: the {scheme}:// protocol needs a package that is not "
                        f"installed ({exc}); {EXTRA_HINT} installs s3fs, gcsfs and aiohttp"
                    ) from None
                try:
                    fs = cls(**self.settings.options_for(protocol))
                except Exception as exc:
                    raise ConfigError(
                        f"{_where(url)}: the {scheme}:// filesystem refused storage_options: "
                        f"{type(exc).__name__}: {scrub(str(exc), url)}"
                    ) from None
                if protocol == "s3" and hasattr(fs, "retries"):
                    fs.retries = 1  # s3fs's own retry loop: batchqueue's bounds the time
                self._filesystems[protocol] = fs
        return fs, fs._strip_protocol(url)

    def retry(self, what: str, url: str, call: Callable[[], T]) -> T:
        """call(), again after a transient error with exponential backoff, within the
        attempts and seconds of the settings; ConfigError naming the URL when it gives up."""
        s = self.settings
        began = time.monotonic()
        delay = _FIRST_BACKOFF_S
        attempt = 0
        while True:
            attempt += 1
            try:
                return call()
            except ConfigError:
                raise
            except Exception as exc:
                spent = time.monotonic() - began
                wait = delay * random.uniform(0.5, 1.0)
                if not is_transient(exc) or attempt >= s.attempts or spent + wait > s.retry_seconds:
                    tried = (
                        f" (still failing after {attempt} attempt(s) over {spent:.1f}s)"
                        if is_transient(exc)
                        else ""
                    )
                    raise ConfigError(
                        f"{_where(url)} cannot be {what}: {_explain(exc, url)}{tried}"
                    ) from None
                time.sleep(wait)
                delay = min(delay * 2, _MAX_BACKOFF_S)

    # ---- objects -------------------------------------------------------------------------------
    def info(self, url: str) -> dict[str, Any]:
        """fsspec's info() of `url` as the server says it now (never from a listing fsspec
        cached), retried; ConfigError naming the URL when it fails."""
        fs, path = self.filesystem(url)
        with contextlib.suppress(Exception):
            fs.invalidate_cache(path)
        return dict(self.retry("read", url, lambda: fs.info(path)))

    def stat(self, url: str) -> RemoteObject:
        """The object at `url`, with its size and identity; ConfigError when it is missing,
        unreadable or not a file."""
        info = self.info(url)
        if info.get("type") == "directory":
            raise ConfigError(f"{_where(url)} is a directory, not a file")
        return self._object(url, info)

    def expand(self, url: str, suffixes: Sequence[str] = ()) -> list[RemoteObject]:
        """The objects `url` names, sorted by URL: one object, every object under a
        directory (only those ending in `suffixes`, when given, and not hidden), or those a
        glob (`*` or `[` in the URL's path) matches (maybe none). ConfigError naming the URL
        when it does not exist or cannot be reached."""
        fs, path = self.filesystem(url)
        base = url.split("://", 1)[0]
        if any(c in urlsplit(url).path for c in "*["):
            found = self.retry("listed", url, lambda: fs.glob(path, detail=True))
            infos = [i for i in found.values() if i.get("type") != "directory"]
        else:
            info = self.info(url)
            if info.get("type") != "directory":
                return [self._object(url, info)]
            found = self.retry("listed", url, lambda: fs.find(path, detail=True))
            infos = [
                i
                for i in found.values()
                if i.get("type") != "directory"
                and not PurePosixPath(str(i["name"])).name.startswith(".")
                and (not suffixes or PurePosixPath(str(i["name"])).suffix.lower() in suffixes)
            ]
        objects = [self._object(_unstrip(base, str(i["name"])), i) for i in infos]
        return sorted(objects, key=lambda o: o.url)

    def _object(self, url: str, info: Mapping[str, Any]) -> RemoteObject:
        size = info.get("size")
        if not isinstance(size, int) or size < 0:
            raise ConfigError(
                f"{_where(url)}: the server does not say how large it is (no size in its "
                "answer), so it cannot be read in ranges"
            )
        identity = object_identity(info)
        obj = RemoteObject(url, size, identity, self)
        if not identity:  # no version, ETag or date: the content itself is the identity
            digest = hashlib.sha256()
            with obj.open(check=False) as f:
                while chunk := f.read(self.settings.block_bytes):
                    digest.update(chunk)
            obj = RemoteObject(url, size, f"{CONTENT_HASH}{digest.hexdigest()}", self)
        return obj

    # ---- bytes ---------------------------------------------------------------------------------
    def block(self, obj: RemoteObject, index: int, before_fetch: Callable[[], None]) -> bytes:
        """Block `index` of `obj` (block_bytes long, the last one shorter), from the cache or
        fetched (calling before_fetch() first)."""
        size = self.settings.block_bytes
        start = index * size
        end = min(start + size, obj.size)
        name = f"blk-{obj.key}-{index:08d}"
        if self.cache is not None:
            cached = self.cache.get(name, end - start)
            if cached is not None:
                return cached
        before_fetch()
        data = self.fetch(obj, start, end)
        if self.cache is not None:
            self.cache.put(name, data)
        return data

    def fetch(self, obj: RemoteObject, start: int, end: int) -> bytes:
        """Bytes [start, end) of `obj` from the server, retried on transient errors."""
        if end <= start:
            return b""
        fs, path = self.filesystem(obj.url)
        kwargs: dict[str, Any] = {}
        if obj.identity.startswith("version:") and getattr(fs, "version_aware", False):
            kwargs["version_id"] = obj.identity.partition(":")[2]

        def call() -> bytes:
            return bytes(fs.cat_file(path, start=start, end=end, **kwargs))

        data = self.retry("read", obj.url, call)
        if len(data) == obj.size and end - start != obj.size:
            data = data[start:end]  # a server that ignores Range sends the whole object
        if len(data) != end - start:
            raise ConfigError(
                f"{obj.where}: asked for bytes {start}-{end} and got {len(data)} bytes: the "
                "object is shorter than when it was listed (it changed)"
            )
        return data

    def local_copy(self, obj: RemoteObject) -> Path:
        """The whole object as a local file in the input cache, for a reader that must
        memory-map it or open it by path. Downloaded once per identity; counted in
        cache_bytes like the blocks, so it must fit there."""
        s = self.settings
        if s.cache_dir is None:
            raise ConfigError(f"{obj.where} must be copied to local disk but there is no cache dir")
        if obj.size > s.cache_bytes:
            raise ConfigError(
                f"{obj.where} is {obj.size} bytes and is read from a local copy, which must fit "
                f"in the input cache: raise remote.cache_bytes (now {s.cache_bytes}) above it"
            )
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", obj.name)[:80].lstrip("._-") or "object"
        path = input_cache_file(s.cache_dir, f"file-{obj.key}-{safe}")
        with contextlib.suppress(OSError):
            if path.stat().st_size == obj.size:
                os.utime(path)
                return path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.check_unchanged(obj)

        def write(f: BinaryIO) -> None:
            for start in range(0, obj.size, s.block_bytes):
                f.write(self.fetch(obj, start, min(start + s.block_bytes, obj.size)))

        atomic_write(path, write)
        if self.cache is not None:
            self.cache.evict(keep=path)
        return path

    def check_unchanged(self, obj: RemoteObject) -> None:
        """ConfigError when the object's size or identity moved since it was listed: its
        blocks would mix two versions of the object. (An object known by a hash of its
        content alone is checked by its size: hashing it again would read it whole.)"""
        info = self.info(obj.url)
        size, identity = info.get("size"), _same_kind(info, obj.identity)
        if obj.identity.startswith(CONTENT_HASH) and not identity:
            identity = obj.identity
        if (size, identity) != (obj.size, obj.identity):
            raise ConfigError(
                f"{obj.where} changed while being read: {obj.size} bytes, {obj.identity} when "
                f"the dataset started; {size} bytes, {identity or 'no identity'} now. Restore "
                "it, or rebuild the dataset (`queue-server reset NAME`)"
            )


def _unstrip(base: str, name: str) -> str:
    """A listed object's name (fsspec strips the scheme) as a URL of the scheme given."""
    if _URL_RE.match(name):
        return name
    return f"{base}://{name.lstrip('/')}"


def object_identity(info: Mapping[str, Any]) -> str:
    """What says which version of an object fsspec's info() describes: a version id, a content
    hash, an ETag, or a modification time, in that order of preference; "" when none."""
    found = _identities(info)
    return found[0] if found else ""


def _identities(info: Mapping[str, Any]) -> list[str]:
    """Every identity `info` holds, as "kind:value", most preferred first. A listing and a
    HEAD of the same object may not hold the same kinds (a HEAD adds the version id)."""
    lower = {str(k).lower(): v for k, v in info.items()}
    found = []

    def present(value: Any) -> bool:
        return value not in (None, "", "null")

    for key in ("versionid", "version_id", "generation"):
        if present(lower.get(key)):
            found.append(f"version:{lower[key]}")
    lfs = lower.get("lfs")
    if isinstance(lfs, Mapping) and present(lfs.get("sha256")):
        found.append(f"sha256:{lfs['sha256']}")
    for key, tag in (
        ("etag", "etag"),
        ("md5hash", "md5"),
        ("content-md5", "md5"),
        ("crc32c", "crc32c"),
        ("blob_id", "blob"),
        ("checksum", "checksum"),
        ("digest", "digest"),
    ):
        if present(lower.get(key)):
            found.append(f"{tag}:{str(lower[key]).strip()}")
    for key in ("last-modified", "lastmodified", "last_modified", "updated", "mtime"):
        if present(lower.get(key)):
            found.append(f"modified:{lower[key]}")
    return found


def _same_kind(info: Mapping[str, Any], listed: str) -> str:
    """The identity of `info` of the kind `listed` is (etag, version, ...), else its first."""
    kind = listed.partition(":")[0] + ":"
    found = _identities(info)
    return next((i for i in found if i.startswith(kind)), found[0] if found else "")


# ---- one object -----------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RemoteObject:
    """One object at a URL, as it was when listed. Shown (str, repr, errors) without secrets."""

    url: str
    size: int
    identity: str
    store: RemoteStore = field(repr=False)

    @property
    def shown(self) -> str:
        return redact(self.url)

    @property
    def where(self) -> str:
        return _where(self.url)

    @property
    def name(self) -> str:
        return PurePosixPath(urlsplit(self.url).path).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    @property
    def key(self) -> str:
        """The object's cache key: its shown URL, identity and size, hashed."""
        blob = f"{self.shown}\0{self.identity}\0{self.size}".encode()
        return hashlib.sha256(blob).hexdigest()[:24]

    def open(self, *, check: bool = True) -> RemoteFile:
        return RemoteFile(self, check=check)

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:
        return f"RemoteObject({self.shown!r}, size={self.size}, identity={self.identity!r})"


class RemoteFile(io.RawIOBase):
    """A seekable, read-only binary file over a RemoteObject, a block at a time.

    The first block that must be fetched (not found in the cache) first checks that the object
    is still the one listed, so blocks of two versions are never mixed in one open."""

    _KEEP_BLOCKS = 2  # the current block and the one before: a reader backing up a little

    def __init__(self, obj: RemoteObject, *, check: bool = True) -> None:
        super().__init__()
        self._obj = obj
        self._pos = 0
        self._blocks: dict[int, bytes] = {}
        self._checked = not check
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._obj.shown

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._obj.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def size(self) -> int:
        return self._obj.size

    def _check(self) -> None:
        if not self._checked:
            self._obj.store.check_unchanged(self._obj)
            self._checked = True

    def _block(self, index: int) -> bytes:
        data = self._blocks.get(index)
        if data is None:
            data = self._obj.store.block(self._obj, index, self._check)
            self._blocks[index] = data
            while len(self._blocks) > self._KEEP_BLOCKS:
                self._blocks.pop(next(iter(self._blocks)))
        return data

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        with self._lock:
            want = min(len(out), max(0, self._obj.size - self._pos))
            done = 0
            bs = self._obj.store.settings.block_bytes
            while done < want:
                index, offset = divmod(self._pos, bs)
                block = self._block(index)
                n = min(want - done, len(block) - offset)
                out[done : done + n] = block[offset : offset + n]
                done += n
                self._pos += n
            return done

    def readall(self) -> bytes:
        return self.read(max(0, self._obj.size - self._pos)) or b""


# ---- the cache ------------------------------------------------------------------------------
class BlockCache:
    """Files in one directory, at most max_bytes together, least recently used evicted.

    Recency is the file's mtime (touched on every hit), so the worker processes of a dataset
    share one cache without a lock: each insert scans the directory and evicts the oldest
    until the total fits. An entry is renamed into place whole, never seen half-written."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes

    def get(self, name: str, size: int) -> bytes | None:
        path = input_cache_file(self.directory, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        if len(data) != size:  # cut short by a power cut (entries are not fsynced): fetch again
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        return data

    def put(self, name: str, data: bytes) -> None:
        """Keep `data` as entry `name`: written under a temp name and renamed, so readers see
        it whole or not at all. Not fsynced: an entry lost to a power cut is fetched again,
        and one cut short is refused by get()'s length check."""
        if len(data) > self.max_bytes:
            return
        path = input_cache_file(self.directory, name)
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(path)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.evict(keep=path)

    def evict(self, keep: Path | None = None) -> None:
        """Delete the least recently used files until the rest fit in max_bytes; also the
        temp files of processes that died while writing here."""
        entries = []
        try:
            scan = list(os.scandir(self.directory))
        except FileNotFoundError:
            return
        for entry in scan:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if is_temp_name(entry.name):
                pid = temp_owner_pid(entry.name)
                if pid is not None and not process_alive(pid):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                continue
            entries.append((st.st_mtime_ns, entry.path, st.st_size))
        total = sum(size for _, _, size in entries)
        for _, path, size in sorted(entries):
            if total <= self.max_bytes:
                break
            if keep is not None and path == str(keep):
                continue
            with contextlib.suppress(OSError):
                os.unlink(path)
            total -= size

    def total_bytes(self) -> int:
        try:
            return sum(
                e.stat().st_size for e in os.scandir(self.directory) if not is_temp_name(e.name)
            )
        except FileNotFoundError:
            return 0


# ---- a path at a URL ------------------------------------------------------------------------
class RemotePath:
    """A URL used where providers use a Path: `/` joins a name, and is_file, is_dir,
    stat().st_size, read_bytes and name work as they do on a Path (is_file and stat list the
    object once). Shown (str, repr) without secrets. `object()` is the RemoteObject."""

    def __init__(self, url: str, store: RemoteStore) -> None:
        self.url = url
        self.store = store
        self._listed: RemoteObject | None = None

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url.rstrip('/')}/{name}", self.store)

    @property
    def name(self) -> str:
        return PurePosixPath(urlsplit(self.url).path).name

    def object(self) -> RemoteObject:
        """The object at this URL (listed on first use); ConfigError naming it if missing."""
        if self._listed is None:
            self._listed = self.store.stat(self.url)
        return self._listed

    def _info(self) -> dict[str, Any] | None:
        try:
            return self.store.info(self.url)
        except ConfigError as exc:
            if "does not exist" in str(exc):
                return None
            raise

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") != "directory"

    def is_dir(self) -> bool:
        """A directory, or an object-store prefix (which exists only while objects lie under
        it); ConfigError, not False, when the store cannot be reached. An http(s) URL names
        no directory to ask about: it counts as one, and its files are checked one by one."""
        if protocol_of(self.url) == "http":
            return True
        info = self._info()
        return info is not None and info.get("type") == "directory"

    def stat(self) -> os.stat_result:
        return os.stat_result((0, 0, 0, 0, 0, 0, self.object().size, 0, 0, 0))

    def read_bytes(self) -> bytes:
        return read_input(self.object())

    def __str__(self) -> str:
        return redact(self.url)

    def __repr__(self) -> str:
        return f"RemotePath({redact(self.url)!r})"


# ---- local or remote ------------------------------------------------------------------------
Location = Path | RemoteObject


def store_for(remote: object, cache_dir: Path | None, who: str) -> RemoteStore:
    """The store of a provider's URL inputs, from its `remote` config table."""
    return RemoteStore(RemoteSettings.from_config(remote, cache_dir=cache_dir, who=who))


def resolve(value: str, store: RemoteStore | None) -> Location:
    """A config path or URL as a Location: a RemoteObject (listed now) or a local Path."""
    if is_url(value):
        return (store or RemoteStore()).stat(value)
    return local_path(value)


def input_path(value: str, store: RemoteStore | None) -> Path | RemotePath:
    """A config path or URL as a Path, or a RemotePath that behaves like one (nothing is
    listed yet)."""
    if is_url(value):
        return RemotePath(value, store or RemoteStore())
    return local_path(value)


def read_text(location: Location | RemotePath) -> str:
    """A text input's characters as Path.read_text(encoding="utf-8", errors="replace")
    reads them: invalid bytes replaced, every line break made "\\n"."""
    if isinstance(location, Path):
        return location.read_text(encoding="utf-8", errors="replace")
    data = location.read_bytes() if isinstance(location, RemotePath) else read_input(location)
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def identity(location: Path | RemotePath) -> tuple[str, int, str]:
    """(URL without secrets, size, version) of an input at a URL, for cache keys."""
    if isinstance(location, RemotePath):
        obj = location.object()
        return (obj.shown, obj.size, obj.identity)
    raise TypeError(f"{location!r} is a local path")


def open_input(location: Location) -> BinaryIO:
    """A binary file for a local path or a remote object (close it, or use `with`)."""
    if isinstance(location, RemoteObject):
        return location.open()  # type: ignore[return-value]
    return open(location, "rb")


def read_input(location: Location) -> bytes:
    """All bytes of a local file or a remote object."""
    if isinstance(location, RemoteObject):
        with location.open() as f:
            return f.read()
    return Path(location).read_bytes()


@contextlib.contextmanager
def arrow_source(location: Location) -> Iterator[Any]:
    """What pyarrow should open: a local path (its own fast reader), or a RemoteFile, which
    pyarrow reads with seeks and ranged reads (a Parquet footer, then row groups as needed)."""
    if isinstance(location, RemoteObject):
        with location.open() as f:
            yield f
    else:
        yield str(location)


def local_file(location: Location | RemotePath) -> Path:
    """A local path to read `location` by: itself, or a copy of the remote object in the
    input cache (for readers that memory-map, or open by path)."""
    if isinstance(location, RemotePath):
        location = location.object()
    if isinstance(location, RemoteObject):
        return location.store.local_copy(location)
    return Path(location)


def shown(location: Location | RemotePath) -> str:
    """A location as errors and records show it: the path, or the URL without secrets."""
    return location.shown if isinstance(location, RemoteObject) else str(location)
