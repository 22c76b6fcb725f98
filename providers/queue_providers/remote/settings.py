"""A provider's `remote` table: fsspec options (never credentials), the cache, the time bounds."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError
from queue_providers.remote.urls import protocol_of

DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_BLOCK_BYTES = 4 << 20
DEFAULT_ATTEMPTS = 5
# A request and its retries end this long after the first try, answered or not.
DEFAULT_RETRY_SECONDS = 15.0
SETTINGS_KEYS = ("storage_options", "cache_bytes", "block_bytes", "attempts", "retry_seconds")
# A connection that is not made in this long is not coming (capped by retry_seconds).
CONNECT_SECONDS = 5.0

# Values of a credential key that name a way to find credentials, not a secret (gcsfs's token).
_CREDENTIAL_METHODS = frozenset({"anon", "google_default", "cloud"})
# Words that, anywhere in a key's name (lower case, `_` and `-` dropped), mark a secret.
_SECRET_PARTS = (
    "secret",
    "token",
    "password",
    "passwd",
    "passphrase",
    "credential",
    "private",
    "auth",
    "cookie",
    "accesskey",
    "connectionstring",
    "connstr",
)
# Words that, as a whole word of a key's name (split at `_`, `-`, `.`), mark a secret.
_SECRET_WORDS = frozenset({"key", "pw", "pwd", "pass", "sas", "signature", "sig", "apikey"})
# Names that hold one of those words but no secret.
_NOT_SECRETS = frozenset({"signature_version", "key_prefix", "sse_kms_key_id", "ssekmskeyid"})


def is_secret_key(name: str) -> bool:
    """Whether a storage_options key names a credential (a key, secret, token, password,
    passphrase, SAS, signature, connection string ...)."""
    lower = str(name).lower()
    if lower in _NOT_SECRETS:
        return False
    compact = re.sub(r"[^a-z0-9]", "", lower)
    words = set(re.split(r"[^a-z0-9]+", lower))
    return (
        compact.endswith("key")
        or bool(words & _SECRET_WORDS)
        or any(p in compact for p in _SECRET_PARTS)
    )


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
        if isinstance(value, str) and value in _CREDENTIAL_METHODS:
            continue
        if is_secret_key(str(key)):
            raise ConfigError(
                f"{where}.{key} looks like a credential, and batchqueue takes none in its config "
                "(the config is fingerprinted, copied and logged). Give credentials the way the "
                "storage's own client reads them: the server's environment (e.g. "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, "
                "HF_TOKEN, AZURE_STORAGE_CONNECTION_STRING) or its config files "
                "(~/.aws/credentials, ...)"
            )
        if isinstance(value, Mapping):
            _refuse_secrets(value, f"{where}.{key}")


@dataclass(frozen=True)
class RemoteSettings:
    """How URL inputs are reached: fsspec options, the cache, the retry and time budget."""

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
        own: dict[str, Any] = {}
        for name, value in self.storage_options.items():
            if name in protocols and protocol_of(f"{name}://") == protocol:
                own.update(value if isinstance(value, Mapping) else {})
        return _merge(self._defaults(protocol), {**shared, **own})

    def _defaults(self, protocol: str) -> dict[str, Any]:
        """Defaults a protocol gets unless storage_options sets them: batchqueue does the
        retrying, and no connection or read waits past retry_seconds (each request is also
        bounded as a whole, see queue_providers.remote.failures)."""
        connect = min(CONNECT_SECONDS, self.retry_seconds)
        read = self.retry_seconds
        if protocol == "s3":
            return {
                "config_kwargs": {
                    "connect_timeout": connect,
                    "read_timeout": read,
                    "retries": {"total_max_attempts": 1},
                },
            }
        if protocol == "http":
            try:
                import aiohttp
            except ImportError:
                return {}
            timeout = aiohttp.ClientTimeout(
                total=read, connect=connect, sock_connect=connect, sock_read=read
            )
            return {"client_kwargs": {"timeout": timeout}}
        return {}


def _known_protocols() -> set[str]:
    try:
        import fsspec
    except ImportError:
        return {"s3", "s3a", "gs", "gcs", "http", "https", "hf", "az", "abfs", "file"}
    return set(fsspec.available_protocols())


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
