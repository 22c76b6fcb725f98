"""Provider inputs where the data lives: fsspec URLs (s3://, gs://, https://, hf://, ...).

A provider input that is a path may also be a URL. This package is the one place that talks to
fsspec, so every reader gets the same things, each in a module of its own:

  - urls: which config values are URLs, and how a URL is shown: user info and every query
    value as `***`, in whatever encoding a client library wrote it into its message.
  - settings: the `remote` table (storage_options never hold credentials).
  - objects, store: `RemoteObject.open()` is a seekable binary file that fetches the object in
    blocks of `block_bytes` as they are read, so nothing is downloaded whole unless a provider
    must memory-map it (`RemoteStore.local_copy`).
  - identity, fetch: each object's version, ETag or content hash and its size (fsspec info()),
    which queue_providers.inputs fingerprints like a local file's sha256, and to which every
    read is pinned (If-Match, a version id, the answer's ETag checked).
  - cache: blocks and local copies under the dataset's input cache directory, at most
    `cache_bytes` of them, least recently used evicted, a file in use never.
  - failures: a transient error is tried again with backoff, at most `attempts` times, and no
    request (a silent endpoint, one that trickles) outlives `retry_seconds`.

fsspec is the optional extra `batchqueue[remote]`.
"""

from queue_providers.remote.cache import BlockCache
from queue_providers.remote.failures import ObjectChanged, is_transient
from queue_providers.remote.identity import CONTENT_HASH, object_identity
from queue_providers.remote.locations import (
    Location,
    arrow_source,
    identity,
    input_path,
    local_file,
    local_files,
    open_input,
    read_input,
    read_text,
    resolve,
    shown,
    store_for,
)
from queue_providers.remote.objects import RemoteFile, RemoteObject, RemotePath
from queue_providers.remote.settings import (
    DEFAULT_ATTEMPTS,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CACHE_BYTES,
    DEFAULT_RETRY_SECONDS,
    SETTINGS_KEYS,
    RemoteSettings,
    check_storage_options,
    is_secret_key,
)
from queue_providers.remote.store import EXTRA_HINT, RemoteStore
from queue_providers.remote.urls import is_url, local_path, protocol_of, redact, scrub

__all__ = [
    "CONTENT_HASH",
    "DEFAULT_ATTEMPTS",
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_RETRY_SECONDS",
    "EXTRA_HINT",
    "SETTINGS_KEYS",
    "BlockCache",
    "Location",
    "ObjectChanged",
    "RemoteFile",
    "RemoteObject",
    "RemotePath",
    "RemoteSettings",
    "RemoteStore",
    "arrow_source",
    "check_storage_options",
    "identity",
    "input_path",
    "is_secret_key",
    "is_transient",
    "is_url",
    "local_file",
    "local_files",
    "local_path",
    "object_identity",
    "open_input",
    "protocol_of",
    "read_input",
    "read_text",
    "redact",
    "resolve",
    "scrub",
    "shown",
    "store_for",
]
