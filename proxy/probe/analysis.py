"""What one probe level measured, and whether it passes. Pure: no I/O, no clock.

Input: the :class:`SessionTrace` of every session a level opened (arrival times as the
client saw them, metered by :class:`proxy.metering.session_meter.SessionMeter` with the adapters of
:mod:`proxy.metering.adapters`) and the level's :class:`LevelWindow`. Output: the level's
:class:`LevelStats` (:mod:`proxy.probe.ceiling` turns the levels into a ceiling).

Definitions (a level's *window* runs from the end of its warm-up to its end; only what
arrives inside it counts):

- **per-chunk delivery ratio** (TTS): the meter's: a chunk's audio seconds / wall seconds
  since the previous chunk of the same utterance. First chunks have none; neither has an
  utterance's last chunk when it carries less audio than the one before it (a
  *remainder*: a few frames, or a fraction of one, arriving a step after a full chunk
  say nothing about keeping up; a late one still shows as a gap and an underrun).
- **stalled streams** (TTS): of the streams that started playing in the window or ran
  dry in it, those whose modelled playback (:class:`proxy.metering.playback.PlaybackBuffer`,
  the client's ``prebuffer``) ran dry in the window; **startup stalls**: those whose
  first stall came at the stream's first seam (its second chunk). A stream that started
  and stalled during the warm-up is not counted (the simulator's ``describe`` counts the
  streams that started after its warm-up the same way).
- **per-event delivery ratio** (ASR): a transcript event stands for an equal share of
  the clip (:func:`event_share`: from the session itself when it finished, else the
  level's median share). Event ``i``'s ratio is ``k * share / (t_i - t_{i-k})`` with the
  smallest ``k`` whose span covers at least ``min_span_s`` (0.4 s) of audio, so per-token
  deltas are judged over spans as long as a TTS chunk's. A finished session's last event
  carries only the clip's remainder: it has no ratio.
- **worst-1%**: the nearest-rank 1st percentile (:func:`quantile`) of every ratio in the
  window, all streams pooled; the same rank rule as the guard (:mod:`proxy.metering.rolling`).
- **stream ratio**: one stream's own speed in the window, ``sum(audio) / sum(spans)``
  over its ratio samples; the level reports their distribution.
- **throughput**: audio seconds delivered (ASR: transcribed) in the window / its length.
- **time to first audio**: session start (connect) to first audio chunk (ASR: first
  transcript event), for first outputs inside the window. It splits at the moment the
  target opened the stream (:meth:`proxy.probe.probe_session.SessionRecorder.opened`):
  the **wait** before it (connecting, and the queue of a gateway that holds the handshake
  or the response until a slot frees) and the **engine's part** after it (the request
  reaching the engine, its own scheduling and making the first chunk).
- the **cause** of a broken TTFA rule: ``queue`` when the engine's part alone stays
  within the limit (the wait broke it), else ``engine``; None when no session says when
  its stream opened.
- a level **passes** when it ran to completion, no session was refused, errored
  sessions are at most ``max_error_rate`` of those started, it has at least one ratio
  sample, worst-1% >= ``threshold`` (else ``slow``: rule ``steady``), the share of
  stalled streams is at most ``max_stall_share`` (else ``stalls``), and TTFA p99 is at
  most ``ttfa_limit_s`` (else ``ttfa``). :attr:`LevelStats.failed_rules` lists every one
  of the three rules a level broke, by the names ``describe`` uses.

The TTFA rule judges what the client waited, the wait included: a listener hears that.
Its cause says whether the engine or the wait before it broke the rule.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from proxy.metering.session_meter import RATIO_CAP

__all__ = [
    "ASR_MIN_SPAN_S",
    "Arrival",
    "LevelStats",
    "LevelWindow",
    "Outcome",
    "SessionTrace",
    "event_share",
    "level_stats",
    "median_share",
    "quantile",
    "ratio_samples",
]

#: Audio seconds an ASR ratio sample spans at least.
ASR_MIN_SPAN_S = 0.4
_MAX_DETAILS = 5

Outcome = Literal["ok", "error", "refused", "cancelled"]
Kind = Literal["tts", "asr"]


@dataclass(frozen=True, slots=True)
class Arrival:
    """One metered upstream chunk: what :class:`proxy.metering.session_meter.ReplicaSink.chunk`
    received.
    ``audio_s`` is 0.0 for a text event; ``gap``/``ratio`` None where the meter has none."""

    at: float
    audio_s: float
    gap: float | None
    ratio: float | None


@dataclass(frozen=True, slots=True)
class SessionTrace:
    """One session as the probe's client saw it.

    ``outcome``: ``ok`` (the response finished), ``error``, ``refused`` (503/429 or close
    1013), ``cancelled`` (cut by the level's end). ``underruns`` are ``(at, stall_s)`` of
    the modelled playback buffer. ``audio_sent_s`` is the ASR input sent; ``events`` the
    number of transcript events (ASR), ``finalize_s`` the meter's finalize latency;
    ``opened_at`` when the target opened the stream (None: not recorded)."""

    started_at: float
    ended_at: float
    outcome: Outcome
    arrivals: tuple[Arrival, ...] = ()
    underruns: tuple[tuple[float, float], ...] = ()
    audio_sent_s: float = 0.0
    finalize_s: float | None = None
    detail: str = ""
    opened_at: float | None = None

    @property
    def events(self) -> int:
        return sum(1 for a in self.arrivals if a.audio_s <= 0.0)

    def first_output(self, kind: Kind) -> float | None:
        for a in self.arrivals:
            if kind == "asr" or a.audio_s > 0.0:
                return a.at
        return None


@dataclass(frozen=True, slots=True)
class LevelWindow:
    """When a level ran: sessions opened from ``started_at``; the window is
    ``[warm_end, ended_at]``. ``complete`` is False when the level was cut short (Ctrl-C,
    time limit): such a level is reported but never decides the ceiling."""

    level: int
    started_at: float
    warm_end: float
    ended_at: float
    complete: bool = True
    phase: str = "ramp"

    @property
    def hold_s(self) -> float:
        return max(self.ended_at - self.warm_end, 0.0)

    def contains(self, at: float) -> bool:
        return self.warm_end <= at <= self.ended_at


@dataclass(frozen=True, slots=True)
class LevelStats:
    """One level's figures (seconds and audio-seconds per second; None without data)."""

    level: int
    phase: str
    complete: bool
    hold_s: float
    sessions: int
    completed: int
    errors: int
    refusals: int
    chunks: int
    worst_1pct: float | None
    median_ratio: float | None
    stream_ratios: tuple[float, ...]
    p99_gap_s: float | None
    ttfa_p50_s: float | None
    ttfa_p99_s: float | None
    underruns: int
    stall_s: float
    throughput: float
    finalize_p99_s: float | None
    passed: bool
    verdict: str
    details: tuple[str, ...] = field(default=())
    #: The probe's own event-loop lag (p99, s): how late the client read what arrived.
    client_lag_p99_s: float | None = None
    #: Streams that played audio in the window, and of those, streams whose modelled
    #: playback ran dry there (the stall rule); ``startup_stalls``: at the first seam.
    streams: int = 0
    stalled_streams: int = 0
    startup_stalls: int = 0

    #: Every rule the level broke (``steady``, ``stalls``, ``ttfa``), as ``describe``
    #: names them; the verdict names the first.
    failed_rules: tuple[str, ...] = ()
    #: TTFA split at the stream's opening (p99 each, s): the wait before it, the
    #: engine's part after it; None without sessions that say when it opened.
    wait_p99_s: float | None = None
    engine_ttfa_p99_s: float | None = None
    #: Why the TTFA rule broke: ``queue`` (the wait) or ``engine``; None when it held,
    #: or when the split is not known.
    ttfa_cause: str | None = None

    @property
    def stalled_share(self) -> float | None:
        return self.stalled_streams / self.streams if self.streams else None

    @property
    def stream_ratio_min(self) -> float | None:
        return min(self.stream_ratios) if self.stream_ratios else None

    @property
    def stream_ratio_p50(self) -> float | None:
        return quantile(self.stream_ratios, 0.5)


def quantile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank ``q`` quantile (the value at rank ``ceil(q * n)``), None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = min(max(math.ceil(q * len(ordered) - 1e-9), 1), len(ordered))
    return ordered[rank - 1]


def event_share(trace: SessionTrace) -> float | None:
    """Audio seconds per transcript event of a finished ASR session, else None.

    Every event but the last covers one share; the last covers the remainder, a fraction
    of a share estimated from its gap over the median gap (at most 1). So
    ``share = audio sent / (events - 1 + fraction)``; it takes at least three events."""
    times = [a.at for a in trace.arrivals if a.audio_s <= 0.0]
    if trace.outcome != "ok" or len(times) < 3 or trace.audio_sent_s <= 0.0:
        return None
    gaps = [b - a for a, b in itertools.pairwise(times)]
    typical = statistics.median(gaps[:-1])
    fraction = min(max(gaps[-1] / typical, 0.0), 1.0) if typical > 0.0 else 1.0
    return trace.audio_sent_s / (len(times) - 1 + fraction)


def median_share(traces: Iterable[SessionTrace]) -> float | None:
    """The median :func:`event_share` of the finished ASR sessions, or None."""
    shares = [s for s in map(event_share, traces) if s is not None]
    return statistics.median(shares) if shares else None


def ratio_samples(
    trace: SessionTrace,
    kind: Kind,
    share: float | None = None,
    min_span_s: float = ASR_MIN_SPAN_S,
) -> list[tuple[float, float, float, float]]:
    """``(at, audio_s, span_s, ratio)`` per ratio sample of one session.

    TTS: the meter's per-chunk ratios, except for remainders (module docstring). ASR:
    per-event ratios with ``share`` audio seconds per event (the session's own when it
    finished)."""
    if kind == "tts":
        chunks = [a for a in trace.arrivals if a.audio_s > 0.0]
        tts: list[tuple[float, float, float, float]] = []
        for i, a in enumerate(chunks):
            if a.ratio is None or a.gap is None:
                continue
            end = i + 1 == len(chunks)
            final = (end and trace.outcome == "ok") or (not end and chunks[i + 1].gap is None)
            if final and a.audio_s < chunks[i - 1].audio_s:
                continue  # the utterance's remainder: its size, not its speed, sets its ratio
            tts.append((a.at, a.audio_s, a.gap, a.ratio))
        return tts
    share = event_share(trace) or share
    if share is None or not share > 0.0:
        return []
    times = [a.at for a in trace.arrivals if a.audio_s <= 0.0]
    k = max(1, math.ceil(min_span_s / share - 1e-9))
    last = len(times) - 1 if trace.outcome == "ok" else len(times)
    samples = []
    for i in range(k, last):
        span = max(times[i] - times[i - k], 0.0)
        audio = k * share
        ratio = audio / span if span * RATIO_CAP > audio else RATIO_CAP
        samples.append((times[i], audio, span, ratio))
    return samples


def _event_audio(trace: SessionTrace, share: float | None) -> list[tuple[float, float]]:
    """``(at, audio seconds transcribed)`` per transcript event of an ASR session; a
    finished session's last event takes the remainder of the audio sent."""
    share = event_share(trace) or share
    times = [a.at for a in trace.arrivals if a.audio_s <= 0.0]
    if share is None or not times:
        return []
    audio = [share] * len(times)
    if trace.outcome == "ok":
        audio[-1] = max(trace.audio_sent_s - share * (len(times) - 1), 0.0)
    return list(zip(times, audio, strict=True))


def _details(traces: Sequence[SessionTrace]) -> tuple[str, ...]:
    seen: list[str] = []
    for t in traces:
        if t.outcome in ("error", "refused") and t.detail and t.detail not in seen:
            seen.append(t.detail)
            if len(seen) == _MAX_DETAILS:
                break
    return tuple(seen)


def level_stats(
    window: LevelWindow,
    traces: Sequence[SessionTrace],
    *,
    threshold: float,
    kind: Kind = "tts",
    max_error_rate: float = 0.0,
    share: float | None = None,
    min_span_s: float = ASR_MIN_SPAN_S,
    max_stall_share: float | None = None,
    ttfa_limit_s: float | None = None,
) -> LevelStats:
    """The level's figures and verdict; ``share`` is the ASR fallback share (the median
    of this level's finished sessions is used first). With ``max_stall_share`` a level
    whose share of stalling streams exceeds it fails (``stalls``); with
    ``ttfa_limit_s`` one whose TTFA p99 exceeds it fails (``ttfa``). None: not judged."""
    if kind == "asr":
        share = median_share(traces) or share
    ratios: list[float] = []
    stream_ratios: list[float] = []
    delivered = 0.0
    for trace in traces:
        audio = span = 0.0
        for at, audio_s, span_s, ratio in ratio_samples(trace, kind, share, min_span_s):
            if window.contains(at):
                ratios.append(ratio)
                audio += audio_s
                span += span_s
        if span > 0.0:
            stream_ratios.append(audio / span)
        elif audio > 0.0:
            stream_ratios.append(RATIO_CAP)
        if kind == "tts":
            delivered += sum(a.audio_s for a in trace.arrivals if window.contains(a.at))
        else:
            delivered += sum(a for at, a in _event_audio(trace, share) if window.contains(at))
    gaps = [
        a.gap for t in traces for a in t.arrivals if a.gap is not None and window.contains(a.at)
    ]
    ttfa: list[float] = []
    waits: list[float] = []
    engine: list[float] = []
    for trace in traces:
        first = trace.first_output(kind)
        if first is not None and window.contains(first):
            ttfa.append(first - trace.started_at)
            opened = trace.opened_at
            if opened is not None and trace.started_at <= opened <= first:
                waits.append(opened - trace.started_at)
                engine.append(first - opened)
    stalls = [s for t in traces for at, s in t.underruns if window.contains(at)]
    playing = stalled = startup = 0
    for t in traces:
        chunks = [a.at for a in t.arrivals if a.audio_s > 0.0]
        ran_dry = [at for at, _ in t.underruns if window.contains(at)]
        if kind != "tts" or not chunks or not (window.contains(chunks[0]) or ran_dry):
            continue
        playing += 1
        if ran_dry:
            stalled += 1
            startup += len(chunks) > 1 and ran_dry[0] == chunks[1]
    finals = [
        t.finalize_s for t in traces if t.finalize_s is not None and window.contains(t.ended_at)
    ]
    sessions = len(traces)
    errors = sum(1 for t in traces if t.outcome == "error")
    refusals = sum(1 for t in traces if t.outcome == "refused")
    worst = quantile(ratios, 0.01)
    ttfa_p99 = quantile(ttfa, 0.99)
    engine_p99 = quantile(engine, 0.99)
    broken = []
    if worst is not None and worst < threshold:
        broken.append("steady")
    if max_stall_share is not None and playing and stalled / playing > max_stall_share:
        broken.append("stalls")
    if ttfa_limit_s is not None and ttfa_p99 is not None and ttfa_p99 > ttfa_limit_s:
        broken.append("ttfa")
    cause = None
    if "ttfa" in broken and engine_p99 is not None and ttfa_limit_s is not None:
        cause = "queue" if engine_p99 <= ttfa_limit_s else "engine"
    if not window.complete:
        verdict = "interrupted"
    elif refusals:
        verdict = "refused"
    elif errors > max_error_rate * sessions:
        verdict = "errors"
    elif worst is None:
        verdict = "no data"
    elif broken:
        verdict = {"steady": "slow", "stalls": "stalls", "ttfa": "ttfa"}[broken[0]]
    else:
        verdict = "pass"
    hold = window.hold_s
    return LevelStats(
        level=window.level,
        phase=window.phase,
        complete=window.complete,
        hold_s=hold,
        sessions=sessions,
        completed=sum(1 for t in traces if t.outcome == "ok"),
        errors=errors,
        refusals=refusals,
        chunks=len(ratios),
        worst_1pct=worst,
        median_ratio=quantile(ratios, 0.5),
        stream_ratios=tuple(sorted(stream_ratios)),
        p99_gap_s=quantile(gaps, 0.99),
        ttfa_p50_s=quantile(ttfa, 0.5),
        ttfa_p99_s=ttfa_p99,
        underruns=len(stalls),
        stall_s=sum(stalls),
        throughput=delivered / hold if hold > 0.0 else 0.0,
        finalize_p99_s=quantile(finals, 0.99),
        passed=verdict == "pass",
        verdict=verdict,
        details=_details(traces),
        streams=playing,
        stalled_streams=stalled,
        startup_stalls=startup,
        failed_rules=tuple(broken),
        wait_p99_s=quantile(waits, 0.99),
        engine_ttfa_p99_s=engine_p99,
        ttfa_cause=cause,
    )
