"""SteeringMixin: QueueClient's calls that change what the server makes mid-run (a curriculum's
alpha, a mixture's weights), each anchored to this rank's position in its stream, so the same
calls at the same steps change the same seqs whatever the timing."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from queue_client import errors
from queue_client.mixture import is_weight_number
from queue_client.streaming.resume import StreamPlan
from queue_client.streaming.skipping import StepSkips, advanced, passed_over
from queue_client.streaming.stream import SplitStream
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire.rpc import Rpc
from queue_client.world import World

log = logging.getLogger("queue_client")


class SteeringMixin:
    """SetCurriculum and SetMixture for QueueClient; QueueClient sets the state."""

    dataset: str
    world: World
    mode: str
    timeout_s: float
    _rpc: Rpc
    _streams: dict[str, SplitStream]
    _resume: dict[str, StreamPlan]

    if TYPE_CHECKING:

        def _check_split(self, split: str) -> None: ...

    def set_curriculum(self, alpha: float | None, split: str = "train") -> int:
        """Set the curriculum's alpha (None: back to the config schedule) for a dataset served
        with selection = "curriculum"; returns the first served seq composed with it.

        The change is anchored to this rank's position in its stream, so the same calls at the
        same steps give the same batches: it reaches this rank within max_backlog_files + 3
        files. Call it from every rank at the same step, or from one; both are deterministic.
        """
        self._check_split(split)
        if alpha is not None and not (is_weight_number(alpha) and 0.0 <= alpha <= 1.0):
            raise errors.InvalidRequest(f"alpha {alpha!r} is outside [0, 1]")
        request = pb.SetCurriculumRequest(
            dataset=self.dataset,
            split=split,
            position_seq=self._position(split),
            rank=self.world.rank,
        )
        if alpha is not None:
            request.alpha = float(alpha)
        reply = self._rpc.call("SetCurriculum", request, timeout_s=self.timeout_s)
        return int(reply.effective_seq)

    def set_mixture(self, weights: Mapping[str, float] | None, split: str = "train") -> int:
        """Set the source weights of a mixture dataset (None: back to the config's weights
        and schedule); returns the first seq whose rows are drawn by them (docs/mixtures.md).

        Anchored to this rank's position as set_curriculum is: calls from every rank at the
        same step land on the same seq, within max_backlog_files + 3 files of this rank.
        Unknown names, negative or NaN weights, all zero: InvalidRequest naming them.
        """
        self._check_split(split)
        request = pb.SetMixtureRequest(
            dataset=self.dataset,
            split=split,
            position_seq=self._position(split),
            rank=self.world.rank,
        )
        if weights is None:
            request.reset = True
        else:
            for name, weight in weights.items():
                if not is_weight_number(weight):
                    raise errors.InvalidRequest(
                        f"weight of source {name!r} is {weight!r}: not a number"
                    )
                request.weights[str(name)] = float(weight)
        reply = self._rpc.call("SetMixture", request, timeout_s=self.timeout_s)
        return int(reply.effective_seq)

    def _position(self, split: str) -> int:
        """The seq of the file this rank reads now (or reads first, before any batch)."""
        if self.mode != "deterministic":
            return self.world.rank  # the server refuses the call, naming the dataset's mode
        stream = self._streams.get(split)
        if stream is not None and stream.current is not None:
            return int(stream.current.seq)
        plan = stream.plan() if stream is not None else self._resume.get(split)
        if plan is not None:
            return int(plan.items[0][0]) if plan.items else int(plan.next_seq)
        return self.world.rank


class SkippingMixin:
    """SkipSteps for QueueClient: skip global steps on every rank, and apply the skips the
    server reports (queue_client/streaming/skipping.py) to this client's streams."""

    dataset: str
    world: World
    mode: str
    timeout_s: float
    batch_size: int
    _rpc: Rpc
    _streams: dict[str, SplitStream]
    _resume: dict[str, StreamPlan]
    _step_skips: dict[str, StepSkips]

    if TYPE_CHECKING:

        def _check_split(self, split: str) -> None: ...

        def _position(self, split: str) -> int: ...

        def _rows_per_file(self) -> int: ...

    def skip_steps(
        self, from_step: int, to_step: int, split: str = "train"
    ) -> list[tuple[int, int]]:
        """Skip global steps [from_step, to_step) on every rank of the job (the steps after a
        loss spike): each rank's step counter (its get_batch calls, kept in state_dict) goes
        from from_step straight to to_step, its stream advanced that many batches of the
        dataset's batch size, unread. Call it from one rank. A checkpoint taken before the
        call skips them too when resumed; one inside the range resumes at to_step. Returns
        every skip in force. from_step must lie past every file a rank may have leased:
        InvalidRequest naming the earliest step that can be skipped now otherwise."""
        self._check_split(split)
        for name, value in (("from_step", from_step), ("to_step", to_step)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise errors.InvalidRequest(f"skip_steps: {name} is {value!r}, not a whole number")
        skips = self._step_skips.setdefault(split, StepSkips())
        request = pb.SkipStepsRequest(
            dataset=self.dataset,
            split=split,
            from_step=int(from_step),
            to_step=int(to_step),
            position_step=skips.step,
            position_seq=self._position(split),
            rank=self.world.rank,
        )
        reply = self._rpc.call("SkipSteps", request, timeout_s=self.timeout_s)
        ranges = [(int(r.from_step), int(r.to_step)) for r in reply.skips]
        skips.learn(ranges)
        return ranges

    def _note_skips(self, split: str, skips: Sequence[pb.StepRange]) -> None:
        self._learn_skips(split, [(r.from_step, r.to_step) for r in skips])

    def _learn_skips(self, split: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Skipped steps a lease reply gave: this client's, or its fetch helper's passed on."""
        found = self._step_skips.get(split)
        if found is not None:
            found.learn(ranges)

    def _list_skips(self, split: str) -> None:
        """Learn the split's skips as a stream opens (a lease reply tells of later ones)."""
        skips = self._step_skips.setdefault(split, StepSkips())
        if self.mode != "deterministic":
            return
        request = pb.SkipStepsRequest(dataset=self.dataset, split=split, list_only=True)
        try:
            reply = self._rpc.call("SkipSteps", request, timeout_s=self.timeout_s)
        except errors.ServerUnavailable as exc:
            # The first lease says why the server cannot be reached (or, with fetch_process,
            # the helper does); its reply carries the skips too.
            log.warning("listing the skipped steps of %s/%s failed: %s", self.dataset, split, exc)
            return
        skips.learn((r.from_step, r.to_step) for r in reply.skips)

    def _skip_if_due(self, split: str, skips: StepSkips) -> bool:
        """At a skipped range: advance the stream past it, unread. True if it moved."""
        target = skips.due()
        if target is None:
            return False
        stream = self._streams.pop(split, None)
        plan = stream.plan() if stream is not None else self._resume.get(split)
        if plan is None:
            plan = StreamPlan((), self.world.rank)
        rows = (target - skips.step) * self.batch_size
        stride = self.world.world_size
        moved = advanced(plan, rows, self._rows_per_file(), stride)
        if stream is not None:  # files wholly passed over go back consumed, the rest unread
            stream.close(passed_over(plan, moved, stride))
        self._resume[split] = moved
        skips.step = target
        return True
