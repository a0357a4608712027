"""The per-session meter: gaps, delivery ratio, time to first audio, playback stalls.

Pure: no clock reads, no asyncio; every call takes the arrival time ``now``. A protocol
adapter (:mod:`proxy.metering.adapters`) feeds a :class:`SessionMeter` as its
:class:`~proxy.metering.adapters.MeterSink`; the meter pushes per-chunk observations to a
:class:`ReplicaSink` (Prometheus and the guard's rolling signals in production, a
:class:`RecordingReplicaSink` in tests) and returns a :class:`SessionSummary` at the end.

Definitions (per session):

- **gap**: wall seconds between consecutive upstream chunks. Once a session has produced
  audio it is measured between audio chunks only (text events next to audio, such as
  transcript deltas, do not dilute it); a session without audio (ASR) measures it between
  events. The first chunk of a session, and the first chunk after an utterance or
  response end (a sentence boundary, or the upstream idling for the client by design),
  have no gap: their wait is first-chunk latency, not delivery speed.
- **delivery ratio**: a chunk's audio seconds / its gap. Chunks without a gap have no
  ratio: time to first audio covers the first one. A zero gap (two chunks in one read)
  gives :data:`RATIO_CAP`, which also caps ratios so Prometheus sums stay finite.
- **time to first audio**: admission to the first chunk with audio, observed once: the
  engine's part (``headroom_time_to_first_audio_seconds``, the guard's input).
- **client time to first audio**: the session's arrival at the gateway to that same
  chunk, observed with it: what the client waited, queue included
  (``headroom_client_time_to_first_audio_seconds``). Without a separate arrival (a
  session that never queued, the probe's own meter) the two are equal.
- **active time** (``headroom_stream_active_seconds_total``, the denominator of the
  aggregate delivery ratio): the wall time a listener spent waiting for or receiving
  audio. Each gap counts, and so does the *opening* of each stream segment (the wait for
  its first chunk, which has no gap): for the session's first audio, admission to that
  chunk (its time to first audio), so a response delivered in one chunk counts its whole
  wall time instead of adding audio with no time at all; after an utterance end (a
  sentence boundary while the response continues), the wait since the previous audio
  chunk; after a response end (the upstream idled for the client, whose think time cannot
  be told apart from generation time), that wait capped at the chunk's own audio seconds
  (a neutral 1.0x: never faster than measured, never slowed by the client). Every audio
  second thus has wall time behind it and ``audio / active`` is the delivery speed a
  listener saw from request to last chunk.
- **playback**: :class:`proxy.metering.playback.PlaybackBuffer` (prebuffer, immediate resume).
- **finalize latency** (ASR): the earliest unanswered ``commit_final`` to the next
  ``transcript_final``; each answered commit is observed once. The summary keeps the worst.
- **session p99 gap / worst-1% ratio**: nearest-rank quantiles over the session's samples
  with :class:`proxy.metering.sketches.QuantileSketch` (exact for the first 256 samples, then
  log buckets with <= 1.96 % error): bounded memory per session.

Audio of zero, negative, infinite or NaN length, and anything fed after :meth:`SessionMeter.finish`
is ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final, Protocol

from prometheus_client import Histogram

from proxy.metering.playback import PlaybackBuffer
from proxy.metering.rolling import ReplicaSignals
from proxy.metering.series import Metrics
from proxy.metering.sketches import QuantileSketch

__all__ = [
    "RATIO_CAP",
    "PrometheusReplicaSink",
    "RecordingReplicaSink",
    "ReplicaSink",
    "SessionMeter",
    "SessionSummary",
]

#: Upper bound of a per-chunk delivery ratio (audio s per wall s).
RATIO_CAP: Final = 1000.0


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """What one session delivered; :meth:`as_log_fields` goes on the end-of-session log line.

    ``worst_ratio`` is the 1st percentile of per-chunk delivery ratios, ``p99_gap`` the
    99th percentile of gaps; both None without samples, ``time_to_first_audio`` (from
    admission) and ``client_time_to_first_audio`` (from arrival) None without audio,
    ``finalize_seconds`` None without an answered ASR commit (the worst one
    if several). ``chunks`` counts audio chunks, ``events`` metered non-audio events;
    ``wall_seconds`` runs from admission to :meth:`SessionMeter.finish`; ``active_seconds``
    is the session's share of ``headroom_stream_active_seconds_total`` (module docstring),
    so ``audio_seconds / active_seconds`` is its aggregate delivery ratio."""

    audio_seconds: float
    wall_seconds: float
    worst_ratio: float | None
    p99_gap: float | None
    underruns: int
    stall_seconds: float
    time_to_first_audio: float | None
    chunks: int
    events: int
    finalize_seconds: float | None
    active_seconds: float = 0.0
    first_chunk_underruns: int = 0
    client_time_to_first_audio: float | None = None

    def as_log_fields(self) -> dict[str, float | int | None]:
        """Flat, rounded fields for a JSON log line."""

        def r(value: float | None, digits: int = 3) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "audio_s": r(self.audio_seconds),
            "wall_s": r(self.wall_seconds),
            "active_s": r(self.active_seconds),
            "delivery_ratio_worst_1pct": r(self.worst_ratio),
            "gap_p99_s": r(self.p99_gap, 4),
            "underruns": self.underruns,
            "first_chunk_underruns": self.first_chunk_underruns,
            "stall_s": r(self.stall_seconds),
            "ttfa_s": r(self.time_to_first_audio),
            "client_ttfa_s": r(self.client_time_to_first_audio),
            "chunks": self.chunks,
            "events": self.events,
            "finalize_s": r(self.finalize_seconds),
        }


class ReplicaSink(Protocol):
    """Per-(pool, replica) destination of a meter's observations. Shared by sessions."""

    def chunk(self, now: float, audio_s: float, gap: float | None, ratio: float | None) -> None:
        """One metered chunk: ``audio_s`` > 0 for audio (0.0 for a gap-only event); ``gap``
        None for a stream's first chunk; ``ratio`` only for audio chunks with a gap."""

    def first_audio(self, ttfa_s: float, now: float, client_ttfa_s: float) -> None:
        """Admission to first audio (``ttfa_s``, ended at ``now``) and the session's
        arrival to it (``client_ttfa_s``, queue included), once per session that has
        audio."""

    def opening(self, wait_s: float) -> None:
        """Active time of a stream segment's first audio chunk (which has no gap): the
        wait it ended, as defined in the module docstring. Called before its ``chunk``."""

    def underrun(self, stall_s: float) -> None:
        """The modelled buffer ran dry; ``stall_s`` of silence ended with this chunk."""

    def first_chunk_underrun(self) -> None:
        """The underrun just reported was ended by its stream's second chunk (a start-up
        transient, see :mod:`proxy.metering.playback`); called right after that ``underrun``."""

    def first_seam(self, now: float, stalled: bool) -> None:
        """A stream's second audio chunk (its first seam) arrived at ``now``; ``stalled``
        if a first-chunk underrun was just reported for it. Called after ``chunk``."""

    def finalize(self, latency_s: float) -> None:
        """ASR commit-final to final transcript."""

    def stream_end(self, summary: SessionSummary) -> None:
        """The session finished (called once)."""


