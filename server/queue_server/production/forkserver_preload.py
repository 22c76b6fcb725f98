"""What the workers' forkserver imports before it forks any worker: worker_main and the
providers' shared code, abandoned at once if the server that started it is gone.

The server starts the forkserver first thing, so that its import runs beside the server's own
start. A server that exits early (a config error, a data root in use, a kill) would otherwise
leave it importing to the end, seconds on a busy machine, before it notices. A thread watches
the forkserver's parent for as long as the import runs, and is gone before the first fork.
Where a dataset's provider uses torch, forkserver_preload_torch runs first and imports it
under the same watch (worker_imports.py says when).
"""

from __future__ import annotations

import gc
import signal

from queue_server.production.forkserver_start import abandoned_with_the_server

# A SIGTERM to the server's whole process group (`timeout`, `kill -- -PGID`, systemd) must not
# end the forkserver before the server has stopped its workers: the server learns of each
# worker's exit through the forkserver, and a stop that cannot wait for them would sweep
# their temp files while they still write. The forkserver ends when the server does (its
# alive pipe closes); workers ignore SIGTERM too (worker_main.py).
signal.signal(signal.SIGTERM, signal.SIG_IGN)

with abandoned_with_the_server():
    import queue_server.production.worker_main  # noqa: F401  (the preload itself)

# Last of the preload: the objects imported so far go to the collector's permanent
# generation, so that a worker's collections never write to (and so never copy) the pages it
# shares with the forkserver and the other workers.
gc.freeze()
