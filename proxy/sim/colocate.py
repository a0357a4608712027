"""Two engines on one simulated GPU (co-location, issue 19), on a virtual clock.

Each engine keeps its own batch, KV cache and step formula, but the GPU runs one step
at a time: a step starts when its engine is ready *and* the GPU is free, so while both
engines have work their steps alternate and each engine's token rate is set by the
sum of the two step times. Each slows the other, and both cross their knee at a lower
concurrency than alone: the shared knee. The model is time-slicing (two processes on
one GPU without MPS); kernels of the two engines never overlap, so it is the
pessimistic end. The codec stage (``EngineSpec.codec``) keeps its own stream, as it
does on one engine. Each engine's KV cache comes from its ``gpu_memory_utilization``
share (:meth:`Preset.with_utilization`).

The load and the measurements are those of :func:`proxy.sim.virtual_load.run_load`, per
engine: with one engine, :func:`run_colocated` gives exactly ``run_load``'s result
(a test pins that). :func:`colocated_ceiling` ramps one engine while the other holds a
fixed load; :func:`describe_colocated` puts each engine's ceiling alone next to its
ceiling beside the other (``headroom sim --colocate A,B``).
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.metering.playback import PlaybackBuffer
from proxy.sim.engine import Emission, Engine
from proxy.sim.presets import TEXT_TOKENS_PER_AUDIO_S, Preset, get_preset
from proxy.sim.virtual_load import LoadResult, Rules, VirtualStream, percentile

__all__ = ["colocated_ceiling", "colocated_presets", "describe_colocated", "run_colocated"]


@dataclass(slots=True)
class _Side:
    """One engine's closed-loop load and measurements (``run_load``'s, per engine)."""

    preset: Preset
    concurrency: int
    engine: Engine
    rng: random.Random
    warmup_s: float
    duration_s: float
    utterance_s: tuple[float, float]
    think_s: float
    prebuffer_s: float
    now: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    streams: dict[int, VirtualStream] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)
    ttfas: list[float] = field(default_factory=list)
    rtfs: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    finished: int = 0
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
        if em.final:
            stream.playback.finish(at)
            del self.streams[em.seq_id]
            if stream.counted:
                self.rtfs.append((at - stream.submitted_at) / stream.audio_s)
                self.e2es.append(at - stream.submitted_at)
            if self.warmup_s <= at <= self.duration_s:
                self.finished += 1
            think = self.rng.uniform(0.0, self.think_s) if self.think_s > 0 else 0.0
            heapq.heappush(self.arrivals, (at + think, stream.client))

    def submit_arrivals(self) -> None:
        preset, rate = self.preset, self.preset.token_rate_hz
        while self.arrivals and self.arrivals[0][0] <= self.now:
            _, client = heapq.heappop(self.arrivals)
            audio_s = self.rng.uniform(*self.utterance_s)
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
        self.submit_arrivals()  # arrivals while the GPU ran the other engine's step
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
        if not self.ratios or not self.steps:
            raise ValueError("the run measured nothing; lengthen duration_s")
        stalled = sum(1 for p in self.counted if p.underruns)
        startup = sum(1 for p in self.counted if p.first_chunk_underruns)
        ttfas, rtfs, e2es = self.ttfas, self.rtfs, self.e2es
        measured_s = max(self.duration_s - self.warmup_s, 1e-9)
        return LoadResult(
            concurrency=self.concurrency,
            chunks=len(self.ratios),
            worst_1pct=percentile(self.ratios, 0.01),
            median_delivery_ratio=statistics.median(self.ratios),
            aggregate_delivery_ratio=self.audio_total / self.wall_total,
            mean_step_ms=1e3 * statistics.fmean(self.steps),
            p95_step_ms=1e3 * percentile(self.steps, 0.95),
            mean_batch=statistics.fmean(self.batches),
            ttfa_p50_s=statistics.median(ttfas) if ttfas else float("nan"),
            max_waiting=self.max_waiting,
            ttfa_p99_s=percentile(ttfas, 0.99) if ttfas else float("nan"),
            ttfa_mean_s=statistics.fmean(ttfas) if ttfas else float("nan"),
            ttfa_p95_s=percentile(ttfas, 0.95) if ttfas else float("nan"),
            request_rtf=statistics.fmean(rtfs) if rtfs else float("nan"),
            request_rtf_p50=statistics.median(rtfs) if rtfs else float("nan"),
            throughput=self.delivered / measured_s,
            e2e_mean_s=statistics.fmean(e2es) if e2es else float("nan"),
            e2e_p95_s=percentile(e2es, 0.95) if e2es else float("nan"),
            requests_per_s=self.finished / measured_s,
            streams=len(self.counted),
            stalled_streams=stalled,
            startup_stalls=startup,
        )


def run_colocated(
    loads: Sequence[tuple[Preset, int]],
    *,
    seed: int = 0,
    duration_s: float = 40.0,
    warmup_s: float = 8.0,
    utterance_s: tuple[float, float] = (8.0, 20.0),
    stagger_s: float = 1.0,
    think_s: float = 0.3,
    prebuffer_s: float = 0.2,
) -> list[LoadResult | None]:
    """Drive each ``(preset, concurrency)`` engine with ``run_load``'s closed-loop load,
    all on one GPU that runs one step at a time; one result per engine (None for an
    engine given 0 streams). Engine 0 is seeded as ``run_load`` seeds its engine."""
    if not loads:
        raise ValueError("no engines to run")
    sides: list[_Side | None] = []
    for i, (preset, concurrency) in enumerate(loads):
        if concurrency < 0:
            raise ValueError("concurrency must be >= 0")
        if concurrency == 0:
            sides.append(None)
            continue
        s = seed + 7 * i
        rng = random.Random(s * 1_000_003 + concurrency)
        side = _Side(
            preset=preset,
            concurrency=concurrency,
            engine=Engine(preset.engine, seed=s * 7919 + concurrency),
            rng=rng,
            warmup_s=warmup_s,
            duration_s=duration_s,
            utterance_s=utterance_s,
            think_s=think_s,
            prebuffer_s=prebuffer_s,
        )
        side.arrivals = [
            (rng.uniform(0.0, stagger_s) if stagger_s > 0 else 0.0, c) for c in range(concurrency)
        ]
        heapq.heapify(side.arrivals)
        sides.append(side)
    active = [side for side in sides if side is not None]
    gpu_free = 0.0
    while True:
        for side in active:
            side.settle()
        ready = [(side.now, i) for i, side in enumerate(active) if not side.done]
        if not ready:
            break
        at, i = min(ready)  # the engine waiting longest goes next (ties: the first)
        gpu_free = active[i].run_step(max(at, gpu_free))
    return [None if side is None else side.result() for side in sides]


def colocated_presets(names: Sequence[str], utilization: Sequence[float]) -> list[Preset]:
    """The named presets, each resized to its ``gpu_memory_utilization`` share of one
    GPU; ``ValueError`` unless they run on the same GPU and the shares sum to <= 1."""
    if len(names) != 2 or len(utilization) != 2:
        raise ValueError("co-location takes two presets and two gpu_memory_utilization shares")
    presets = [get_preset(name) for name in names]
    if presets[0].gpu != presets[1].gpu:
        raise ValueError(
            f"{names[0]} runs on {presets[0].gpu.name} and {names[1]} on "
            f"{presets[1].gpu.name}: co-located presets must share one GPU model"
        )
    if not all(0 < u <= 1 for u in utilization):
        raise ValueError("each gpu_memory_utilization must be in (0, 1]")
    if sum(utilization) > 1 + 1e-9:
        raise ValueError(
            f"gpu_memory_utilization {' + '.join(f'{u:g}' for u in utilization)} sums "
            "above 1: the engines would over-commit the GPU's memory"
        )
    return [p.with_utilization(u) for p, u in zip(presets, utilization, strict=True)]


def _ramp(passes: Callable[[int], bool], limit: int = 1024) -> int:
    """The largest n passing, by ramping 1, 2, 4, ... then bisecting (find_ceiling's)."""
    if not passes(1):
        return 0
    low, high = 1, 2
    while passes(high):
        low, high = high, high * 2
        if high > limit:
            return low
    while high - low > 1:
        mid = (low + high) // 2
        if passes(mid):
            low = mid
        else:
            high = mid
    return low


def _bisect(passes: Callable[[int], bool], high: int) -> int:
    """The largest n in 1..``high`` passing (0: none), assuming passing is monotone."""
    if passes(high):
        return high
    low = 0
    while high - low > 1:
        mid = (low + high) // 2
        if passes(mid):
            low = mid
        else:
            high = mid
    return low


def colocated_ceiling(
    target: Preset,
    other: Preset,
    other_load: int,
    *,
    seed: int = 0,
    rules: Rules | None = None,
) -> int:
    """The ceiling of ``target`` (describe's rules) while ``other`` holds ``other_load``
    streams on the same GPU. ``other_load`` 0: the ceiling alone (at ``target``'s own KV
    cache)."""
    rules = rules or Rules()

    def passes(n: int) -> bool:
        result = run_colocated([(target, n), (other, other_load)], seed=seed)[0]
        assert result is not None
        return not rules.failed(result)

    return _ramp(passes)


def describe_colocated(
    names: Sequence[str], utilization: Sequence[float] = (0.45, 0.45), *, seed: int = 0
) -> dict[str, Any]:
    """Each engine's ceiling alone on the whole GPU (its preset), alone at its memory
    share, and beside the other engine holding half of *its* ceiling at its share; then
    ``shared_percent``: the largest p such that both engines together, each at p % of
    its ceiling at its share, pass (100 would mean they do not slow each other)."""
    shared = colocated_presets(names, utilization)
    rules = Rules()
    alone = [colocated_ceiling(get_preset(n), shared[0], 0, seed=seed) for n in names]
    at_share = [colocated_ceiling(p, p, 0, seed=seed) for p in shared]
    engines: list[dict[str, Any]] = []
    for i, preset in enumerate(shared):
        other = shared[1 - i]
        background = max(1, at_share[1 - i] // 2)
        beside = colocated_ceiling(preset, other, background, seed=seed)
        engines.append({
            "preset": preset.name,
            "kind": preset.kind,
            "gpu_memory_utilization": utilization[i],
            "kv_cache_gib": round(preset.engine.kv_budget_bytes / 2**30, 2),
            "ceiling_alone": alone[i],
            "ceiling_alone_at_share": at_share[i],
            "other_streams": background,
            "ceiling_beside_other": beside,
        })  # fmt: skip

    def both_pass(percent: int) -> bool:
        loads = [
            (p, max(1, round(c * percent / 100))) for p, c in zip(shared, at_share, strict=True)
        ]
        results = run_colocated(loads, seed=seed)
        return all(r is not None and not rules.failed(r) for r in results)

    return {
        "gpu": shared[0].gpu.name,
        "model": "time-sliced: one step at a time on the GPU",
        "engines": engines,
        "shared_percent": _bisect(both_pass, 100) if all(at_share) else 0,
        "ceiling_rules": {
            "threshold": rules.threshold,
            "max_stall_share": rules.max_stall_share,
            "ttfa_p99_s": rules.ttfa_p99_s,
        },
        "seed": seed,
    }