class PrometheusReplicaSink:
    """Observes the contract metrics (docs/contracts.md); feeds the replica's
    :class:`ReplicaSignals`.

    Build one per replica and share it between that replica's sessions: the replica's
    :class:`~proxy.metering.replica_series.ReplicaSeries` and the pool's label children are
    resolved here, once. Per chunk it only adds plain numbers
    (:meth:`~proxy.metering.replica_series.ReplicaSeries.observe_gap`), no prometheus_client call
    and no lock: see :mod:`proxy.metering.replica_series` for the threading assumption (one
    event-loop thread).
    ``headroom_session_duration_seconds`` is not
    observed here (the relay knows the session's end);
    ``headroom_delivery_ratio_worst_1pct`` is a scrape-time gauge read from
    ``signals.worst_ratio(now)``."""

    __slots__ = (
        "_client_ttfa",
        "_finalize",
        "_gap_p99",
        "_metrics",
        "_series",
        "_signals",
        "_ttfa",
        "pool",
        "replica",
    )

    def __init__(self, metrics: Metrics, pool: str, replica: str, signals: ReplicaSignals):
        self.pool = pool
        self.replica = replica
        self._metrics = metrics
        self._signals = signals
        self._series = metrics.replica_series(pool, replica)
        self._ttfa = metrics.child(metrics.time_to_first_audio, pool)
        self._client_ttfa = metrics.child(metrics.client_time_to_first_audio, pool)
        self._gap_p99 = metrics.child(metrics.stream_gap_p99, pool)
        # Created by the pool's first answered ASR commit: a pool that only speaks (TTS)
        # never has a headroom_asr_finalize_seconds series, not even one of zeros.
        self._finalize: Histogram | None = None

    def chunk(self, now: float, audio_s: float, gap: float | None, ratio: float | None) -> None:
        series = self._series
        if audio_s > 0.0:
            series.audio += audio_s
        if gap is None:
            return
        series.observe_gap(gap)
        if ratio is None:
            self._signals.observe_gap(now, gap)
            return
        series.observe_ratio(ratio)
        # Stream-active time is the sum of audio gaps, pushed per chunk so rate() is live.
        series.active += gap
        self._signals.observe(now, ratio, gap)

    def first_audio(self, ttfa_s: float, now: float, client_ttfa_s: float) -> None:
        self._ttfa.observe(ttfa_s)
        self._client_ttfa.observe(client_ttfa_s)
        # The guard judges the replica: the engine's part, not the queue in front of it.
        self._signals.observe_ttfa(now, ttfa_s)

    def opening(self, wait_s: float) -> None:
        self._series.active += wait_s

    def underrun(self, stall_s: float) -> None:
        series = self._series
        series.underruns += 1.0
        series.stall += stall_s

    def first_chunk_underrun(self) -> None:
        self._series.first_chunk_underruns += 1.0

    def first_seam(self, now: float, stalled: bool) -> None:
        self._signals.observe_first_seam(now, stalled)

    def finalize(self, latency_s: float) -> None:
        child = self._finalize
        if child is None:
            child = self._finalize = self._metrics.asr_finalize.labels(self.pool)
        child.observe(latency_s)

    def stream_end(self, summary: SessionSummary) -> None:
        if summary.p99_gap is not None:
            self._gap_p99.observe(summary.p99_gap)

    def __repr__(self) -> str:
        return f"<PrometheusReplicaSink {self.pool}/{self.replica}>"


