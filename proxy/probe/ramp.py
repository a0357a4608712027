"""The probe's asyncio shell: hold N sessions open per level, ramp, bisect, stop cleanly.

A level keeps exactly N sessions open (closed loop): N workers each run one session after
another, each new one the moment the previous ends (after a refusal the worker waits the
``Retry-After``, at most 1 s; after an error 0.25 s, so a dead target is not hammered).
Workers start staggered over the first second. Only what arrives after the warm-up
counts (:mod:`proxy.probe.analysis`); at the level's end every session is cancelled and
its connection closed before the next level starts (after a short cool-down).

The probe watches its own event loop (how late a 50 ms sleep wakes): a client that is
too busy reads arrivals late and under-reports delivery; the level reports the lag's p99.

Bounds: ``time_limit_s`` for the whole run (a level that would not fit is not started),
``session_timeout_s`` per session. Setting the ``stop`` event (the CLI does on Ctrl-C)
ends the current level at once: it is reported as interrupted, never used for the ceiling,
and the result holds everything measured so far. Every session is closed on every path.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import httpx

from proxy.metering.rolling import DELIVERY_THRESHOLD
from proxy.probe.analysis import (
    LevelStats,
    LevelWindow,
    SessionTrace,
    event_share,
    level_stats,
    median_share,
    quantile,
)
from proxy.probe.ceiling import CeilingSearch, ProbeSummary, summarize
from proxy.probe.clients import run_session
from proxy.probe.probe_session import (
    PROTOCOL_KINDS,
    ClientOptions,
    Refusal,
    SessionFailed,
    SessionRecorder,
    detect_model,
)
from proxy.probe.workload import Workload

__all__ = [
    "LevelRun",
    "LiveFigures",
    "ProbeError",
    "ProbeResult",
    "ProbeSettings",
    "Progress",
    "run_probe",
]

_STAGGER_S = 1.0
_TICK_S = 0.5
_LAG_PERIOD_S = 0.05


class ProbeError(Exception):
    """The probe cannot run (unreachable target, wrong protocol, a level that measured
    nothing, ...): the message says what was wrong and what to try."""


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """Everything a run needs; :attr:`client` says how to reach the target."""

    client: ClientOptions
    workload: Workload
    levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    extend: bool = True
    max_level: int = 512
    hold_s: float = 30.0
    warmup_s: float = 8.0
    threshold: float = DELIVERY_THRESHOLD
    seed: int = 0
    time_limit_s: float = 1800.0
    session_timeout_s: float = 600.0
    max_error_rate: float = 0.0
    bisect: bool = True
    cooldown_s: float = 0.5
    preflight: bool = True
    #: Playback continuity: the share of streams that may stall (None: not judged)...
    max_stall_share: float | None = 0.0
    #: ... and the TTFA p99 a level may reach (None: not judged).
    ttfa_limit_s: float | None = 1.0
    #: Extra trials of the ceiling and the level above it once the search has closed
    #: the bracket (:class:`CeilingSearch`); the result reports the range seen.
    repeats: int = 1

    @property
    def kind(self) -> Literal["tts", "asr"]:
        return self.workload.kind

    def __post_init__(self) -> None:
        kind = PROTOCOL_KINDS.get(self.client.protocol)
        if kind is None:
            raise ValueError(
                f"unsupported protocol {self.client.protocol!r}; "
                f"use one of {', '.join(PROTOCOL_KINDS)}"
            )
        if kind != self.workload.kind:
            raise ValueError(
                f"{self.client.protocol} carries {kind.upper()} but the workload "
                f"{self.workload.source} is {self.workload.kind.upper()}"
            )
        if not self.hold_s > 0 or self.warmup_s < 0 or not self.threshold > 0:
            raise ValueError("hold must be > 0 s, warm-up >= 0 s, threshold > 0")
        if self.repeats < 0:
            raise ValueError("repeats must be >= 0")


@dataclass(frozen=True, slots=True)
class LevelRun:
    """One measured level: its window, every session's trace, and the figures."""

    window: LevelWindow
    traces: tuple[SessionTrace, ...]
    stats: LevelStats
    share: float | None = None  #: ASR: the fallback share the level was analysed with


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """A whole run. ``stopped`` says why it ended early (None: the search finished)."""

    settings: ProbeSettings
    summary: ProbeSummary
    runs: tuple[LevelRun, ...]
    started_at: float  #: wall clock (epoch seconds)
    duration_s: float
    stopped: str | None = None
    model: str | None = None
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class LiveFigures:
    """A level's figures so far, for progress display: kept up to date incrementally so
    that drawing them never stalls the loop that times the arrivals. ASR ratios use the
    share known before the level (exact figures come at the level's end)."""

    elapsed_s: float
    open_sessions: int
    chunks: int
    worst_1pct: float | None
    median_ratio: float | None
    errors: int
    refusals: int


