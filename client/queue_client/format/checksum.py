"""The crc32 of batch files: zlib's checksum, computed by zlib-ng's vectorised code.

Every file is hashed twice on its way to a trainer (by the worker that writes it, and by the
client that verifies it, in the trainer's process), so the hash's speed is CPU the loader
takes from training: zlib-ng's crc32 is about 9x zlib's on 2.5 MB here, same values. Both
release the GIL while they hash. zlib's own stands in where zlib-ng is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

try:
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # zlib-ng is a dependency: this is for a platform without its wheel
    from zlib import crc32 as _crc32

if TYPE_CHECKING:
    from typing_extensions import Buffer

IMPLEMENTATION = _crc32.__module__ or "zlib"


def crc32(data: Buffer, value: int = 0) -> int:
    """zlib.crc32(data, value), faster."""
    return _crc32(data, value)
