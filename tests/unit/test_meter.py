"""The session meter: gaps, ratios, TTFA, playback, finalize; and its Prometheus sink."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.samples import Sample

from proxy.metering.adapters import AudioFormat, http_adapter, ws_adapter
from proxy.metering.rolling import ReplicaSignals
from proxy.metering.series import Metrics
from proxy.metering.session_meter import (
    RATIO_CAP,
    PrometheusReplicaSink,
    RecordingReplicaSink,
    SessionMeter,
    SessionSummary,
)


def meter(
    admitted_at: float = 100.0, prebuffer_s: float = 0.2
) -> tuple[SessionMeter, RecordingReplicaSink]:
    sink = RecordingReplicaSink()
    return SessionMeter(admitted_at, sink, prebuffer_s), sink


def test_ten_fifth_second_pcm_chunks_are_two_seconds_and_nine_gaps() -> None:
    session, sink = meter(admitted_at=0.0)
    ws = ws_adapter("vllm-omni-speech-ws", session, AudioFormat(24000, 1, 2))
    for i in range(10):
        ws.upstream_binary(0.3 + i * 0.2, bytes(9600))
    summary = session.finish(2.5)
    assert summary.audio_seconds == 2.0
    assert summary.chunks == 10
    assert len(sink.gaps) == 9
    assert sink.gaps == pytest.approx([0.2] * 9)
    assert sink.ratios == pytest.approx([1.0] * 9)
    assert summary.time_to_first_audio == pytest.approx(0.3)
    assert summary.p99_gap == pytest.approx(0.2)
    assert summary.worst_ratio == pytest.approx(1.0)
    assert summary.underruns == 0


def test_upstream_pause_gives_exactly_one_underrun_and_its_stall() -> None:
    session, sink = meter(admitted_at=0.0)
    for i in range(10):
        session.audio(i * 0.2, 0.2)  # buffered audio runs out at 0.2 + 2.0 = 2.2
    session.audio(5.0, 0.2)
    for i in range(1, 10):
        session.audio(5.0 + i * 0.2, 0.2)
    summary = session.finish(7.0)
    assert summary.underruns == 1
    assert summary.stall_seconds == pytest.approx(2.8)
    assert sink.stalls == pytest.approx([2.8])
    assert summary.p99_gap == pytest.approx(5.0 - 1.8)
    assert summary.worst_ratio == pytest.approx(0.2 / 3.2)


def test_faster_than_realtime_has_no_underrun() -> None:
    session, sink = meter(admitted_at=0.0)
    for i in range(100):
        session.audio(0.5 + i * 0.1, 0.2)
    summary = session.finish(20.0)
    assert summary.underruns == 0
    assert summary.stall_seconds == 0.0
    assert sink.stalls == []
    assert summary.worst_ratio == pytest.approx(2.0)


def test_time_to_first_audio_is_observed_once_from_admission() -> None:
    session, sink = meter(admitted_at=100.0)
    session.event(100.1)  # text before audio does not count as audio
    session.audio(100.35, 0.1)
    session.audio(100.4, 0.1)
    assert sink.ttfa == pytest.approx([0.35])
    assert sink.client_ttfa == pytest.approx([0.35])  # no separate arrival: the same


def test_client_time_to_first_audio_runs_from_arrival_and_includes_the_queue() -> None:
    sink = RecordingReplicaSink()
    session = SessionMeter(100.0, sink, arrived_at=91.5)  # 8.5 s in the queue
    session.audio(100.25, 0.2)
    session.audio(100.45, 0.2)
    summary = session.finish(101.0)
    assert sink.ttfa == pytest.approx([0.25])
    assert sink.client_ttfa == pytest.approx([8.75])
    assert summary.time_to_first_audio == pytest.approx(0.25)
    assert summary.client_time_to_first_audio == pytest.approx(8.75)
    # Everything else runs from admission: the queue is not delivery time.
    assert summary.wall_seconds == pytest.approx(1.0)
    assert summary.active_seconds == pytest.approx(0.45)
    fields = summary.as_log_fields()
    assert (fields["ttfa_s"], fields["client_ttfa_s"]) == (0.25, 8.75)


def test_a_session_without_audio_has_no_client_time_to_first_audio() -> None:
    sink = RecordingReplicaSink()
    session = SessionMeter(100.0, sink, arrived_at=95.0)
    session.event(100.5)
    summary = session.finish(101.0)
    assert summary.client_time_to_first_audio is None and sink.client_ttfa == []


@pytest.mark.parametrize("arrived_at", [100.001, math.nan])
def test_an_arrival_after_admission_is_refused(arrived_at: float) -> None:
    with pytest.raises(ValueError, match="arrives before it is admitted"):
        SessionMeter(100.0, RecordingReplicaSink(), arrived_at=arrived_at)


def test_first_chunk_has_no_gap_and_no_ratio() -> None:
    session, sink = meter()
    session.audio(101.0, 0.2)
    session.audio(101.1, 0.2)
    assert sink.chunks[0] == (101.0, 0.2, None, None)
    assert sink.chunks[1][2:] == (pytest.approx(0.1), pytest.approx(2.0))


def test_zero_gap_ratio_is_capped() -> None:
    session, sink = meter()
    session.audio(101.0, 0.2)
    session.audio(101.0, 0.2)
    session.audio(100.9, 0.2)  # a clock step back is a zero gap, not a negative one
    assert sink.gaps == [0.0, 0.0]
    assert sink.ratios == [RATIO_CAP, RATIO_CAP]


def test_empty_or_invalid_audio_is_ignored() -> None:
    session, sink = meter()
    session.audio(101.0, 0.0)
    session.audio(101.1, -1.0)
    session.audio(101.2, math.nan)
    assert sink.chunks == []
    assert session.finish(102.0).chunks == 0


def test_text_only_session_measures_event_gaps() -> None:
    session, sink = meter(admitted_at=0.0)
    for t in (1.0, 1.5, 1.7, 2.7):
        session.event(t)
    summary = session.finish(3.0)
    assert sink.gaps == pytest.approx([0.5, 0.2, 1.0])
    assert sink.ratios == []
    assert summary.events == 4
    assert summary.audio_seconds == 0.0
    assert summary.time_to_first_audio is None
    assert summary.worst_ratio is None
    assert summary.p99_gap == pytest.approx(1.0)


def test_events_in_an_audio_session_do_not_dilute_audio_gaps() -> None:
    session, sink = meter()
    session.audio(101.0, 0.5)
    session.event(101.2)
    session.event(101.4)
    session.audio(101.5, 0.5)
    assert sink.gaps == pytest.approx([0.5])
    assert session.finish(102.0).events == 2


def test_response_end_starts_a_new_timeline_without_underrun() -> None:
    session, sink = meter(admitted_at=0.0)
    session.audio(0.1, 0.5)
    session.audio(0.2, 0.5)
    session.response_end(0.25)
    session.audio(9.0, 0.5)  # the client's next request, much later
    session.audio(9.1, 0.5)
    summary = session.finish(10.0)
    assert sink.gaps == pytest.approx([0.1, 0.1])
    assert summary.underruns == 0
    assert summary.audio_seconds == 2.0


def test_utterance_end_skips_the_gap_but_the_listener_keeps_playing() -> None:
    session, sink = meter(admitted_at=0.0)
    session.audio(0.0, 0.5)
    session.audio(0.1, 0.5)  # buffered audio lasts until 0.2 + 1.0 = 1.2
    session.utterance_end(0.2)
    session.audio(1.0, 0.5)  # next sentence in time: first-chunk latency, not a gap
    session.audio(1.1, 0.5)
    session.utterance_end(1.2)
    session.audio(3.0, 0.5)  # next sentence late: the listener heard 3.0 - 2.2 s of silence
    summary = session.finish(4.0)
    assert sink.gaps == pytest.approx([0.1, 0.1])
    assert summary.underruns == 1
    assert summary.stall_seconds == pytest.approx(0.8)


def test_finalize_latency_from_commit_to_transcript() -> None:
    session, sink = meter(admitted_at=0.0)
    session.transcript_final(0.5)  # nothing committed yet: ignored
    session.commit_final(1.0)
    session.commit_final(1.1)  # the earliest unanswered commit counts
    session.transcript_final(1.4)
    session.transcript_final(1.6)  # already answered
    session.commit_final(2.0)
    session.transcript_final(2.9)
    summary = session.finish(3.0)
    assert sink.finalizes == pytest.approx([0.4, 0.9])
    assert summary.finalize_seconds == pytest.approx(0.9)


def test_finish_is_idempotent_and_ends_metering() -> None:
    session, sink = meter(admitted_at=0.0)
    session.audio(0.5, 0.2)
    first = session.finish(1.0)
    session.audio(1.5, 0.2)
    session.event(1.6)
    session.commit_final(1.7)
    session.transcript_final(1.8)
    assert session.finish(9.0) is first
    assert sink.summaries == [first]
    assert len(sink.chunks) == 1
    assert first.wall_seconds == 1.0
    assert session.finished


def test_summary_log_fields() -> None:
    summary = SessionSummary(
        audio_seconds=2.00004,
        wall_seconds=3.5,
        worst_ratio=1.23456,
        p99_gap=0.21234,
        underruns=1,
        stall_seconds=0.5,
        time_to_first_audio=0.3,
        chunks=10,
        events=0,
        finalize_seconds=None,
        active_seconds=2.5004,
    )
    assert summary.as_log_fields() == {
        "audio_s": 2.0,
        "wall_s": 3.5,
        "active_s": 2.5,
        "delivery_ratio_worst_1pct": 1.235,
        "gap_p99_s": 0.2123,
        "underruns": 1,
        "first_chunk_underruns": 0,
        "stall_s": 0.5,
        "ttfa_s": 0.3,
        "client_ttfa_s": None,
        "chunks": 10,
        "events": 0,
        "finalize_s": None,
    }


def test_long_session_quantiles_stay_bounded_and_close() -> None:
    session, _ = meter(admitted_at=0.0)
    now = 0.0
    for i in range(20_000):
        now += 0.5 if i % 50 == 0 else 0.04  # 2 % of gaps are slow
        session.audio(now, 0.08)
    summary = session.finish(now)
    assert summary.p99_gap == pytest.approx(0.5, rel=0.02)
    assert summary.worst_ratio == pytest.approx(0.16, rel=0.02)
    assert len(session._gaps._hist.buckets) < 10  # type: ignore[union-attr]


@given(st.lists(st.floats(0.0, 3.0), min_size=2, max_size=80))
def test_session_p99_gap_is_the_nearest_rank_value(gaps: list[float]) -> None:
    session, sink = meter(admitted_at=0.0)
    now = 0.0
    session.audio(now, 0.1)
    for gap in gaps:
        now += gap
        session.audio(now, 0.1)
    observed = sorted(sink.gaps)
    rank = math.ceil(0.99 * len(observed))
    assert session.finish(now).p99_gap == observed[rank - 1]


# --- active time: the aggregate delivery ratio's denominator ---------------------------


def aggregate_ratio(metrics: Metrics, pool: str, replica: str) -> float:
    """audio_delivered / stream_active, as the recording rule computes it."""
    rep = {"pool": pool, "replica": replica}
    audio = sample(metrics, "headroom_audio_delivered_seconds_total", **rep)
    active = sample(metrics, "headroom_stream_active_seconds_total", **rep)
    assert audio is not None and active is not None
    return audio / active if active else math.inf


def test_a_one_chunk_response_counts_its_wall_time_as_active() -> None:
    """A non-streamed HTTP response (the whole body in one chunk) used to add 5 s of audio
    and no active time, so the aggregate delivery ratio of a pool serving such responses
    was infinite (or inflated by every one of them)."""
    metrics = Metrics()
    sink = PrometheusReplicaSink(metrics, "tts", "gpu0", ReplicaSignals())
    session = SessionMeter(0.0, sink)
    http = http_adapter("openai-speech-http", session, AudioFormat(24000, 1, 2))
    http.request("POST", {}, "application/json", b'{"input": "hello"}')
    http.response_start(200, {"Content-Type": "audio/pcm"})
    http.response_chunk(2.0, bytes(240_000))  # 5 s of audio, 2 s after admission
    http.response_complete(2.001)
    summary = session.finish(2.01)
    assert summary.audio_seconds == pytest.approx(5.0)
    assert summary.active_seconds == pytest.approx(2.0)
    assert aggregate_ratio(metrics, "tts", "gpu0") == pytest.approx(2.5)


def test_a_streamed_response_counts_from_admission_to_its_last_chunk() -> None:
    """Ten 0.2 s chunks every 0.2 s after 0.3 s to first audio: the listener received 2 s
    of audio over 2.1 s. Counting only the gaps (1.8 s) read 1.11x, faster than realtime."""
    session, sink = meter(admitted_at=0.0)
    for i in range(10):
        session.audio(0.3 + i * 0.2, 0.2)
    summary = session.finish(2.5)
    assert sink.openings == pytest.approx([0.3])
    assert summary.active_seconds == pytest.approx(2.1) == pytest.approx(sink.active_seconds)
    assert summary.audio_seconds / summary.active_seconds == pytest.approx(2.0 / 2.1)


def test_a_sentence_boundary_counts_its_wait_in_full() -> None:
    session, sink = meter(admitted_at=0.0)
    session.audio(0.5, 1.0)
    session.audio(1.0, 1.0)
    session.utterance_end(1.05)
    session.audio(3.0, 1.0)  # the next sentence: 2 s after the previous chunk
    summary = session.finish(4.0)
    assert sink.openings == pytest.approx([0.5, 2.0])
    assert summary.active_seconds == pytest.approx(3.0)  # admission to the last chunk


def test_after_a_response_end_the_clients_think_time_is_not_active() -> None:
    session, sink = meter(admitted_at=0.0)
    session.audio(0.5, 1.0)
    session.response_end(0.6)
    session.audio(30.0, 0.4)  # the client asked again, much later: neutral, 0.4 s
    session.response_end(30.1)
    session.audio(30.2, 0.4)  # answered 0.1 s after the response end: 0.1 s, under the cap
    summary = session.finish(31.0)
    assert sink.openings == pytest.approx([0.5, 0.4, 0.1])
    assert summary.active_seconds == pytest.approx(1.0)


@given(
    st.lists(
        st.tuples(st.floats(0.0, 2.0), st.floats(0.001, 1.0), st.booleans()),
        min_size=1,
        max_size=40,
    )
)
def test_within_one_response_active_time_runs_from_admission_to_the_last_chunk(
    chunks: list[tuple[float, float, bool]],
) -> None:
    metrics = Metrics()
    sink = PrometheusReplicaSink(metrics, "tts", "gpu0", ReplicaSignals())
    session = SessionMeter(10.0, sink)
    now = 10.0
    for wait, seconds, sentence_end in chunks:
        now += wait
        session.audio(now, seconds)
        if sentence_end:
            session.utterance_end(now)
    summary = session.finish(now + 1.0)
    assert summary.active_seconds == pytest.approx(now - 10.0, abs=1e-9)
    counted = sample(metrics, "headroom_stream_active_seconds_total", pool="tts", replica="gpu0")
    assert counted == pytest.approx(summary.active_seconds, abs=1e-9)


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_prometheus_sink_observes_the_contract_metrics() -> None:
    metrics = Metrics()
    signals = ReplicaSignals(30.0, min_samples=1)
    sink = PrometheusReplicaSink(metrics, "tts", "gpu0", signals)
    # Children are resolved once: later label look-ups must not be needed.
    metrics.chunk_gap.labels = None  # type: ignore[method-assign, assignment]
    session = SessionMeter(10.0, sink)
    for i in range(10):
        session.audio(10.5 + i * 0.2, 0.2)
    session.audio(15.0, 0.2)  # an underrun: buffered audio ran out at 0.7 + 2.0
    session.finish(16.0)
    rep = {"pool": "tts", "replica": "gpu0"}
    assert sample(metrics, "headroom_chunk_gap_seconds_count", **rep) == 10
    assert sample(metrics, "headroom_chunk_delivery_ratio_count", **rep) == 10
    assert sample(metrics, "headroom_audio_delivered_seconds_total", **rep) == pytest.approx(2.2)
    # Active: admission (10.0) to the first audio (10.5), then the gaps to 15.0.
    assert sample(metrics, "headroom_stream_active_seconds_total", **rep) == pytest.approx(5.0)
    assert sample(metrics, "headroom_playback_underruns_total", **rep) == 1
    assert sample(metrics, "headroom_playback_stall_seconds_total", **rep) == pytest.approx(2.3)
    assert sample(metrics, "headroom_time_to_first_audio_seconds_sum", pool="tts") == pytest.approx(
        0.5
    )
    # No separate arrival: the client's figure is the engine's.
    client_sum = sample(metrics, "headroom_client_time_to_first_audio_seconds_sum", pool="tts")
    assert client_sum == pytest.approx(0.5)
    assert sample(metrics, "headroom_stream_gap_p99_seconds_count", pool="tts") == 1
    assert signals.samples(15.0) == 10
    assert signals.worst_ratio(15.0) == pytest.approx(0.2 / 2.7, rel=0.02)


def test_a_speech_only_pool_exports_no_asr_finalize_series() -> None:
    """headroom_asr_finalize_seconds{pool="tts"} used to be created (all zeros) by every
    TTS replica's sink; only a pool that has answered an ASR commit has a series now."""
    metrics = Metrics()
    tts = SessionMeter(0.0, PrometheusReplicaSink(metrics, "tts", "gpu0", ReplicaSignals()))
    tts.audio(0.5, 0.2)
    tts.audio(0.7, 0.2)
    tts.finish(1.0)
    asr = SessionMeter(0.0, PrometheusReplicaSink(metrics, "asr", "gpu1", ReplicaSignals()))
    asr.event(0.5)
    asr.finish(1.0)  # no commit answered yet: no series either
    text = generate_latest(metrics.registry).decode()
    assert "# TYPE headroom_asr_finalize_seconds histogram" in text  # still registered
    assert "headroom_asr_finalize_seconds_count" not in text
    asr = SessionMeter(2.0, PrometheusReplicaSink(metrics, "asr", "gpu1", ReplicaSignals()))
    asr.commit_final(2.0)
    asr.transcript_final(2.25)
    asr.finish(3.0)
    assert sample(metrics, "headroom_asr_finalize_seconds_count", pool="asr") == 1
    assert sample(metrics, "headroom_asr_finalize_seconds_count", pool="tts") is None
    assert 'headroom_asr_finalize_seconds_count{pool="tts"}' not in (
        generate_latest(metrics.registry).decode()
    )


