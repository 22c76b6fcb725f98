"""batchqueue's benchmark suite: `python -m bench` (or `make bench`) prints one table.

Each row sits beside what a user would pick instead (nanoGPT's get_batch, a torch DataLoader)
or beside the physical limit (memcpy, a bare gRPC echo, pinned H2D copies), measured in the
same run on the same data, because this machine is shared and drifts between runs.
BENCHMARKS.md at the repository root records the latest figures and how to read them.
"""

import os

# The suite's composer rows (8d-8f) run the composer as the server's worker processes do:
# numpy's OpenBLAS with one thread (queue_server/production/forkserver_preload.py). It reads
# the count when numpy first loads, which is after this.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
