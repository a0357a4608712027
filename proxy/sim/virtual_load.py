"""Closed-loop load on a simulated engine, on a virtual clock, and the ceiling search.

Nothing here sleeps or reads a clock: :func:`run_load` steps an :class:`Engine` from
one emission time to the next, so a minute of GPU time costs a few milliseconds to
a few hundred of CPU. This is how ``headroom sim --describe``
(:mod:`proxy.sim.capacity`) finds a preset's ``single_stream_rtf`` and ``ceiling``,
and how the tests check the knee.

Load model: ``concurrency`` closed-loop clients, each submitting one utterance
(8-20 s of audio, seeded) after another, starts staggered over the first second. A
chunk's *delivery ratio* is its audio seconds divided by the wall seconds since the
stream's previous chunk (docs/architecture.md, the meter); a stream's first chunk has no
previous one and is not counted. Ratios from the warm-up period are discarded.

The *ceiling* is the largest concurrency whose worst-1% (1st percentile) delivery
ratio stays at or above ``threshold`` (1.2), found by ramping 1, 2, 4, 8, ... and
bisecting the first failing bracket, as ``headroom probe`` does against a real GPU.
"""

from __future__ import annotations

import heapq
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from proxy.metering.playback import PlaybackBuffer
from proxy.sim.engine import Emission, Engine
from proxy.sim.presets import TEXT_TOKENS_PER_AUDIO_S, Preset

__all__ = [
    "THRESHOLD",
    "LoadResult",
    "Rules",
    "VirtualStream",
    "find_ceiling",
    "min_prebuffer",
    "percentile",
    "run_load",
    "single_stream",
]

