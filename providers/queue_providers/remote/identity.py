"""Which version of an object a listing describes: "kind:value" strings from fsspec's info().

An identity is recorded in inputs.json, keys the cache, and pins every read of the object
(queue_providers.remote.fetch), so it is the one name of "the bytes the dataset was built from".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The identity of an object whose server gives no version, ETag or date: its content's sha256.
CONTENT_HASH = "content-sha256:"


def object_identity(info: Mapping[str, Any]) -> str:
    """What says which version of an object fsspec's info() describes: a version id, a content
    hash, an ETag, or a modification time, in that order of preference; "" when none."""
    found = identities(info)
    return found[0] if found else ""


def identities(info: Mapping[str, Any]) -> list[str]:
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


def same_kind(info: Mapping[str, Any], listed: str) -> str:
    """The identity of `info` of the kind `listed` is (etag, version, ...), else its first."""
    kind = listed.partition(":")[0] + ":"
    found = identities(info)
    return next((i for i in found if i.startswith(kind)), found[0] if found else "")


def etag_of(identity: str) -> str | None:
    """The ETag an identity pins (as the server wrote it, quotes included), or None."""
    kind, _, value = identity.partition(":")
    return value if kind == "etag" and value else None


def version_of(identity: str) -> str | None:
    """The version id an identity pins, or None."""
    kind, _, value = identity.partition(":")
    return value if kind == "version" and value else None


def same_etag(a: str, b: str) -> bool:
    """Whether two ETags name one version: weak marks and quotes aside."""

    def bare(tag: str) -> str:
        tag = tag.strip()
        return (tag[2:] if tag.startswith("W/") else tag).strip('"')

    return bare(a) == bare(b)
