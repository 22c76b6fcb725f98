"""A raw token file (nanoGPT's train.bin): nothing but ids, in the dtype the config names."""

from __future__ import annotations

import numpy as np

from queue_client.errors import ConfigError
from queue_providers.remote import Location, shown
from queue_providers.token_shards.shard import Shard, size_of


def read_raw(location: Location, dtype: np.dtype) -> Shard:
    """The whole file as `dtype` ids; ConfigError when its size is not a whole number of them."""
    size = size_of(location)
    if size % dtype.itemsize:
        raise ConfigError(
            f"token_shards: {shown(location)} is {size} bytes, not a multiple of "
            f"{dtype.itemsize} ({dtype.name} tokens); the file is truncated or holds another "
            "dtype: set token_dtype to the one it was written with"
        )
    return Shard(location, "raw", dtype, 0, size // dtype.itemsize)
