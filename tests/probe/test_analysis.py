"""The pure analysis: level figures, the pass rule, ASR shares, on synthetic and recorded traces."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.probe.analysis import (
    Arrival,
    LevelWindow,
    SessionTrace,
    event_share,
    level_stats,
    quantile,
    ratio_samples,
)
from proxy.probe.ceiling import summarize
from proxy.probe.traces import read_traces, trace_from_json, trace_json, write_traces
from tests.probe.helpers import DATA, asr_trace, recorded, steady, tts_trace

W = LevelWindow(level=2, started_at=0.0, warm_end=10.0, ended_at=40.0)


# -- quantile ---------------------------------------------------------------------------


def test_quantile_is_nearest_rank() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0], 0.01) == 3.0
    values = [float(v) for v in range(1, 201)]  # 1..200
    assert quantile(values, 0.01) == 2.0  # rank ceil(2.0) = 2
    assert quantile(values, 0.5) == 100.0
    assert quantile(values, 0.99) == 198.0
    assert quantile(values[:100], 0.01) == 1.0  # under 100 samples: the minimum


@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=300), st.floats(0.001, 1.0))
def test_quantile_property(values: list[float], q: float) -> None:
    result = quantile(values, q)
    assert result is not None
    below = sum(1 for v in values if v < result)
    at_or_below = sum(1 for v in values if v <= result)
    rank = max(math.ceil(q * len(values) - 1e-9), 1)
    assert below < rank <= at_or_below


# -- TTS levels -------------------------------------------------------------------------


def test_steady_streams_give_their_ratio_and_only_the_window_counts() -> None:
    # 2 s chunks every 1.25 s (1.6x), from t=1 to t=51: the window is [10, 40].
    a = steady(0.0, 1.0, 1.25, 2.0, 40)
    b = steady(0.5, 1.5, 1.25, 2.0, 40)
    s = level_stats(W, [a, b], threshold=1.2)
    assert s.worst_1pct == pytest.approx(1.6) and s.median_ratio == pytest.approx(1.6)
    in_window = [x.at for t in (a, b) for x in t.arrivals if 10.0 <= x.at <= 40.0]
    assert s.chunks == len(in_window) == 48
    assert s.stream_ratios == pytest.approx((1.6, 1.6))
    assert s.throughput == pytest.approx(48 * 2.0 / 30.0)
    assert s.p99_gap_s == pytest.approx(1.25)
    assert s.ttfa_p50_s is None  # both first chunks came during the warm-up
    assert s.verdict == "pass" and s.passed
    assert (s.sessions, s.completed, s.errors, s.refusals) == (2, 2, 0, 0)


def test_first_chunk_has_no_ratio_and_its_wait_is_time_to_first_audio() -> None:
    late = tts_trace(11.0, [(11.8, 0.32), (12.5, 2.0), (13.5, 2.0)])
    s = level_stats(W, [late], threshold=1.2)
    assert s.chunks == 2
    assert s.ttfa_p50_s == pytest.approx(0.8) and s.ttfa_p99_s == pytest.approx(0.8)
    assert [r for *_, r in ratio_samples(late, "tts")] == pytest.approx([2.0 / 0.7, 2.0])


def test_worst_one_percent_is_the_slow_tail_of_all_streams_pooled() -> None:
    # 4 streams x 50 chunks at 2.0x; stream 0 has two chunks at 0.5x and 0.8x.
    traces = []
    for i in range(4):
        chunks, t = [], 10.0 + 0.1 * i
        chunks.append((t, 1.0))
        for j in range(50):
            gap = 0.5
            if i == 0 and j == 10:
                gap = 2.0
            if i == 0 and j == 20:
                gap = 1.25
            t += gap
            chunks.append((t, 1.0))
        traces.append(tts_trace(9.0, chunks))
    window = LevelWindow(4, 0.0, 9.5, 60.0)
    s = level_stats(window, traces, threshold=1.2)
    assert s.chunks == 200
    assert s.worst_1pct == pytest.approx(0.8)  # rank 2 of 200
    assert s.verdict == "slow" and not s.passed
    assert s.stream_ratio_min == pytest.approx(50 / (48 * 0.5 + 2.0 + 1.25))
    assert s.median_ratio == pytest.approx(2.0)


def test_a_remainder_chunk_has_no_ratio() -> None:
    # An utterance ends with 0.04 s of audio one step after a full 2 s chunk.
    chunks = [(11.0, 0.32), (12.0, 2.0), (13.0, 2.0), (13.05, 0.04)]
    finished = tts_trace(10.0, chunks)
    assert [round(r, 3) for *_, r in ratio_samples(finished, "tts")] == [2.0, 2.0]
    assert level_stats(W, [finished], threshold=1.2).worst_1pct == pytest.approx(2.0)
    # Cut by the level's end, the last chunk is not known to be the last: it counts.
    cut = tts_trace(10.0, chunks, outcome="cancelled")
    assert len(ratio_samples(cut, "tts")) == 3
    # A full-size last chunk keeps its ratio, and so does a chunk followed by the next
    # utterance's first (gap None) only when it is not smaller than the one before it.
    full = tts_trace(10.0, [(11.0, 0.32), (12.0, 2.0), (13.0, 2.0), (14.0, 2.0)])
    assert len(ratio_samples(full, "tts")) == 3
    two = SessionTrace(
        10.0,
        20.0,
        "ok",
        (
            Arrival(11.0, 2.0, None, None),
            Arrival(12.0, 2.0, 1.0, 2.0),
            Arrival(12.1, 0.1, 0.1, 1.0),  # first utterance's remainder
            Arrival(14.0, 2.0, None, None),  # second utterance
            Arrival(15.0, 2.0, 1.0, 2.0),
        ),
    )
    assert [r for *_, r in ratio_samples(two, "tts")] == [2.0, 2.0]


@pytest.mark.parametrize(("threshold", "verdict"), [(2.0, "pass"), (2.001, "slow"), (1.2, "pass")])
def test_threshold_is_inclusive(threshold: float, verdict: str) -> None:
    trace = steady(0.0, 10.5, 0.5, 1.0, 20)  # exactly 2.0x
    assert level_stats(W, [trace], threshold=threshold).verdict == verdict


@given(st.floats(0.2, 5.0), st.floats(0.3, 3.0))
def test_scaling_gaps_scales_ratios(gap: float, factor: float) -> None:
    base = steady(0.0, 10.2, gap, 1.0, 15)
    slow = steady(0.0, 10.2, gap * factor, 1.0, 15)
    window = LevelWindow(1, 0.0, 10.0, 10.2 + 16 * gap * max(factor, 1.0))
    a = level_stats(window, [base], threshold=1.2)
    b = level_stats(window, [slow], threshold=1.2)
    assert a.worst_1pct is not None and b.worst_1pct is not None
    assert b.worst_1pct == pytest.approx(a.worst_1pct / factor, rel=1e-6)
    assert a.worst_1pct == pytest.approx(1.0 / gap, rel=1e-6)


def test_underruns_are_counted_inside_the_window_only() -> None:
    # The listener starts 0.2 s after the first chunk; a 0.3 s chunk then a 2 s wait:
    # the buffer runs dry once, during the warm-up; then once inside the window.
    trace = tts_trace(0.0, [(1.0, 0.3), (3.0, 2.0), (4.0, 2.0), (20.0, 2.0), (21.0, 1.0)])
    s = level_stats(W, [trace], threshold=1.2)
    assert len(trace.underruns) == 2
    assert s.underruns == 1 and s.stall_s == pytest.approx(20.0 - 7.0)


def test_a_stream_that_stalls_at_its_first_seam_fails_the_stall_rule() -> None:
    # Inside the window: a 0.32 s first chunk, then a 2 s chunk 0.8 s later (2.5x, far
    # above the steady threshold) and steady 2 s chunks every 1.25 s. The listener
    # starts 0.2 s after the first chunk and runs dry 0.28 s before the second arrives.
    seam = tts_trace(11.0, [(11.5, 0.32), (12.3, 2.0)] + [(12.3 + 1.25 * i, 2.0) for i in
                     range(1, 12)])  # fmt: skip
    smooth = steady(11.0, 11.5, 1.25, 2.0, 12)
    # Started and stalled in the warm-up: neither counted as a stream nor as stalled.
    early = tts_trace(0.0, [(1.0, 0.32), (1.8, 2.0)] + [(1.8 + 1.25 * i, 2.0) for i in
                      range(1, 25)])  # fmt: skip
    s = level_stats(W, [seam, smooth, early], threshold=1.2, max_stall_share=0.0)
    assert s.worst_1pct is not None and s.worst_1pct >= 1.2
    assert (s.streams, s.stalled_streams, s.startup_stalls) == (2, 1, 1)
    assert s.stalled_share == pytest.approx(0.5)
    assert s.verdict == "stalls" and s.failed_rules == ("stalls",) and not s.passed
    assert level_stats(W, [seam, smooth], threshold=1.2, max_stall_share=0.5).passed
    assert level_stats(W, [seam, smooth], threshold=1.2).passed  # not judged
    # A level that breaks several rules names them all; its verdict is the first.
    slow = level_stats(W, [seam], threshold=3.0, max_stall_share=0.0, ttfa_limit_s=0.4)
    assert slow.ttfa_p99_s == pytest.approx(0.5)
    assert slow.verdict == "slow" and slow.failed_rules == ("steady", "stalls", "ttfa")
    assert level_stats(W, [smooth], threshold=1.2, ttfa_limit_s=0.4).verdict == "ttfa"
    assert level_stats(W, [smooth], threshold=1.2, ttfa_limit_s=0.5).verdict == "pass"


def test_time_to_first_audio_splits_where_the_stream_opened_and_names_its_cause() -> None:
    # Through a gateway's queue: each session waits 5 s before its stream opens, then
    # the engine sends first audio 0.3 s later and keeps 1.6x.
    queued = [steady(s, s + 5.3, 1.25, 2.0, 12, opened=s + 5.0) for s in (6.0, 12.0, 20.0)]
    q = level_stats(W, queued, threshold=1.2, max_stall_share=0.0, ttfa_limit_s=1.0)
    assert q.ttfa_p99_s == pytest.approx(5.3)
    assert q.wait_p99_s == pytest.approx(5.0) and q.engine_ttfa_p99_s == pytest.approx(0.3)
    assert q.verdict == "ttfa" and q.failed_rules == ("ttfa",) and q.ttfa_cause == "queue"
    # The engine's own part breaks the limit: its cause is the engine, whatever the wait.
    slow = [steady(s, s + 1.6, 1.25, 2.0, 12, opened=s + 0.4) for s in (12.0, 20.0)]
    e = level_stats(W, slow, threshold=1.2, ttfa_limit_s=1.0)
    assert e.engine_ttfa_p99_s == pytest.approx(1.2) and e.wait_p99_s == pytest.approx(0.4)
    assert e.verdict == "ttfa" and e.ttfa_cause == "engine"
    # The limit is inclusive for the engine's part too.
    edge = [steady(12.0, 13.5, 1.25, 2.0, 12, opened=12.5)]
    assert level_stats(W, edge, threshold=1.2, ttfa_limit_s=1.0).ttfa_cause == "queue"
    # Held rule: no cause; the split is still reported.
    fine = level_stats(W, queued, threshold=1.2, ttfa_limit_s=6.0)
    assert fine.passed and fine.ttfa_cause is None and fine.wait_p99_s == pytest.approx(5.0)
    # Without an opening recorded (older traces) the split and the cause are unknown.
    unknown = [steady(s, s + 5.3, 1.25, 2.0, 12) for s in (12.0, 20.0)]
    u = level_stats(W, unknown, threshold=1.2, ttfa_limit_s=1.0)
    assert u.verdict == "ttfa" and u.ttfa_cause is None
    assert u.wait_p99_s is None and u.engine_ttfa_p99_s is None


def test_verdict_precedence_and_error_tolerance() -> None:
    ok = steady(0.0, 10.5, 0.5, 1.0, 20)
    error = SessionTrace(1.0, 2.0, "error", detail="HTTP 500 boom")
    refused = SessionTrace(1.0, 1.1, "refused", detail="pool_full")
    assert level_stats(W, [ok, error], threshold=1.2).verdict == "errors"
    tolerant = level_stats(W, [ok, ok, ok, error], threshold=1.2, max_error_rate=0.25)
    assert tolerant.verdict == "pass"
    s = level_stats(W, [ok, error, refused], threshold=1.2)
    assert s.verdict == "refused" and s.details == ("HTTP 500 boom", "pool_full")
    assert level_stats(W, [], threshold=1.2).verdict == "no data"
    cut = LevelWindow(2, 0.0, 10.0, 20.0, complete=False)
    assert level_stats(cut, [ok], threshold=1.2).verdict == "interrupted"


# -- ASR --------------------------------------------------------------------------------


def test_event_share_accounts_for_a_partial_last_event() -> None:
    # 9 s of audio in events 0.5 s apart; the last comes after 0.25 s: it carries half a
    # share, so share = 9 / (4 + 0.5) = 2 s.
    trace = asr_trace(0.0, [1.0, 1.5, 2.0, 2.5, 2.75], 9.0)
    assert event_share(trace) == pytest.approx(2.0)
    assert event_share(asr_trace(0.0, [1.0, 1.5], 4.0)) is None  # too few events
    cut = asr_trace(0.0, [1.0, 1.5, 2.0], 9.0, outcome="cancelled")
    assert event_share(cut) is None


def test_asr_ratios_use_the_share_and_skip_the_remainder_event() -> None:
    trace = asr_trace(0.0, [1.0, 1.5, 2.0, 2.5, 2.75], 9.0)
    samples = ratio_samples(trace, "asr")
    assert [round(r, 6) for *_, r in samples] == [4.0, 4.0, 4.0]  # 2 s per 0.5 s
    # Per-token events (80 ms each) are judged over spans of at least 0.4 s of audio.
    fine = asr_trace(0.0, [1.0 + 0.04 * i for i in range(101)], 8.0)
    share = event_share(fine)
    assert share == pytest.approx(0.08, rel=0.02)
    k_samples = ratio_samples(fine, "asr")
    assert 0.4 <= k_samples[0][1] < 0.4 + share
    assert len(k_samples) == 100 - math.ceil(0.4 / share)
    assert all(r == pytest.approx(2.0, rel=0.02) for *_, r in k_samples)


def test_unfinished_asr_sessions_use_the_level_share() -> None:
    done = asr_trace(10.0, [11.0, 12.0, 13.0, 14.0, 15.0], 10.0)  # share 2 s, 2x
    cut = asr_trace(10.0, [11.0, 13.0, 15.0, 17.0], 20.0, outcome="cancelled")  # 1x
    s = level_stats(W, [done, cut], threshold=1.2, kind="asr")
    assert sorted(r for r in s.stream_ratios) == pytest.approx([1.0, 2.0])
    assert s.worst_1pct == pytest.approx(1.0) and s.verdict == "slow"
    assert s.throughput == pytest.approx((10.0 + 4 * 2.0) / 30.0)
    alone = level_stats(W, [cut], threshold=1.2, kind="asr")
    assert alone.verdict == "no data"  # nothing to learn the share from...
    hinted = level_stats(W, [cut], threshold=1.2, kind="asr", share=2.0)
    assert hinted.worst_1pct == pytest.approx(1.0)  # ...unless the caller knows it
    assert s.ttfa_p50_s == pytest.approx(1.0)  # first transcript event


# -- recorded runs ----------------------------------------------------------------------


def test_recorded_tts_run_decides_the_ceiling() -> None:
    levels = recorded("tts-c2")
    assert [(w.level, s.verdict) for w, s in levels] == [
        (1, "pass"),
        (2, "pass"),
        (4, "slow"),
        (3, "slow"),
    ]
    by_level = {w.level: s for w, s in levels}
    assert by_level[2].worst_1pct == pytest.approx(1.46, abs=0.05)
    assert by_level[3].worst_1pct == pytest.approx(0.99, abs=0.05)
    summary = summarize([s for _, s in levels], 1.2)
    assert (summary.ceiling, summary.bounded, summary.bracket) == (2, True, (2, 3))


def test_recorded_asr_run_decides_the_ceiling() -> None:
    levels = recorded("asr-c3")
    summary = summarize([s for _, s in levels], 1.2)
    assert (summary.ceiling, summary.bounded) == (3, True)
    assert {w.level: s.verdict for w, s in levels} == {
        1: "pass",
        2: "pass",
        4: "slow",
        3: "pass",
    }


@pytest.mark.parametrize(
    ("threshold", "ceiling", "bounded"), [(3.5, 0, True), (2.0, 1, True), (0.9, 3, True)]
)
def test_recorded_run_reanalysed_at_another_threshold(
    threshold: float, ceiling: int, bounded: bool
) -> None:
    levels = recorded("tts-c2", threshold)
    summary = summarize([s for _, s in levels], threshold)
    assert (summary.ceiling, summary.bounded) == (ceiling, bounded)


def test_traces_round_trip(tmp_path: object) -> None:
    runs = read_traces(DATA / "tts-c2.jsonl")
    for _, traces, _ in runs:
        for trace in traces:
            assert trace_from_json(trace_json(trace)) == trace
    opened = steady(1.0, 6.3, 1.25, 2.0, 3, opened=6.0)
    assert opened.opened_at == 6.0 and trace_from_json(trace_json(opened)) == opened
    older = trace_json(opened)
    del older["opened_at"]  # files saved before the opening was recorded
    assert trace_from_json(older).opened_at is None
    out = tmp_path / "again.jsonl"  # type: ignore[operator]
    write_traces(runs, out)
    assert read_traces(out) == runs
