"""The playback-buffer model, with explicit arrival times."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.metering.playback import PlaybackBuffer


def play(chunks: list[tuple[float, float]], prebuffer_s: float = 0.2) -> PlaybackBuffer:
    buffer = PlaybackBuffer(prebuffer_s)
    for now, seconds in chunks:
        buffer.add(now, seconds)
    return buffer


def test_faster_than_realtime_never_underruns() -> None:
    buffer = play([(i * 0.1, 0.2) for i in range(50)])
    assert buffer.underruns == 0
    assert buffer.stall_seconds == 0.0


def test_exactly_realtime_after_the_prebuffer_never_underruns() -> None:
    buffer = play([(i * 0.2, 0.2) for i in range(50)])
    assert buffer.underruns == 0


def test_a_pause_longer_than_the_buffer_is_one_underrun_with_its_stall() -> None:
    # Ten 0.2 s chunks at realtime from t=0: the buffer holds audio until 0.2 + 2.0 = 2.2.
    chunks = [(i * 0.2, 0.2) for i in range(10)]
    # The upstream pauses; the next chunk arrives at 5.0: 2.8 s of silence, then it resumes
    # at realtime from there (immediate resume), so nothing more is lost.
    chunks += [(5.0 + i * 0.2, 0.2) for i in range(10)]
    buffer = PlaybackBuffer(0.2)
    stalls = [buffer.add(now, seconds) for now, seconds in chunks]
    assert buffer.underruns == 1
    assert buffer.stall_seconds == pytest.approx(2.8)
    assert stalls[10] == pytest.approx(2.8)
    assert [s for i, s in enumerate(stalls) if i != 10] == [0.0] * 19


def test_a_pause_shorter_than_the_buffer_is_no_underrun() -> None:
    buffer = play([(0.0, 1.0), (1.1, 0.2)])  # played until 1.2 > 1.1
    assert buffer.underruns == 0


def test_arrival_exactly_when_the_buffer_empties_is_in_time() -> None:
    buffer = play([(0.0, 0.5), (0.75, 0.5)], prebuffer_s=0.25)
    assert buffer.underruns == 0


def test_the_first_chunk_starts_playback_after_the_prebuffer() -> None:
    buffer = play([(0.0, 0.1), (0.35, 0.1)], prebuffer_s=0.2)  # played until 0.3
    assert buffer.underruns == 1
    assert buffer.stall_seconds == pytest.approx(0.05)
    assert play([(0.0, 0.1), (0.35, 0.1)], prebuffer_s=0.3).underruns == 0


def test_an_empty_frame_neither_feeds_the_buffer_nor_splits_a_stall() -> None:
    buffer = play([(0.0, 0.2), (1.0, 0.0), (1.5, float("nan")), (2.0, 0.2)])
    assert buffer.underruns == 1
    assert buffer.stall_seconds == pytest.approx(2.0 - 0.4)


def test_idle_lets_the_buffer_drain_and_the_next_response_prebuffers() -> None:
    buffer = PlaybackBuffer(0.2)
    buffer.add(0.0, 1.0)  # plays 0.2 .. 1.2
    buffer.idle(0.1)
    buffer.add(10.0, 0.2)  # idle, not a stall; plays 10.2 .. 10.4
    assert buffer.underruns == 0
    buffer.add(10.5, 0.2)  # the new response then stalls 0.1 s
    assert buffer.underruns == 1
    assert buffer.stall_seconds == pytest.approx(0.1)


def test_audio_arriving_before_an_idle_buffer_drained_just_queues() -> None:
    buffer = PlaybackBuffer(0.2)
    buffer.add(0.0, 1.0)  # plays until 1.2
    buffer.idle(0.0)
    buffer.add(1.0, 1.0)  # still playing: queued, plays until 2.2
    buffer.add(2.5, 0.1)  # a stall within the continuing stream
    assert buffer.underruns == 1
    assert buffer.stall_seconds == pytest.approx(0.3)


def test_finish_ignores_the_drain_and_later_audio() -> None:
    buffer = play([(0.0, 0.2)])
    buffer.finish(10.0)
    assert buffer.add(20.0, 0.2) == 0.0
    assert buffer.underruns == 0


def test_buffered_seconds() -> None:
    buffer = PlaybackBuffer(0.2)
    assert buffer.buffered(0.0) == 0.0
    buffer.add(0.0, 0.5)
    assert buffer.buffered(0.1) == pytest.approx(0.5)  # still prebuffering
    assert buffer.buffered(0.4) == pytest.approx(0.3)
    assert buffer.buffered(1.0) == 0.0


def test_negative_prebuffer_is_rejected() -> None:
    with pytest.raises(ValueError, match="prebuffer_s"):
        PlaybackBuffer(-0.1)


chunk_lists = st.lists(
    st.tuples(st.floats(0.0, 2.0), st.floats(0.001, 1.0)), min_size=1, max_size=40
)


@given(chunk_lists, st.floats(0.0, 1.0))
def test_stall_total_matches_the_closed_form(steps: list[tuple[float, float]], pre: float) -> None:
    """With immediate resume, total stall = max(0, max_j(t_j - t_0 - pre - S_{<j}))."""
    times, now = [], 0.0
    for gap, _ in steps:
        now += gap
        times.append(now)
    sizes = [s for _, s in steps]
    buffer = play(list(zip(times, sizes, strict=True)), pre)
    behind = max(t - times[0] - pre - sum(sizes[:j]) for j, t in enumerate(times))
    assert buffer.stall_seconds == pytest.approx(max(behind, 0.0), abs=1e-9)
    assert buffer.underruns <= len(times) - 1
    assert (buffer.underruns == 0) == (buffer.stall_seconds == 0.0)


@given(st.lists(st.floats(0.001, 1.0), min_size=1, max_size=60), st.data())
def test_any_stream_faster_than_realtime_never_underruns(
    sizes: list[float], data: st.DataObject
) -> None:
    buffer, now = PlaybackBuffer(0.0), 0.0
    for size in sizes:
        buffer.add(now, size)
        now += data.draw(st.floats(0.0, size))  # the next chunk comes within this one's audio
    assert buffer.underruns == 0


def test_a_stall_on_the_first_chunk_alone_is_a_first_chunk_underrun() -> None:
    """The start-up transient: 0.32 s first chunk, the 2 s second one 0.95 s later
    (vllm-omni Qwen3-TTS at batch 8): the buffer ran dry at 0.52. Later stalls are not
    first-chunk ones."""
    buffer = PlaybackBuffer(0.2)
    assert buffer.add(0.0, 0.32) == 0.0 and buffer.stream_chunks == 1
    assert buffer.add(0.95, 2.0) == pytest.approx(0.43) and buffer.stream_chunks == 2
    assert (buffer.underruns, buffer.first_chunk_underruns) == (1, 1)
    buffer.add(5.0, 2.0)  # mid-stream: the 2 s ran out at 2.95
    assert (buffer.underruns, buffer.first_chunk_underruns) == (2, 1)
    assert buffer.stream_chunks == 3


def test_each_restarted_stream_has_its_own_first_chunk() -> None:
    buffer = PlaybackBuffer(0.2)
    buffer.add(0.0, 0.32)
    buffer.add(0.3, 2.0)  # in time
    buffer.idle(0.3)
    buffer.add(10.0, 0.32)  # the client's next request: a new stream, a new prebuffer
    assert buffer.stream_chunks == 1
    buffer.add(11.0, 2.0)  # ran dry at 10.52
    assert (buffer.underruns, buffer.first_chunk_underruns) == (1, 1)


@given(st.lists(st.tuples(st.floats(0.0, 3.0), st.floats(0.01, 2.0)), max_size=40))
def test_first_chunk_underruns_are_at_most_one_per_stream(
    chunks: list[tuple[float, float]],
) -> None:
    buffer, now = PlaybackBuffer(0.2), 0.0
    for wait, seconds in chunks:
        now += wait
        buffer.add(now, seconds)
    assert buffer.first_chunk_underruns <= min(buffer.underruns, 1)