def test_first_chunk_underruns_are_counted_apart_and_among_all_underruns() -> None:
    metrics = Metrics()
    session = SessionMeter(0.0, PrometheusReplicaSink(metrics, "tts", "gpu0", ReplicaSignals()))
    session.audio(0.1, 0.32)  # plays 0.3 .. 0.62
    session.audio(1.0, 2.0)  # first-chunk underrun: 0.38 s
    session.audio(4.0, 2.0)  # mid-stream: the buffer ran dry at 3.0
    summary = session.finish(5.0)
    assert (summary.underruns, summary.first_chunk_underruns) == (2, 1)
    assert summary.as_log_fields()["first_chunk_underruns"] == 1
    rep = {"pool": "tts", "replica": "gpu0"}
    assert sample(metrics, "headroom_playback_underruns_total", **rep) == 2
    assert sample(metrics, "headroom_playback_first_chunk_underruns_total", **rep) == 1
    recording, sink = meter(admitted_at=0.0)
    for now, seconds in ((0.1, 0.32), (1.0, 2.0), (4.0, 2.0)):
        recording.audio(now, seconds)
    assert sink.stalls == pytest.approx([0.38, 1.0])
    assert sink.first_chunk_stalls == pytest.approx([0.38])


def test_prometheus_sink_text_events_and_finalize() -> None:
    metrics = Metrics()
    signals = ReplicaSignals(min_samples=1)
    session = SessionMeter(0.0, PrometheusReplicaSink(metrics, "asr", "gpu1", signals))
    session.event(1.0)
    session.event(1.25)
    session.commit_final(2.0)
    session.transcript_final(2.3)
    session.finish(3.0)
    rep = {"pool": "asr", "replica": "gpu1"}
    assert sample(metrics, "headroom_chunk_gap_seconds_sum", **rep) == pytest.approx(0.25)
    assert sample(metrics, "headroom_chunk_delivery_ratio_count", **rep) == 0
    assert sample(metrics, "headroom_asr_finalize_seconds_sum", pool="asr") == pytest.approx(0.3)
    assert sample(metrics, "headroom_time_to_first_audio_seconds_count", pool="asr") == 0
    assert signals.samples(3.0) == 0
    assert signals.p99_gap(3.0) == pytest.approx(0.25, rel=0.02)


