"""Local path or URL: the few functions providers call to read an input wherever it lives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from queue_providers.remote.objects import ObjectStore, RemoteObject, RemotePath
from queue_providers.remote.settings import RemoteSettings
from queue_providers.remote.store import RemoteStore
from queue_providers.remote.urls import is_url, local_path

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
    input cache, kept from eviction for as long as the provider lives (for readers that
    memory-map it). A reader done with it once read uses `local_files` instead."""
    if isinstance(location, RemotePath):
        location = location.object()
    if isinstance(location, RemoteObject):
        return location.store.local_copy(location)
    return Path(location)


@contextlib.contextmanager
def local_files(locations: Sequence[Location | RemotePath]) -> Iterator[list[Path]]:
    """Local paths to read `locations` by, kept from eviction until the `with` ends (they
    must fit in the input cache together: ConfigError naming the sizes otherwise)."""
    held: list[tuple[ObjectStore, Path]] = []
    try:
        paths = []
        for location in locations:
            obj = location.object() if isinstance(location, RemotePath) else location
            if isinstance(obj, RemoteObject):
                path = obj.store.local_copy(obj)
                held.append((obj.store, path))
                paths.append(path)
            else:
                paths.append(Path(obj))
        yield paths
    finally:
        for store, path in held:
            store.unpin(path)


def shown(location: Location | RemotePath) -> str:
    """A location as errors and records show it: the path, or the URL without secrets."""
    return location.shown if isinstance(location, RemoteObject) else str(location)
