"""Input records as inputs.json keeps them, read without a provider: their fingerprint, and
whether local files still match theirs.

Light on purpose (hashlib, json, os): the server imports it to check, at a restart, the inputs
of a dataset whose provider named them one by one (`DataProviderBase.fixed_inputs`), before any
worker process (and so torch) has started. queue_providers.inputs makes the records.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def inputs_fingerprint(records: Mapping[str, Mapping[str, Any]]) -> str:
    """16 hex digits over each input's path and sha256 (not its mtime: a touch is no change),
    or for an input at a URL, its version and size."""
    pairs = sorted((key, record_content(r)) for key, r in records.items())
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]


def record_content(record: Mapping[str, Any]) -> str:
    if "sha256" in record:
        return str(record["sha256"])
    return f"{record.get('version')}|{record.get('size')}"


def local_files_unchanged(records: Mapping[str, Mapping[str, Any]], base: Path) -> bool:
    """True when every record is a hashed local file whose size and mtime are still those
    recorded (relative keys are relative to `base`, the providers' working directory): the
    trust rule describe_inputs applies, which then keeps the recorded sha256 unread. False for
    anything else (no records, an input at a URL, a file gone or moved on), which a provider
    must then check."""
    if not records:
        return False
    for key, record in records.items():
        if "sha256" not in record or "version" in record:
            return False
        try:
            st = os.stat(base / key)
        except OSError:
            return False
        if st.st_size != record.get("size") or st.st_mtime_ns != record.get("mtime_ns"):
            return False
    return True