@dataclass
class RecordingReplicaSink:
    """A :class:`ReplicaSink` that keeps every observation, for tests, the simulator and
    the probe. ``underrun_at`` pairs each stall with the arrival time of the chunk that
    ended it (the meter reports a chunk before the underrun it ends)."""

    chunks: list[tuple[float, float, float | None, float | None]] = field(default_factory=list)
    ttfa: list[float] = field(default_factory=list)
    client_ttfa: list[float] = field(default_factory=list)
    openings: list[float] = field(default_factory=list)
    underrun_at: list[tuple[float, float]] = field(default_factory=list)
    first_chunk_stalls: list[float] = field(default_factory=list)
    first_seams: list[tuple[float, bool]] = field(default_factory=list)
    finalizes: list[float] = field(default_factory=list)
    summaries: list[SessionSummary] = field(default_factory=list)

    def chunk(self, now: float, audio_s: float, gap: float | None, ratio: float | None) -> None:
        self.chunks.append((now, audio_s, gap, ratio))

    def first_audio(self, ttfa_s: float, now: float, client_ttfa_s: float) -> None:
        self.ttfa.append(ttfa_s)
        self.client_ttfa.append(client_ttfa_s)

    def opening(self, wait_s: float) -> None:
        self.openings.append(wait_s)

    def underrun(self, stall_s: float) -> None:
        self.underrun_at.append((self.chunks[-1][0] if self.chunks else 0.0, stall_s))

    def first_chunk_underrun(self) -> None:
        self.first_chunk_stalls.append(self.underrun_at[-1][1] if self.underrun_at else 0.0)

    def first_seam(self, now: float, stalled: bool) -> None:
        self.first_seams.append((now, stalled))

    def finalize(self, latency_s: float) -> None:
        self.finalizes.append(latency_s)

    def stream_end(self, summary: SessionSummary) -> None:
        self.summaries.append(summary)

    @property
    def stalls(self) -> list[float]:
        """The stall of each underrun, in order."""
        return [stall for _, stall in self.underrun_at]

    @property
    def gaps(self) -> list[float]:
        return [g for _, _, g, _ in self.chunks if g is not None]

    @property
    def ratios(self) -> list[float]:
        return [r for _, _, _, r in self.chunks if r is not None]

    @property
    def active_seconds(self) -> float:
        """What :class:`PrometheusReplicaSink` adds to the stream-active counter: the gaps
        of audio chunks, and the openings."""
        gaps = [g for _, _, g, r in self.chunks if g is not None and r is not None]
        return sum(gaps, 0.0) + sum(self.openings, 0.0)


