"""One object at a URL (RemoteObject), a seekable file over it (RemoteFile), and a URL that
behaves like a Path (RemotePath). All are shown (str, repr, errors) without secrets."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol
from urllib.parse import urlsplit

from queue_client.errors import ConfigError
from queue_providers.remote.failures import where
from queue_providers.remote.settings import RemoteSettings
from queue_providers.remote.urls import protocol_of, redact


class ObjectStore(Protocol):
    """What an object, its files and paths, and the readers of either ask of the store that
    lists and fetches them (store.RemoteStore): this module needs nothing of the store's own."""

    settings: RemoteSettings

    def info(self, url: str) -> dict[str, Any]: ...

    def stat(self, url: str) -> RemoteObject: ...

    def pins_every_read(self, obj: RemoteObject) -> bool: ...

    def block(self, obj: RemoteObject, index: int, before_fetch: Callable[[], None]) -> bytes: ...

    def check_unchanged(self, obj: RemoteObject) -> None: ...

    def fetch(self, obj: RemoteObject, start: int, end: int) -> bytes:
        """Bytes [start, end) of the version of `obj` that was listed."""
        ...

    def local_copy(self, obj: RemoteObject) -> Path:
        """The whole object as a local file, kept until as many unpin() calls."""
        ...

    def unpin(self, path: Path) -> None: ...


@dataclass(frozen=True, eq=False)
class RemoteObject:
    """One object at a URL, as it was when listed. Shown (str, repr, errors) without secrets."""

    url: str
    size: int
    identity: str
    store: ObjectStore = field(repr=False)

    @property
    def shown(self) -> str:
        return redact(self.url)

    @property
    def where(self) -> str:
        return where(self.url)

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

    Blocks of two versions are never mixed in one open: over http(s) and s3 every fetch is
    pinned to the listed version (RemoteStore.fetch); elsewhere the first block that must be
    fetched checks first that the object is still the one listed."""

    _KEEP_BLOCKS = 2  # the current block and the one before: a reader backing up a little

    def __init__(self, obj: RemoteObject, *, check: bool = True) -> None:
        super().__init__()
        self._obj = obj
        self._pos = 0
        self._blocks: dict[int, bytes] = {}
        self._checked = not check or obj.store.pins_every_read(obj)
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


class RemotePath:
    """A URL used where providers use a Path: `/` joins a name, and is_file, is_dir,
    stat().st_size, read_bytes and name work as they do on a Path (is_file and stat list the
    object once). Shown (str, repr) without secrets. `object()` is the RemoteObject."""

    def __init__(self, url: str, store: ObjectStore) -> None:
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
        with self.object().open() as f:
            return f.read()

    def __str__(self) -> str:
        return redact(self.url)

    def __repr__(self) -> str:
        return f"RemotePath({redact(self.url)!r})"