#: Delivery-ratio threshold of the ceiling, the same as the probe's and the guard's
#: (docs/probe.md).
THRESHOLD = 1.2


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by linear interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What one virtual load run measured (chunks and streams after the warm-up)."""

    concurrency: int
    chunks: int  #: delivery ratios measured
    worst_1pct: float  #: the delivery ratio of the worst hundredth of the chunks
    median_delivery_ratio: float
    aggregate_delivery_ratio: float  #: audio seconds / wall seconds over all counted chunks
    mean_step_ms: float
    p95_step_ms: float
    mean_batch: float
    ttfa_p50_s: float
    max_waiting: int  #: most sequences left waiting by a step's admission
    ttfa_p99_s: float = float("nan")
    ttfa_mean_s: float = float("nan")
    ttfa_p95_s: float = float("nan")
    #: mean over finished requests of (last chunk - submit) / audio seconds
    request_rtf: float = float("nan")
    throughput: float = 0.0  #: audio seconds delivered per wall second (all streams)
    #: mean and 95th percentile over finished requests of (last chunk - submit), seconds
    e2e_mean_s: float = float("nan")
    e2e_p95_s: float = float("nan")
    requests_per_s: float = 0.0  #: requests finished per wall second after the warm-up
    #: the median over finished requests of (last chunk - submit) / audio seconds
    request_rtf_p50: float = float("nan")
    streams: int = 0  #: streams that started playing after the warm-up
    stalled_streams: int = 0  #: of those, streams whose modelled playback ran dry
    startup_stalls: int = 0  #: streams whose first stall was at their first seam

    @property
    def stalled_share(self) -> float:
        return self.stalled_streams / self.streams if self.streams else 0.0

    def as_json(self) -> dict[str, Any]:
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}
        out["stalled_share"] = round(self.stalled_share, 4)
        return out


@dataclass(slots=True)
class VirtualStream:
    """One client's stream in a virtual-clock run: its audio and its listener's buffer."""

    client: int
    submitted_at: float
    audio_s: float
    playback: PlaybackBuffer
    last_at: float | None = None
    counted: bool = False


def run_load(
    preset: Preset,
    concurrency: int,
    *,
    seed: int = 0,
    duration_s: float = 40.0,
    warmup_s: float = 8.0,
    utterance_s: tuple[float, float] = (8.0, 20.0),
    stagger_s: float = 1.0,
    think_s: float = 0.3,
    prebuffer_s: float = 0.2,
    requests: int | None = None,
) -> LoadResult:
    """Drive ``concurrency`` closed-loop streams through the engine for ``duration_s``
    virtual seconds; see the module docstring. ``stagger_s`` 0 starts every client at
    once (a benchmark's burst); ``prebuffer_s`` is the modelled listener's buffer.

    ``requests`` set runs a serving benchmark's fixed prompt count instead: the clients
    send ``requests`` in all (``duration_s`` is then only a bound), and throughput and
    requests per second are over the whole run, from the first submit to the last
    chunk, ramp-down included."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    rng = random.Random(seed * 1_000_003 + concurrency)
    engine = Engine(preset.engine, seed=seed * 7919 + concurrency)
    rate = preset.token_rate_hz
    arrivals: list[tuple[float, int]] = [
        (rng.uniform(0.0, stagger_s) if stagger_s > 0 else 0.0, i) for i in range(concurrency)
    ]
    heapq.heapify(arrivals)
    streams: dict[int, VirtualStream] = {}
    ratios: list[float] = []
    audio_total = wall_total = delivered = 0.0
    ttfas: list[float] = []
    rtfs: list[float] = []
    e2es: list[float] = []
    finished = 0
    steps: list[float] = []
    batches: list[int] = []
    counted: list[PlaybackBuffer] = []
    max_waiting = 0
    now = 0.0
    submitted = 0
    last_at = 0.0

    def deliver(em: Emission) -> None:
        nonlocal audio_total, wall_total, delivered, finished, last_at
        stream = streams[em.seq_id]
        audio, at = (em.end - em.start) / rate, em.at
        measuring = at >= warmup_s
        if audio > 0:
            if stream.last_at is None:
                if measuring:
                    ttfas.append(at - stream.submitted_at)
                    stream.counted = True
                    counted.append(stream.playback)
            elif measuring and at > stream.last_at:
                wall = at - stream.last_at
                ratios.append(audio / wall)
                audio_total += audio
                wall_total += wall
            if measuring and at <= duration_s:
                delivered += audio
            stream.playback.add(at, audio)
            stream.last_at = at
        last_at = max(last_at, at)
        if em.final:
            stream.playback.finish(at)
            del streams[em.seq_id]
            if stream.counted:
                rtfs.append((at - stream.submitted_at) / stream.audio_s)
                e2es.append(at - stream.submitted_at)
            if warmup_s <= at <= duration_s:
                finished += 1
            think = rng.uniform(0.0, think_s) if think_s > 0 else 0.0
            if requests is None or submitted < requests:
                heapq.heappush(arrivals, (at + think, stream.client))

    while now < duration_s:
        while arrivals and arrivals[0][0] <= now:
            _, client = heapq.heappop(arrivals)
            if requests is not None and submitted >= requests:
                continue
            submitted += 1
            audio_s = rng.uniform(*utterance_s)
            text_tokens = 0 if preset.kind == "asr" else round(audio_s * TEXT_TOKENS_PER_AUDIO_S)
            output = max(1, round(audio_s * rate))
            seq_id = engine.submit(
                now=now,
                prompt_tokens=preset.prompt_overhead_tokens + text_tokens,
                output_tokens=output,
                schedule=preset.schedule,
            )
            streams[seq_id] = VirtualStream(client, now, output / rate, PlaybackBuffer(prebuffer_s))
        if not engine.has_work():
            for em in sorted(engine.drain_codec(), key=lambda e: e.at):
                deliver(em)
            if not arrivals:
                break
            now = max(now, arrivals[0][0])
            continue
        step = engine.step(now)
        now = step.ends_at
        max_waiting = max(max_waiting, step.waiting)
        if now >= warmup_s:
            steps.append(step.duration)
            batches.append(step.batch)
        for em in sorted(step.emissions, key=lambda e: e.at):
            deliver(em)
    if not steps or not (ratios or e2es):
        raise ValueError("the run measured nothing; lengthen duration_s")
    nan = float("nan")  # one chunk per request (no async chunk): no ratio to measure
    span = max(duration_s - warmup_s, 1e-9) if requests is None else max(last_at, 1e-9)
    stalled = sum(1 for p in counted if p.underruns)
    startup = sum(1 for p in counted if p.first_chunk_underruns)
    return LoadResult(
        concurrency=concurrency,
        chunks=len(ratios),
        worst_1pct=percentile(ratios, 0.01) if ratios else nan,
        median_delivery_ratio=statistics.median(ratios) if ratios else nan,
        aggregate_delivery_ratio=audio_total / wall_total if ratios else nan,
        mean_step_ms=1e3 * statistics.fmean(steps),
        p95_step_ms=1e3 * percentile(steps, 0.95),
        mean_batch=statistics.fmean(batches),
        ttfa_p50_s=statistics.median(ttfas) if ttfas else float("nan"),
        max_waiting=max_waiting,
        ttfa_p99_s=percentile(ttfas, 0.99) if ttfas else float("nan"),
        ttfa_mean_s=statistics.fmean(ttfas) if ttfas else float("nan"),
        ttfa_p95_s=percentile(ttfas, 0.95) if ttfas else float("nan"),
        request_rtf=statistics.fmean(rtfs) if rtfs else float("nan"),
        throughput=delivered / span,
        e2e_mean_s=statistics.fmean(e2es) if e2es else float("nan"),
        e2e_p95_s=percentile(e2es, 0.95) if e2es else float("nan"),
        requests_per_s=finished / span,
        request_rtf_p50=statistics.median(rtfs) if rtfs else float("nan"),
        streams=len(counted),
        stalled_streams=stalled,
        startup_stalls=startup,
    )


def single_stream(preset: Preset, *, seed: int = 0) -> tuple[float, float]:
    """``(rtf, ttfa_s)`` of one stream alone, over a few minutes of back-to-back
    utterances: wall seconds per audio second between each utterance's first and last
    chunk (so prefill and time to first audio are excluded), and the median TTFA."""
    result = run_load(preset, 1, seed=seed, duration_s=240.0, warmup_s=1.0)
    return 1.0 / result.aggregate_delivery_ratio, result.ttfa_p50_s


@dataclass(frozen=True, slots=True)
class Rules:
    """What a level must keep to count (the probe's verdict uses the same three):
    the worst-1% per-chunk ``threshold``, at most ``max_stall_share`` of streams whose
    modelled playback (``prebuffer_s``) ran dry, and TTFA p99 within ``ttfa_p99_s``."""

    threshold: float = THRESHOLD
    prebuffer_s: float = 0.2
    max_stall_share: float = 0.0
    ttfa_p99_s: float = 1.0

    def failed(self, result: LoadResult) -> list[str]:
        """The rules ``result`` breaks: ``steady`` (ratio), ``stalls``, ``ttfa``."""
        out = []
        if not result.worst_1pct >= self.threshold:
            out.append("steady")
        if result.stalled_share > self.max_stall_share:
            out.append("stalls")
        if not result.ttfa_p99_s <= self.ttfa_p99_s:
            out.append("ttfa")
        return out


def find_ceiling(
    preset: Preset,
    *,
    seed: int = 0,
    threshold: float = THRESHOLD,
    limit: int = 1024,
    rules: Rules | None = None,
) -> tuple[int, list[LoadResult]]:
    """``(ceiling, runs)``: ramp 1, 2, 4, ... until a level breaks a rule (by default
    only the worst-1% ``threshold``; pass :class:`Rules` for all three), then bisect.
    ``ceiling`` is 0 when one stream already fails, and ``limit`` when ``limit`` itself
    passes (the ramp never measures past it)."""
    runs: dict[int, LoadResult] = {}
    prebuffer = rules.prebuffer_s if rules is not None else 0.2

    def passes(n: int) -> bool:
        if n not in runs:
            runs[n] = run_load(preset, n, seed=seed, prebuffer_s=prebuffer)
        if rules is not None:
            return not rules.failed(runs[n])
        return runs[n].worst_1pct >= threshold

    if not passes(1):
        return 0, list(runs.values())
    low, high = 1, 2
    while True:
        high = min(high, limit)
        if high <= low:  # ``limit`` passed
            return low, sorted(runs.values(), key=lambda r: r.concurrency)
        if not passes(high):
            break
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if passes(mid):
            low = mid
        else:
            high = mid
    return low, sorted(runs.values(), key=lambda r: r.concurrency)


def min_prebuffer(
    preset: Preset, *, seed: int = 0, rules: Rules | None = None, step_s: float = 0.05,
    most_s: float = 10.0,
) -> float | None:  # fmt: skip
    """The smallest listener prebuffer (a multiple of ``step_s``, at most ``most_s``) at
    which one stream alone passes every rule of ``rules``: below it the preset's
    ceiling is 0 whatever the load. ``None`` when one stream fails a rule a buffer
    cannot mend (steady ratio, TTFA) or needs more than ``most_s``.

    The engine's emissions do not depend on the listener's buffer (the run's seeds are
    the seed and the concurrency), so stalls only fall as the buffer grows: bisection."""
    rules = rules or Rules()

    def passes(steps: int) -> bool:
        run = run_load(preset, 1, seed=seed, prebuffer_s=steps * step_s)
        return not rules.failed(run)

    low, high = -1, round(most_s / step_s)  # low fails (or is below 0), high is unknown
    if not passes(high):
        return None
    while high - low > 1:
        mid = (low + high) // 2
        if passes(mid):
            high = mid
        else:
            low = mid
    return round(high * step_s, 3)
