"""ExplainMixin: QueueClient.explain, where each row of a step came from (ExplainStep).

To decide which steps to skip after a loss spike (docs/ordering.md, "Explaining a step"),
explain the steps around it: each row's mixture source, input file, token offset and
document, as the server's provider places them, without reading the corpus.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire.rpc import Rpc
from queue_client.world import World

ROW_FIELDS = ("seq", "row", "source", "file", "token_offset", "document")


def explain_request(
    dataset: str,
    split: str,
    step: int,
    rank: int,
    world_size: int = 0,
    seq: int | None = None,
    offset: int = 0,
    batch_size: int = 0,
) -> pb.ExplainStepRequest:
    """ExplainStep's request: step of rank (world_size 0: the split's), or the batch at row
    offset of file seq; batch_size 0: the dataset's."""
    request = pb.ExplainStepRequest(
        dataset=dataset,
        split=split,
        rank=rank,
        world_size=world_size,
        step=step,
        offset=offset,
        batch_size=batch_size,
    )
    if seq is not None:
        request.seq = seq
    return request


def explained_rows(reply: pb.ExplainStepResponse) -> list[dict[str, Any]]:
    """One dict per row of the step, keyed by ROW_FIELDS (document -1: unknown)."""
    return [{name: getattr(row, name) for name in ROW_FIELDS} for row in reply.rows]


class ExplainMixin:
    """ExplainStep for QueueClient."""

    dataset: str
    world: World
    timeout_s: float
    batch_size: int
    _rpc: Rpc

    if TYPE_CHECKING:

        def _check_split(self, split: str) -> None: ...

    def explain(
        self, step: int, split: str = "train", rank: int | None = None
    ) -> list[dict[str, Any]]:
        """Where each row of `step` (a get_batch call, counted from 0 as state_dict counts
        them) of `rank` (default: this one) came from: one dict per row with its batch file
        (seq, row), mixture source, input file, token_offset and document. The step is placed
        on the plain stride of this client's world size, so after an elastic resume name the
        file and row instead (queue-client explain --seq --offset)."""
        self._check_split(split)
        request = explain_request(
            self.dataset,
            split,
            step,
            self.world.rank if rank is None else rank,
            self.world.world_size,
            batch_size=self.batch_size,
        )
        return explained_rows(self._rpc.call("ExplainStep", request, timeout_s=self.timeout_s))
