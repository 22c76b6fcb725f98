"""After a stop, no temp file of an interrupted write is left in a dataset's directory.

A worker that is stopped in the middle of a file (or of meta, a tokenizer snapshot, a cache
directory) exits before it renames its temp file into place. Once the server has stopped and
reaped every worker, a temp name whose writer process is gone is such a leftover. A temp name
whose writer is still alive (this server, another program) is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from queue_client.format.layout import is_temp_name, process_alive, temp_owner_pid


def remove_orphan_temp_files(directories: Iterable[Path]) -> int:
    """Remove every temp file or directory under `directories` whose writer has exited;
    returns how many. Missing directories are skipped."""
    removed = 0
    for top in directories:
        for here, dirs, files in os.walk(top):
            for name in [*files, *dirs]:
                if not is_temp_name(name):
                    continue
                pid = temp_owner_pid(name)
                if pid is None or process_alive(pid):
                    continue
                path = Path(here, name)
                with contextlib.suppress(FileNotFoundError):
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink()
                removed += 1
            dirs[:] = [d for d in dirs if not is_temp_name(d)]  # never walk into a temp dir
    return removed
