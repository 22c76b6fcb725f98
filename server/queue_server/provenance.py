"""ExplainStep: where each row of one step of a rank came from, asked of a one-off worker.

Step S of rank R at world size W, B rows a step, is rows [S*B, (S+1)*B) of the rank's
stream, whose k-th file is seq R + W*k and holds F = batch_size * batches_per_file rows (the
files' unit, meta's batch_size): stream row r is row r % F of seq R + W*(r // F). Skipped
steps advance the stream one batch each, so this holds across skips. An elastic resume
leaves the plain stride, so the caller may name the file and row the step starts at instead
(seq, offset); its rows then run on along the stride from there.

Each file's rows are the provider's to explain (DataProviderBase.provenance), computed in a
worker process started for this call alone, as meta is built: the event loop runs no
provider code, and the split's own workers are never interrupted. A mixture's worker is
given the split's SetMixture calls, as a produce is.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import TYPE_CHECKING

from queue_client import errors
from queue_client.format.batchfile import MAX_SEQ
from queue_client.wire import batchqueue_pb2 as pb
from queue_server import dataset_workers
from queue_server.production.worker_process import WorkerDied, WorkerError

if TYPE_CHECKING:
    from queue_server.dataset import DatasetRuntime
    from queue_server.split.queue import SplitQueue

# One explaining worker at a time per server (per event loop: a process may run several
# servers in turn, in-process): each is a provider started afresh.
_ONE_AT_A_TIME: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def _one_at_a_time() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    limit = _ONE_AT_A_TIME.get(loop)
    if limit is None:
        limit = _ONE_AT_A_TIME[loop] = asyncio.Semaphore(1)
    return limit


def step_rows(
    first_seq: int, first_row: int, rows: int, rows_per_file: int, stride: int
) -> list[tuple[int, list[int]]]:
    """(seq, its rows) of `rows` stream rows from row `first_row` of `first_seq` on,
    the stream going on at seq + stride after each file."""
    out: list[tuple[int, list[int]]] = []
    seq, row = first_seq, first_row
    while rows > 0:
        take = min(rows, rows_per_file - row)
        out.append((seq, list(range(row, row + take))))
        rows -= take
        seq, row = seq + stride, 0
    return out


async def explain_step(
    runtime: DatasetRuntime, queue: SplitQueue, request: pb.ExplainStepRequest
) -> pb.ExplainStepResponse:
    """The reply to ExplainStep (bounds already checked: request_bounds.check_explain_step)."""
    name, split = runtime.config.name, queue.split
    where = f"explain {name}/{split}"
    if runtime.config.selection == "curriculum" and split in runtime.config.curriculum.splits:
        raise errors.InvalidRequest(
            f"{where}: a curriculum split's batches are composed from candidate files as the "
            "run goes, so a step's rows are not placed by arithmetic: explain is not available"
        )
    meta = runtime.meta
    per_file = int(meta["batch_size"]) * int(meta["batches_per_file"])
    world = request.world_size or queue.schedule.world_size or 1
    if request.rank >= world:
        raise errors.InvalidRequest(f"{where}: rank {request.rank} is outside [0, {world})")
    batch = request.batch_size or runtime.served_batch_size
    if request.HasField("seq"):
        if request.offset >= per_file:
            raise errors.InvalidRequest(
                f"{where}: offset {request.offset} is outside the {per_file} rows of a file"
            )
        first_seq, first_row = request.seq, request.offset
    else:
        files, first_row = divmod(request.step * batch, per_file)
        first_seq = request.rank + world * files
    places = step_rows(first_seq, first_row, batch, per_file, world)
    last = places[-1][0]
    if last > MAX_SEQ:
        raise errors.InvalidRequest(
            f"{where}: step {request.step} of rank {request.rank}/{world} lies in seq {last}, "
            f"past the last seq a split has ({MAX_SEQ})"
        )
    overrides = [list(o) for o in queue.mixture_changes] if queue.mixture else []
    reply = pb.ExplainStepResponse(world_size=world, batch_size=batch)
    async with _one_at_a_time():
        worker = dataset_workers.worker(runtime, split, 0)
        try:
            await worker.start()
            await worker.call({"op": "set_meta", "meta_json": runtime.meta_json, "split": split})
            for seq, rows in places:
                ask = {"op": "provenance", "split": split, "seq": seq, "rows": rows}
                said = await worker.call({**ask, "overrides": overrides})
                for row, entry in zip(rows, said["rows"], strict=True):
                    reply.rows.append(pb.RowProvenance(seq=seq, row=row, **entry))
        except WorkerError as exc:
            raise errors.InvalidRequest(f"{where}: {_without_kind(str(exc))}") from None
        except WorkerDied as exc:
            raise errors.ProviderFailed(f"{where}: the explaining worker died: {exc}") from None
        finally:
            await worker.stop()
    return reply


def _without_kind(message: str) -> str:
    """A worker's "ValueError: why" as "why": the reader wants the why."""
    head, _, rest = message.partition(": ")
    return rest if rest and head.isidentifier() else message