class Progress(Protocol):
    """Live reporting hooks (:mod:`proxy.probe.progress` draws bars on a terminal)."""

    def level_started(self, level: int, phase: str, warmup_s: float, hold_s: float) -> None: ...

    def tick(self, live: LiveFigures) -> None: ...

    def level_done(self, stats: LevelStats) -> None: ...

    def note(self, message: str) -> None: ...


class _Level:
    """One level's closed loop."""

    def __init__(
        self,
        settings: ProbeSettings,
        http: httpx.AsyncClient,
        clock: Callable[[], float],
        level: int,
        phase: str,
        share: float | None,
    ) -> None:
        self.s = settings
        self.http = http
        self.clock = clock
        self.level = level
        self.phase = phase
        self.share = share
        self.recorders: list[SessionRecorder] = []
        self.open = 0
        self._seen: list[int] = []  # per recorder: chunks already folded into _ratios
        self._ratios: list[float] = []
        self.sampler = settings.workload.sampler(settings.seed * 1_000_003 + level)

    async def worker(self, index: int, until: float) -> None:
        await asyncio.sleep(_STAGGER_S * index / self.level)
        s = self.s
        while self.clock() < until:
            rec = SessionRecorder(self.clock, s.client.prebuffer_s)
            self.recorders.append(rec)
            self.open += 1
            try:
                async with asyncio.timeout(s.session_timeout_s):
                    await run_session(s.client, self.http, self.sampler.next(), rec)
            except Refusal as refusal:
                rec.close("refused", refusal.reason)
                await asyncio.sleep(min(refusal.retry_after_s or 1.0, 1.0))
            except SessionFailed as failure:
                rec.close("error", str(failure))
                await asyncio.sleep(0.25)
            except TimeoutError:
                rec.close("error", f"session exceeded {s.session_timeout_s:g} s")
            else:
                rec.close("ok")
            finally:
                self.open -= 1
                rec.close("cancelled")  # no-op unless cancelled mid-session

    def live(self, elapsed_s: float, warm_end: float) -> LiveFigures:
        """Fold in what arrived since the last call (new chunks only)."""
        self._seen.extend([0] * (len(self.recorders) - len(self._seen)))
        errors = refusals = 0
        for i, rec in enumerate(self.recorders):
            chunks = rec.sink.chunks
            for at, _, gap, ratio in chunks[self._seen[i] :]:
                if at < warm_end:
                    continue
                if ratio is not None:
                    self._ratios.append(ratio)
                elif self.s.kind == "asr" and gap and self.share:
                    self._ratios.append(self.share / gap)
            self._seen[i] = len(chunks)
            outcome = rec.trace.outcome if rec.trace is not None else None
            errors += outcome == "error"
            refusals += outcome == "refused"
        ratios = self._ratios
        worst = None
        if ratios:
            worst = max(heapq.nsmallest(math.ceil(0.01 * len(ratios) - 1e-9) or 1, ratios))
        median = statistics.median_low(ratios) if ratios else None
        return LiveFigures(elapsed_s, self.open, len(ratios), worst, median, errors, refusals)

    def stats(self, window: LevelWindow) -> LevelStats:
        traces = [r.close("cancelled") for r in self.recorders]
        return level_stats(
            window,
            traces,
            threshold=self.s.threshold,
            kind=self.s.kind,
            max_error_rate=self.s.max_error_rate,
            share=self.share,
            max_stall_share=self.s.max_stall_share,
            ttfa_limit_s=self.s.ttfa_limit_s,
        )

    async def run(self, stop: asyncio.Event, progress: Progress | None) -> LevelRun:
        s = self.s
        start = self.clock()
        warm_end = start + s.warmup_s
        end = warm_end + s.hold_s
        tasks = [asyncio.create_task(self.worker(i, end)) for i in range(self.level)]
        lags: list[float] = []
        tasks.append(asyncio.create_task(self.lag_monitor(lags)))
        stopper = asyncio.create_task(stop.wait())
        try:
            while (now := self.clock()) < end and not stop.is_set():
                await asyncio.wait({stopper}, timeout=min(_TICK_S, end - now))
                for task in tasks:
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]  # a bug: surface it
                if progress is not None:
                    progress.tick(self.live(self.clock() - start, warm_end))
        finally:
            ended = min(self.clock(), end)
            stopper.cancel()
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, stopper, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception) and not isinstance(result, asyncio.CancelledError):
                raise result
        window = LevelWindow(self.level, start, warm_end, ended, ended >= end, self.phase)
        traces = tuple(r.close("cancelled") for r in self.recorders)
        stats = replace(self.stats(window), client_lag_p99_s=quantile(lags, 0.99))
        return LevelRun(window, traces, stats, self.share)

    async def lag_monitor(self, lags: list[float]) -> None:
        """How late this loop wakes: arrivals are read (and timed) that much late."""
        while True:
            start = self.clock()
            await asyncio.sleep(_LAG_PERIOD_S)
            lags.append(max(self.clock() - start - _LAG_PERIOD_S, 0.0))


