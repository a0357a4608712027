"""Closed-loop load on simulated engines, on a virtual clock, and the ceiling of one.

Nothing here sleeps or reads a clock: :func:`run_colocated` steps each :class:`Engine`
from one emission time to the next, so a minute of GPU time costs a few milliseconds
to a few hundred of CPU. :func:`run_load` is one engine with the GPU to itself. This is
how ``headroom sim --describe`` (:mod:`proxy.sim.capacity`) finds a preset's
``single_stream_rtf`` and ``ceiling``, how :mod:`proxy.sim.colocated_ceilings` puts
two engines on one GPU, and how the tests check the knee.

Load model: ``concurrency`` closed-loop clients per engine, each submitting one
utterance (8-20 s of audio, seeded) after another, starts staggered over the first
second (or, for a serving benchmark's fixed prompt count, a request rate: open-loop
sends on ``vllm bench serve``'s schedule, :func:`send_times`). A chunk's *delivery
ratio* is its audio seconds divided by the wall seconds
since the stream's previous chunk (docs/architecture.md, the meter); a stream's first
chunk has no previous one and is not counted. Ratios from the warm-up period are
discarded.

The *ceiling* is the largest concurrency whose worst-1% (1st percentile) delivery
ratio stays at or above ``threshold`` (:data:`proxy.metering.rolling.DELIVERY_THRESHOLD`),
found by the probe's own search (:func:`proxy.probe.ceiling.largest_passing`): ramping
1, 2, 4, 8, ... and bisecting the first failing bracket, as ``headroom probe`` does
against a real GPU.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from proxy.metering.playback import PlaybackBuffer
from proxy.metering.rolling import DELIVERY_THRESHOLD as THRESHOLD
from proxy.probe.ceiling import doubling, largest_passing
from proxy.sim.engine import Emission, Engine
from proxy.sim.presets import TEXT_TOKENS_PER_AUDIO_S, Preset

#: The audio seconds of a load's requests when none are given: uniform in this range.
UTTERANCE_S: tuple[float, float] = (8.0, 20.0)

__all__ = [
    "THRESHOLD",
    "UTTERANCE_S",
    "LoadResult",
    "RequestLengths",
    "Rules",
    "VirtualStream",
    "find_ceiling",
    "min_prebuffer",
    "percentile",
    "run_colocated",
    "run_load",
    "send_times",
    "single_stream",
]


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
        """Share of the counted streams whose modelled playback ran dry."""
        return self.stalled_streams / self.streams if self.streams else 0.0

    def as_json(self) -> dict[str, Any]:
        """The result as JSON, floats rounded to 4 places, with ``stalled_share``."""
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}
        out["stalled_share"] = round(self.stalled_share, 4)
        return out


@dataclass(frozen=True, slots=True)
class RequestLengths:
    """The audio seconds of the requests a load sends, drawn from the run's seeded
    generator: uniform within ``mean_s x (1 +- spread)``, or with ``sigma`` set
    log-normal, its mean ``mean_s`` and its logarithm's standard deviation ``sigma`` (a
    prompt set of short texts with a few long ones: the median below the mean)."""

    mean_s: float
    spread: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if not self.mean_s > 0:
            raise ValueError("request lengths need a mean above 0 s")
        if not 0.0 <= self.spread < 1.0:
            raise ValueError("request length spread must be in [0, 1)")
        if self.sigma < 0.0:
            raise ValueError("request length sigma must be >= 0")
        if self.sigma > 0.0 and self.spread > 0.0:
            raise ValueError("request lengths are uniform (spread) or log-normal (sigma)")

    @classmethod
    def between(cls, low: float, high: float) -> RequestLengths:
        """Uniform within ``[low, high]``."""
        if not 0 < low <= high:
            raise ValueError(f"request lengths need 0 < low <= high, got {low}..{high}")
        mean = (low + high) / 2
        return cls(mean, (high - low) / 2 / mean)

    @property
    def median_s(self) -> float:
        return self.mean_s * math.exp(-(self.sigma**2) / 2)

    def draw(self, rng: random.Random) -> float:
        if self.sigma > 0.0:
            return rng.lognormvariate(math.log(self.median_s), self.sigma)
        return rng.uniform(self.mean_s * (1 - self.spread), self.mean_s * (1 + self.spread))


@dataclass(slots=True)
class VirtualStream:
    """One client's stream in a virtual-clock run: its audio and its listener's buffer."""

    client: int
    submitted_at: float
    audio_s: float
    playback: PlaybackBuffer
    last_at: float | None = None
    counted: bool = False


@dataclass(slots=True)
class _EngineLoad:
    """One engine's closed-loop clients and what they measured (the module docstring's
    load model). :func:`run_colocated` alternates the steps of several of these on one
    GPU; :func:`run_load` runs one alone."""

    preset: Preset
    concurrency: int
    engine: Engine
    rng: random.Random
    warmup_s: float
    duration_s: float
    lengths: RequestLengths
    think_s: float
    prebuffer_s: float
    requests: int | None
    #: open loop (a request rate): the send times no client has taken yet
    schedule: deque[float] | None = None
    now: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    streams: dict[int, VirtualStream] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)
    ttfas: list[float] = field(default_factory=list)
    rtfs: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    finished: int = 0
    submitted: int = 0
    last_at: float = 0.0  #: the latest emission, the end of a fixed-count run
    steps: list[float] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    counted: list[PlaybackBuffer] = field(default_factory=list)
    audio_total: float = 0.0
    wall_total: float = 0.0
    delivered: float = 0.0
    max_waiting: int = 0
    done: bool = False

    def deliver(self, em: Emission) -> None:
        stream = self.streams[em.seq_id]
        audio, at = (em.end - em.start) / self.preset.token_rate_hz, em.at
        measuring = at >= self.warmup_s
        if audio > 0:
            if stream.last_at is None:
                if measuring:
                    self.ttfas.append(at - stream.submitted_at)
                    stream.counted = True
                    self.counted.append(stream.playback)
            elif measuring and at > stream.last_at:
                wall = at - stream.last_at
                self.ratios.append(audio / wall)
                self.audio_total += audio
                self.wall_total += wall
            if measuring and at <= self.duration_s:
                self.delivered += audio
            stream.playback.add(at, audio)
            stream.last_at = at
        self.last_at = max(self.last_at, at)
        if em.final:
            stream.playback.finish(at)
            del self.streams[em.seq_id]
            if stream.counted:
                self.rtfs.append((at - stream.submitted_at) / stream.audio_s)
                self.e2es.append(at - stream.submitted_at)
            if self.warmup_s <= at <= self.duration_s:
                self.finished += 1
            think = self.rng.uniform(0.0, self.think_s) if self.think_s > 0 else 0.0
            if self.schedule is not None:
                if self.schedule:
                    send = self.schedule.popleft()
                    heapq.heappush(self.arrivals, (max(at + think, send), stream.client))
            elif self.requests is None or self.submitted < self.requests:
                heapq.heappush(self.arrivals, (at + think, stream.client))

    def submit_arrivals(self) -> None:
        preset, rate = self.preset, self.preset.token_rate_hz
        while self.arrivals and self.arrivals[0][0] <= self.now:
            _, client = heapq.heappop(self.arrivals)
            if self.requests is not None and self.submitted >= self.requests:
                continue
            self.submitted += 1
            audio_s = self.lengths.draw(self.rng)
            text_tokens = 0 if preset.kind == "asr" else round(audio_s * TEXT_TOKENS_PER_AUDIO_S)
            output = max(1, round(audio_s * rate))
            seq_id = self.engine.submit(
                now=self.now,
                prompt_tokens=preset.prompt_overhead_tokens + text_tokens,
                output_tokens=output,
                schedule=preset.schedule,
            )
            self.streams[seq_id] = VirtualStream(
                client, self.now, output / rate, PlaybackBuffer(self.prebuffer_s)
            )

    def settle(self) -> None:
        """Bring ``now`` to the next time this engine has a step to run (or finish)."""
        while not self.done:
            if self.now >= self.duration_s:
                self.done = True
                return
            self.submit_arrivals()
            if self.engine.has_work():
                return
            for em in sorted(self.engine.drain_codec(), key=lambda e: e.at):
                self.deliver(em)
            if not self.arrivals:
                self.done = True
                return
            self.now = max(self.now, self.arrivals[0][0])

    def run_step(self, start: float) -> float:
        """Run one step starting at ``start`` (>= ``now``); its end."""
        self.now = start
        self.submit_arrivals()  # arrivals while the GPU ran another engine's step
        step = self.engine.step(self.now)
        self.now = step.ends_at
        self.max_waiting = max(self.max_waiting, step.waiting)
        if self.now >= self.warmup_s:
            self.steps.append(step.duration)
            self.batches.append(step.batch)
        for em in sorted(step.emissions, key=lambda e: e.at):
            self.deliver(em)
        return self.now

    def result(self) -> LoadResult:
        if not self.steps or not (self.ratios or self.e2es):
            raise ValueError("the run measured nothing; lengthen duration_s")
        nan = float("nan")  # one chunk per request (no async chunk): no ratio to measure
        ratios, ttfas, rtfs, e2es = self.ratios, self.ttfas, self.rtfs, self.e2es
        if self.requests is None:
            span = max(self.duration_s - self.warmup_s, 1e-9)
        else:
            span = max(self.last_at, 1e-9)
        return LoadResult(
            concurrency=self.concurrency,
            chunks=len(ratios),
            worst_1pct=percentile(ratios, 0.01) if ratios else nan,
            median_delivery_ratio=statistics.median(ratios) if ratios else nan,
            aggregate_delivery_ratio=self.audio_total / self.wall_total if ratios else nan,
            mean_step_ms=1e3 * statistics.fmean(self.steps),
            p95_step_ms=1e3 * percentile(self.steps, 0.95),
            mean_batch=statistics.fmean(self.batches),
            ttfa_p50_s=statistics.median(ttfas) if ttfas else nan,
            max_waiting=self.max_waiting,
            ttfa_p99_s=percentile(ttfas, 0.99) if ttfas else nan,
            ttfa_mean_s=statistics.fmean(ttfas) if ttfas else nan,
            ttfa_p95_s=percentile(ttfas, 0.95) if ttfas else nan,
            request_rtf=statistics.fmean(rtfs) if rtfs else nan,
            throughput=self.delivered / span,
            e2e_mean_s=statistics.fmean(e2es) if e2es else nan,
            e2e_p95_s=percentile(e2es, 0.95) if e2es else nan,
            requests_per_s=self.finished / span,
            request_rtf_p50=statistics.median(rtfs) if rtfs else nan,
            streams=len(self.counted),
            stalled_streams=sum(1 for p in self.counted if p.underruns),
            startup_stalls=sum(1 for p in self.counted if p.first_chunk_underruns),
        )


def send_times(rng: random.Random, requests: int, rate: float) -> list[float]:
    """When an open-loop run sends its requests, as ``vllm bench serve --request-rate``
    schedules them: exponential gaps of mean ``1 / rate`` (a Poisson process), summed,
    then all scaled so the last request goes out at exactly ``requests / rate``."""
    times: list[float] = []
    at = 0.0
    for _ in range(requests):
        at += rng.expovariate(rate)
        times.append(at)
    scale = requests / rate / times[-1]
    return [t * scale for t in times]


def run_colocated(
    loads: Sequence[tuple[Preset, int]],
    *,
    seed: int = 0,
    duration_s: float = 40.0,
    warmup_s: float = 8.0,
    utterance_s: tuple[float, float] | RequestLengths = UTTERANCE_S,
    stagger_s: float = 1.0,
    think_s: float = 0.3,
    prebuffer_s: float = 0.2,
    requests: int | None = None,
    request_rate: float | None = None,
) -> list[LoadResult | None]:
    """Drive each ``(preset, concurrency)`` engine with the closed-loop load of the
    module docstring, all on one GPU that runs one step at a time; one result per engine
    (None for an engine given 0 streams). Engine ``i`` is seeded from ``seed + 7 * i``.

    Each engine keeps its own batch, KV cache and step formula, but a step starts when
    its engine is ready *and* the GPU is free, so while several engines have work their
    steps alternate (the engine that has waited longest goes next, ties to the first)
    and each one's token rate is set by the sum of their step times: time-slicing, two
    processes on one GPU without MPS, whose kernels never overlap -- the pessimistic
    end. The codec stage (``EngineSpec.codec``) keeps its own stream, as it does on one
    engine. One engine alone is :func:`run_load`.

    ``utterance_s`` is the requests' length in audio seconds: uniform between two
    bounds, or a :class:`RequestLengths`. ``stagger_s`` 0 starts every client at once
    (a benchmark's burst); ``prebuffer_s`` is the modelled listener's buffer.
    ``requests`` set runs a serving benchmark's fixed prompt count per engine instead:
    its clients send ``requests`` in all (``duration_s`` is then only a bound), and
    throughput and requests per second are over the whole run, from its start to the
    last chunk, ramp-down included. ``request_rate`` set (with ``requests``) sends them
    open-loop instead, as ``vllm bench serve --request-rate`` does: exponential gaps of
    mean ``1 / request_rate``, rescaled so the last request is sent at ``requests /
    request_rate`` (:func:`send_times`); ``concurrency`` is then its
    ``--max-concurrency``, a request whose time comes while every place is taken
    waiting for one, and its clock starting when it gets one."""
    if not loads:
        raise ValueError("no engines to run")
    if request_rate is not None and (requests is None or requests < 1 or not request_rate > 0):
        raise ValueError("an open-loop run needs a request count and a rate above 0")
    lengths = (
        utterance_s
        if isinstance(utterance_s, RequestLengths)
        else RequestLengths.between(*utterance_s)
    )
    engines: list[_EngineLoad | None] = []
    for i, (preset, concurrency) in enumerate(loads):
        if concurrency < 0:
            raise ValueError("concurrency must be >= 0")
        if concurrency == 0:
            engines.append(None)
            continue
        s = seed + 7 * i
        rng = random.Random(s * 1_000_003 + concurrency)
        load = _EngineLoad(
            preset=preset,
            concurrency=concurrency,
            engine=Engine(preset.engine, seed=s * 7919 + concurrency),
            rng=rng,
            warmup_s=warmup_s,
            duration_s=duration_s,
            lengths=lengths,
            think_s=think_s,
            prebuffer_s=prebuffer_s,
            requests=requests,
        )
        if request_rate is not None and requests is not None:
            times = send_times(rng, requests, request_rate)
            load.arrivals = [(at, c) for c, at in enumerate(times[:concurrency])]
            load.schedule = deque(times[concurrency:])
        else:
            load.arrivals = [
                (rng.uniform(0.0, stagger_s) if stagger_s > 0 else 0.0, c)
                for c in range(concurrency)
            ]
        heapq.heapify(load.arrivals)
        engines.append(load)
    active = [load for load in engines if load is not None]
    gpu_free = 0.0
    while True:
        for load in active:
            load.settle()
        ready = [(load.now, i) for i, load in enumerate(active) if not load.done]
        if not ready:
            break
        at, i = min(ready)
        gpu_free = active[i].run_step(max(at, gpu_free))
    return [None if load is None else load.result() for load in engines]


def run_load(
    preset: Preset,
    concurrency: int,
    *,
    seed: int = 0,
    duration_s: float = 40.0,
    warmup_s: float = 8.0,
    utterance_s: tuple[float, float] | RequestLengths = UTTERANCE_S,
    stagger_s: float = 1.0,
    think_s: float = 0.3,
    prebuffer_s: float = 0.2,
    requests: int | None = None,
    request_rate: float | None = None,
) -> LoadResult:
    """Drive ``concurrency`` closed-loop streams through one engine for ``duration_s``
    virtual seconds: :func:`run_colocated` with the GPU to itself (the options are
    its)."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    result = run_colocated(
        [(preset, concurrency)],
        seed=seed,
        duration_s=duration_s,
        warmup_s=warmup_s,
        utterance_s=utterance_s,
        stagger_s=stagger_s,
        think_s=think_s,
        prebuffer_s=prebuffer_s,
        requests=requests,
        request_rate=request_rate,
    )[0]
    assert result is not None  # concurrency >= 1
    return result


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
    utterance_s: tuple[float, float] | RequestLengths = UTTERANCE_S,
) -> tuple[int, list[LoadResult]]:
    """``(ceiling, runs)``: the probe's search (:func:`proxy.probe.ceiling.largest_passing`)
    ramping 1, 2, 4, ... up to ``limit`` until a level breaks a rule (by default only the
    worst-1% ``threshold``; pass :class:`Rules` for all three), then bisecting, each
    level a :func:`run_load` of requests ``utterance_s`` long.
    ``ceiling`` is 0 when one stream already fails, and ``limit`` when ``limit`` itself
    passes (the ramp never measures past it); ``runs`` by concurrency."""
    runs: dict[int, LoadResult] = {}
    prebuffer = rules.prebuffer_s if rules is not None else 0.2

    def passes(n: int) -> bool:
        runs[n] = run_load(preset, n, seed=seed, prebuffer_s=prebuffer, utterance_s=utterance_s)
        if rules is not None:
            return not rules.failed(runs[n])
        return runs[n].worst_1pct >= threshold

    ceiling = largest_passing(passes, doubling(limit))
    return ceiling, sorted(runs.values(), key=lambda r: r.concurrency)


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
