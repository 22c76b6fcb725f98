"""RemoteStore: one provider's URL inputs: its settings, its fsspec filesystems, its cache."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlsplit

from queue_client.errors import ConfigError
from queue_client.format.layout import atomic_write, input_cache_file
from queue_providers.remote.cache import BlockCache, pin
from queue_providers.remote.failures import ObjectChanged, retry, where
from queue_providers.remote.fetch import PINNED_PROTOCOLS, bounded, read_range
from queue_providers.remote.identity import CONTENT_HASH, object_identity, same_kind
from queue_providers.remote.objects import RemoteObject
from queue_providers.remote.settings import RemoteSettings
from queue_providers.remote.urls import looks_like_url, protocol_of, scrub

T = TypeVar("T")

EXTRA_HINT = "pip install 'batchqueue[remote]'"


class RemoteStore:
    """URL inputs of one provider: its settings, one fsspec filesystem per protocol, its cache."""

    def __init__(self, settings: RemoteSettings | None = None) -> None:
        self.settings = settings or RemoteSettings()
        self._filesystems: dict[str, Any] = {}
        self._lock = threading.Lock()
        # local copy in use -> [locked fd, its bytes, how many users hold it]
        self._pins: dict[Path, list[int]] = {}
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
            from fsspec.core import split_protocol, strip_protocol
        except ImportError:
            raise ConfigError(
                f"{where(url)} is a URL, and reading URLs needs fsspec: {EXTRA_HINT}"
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
                        f"{where(url)}: fsspec knows no URL scheme {scheme!r}; use s3://, "
                        "gs://, https://, hf:// or the scheme of another installed fsspec "
                        "implementation"
                    ) from None
                except ImportError as exc:
                    raise ConfigError(
                        f"{where(url)}: the {scheme}:// protocol needs a package that is not "
                        f"installed ({exc}); {EXTRA_HINT} installs s3fs, gcsfs and aiohttp"
                    ) from None
                try:
                    fs = cls(**self.settings.options_for(protocol))
                except Exception as exc:
                    raise ConfigError(
                        f"{where(url)}: the {scheme}:// filesystem refused storage_options: "
                        f"{type(exc).__name__}: {scrub(str(exc), url)}"
                    ) from None
                if protocol == "s3" and hasattr(fs, "retries"):
                    fs.retries = 1  # s3fs's own retry loop: batchqueue's bounds the time
                self._filesystems[protocol] = fs
        return fs, strip_protocol(url)

    def retry(self, what: str, url: str, call: Callable[[float], T]) -> T:
        """call(time_left), retried within the settings' attempts and retry_seconds."""
        s = self.settings
        return retry(what, url, call, attempts=s.attempts, seconds=s.retry_seconds)

    # ---- objects -------------------------------------------------------------------------------
    def info(self, url: str) -> dict[str, Any]:
        """fsspec's info() of `url` as the server says it now (never from a listing fsspec
        cached), retried; ConfigError naming the URL when it fails."""
        fs, path = self.filesystem(url)
        with contextlib.suppress(Exception):
            fs.invalidate_cache(path)
        return dict(self.retry("read", url, lambda t: bounded(fs, "info", path, seconds=t)))

    def stat(self, url: str) -> RemoteObject:
        """The object at `url`, with its size and identity; ConfigError when it is missing,
        unreadable or not a file."""
        info = self.info(url)
        if info.get("type") == "directory":
            raise ConfigError(f"{where(url)} is a directory, not a file")
        return self._object(url, info)

    def expand(self, url: str, suffixes: Sequence[str] = ()) -> list[RemoteObject]:
        """The objects `url` names, sorted by URL: one object, every object under a
        directory (only those ending in `suffixes`, when given, and not hidden), or those a
        glob (`*` or `[` in the URL's path) matches (maybe none). ConfigError naming the URL
        when it does not exist or cannot be reached."""
        fs, path = self.filesystem(url)
        base = url.split("://", 1)[0]
        if any(c in urlsplit(url).path for c in "*["):
            found = self.retry(
                "listed", url, lambda t: bounded(fs, "glob", path, detail=True, seconds=t)
            )
            infos = [i for i in found.values() if i.get("type") != "directory"]
        else:
            info = self.info(url)
            if info.get("type") != "directory":
                return [self._object(url, info)]
            found = self.retry(
                "listed", url, lambda t: bounded(fs, "find", path, detail=True, seconds=t)
            )
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
                f"{where(url)}: the server does not say how large it is (no size in its "
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

    def pins_every_read(self, obj: RemoteObject) -> bool:
        """Whether each fetch of `obj` is itself pinned to its identity (no separate check)."""
        return protocol_of(obj.url) in PINNED_PROTOCOLS and not obj.identity.startswith(
            CONTENT_HASH
        )

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
        """Bytes [start, end) of the version of `obj` that was listed, retried on transient
        errors; ConfigError naming the URL and both versions when the object changed."""
        if end <= start:
            return b""
        fs, path = self.filesystem(obj.url)
        protocol = protocol_of(obj.url)
        pinned = obj.identity if self.pins_every_read(obj) else ""

        def call(seconds: float) -> bytes:
            return read_range(fs, protocol, path, start, end, pinned, seconds)

        try:
            data = self.retry("read", obj.url, call)
        except ObjectChanged as exc:
            raise ConfigError(
                f"{obj.where} changed while being read: it was {obj.size} bytes, "
                f"{obj.identity} when listed, and the server now answers for "
                f"{exc.found or self._identity_now(obj)}; no byte of the new version was "
                "used. Restore it, or rebuild the dataset (`queue-server reset NAME`)"
            ) from None
        if len(data) == obj.size and end - start != obj.size:
            data = data[start:end]  # a server that ignores Range sends the whole object
        if len(data) != end - start:
            raise ConfigError(
                f"{obj.where}: asked for bytes {start}-{end} and got {len(data)} bytes: the "
                "object is shorter than when it was listed (it changed)"
            )
        return data

    def _identity_now(self, obj: RemoteObject) -> str:
        """The identity the server gives `obj` now, of the kind listed (for an error)."""
        try:
            info = self.info(obj.url)
        except ConfigError:
            return "another version (If-Match failed)"
        return f"{info.get('size')} bytes, {same_kind(info, obj.identity) or 'no identity'}"

    def check_unchanged(self, obj: RemoteObject) -> None:
        """ConfigError when the object's size or identity moved since it was listed: its
        blocks would mix two versions of the object. (An object known by a hash of its
        content alone is checked by its size: hashing it again would read it whole.)"""
        info = self.info(obj.url)
        size, identity = info.get("size"), same_kind(info, obj.identity)
        if obj.identity.startswith(CONTENT_HASH) and not identity:
            identity = obj.identity
        if (size, identity) != (obj.size, obj.identity):
            raise ConfigError(
                f"{obj.where} changed while being read: {obj.size} bytes, {obj.identity} when "
                f"the dataset started; {size} bytes, {identity or 'no identity'} now. Restore "
                "it, or rebuild the dataset (`queue-server reset NAME`)"
            )

    # ---- whole local copies --------------------------------------------------------------------
    def check_room(self, objects: Sequence[RemoteObject], who: str) -> None:
        """ConfigError naming remote.cache_bytes and every size when local copies of all of
        `objects`, which a provider holds at once, cannot fit in the input cache."""
        need = sum(o.size for o in objects)
        if need > self.settings.cache_bytes:
            sizes = " + ".join(f"{o.name} ({o.size} bytes)" for o in objects)
            raise ConfigError(
                f"{who}: remote.cache_bytes = {self.settings.cache_bytes} cannot hold the local "
                f"copies it reads at once: {sizes} = {need} bytes. Raise remote.cache_bytes to "
                f"at least {need} (a file in use is never evicted, so a smaller cache could "
                "only fetch them again and again)"
            )

    def local_copy(self, obj: RemoteObject) -> Path:
        """The whole object as a local file in the input cache, for a reader that must
        memory-map it or open it by path. Downloaded once per identity and pinned (never
        evicted) until as many unpin() calls as local_copy() calls, or the store's end;
        counted in cache_bytes like the blocks, so the copies in use at once must fit there."""
        s = self.settings
        if s.cache_dir is None:
            raise ConfigError(f"{obj.where} must be copied to local disk but there is no cache dir")
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", obj.name)[:80].lstrip("._-") or "object"
        path = input_cache_file(s.cache_dir, f"file-{obj.key}-{safe}")
        with self._lock:
            if path in self._pins:
                self._pins[path][2] += 1
                return path
            held = sum(n for _, n, _ in self._pins.values())
        if held + obj.size > s.cache_bytes:
            raise ConfigError(
                f"{obj.where} is {obj.size} bytes and is read from a local copy, which must fit "
                f"in the input cache beside the {held} bytes of copies in use: raise "
                f"remote.cache_bytes (now {s.cache_bytes}) to at least {held + obj.size}"
            )
        for attempt in range(3):
            with contextlib.suppress(OSError):
                if path.stat().st_size == obj.size:
                    os.utime(path)
                    fd = pin(path)
                    if fd is not None:
                        return self._pinned(path, fd, obj.size)
            if attempt < 2:
                self._download(obj, path)
        raise ConfigError(f"{obj.where}: its local copy {path.name} was deleted as it was made")

    def _pinned(self, path: Path, fd: int, size: int) -> Path:
        with self._lock:
            if path in self._pins:  # another thread pinned it meanwhile
                os.close(fd)
                self._pins[path][2] += 1
                return path
            self._pins[path] = [fd, size, 1]
        if self.cache is not None:
            self.cache.evict(keep=path)
        return path

    def _download(self, obj: RemoteObject, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self.pins_every_read(obj):
            self.check_unchanged(obj)
        block = self.settings.block_bytes

        def write(f: BinaryIO) -> None:
            for start in range(0, obj.size, block):
                f.write(self.fetch(obj, start, min(start + block, obj.size)))

        atomic_write(path, write)

    def unpin(self, path: Path) -> None:
        """One user of a local copy is done with it; with the last, it may be evicted."""
        with self._lock:
            pinned = self._pins.get(path)
            if pinned is None:
                return
            pinned[2] -= 1
            if pinned[2] > 0:
                return
            del self._pins[path]
        with contextlib.suppress(OSError):
            os.close(pinned[0])


def _unstrip(base: str, name: str) -> str:
    """A listed object's name (fsspec strips the scheme) as a URL of the scheme given."""
    if looks_like_url(name):
        return name
    return f"{base}://{name.lstrip('/')}"