async def _preflight(
    settings: ProbeSettings, http: httpx.AsyncClient, clock: Callable[[], float]
) -> SessionTrace:
    """One session before the ramp: a clear error now instead of a failed ramp later."""
    rec = SessionRecorder(clock, settings.client.prebuffer_s)
    where = f"{settings.client.url} ({settings.client.protocol})"
    request = settings.workload.preflight_request()
    try:
        async with asyncio.timeout(min(settings.session_timeout_s, 120.0)):
            await run_session(settings.client, http, request, rec)
    except Refusal as refusal:
        raise ProbeError(
            f"{where} refused the pre-flight session ({refusal.reason}). If this is "
            "Headroom, its pool is full or draining: probe the engine directly, or wait."
        ) from None
    except (SessionFailed, TimeoutError) as exc:
        raise ProbeError(
            f"the pre-flight session against {where} failed: {exc or 'timed out'}. "
            "Check --target, --protocol (the endpoint must speak it) and --model/--voice."
        ) from None
    else:
        rec.close("ok")
    finally:
        trace = rec.close("cancelled")  # the trace frozen above, unless interrupted
    if not trace.arrivals:
        raise ProbeError(f"the pre-flight session against {where} completed with no output")
    return trace


async def run_probe(
    settings: ProbeSettings,
    *,
    progress: Progress | None = None,
    stop: asyncio.Event | None = None,
    clock: Callable[[], float] | None = None,
) -> ProbeResult:
    """Run the ramp and bisection against the target; see the module docstring.

    Raises :class:`ProbeError` when the target cannot be probed at all."""
    clock = clock or asyncio.get_running_loop().time
    stop = stop or asyncio.Event()
    began, wall = clock(), time.time()
    deadline = began + settings.time_limit_s
    search = CeilingSearch(
        settings.levels,
        extend=settings.extend,
        max_level=settings.max_level,
        bisect=settings.bisect,
        repeats=settings.repeats,
    )
    runs: list[LevelRun] = []
    stopped: str | None = None
    notes: list[str] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(settings.client.read_timeout_s, connect=settings.client.open_timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        model = settings.client.model
        if model is None:
            model = await detect_model(http, settings.client.url, settings.client.headers)
            if model is not None:
                notes.append(f"model {model} (from GET /v1/models)")
                if settings.client.protocol == "vllm-realtime":  # it must be named there
                    settings = _with_model(settings, model)
        share: float | None = None
        if settings.preflight and not stop.is_set():
            share = event_share(await _preflight(settings, http, clock))
        while (level := search.next_level()) is not None:
            if stop.is_set():
                stopped = "interrupted (Ctrl-C)"
                break
            if clock() + settings.warmup_s + settings.hold_s > deadline:
                stopped = f"time limit ({settings.time_limit_s:g} s) reached before level {level}"
                break
            phase = search.phase
            if progress is not None:
                progress.level_started(level, phase, settings.warmup_s, settings.hold_s)
            run = await _Level(settings, http, clock, level, phase, share).run(stop, progress)
            runs.append(run)
            if progress is not None:
                progress.level_done(run.stats)
            if run.stats.verdict == "no data" and all(r.stats.chunks == 0 for r in runs):
                # Nothing measured at all (later levels without data just fail: their
                # chunks came too slowly for the hold).
                raise ProbeError(_no_data_message(settings, run, model))
            if not run.window.complete:
                stopped = "interrupted (Ctrl-C)"
                break
            search.record(level, run.stats.passed)
            share = median_share(run.traces) or share
            await asyncio.sleep(settings.cooldown_s)
    if stopped and progress is not None:
        progress.note(stopped)
    summary = summarize([r.stats for r in runs], settings.threshold)
    return ProbeResult(
        settings=settings,
        summary=summary,
        runs=tuple(runs),
        started_at=wall,
        duration_s=clock() - began,
        stopped=stopped,
        model=model,
        notes=tuple(notes),
    )


def _no_data_message(settings: ProbeSettings, run: LevelRun, model: str | None) -> str:
    """Why a level that ran without errors measured nothing, and what to try."""
    c, stats = settings.client, run.stats
    kind = settings.kind
    wanted = "audio chunk" if kind == "tts" else "transcript event"
    audio = sum(1 for t in run.traces for a in t.arrivals if a.audio_s > 0.0)
    text = sum(1 for t in run.traces for a in t.arrivals if a.audio_s <= 0.0)
    served = f" (it serves {model})" if model else ""
    head = (
        f"measured nothing at concurrency {stats.level}: {stats.sessions} session(s) against "
        f"{c.url} ({c.protocol}) ran, {stats.completed} completed, without errors, but "
        f"not one {wanted} could be timed in the {settings.hold_s:g} s hold, so there is "
        "no ceiling to report."
    )
    if kind == "asr" and audio:
        why = (
            f" The target sent {audio} audio chunk(s) and {text} transcript event(s): it "
            f"is a speech-synthesis or speech-to-speech model{served}, not a "
            "transcription one. Probe it with --protocol vllm-omni-speech-ws or "
            "openai-speech-http."
        )
    elif kind == "tts" and not audio:
        why = (
            f" No audio arrived{served}: check that the endpoint speaks {c.protocol} "
            "(for a transcription model use --protocol vllm-realtime or "
            "openai-transcription-sse) and that --voice is one it knows."
        )
    else:
        why = (
            f" Check that --protocol matches the endpoint{served}, or raise --hold above "
            "the time between two chunks (a ratio needs two chunks of one stream)."
        )
    return head + why


def _with_model(settings: ProbeSettings, model: str) -> ProbeSettings:
    return replace(settings, client=replace(settings.client, model=model))