def test_each_streams_first_seam_is_reported_once_with_whether_it_stalled() -> None:
    signals = ReplicaSignals(window_s=10)
    session = SessionMeter(0.0, PrometheusReplicaSink(Metrics(), "tts", "gpu0", signals))
    session.audio(0.1, 0.32)  # plays 0.3 .. 0.62
    session.audio(1.0, 2.0)  # first seam: stalled
    session.audio(2.0, 2.0)  # not a seam
    session.response_end(2.5)
    session.audio(9.0, 0.32)  # a new stream after the idle: plays 9.2 .. 9.52
    session.audio(9.1, 2.0)  # its first seam: in time
    startup = signals.startup(9.5)
    assert (startup.seams, startup.stalled, startup.ttfas) == (2, 1, 1)
    assert startup.ttfa_p99 == pytest.approx(0.1, rel=0.02)
    recording, sink = meter(admitted_at=0.0)
    for now, seconds in ((0.1, 0.32), (1.0, 2.0), (2.0, 2.0)):
        recording.audio(now, seconds)
    assert sink.first_seams == [(1.0, True)]


def test_prometheus_sink_exports_both_figures_and_the_guard_sees_the_engines() -> None:
    """A session that queued 8.5 s: the client histogram holds the wait, the engine's
    (the contract's admission-to-first-audio, and the guard's input) does not."""
    metrics = Metrics()
    signals = ReplicaSignals(window_s=30)
    sink = PrometheusReplicaSink(metrics, "tts", "gpu0", signals)
    session = SessionMeter(10.0, sink, arrived_at=1.5)
    session.audio(10.25, 0.2)
    session.finish(11.0)
    engine = {s.labels.get("le"): s.value for s in _samples(metrics, "headroom_time_to_first")}
    client = {s.labels.get("le"): s.value for s in _samples(metrics, "headroom_client_time")}
    assert engine["0.3"] == 1 and engine["0.2"] == 0
    assert client["10.0"] == 1 and client["7.5"] == 0 and client["+Inf"] == 1
    assert sample(metrics, "headroom_client_time_to_first_audio_seconds_sum", pool="tts") == (
        pytest.approx(8.75)
    )
    assert signals.startup(10.5).ttfa_p99 == pytest.approx(0.25, rel=0.02)


def _samples(metrics: Metrics, prefix: str) -> list[Sample]:
    return [
        s
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name.startswith(prefix) and s.name.endswith("_bucket")
    ]
