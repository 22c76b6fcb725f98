"""read_past: which files a rank read past (consumed before a restart, their releases never
journaled), as a table over the schedule's facts. The server journals them as consumed and
deletes them: tests/test_disk_full.py shows it with real servers on a full disk."""

from __future__ import annotations

import pytest

from queue_server.split.read_past import read_past
from queue_server.split.schedule import BEST_EFFORT, DETERMINISTIC, Schedule

FREE = [2, 4, 5, 8, 9, 12, 14]  # files on disk, leased to nobody (6 is leased)


def _schedule(
    last_consumed: dict[int, int], last_acquired: dict[int, int], mode: str = DETERMINISTIC
) -> Schedule:
    # World size 2, windows of 6 seqs per rank.
    schedule = Schedule(mode, max_backlog_files=4, world_size=2)
    schedule.last_consumed = dict(last_consumed)
    schedule.last_acquired = dict(last_acquired)
    return schedule


@pytest.mark.parametrize(
    ("last_consumed", "last_acquired", "held", "mode", "expected"),
    [
        # Rank 0 consumed 10 and asked for 12: its free 2, 4 and 8 were read past.
        ({0: 10}, {0: 12}, {}, DETERMINISTIC, [2, 4, 8]),
        # It holds 6 (taken back after the restart, say): nothing from 6 on was read past.
        ({0: 10}, {0: 12}, {0: 6}, DETERMINISTIC, [2, 4]),
        # It rewound to 4: what it reads again, from 4 on, is kept.
        ({0: 10}, {0: 4}, {}, DETERMINISTIC, [2]),
        # It has not asked since a restart: reckoned at the seq after its last consumed one.
        ({0: 10}, {}, {}, DETERMINISTIC, [2, 4, 8]),
        # Its last consumption was a seq carried from another rank (9 is rank 1's): no proof.
        ({0: 9}, {0: 12}, {}, DETERMINISTIC, []),
        # Rank 1 consumed 7: its 5 is read past; its 9 is not (above 7).
        ({1: 7}, {1: 11}, {}, DETERMINISTIC, [5]),
        # A rank that consumed nothing read past nothing.
        ({}, {0: 12}, {}, DETERMINISTIC, []),
        # Best effort: any rank takes any file, so no rank's position says anything.
        ({0: 10}, {0: 12}, {}, BEST_EFFORT, []),
    ],
)
def test_read_past(
    last_consumed: dict[int, int],
    last_acquired: dict[int, int],
    held: dict[int, int],
    mode: str,
    expected: list[int],
) -> None:
    schedule = _schedule(last_consumed, last_acquired, mode)
    assert read_past(schedule, FREE, held) == expected
