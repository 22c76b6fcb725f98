"""The frames between a trainer and its fetch helper: every kind round-trips, a stream of
them cut anywhere gives back whole frames only, and an oversized length is refused."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_client.helper import helper_wire as wire

frames = st.one_of(
    st.builds(wire.fetch_frame, st.integers(0, 255), st.integers(0, 65535),
              st.integers(0, 65535), st.none() | st.integers(0, 2**62), st.booleans()),
    st.builds(wire.done_frame, st.integers(0, 255), st.integers(0, 65535), st.booleans(),
              st.floats(0, 1e9, allow_nan=False)),
    st.builds(wire.ready_frame, st.integers(0, 255), st.integers(0, 65535), st.integers(0, 2**62),
              st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 2**31),
              st.text(max_size=40)),
    st.builds(lambda d: wire.json_frame(d), st.dictionaries(st.text(max_size=8),
              st.integers() | st.text(max_size=20), max_size=4).map(lambda d: {"op": "x", **d})),
)  # fmt: skip


@given(st.lists(frames, max_size=12), st.data())
def test_a_stream_cut_anywhere_gives_back_the_frames_in_order(chunks: list[bytes], data) -> None:
    stream = b"".join(chunks)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=5)))
    buf, got = bytearray(), []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        buf += stream[a:b]
        got += wire.take_frames(buf)
    assert not buf
    assert got == [c[4:] for c in chunks]
    assert [wire.read_frame(r) for r in [io.BytesIO(stream)] for _ in chunks] == got


def test_each_kind_round_trips() -> None:
    assert wire.parse(wire.fetch_frame(3, 7, 10, None, True)[4:]) == ("F", (3, 7, 10, None, True))
    assert wire.parse(wire.done_frame(1, 2, False, 0.25)[4:]) == ("D", (1, 2, False, 0.25))
    assert wire.parse(wire.ready_frame(0, 5, 41, 100, 12, 2, "lease-é")[4:]) == (
        "R", (0, 5, 41, 100, 12, 2, "lease-é"),
    )  # fmt: skip
    assert wire.parse(wire.json_frame({"op": "ring", "slots": 4})[4:]) == (
        "J", {"op": "ring", "slots": 4},
    )  # fmt: skip


def test_an_oversized_or_unknown_frame_is_refused() -> None:
    with pytest.raises(ValueError, match="more than"):
        wire.take_frames(bytearray((wire.MAX_FRAME + 1).to_bytes(4, "little") + b"J"))
    with pytest.raises(ValueError, match="unknown kind b'Z'"):
        wire.parse(b"Z123")
    with pytest.raises(ValueError, match="not an object"):
        wire.parse(b"J[1, 2]")
    assert wire.read_frame(io.BytesIO(b"\x05\x00\x00\x00ab")) is None  # cut short: the end