class SessionMeter:
    """Meters one admitted session; implements :class:`proxy.metering.adapters.MeterSink`."""

    __slots__ = (
        "_active",
        "_admitted",
        "_arrived",
        "_audio_err",
        "_audio_s",
        "_chunks",
        "_commit",
        "_events",
        "_finalize",
        "_first_audio",
        "_gaps",
        "_last_audio",
        "_last_event",
        "_open_capped",
        "_open_from",
        "_playback",
        "_ratios",
        "_sink",
        "_summary",
    )

    def __init__(
        self,
        admitted_at: float,
        sink: ReplicaSink,
        prebuffer_s: float = 0.2,
        arrived_at: float | None = None,
    ) -> None:
        """``arrived_at``: when the session reached the gateway, before any queue wait
        (None: at ``admitted_at``); the client's time to first audio runs from there."""
        if arrived_at is None:
            arrived_at = admitted_at
        elif not arrived_at <= admitted_at:
            raise ValueError(
                f"a session arrives before it is admitted: arrived_at {arrived_at!r} "
                f"> admitted_at {admitted_at!r}"
            )
        self._admitted = admitted_at
        self._arrived = arrived_at
        # The concrete class first: compiled, a call to it is native after a type check
        # (docs/performance.md).
        self._sink: PrometheusReplicaSink | ReplicaSink = sink
        self._playback = PlaybackBuffer(prebuffer_s)
        self._gaps = QuantileSketch()
        self._ratios = QuantileSketch()
        self._audio_s = 0.0
        self._audio_err = 0.0  # Neumaier compensation: ten 0.2 s chunks sum to exactly 2.0
        self._chunks = 0
        self._events = 0
        self._first_audio: float | None = None
        self._last_audio: float | None = None  # previous audio chunk of this utterance
        self._active = 0.0  # this session's stream-active seconds (module docstring)
        self._open_from = admitted_at  # the next segment opening's wait runs from here...
        self._open_capped = False  # ...capped at its chunk's audio (after a response end)
        self._last_event: float | None = None
        self._commit: float | None = None  # earliest unanswered commit_final
        self._finalize: float | None = None
        self._summary: SessionSummary | None = None

    def move_to(self, sink: ReplicaSink) -> None:
        """Observe into ``sink`` from now on: the session's upstream moved to another
        replica (an HTTP request failing over before anything flowed)."""
        self._sink = sink

    @property
    def finished(self) -> bool:
        return self._summary is not None

    def audio(self, now: float, seconds: float) -> None:
        if not 0.0 < seconds < math.inf or self._summary is not None:
            return
        if self._first_audio is None:
            self._first_audio = now
            self._sink.first_audio(
                max(now - self._admitted, 0.0), now, max(now - self._arrived, 0.0)
            )
        self._chunks += 1
        total = self._audio_s + seconds
        if abs(self._audio_s) >= seconds:
            self._audio_err += (self._audio_s - total) + seconds
        else:
            self._audio_err += (seconds - total) + self._audio_s
        self._audio_s = total
        prev = self._last_audio
        self._last_audio = now
        gap = ratio = None
        if prev is not None:
            gap = now - prev if now > prev else 0.0
            ratio = seconds / gap if gap * RATIO_CAP > seconds else RATIO_CAP
            self._gaps.add(gap)
            self._ratios.add(ratio)
            self._active += gap
        else:
            start = self._open_from
            wait = now - start if now > start else 0.0
            if self._open_capped and wait > seconds:
                wait = seconds
            self._active += wait
            self._sink.opening(wait)
        playback = self._playback
        stall = playback.add(now, seconds)
        self._sink.chunk(now, seconds, gap, ratio)
        first_seam = playback.stream_chunks == 2
        if stall > 0.0:
            self._sink.underrun(stall)
            if first_seam:
                self._sink.first_chunk_underrun()
        if first_seam:
            self._sink.first_seam(now, stall > 0.0)

    def event(self, now: float) -> None:
        if self._summary is not None:
            return
        self._events += 1
        if self._first_audio is not None:
            return  # an audio session is measured on its audio chunks
        prev = self._last_event
        self._last_event = now
        if prev is None:
            self._sink.chunk(now, 0.0, None, None)
            return
        gap = now - prev if now > prev else 0.0
        self._gaps.add(gap)
        self._sink.chunk(now, 0.0, gap, None)

    def utterance_end(self, now: float) -> None:
        if self._last_audio is not None:
            # The response goes on: the wait for the next sentence is delivery time.
            self._open_from, self._open_capped = self._last_audio, False
        self._last_audio = None

    def response_end(self, now: float) -> None:
        if self._summary is not None:
            return
        self._last_audio = None
        self._open_from, self._open_capped = now, True
        self._playback.idle(now)

    def commit_final(self, now: float) -> None:
        if self._summary is None and self._commit is None:
            self._commit = now

    def transcript_final(self, now: float) -> None:
        if self._summary is not None or self._commit is None:
            return
        latency = max(now - self._commit, 0.0)
        self._commit = None
        if self._finalize is None or latency > self._finalize:
            self._finalize = latency
        self._sink.finalize(latency)

    def finish(self, now: float) -> SessionSummary:
        """End the session (idempotent: later calls return the same summary)."""
        if self._summary is not None:
            return self._summary
        self._playback.finish(now)
        first = self._first_audio
        summary = SessionSummary(
            audio_seconds=self._audio_s + self._audio_err,
            wall_seconds=max(now - self._admitted, 0.0),
            worst_ratio=self._ratios.quantile(0.01),
            p99_gap=self._gaps.quantile(0.99),
            underruns=self._playback.underruns,
            first_chunk_underruns=self._playback.first_chunk_underruns,
            stall_seconds=self._playback.stall_seconds,
            time_to_first_audio=None if first is None else max(first - self._admitted, 0.0),
            client_time_to_first_audio=None if first is None else max(first - self._arrived, 0.0),
            chunks=self._chunks,
            events=self._events,
            finalize_seconds=self._finalize,
            active_seconds=self._active,
        )
        self._summary = summary
        self._sink.stream_end(summary)
        return summary

    def __repr__(self) -> str:
        state = "finished" if self._summary is not None else "open"
        audio = self._audio_s + self._audio_err
        return (
            f"<SessionMeter {state} audio={audio:.3f}s chunks={self._chunks} "
            f"events={self._events} underruns={self._playback.underruns}>"
        )
