"""Measure a preset by running its engine model on a virtual clock.

Nothing here sleeps or reads a clock: :func:`run_load` steps an :class:`Engine` from
one emission time to the next, so a minute of GPU time costs a few milliseconds to
a few hundred of CPU. This is how ``headroom sim --describe`` finds a preset's
``single_stream_rtf`` and ``ceiling``, and how the tests check the knee.

Load model: ``concurrency`` closed-loop clients, each submitting one utterance
(8-20 s of audio, seeded) after another, starts staggered over the first second. A
chunk's *delivery ratio* is its audio seconds divided by the wall seconds since the
stream's previous chunk (DESIGN "Meter"); a stream's first chunk has no previous one
and is not counted. Ratios from the warm-up period are discarded.

The *ceiling* is the largest concurrency whose worst-1% (1st percentile) delivery
ratio stays at or above ``threshold`` (1.2), found by ramping 1, 2, 4, 8, ... and
bisecting the first failing bracket, as ``headroom probe`` does against a real GPU.
"""

from __future__ import annotations

import copy
import heapq
import random
import statistics
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from proxy.sim.engine import Engine
from proxy.sim.presets import Preset, get_preset

__all__ = [
    "LoadResult",
    "describe",
    "find_ceiling",
    "percentile",
    "run_load",
    "single_stream",
]

#: Delivery-ratio threshold of the ceiling (DESIGN: 1.2x realtime).
THRESHOLD = 1.2
_TEXT_TOKENS_PER_AUDIO_S = 3.5  # ~2.6 words/s of speech, ~1.3 tokens per word


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
    """What one virtual load run measured."""

    concurrency: int
    chunks: int  #: delivery ratios measured
    p01_delivery_ratio: float  #: worst 1%
    median_delivery_ratio: float
    aggregate_delivery_ratio: float  #: audio seconds / wall seconds over all counted chunks
    mean_step_ms: float
    p95_step_ms: float
    mean_batch: float
    ttfa_p50_s: float
    max_waiting: int  #: most sequences left waiting by a step's admission

    def as_json(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def run_load(
    preset: Preset,
    concurrency: int,
    *,
    seed: int = 0,
    duration_s: float = 40.0,
    warmup_s: float = 8.0,
    utterance_s: tuple[float, float] = (8.0, 20.0),
) -> LoadResult:
    """Drive ``concurrency`` closed-loop streams through the engine for ``duration_s``
    virtual seconds; see the module docstring."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    rng = random.Random(seed * 1_000_003 + concurrency)
    engine = Engine(preset.engine, seed=seed * 7919 + concurrency)
    rate = preset.token_rate_hz
    arrivals: list[tuple[float, int]] = [(rng.uniform(0.0, 1.0), i) for i in range(concurrency)]
    heapq.heapify(arrivals)
    submitted_at: dict[int, float] = {}
    last_chunk: dict[int, float] = {}
    client_of: dict[int, int] = {}
    ratios: list[float] = []
    audio_total = wall_total = 0.0
    ttfas: list[float] = []
    steps: list[float] = []
    batches: list[int] = []
    max_waiting = 0
    now = 0.0
    while now < duration_s:
        while arrivals and arrivals[0][0] <= now:
            _, client = heapq.heappop(arrivals)
            audio_s = rng.uniform(*utterance_s)
            text_tokens = 0 if preset.kind == "asr" else round(audio_s * _TEXT_TOKENS_PER_AUDIO_S)
            seq_id = engine.submit(
                now=now,
                prompt_tokens=preset.prompt_overhead_tokens + text_tokens,
                output_tokens=max(1, round(audio_s * rate)),
                first_chunk_tokens=preset.first_chunk_tokens,
                chunk_tokens=preset.chunk_tokens,
            )
            submitted_at[seq_id] = now
            client_of[seq_id] = client
        if not engine.has_work():
            if not arrivals:
                break
            now = arrivals[0][0]
            continue
        step = engine.step(now)
        now = step.ends_at
        max_waiting = max(max_waiting, step.waiting)
        measuring = now >= warmup_s
        if measuring:
            steps.append(step.duration)
            batches.append(step.batch)
        for em in step.emissions:
            previous = last_chunk.get(em.seq_id)
            if previous is None:
                if measuring:
                    ttfas.append(now - submitted_at[em.seq_id])
            elif measuring and now > previous:
                audio, wall = (em.end - em.start) / rate, now - previous
                ratios.append(audio / wall)
                audio_total += audio
                wall_total += wall
            last_chunk[em.seq_id] = now
            if em.final:
                last_chunk.pop(em.seq_id, None)
                submitted_at.pop(em.seq_id, None)
                heapq.heappush(arrivals, (now + rng.uniform(0.0, 0.3), client_of.pop(em.seq_id)))
    if not ratios or not steps:
        raise ValueError("the run measured nothing; lengthen duration_s")
    return LoadResult(
        concurrency=concurrency,
        chunks=len(ratios),
        p01_delivery_ratio=percentile(ratios, 0.01),
        median_delivery_ratio=statistics.median(ratios),
        aggregate_delivery_ratio=audio_total / wall_total,
        mean_step_ms=1e3 * statistics.fmean(steps),
        p95_step_ms=1e3 * percentile(steps, 0.95),
        mean_batch=statistics.fmean(batches),
        ttfa_p50_s=statistics.median(ttfas) if ttfas else float("nan"),
        max_waiting=max_waiting,
    )


def single_stream(preset: Preset, *, seed: int = 0) -> tuple[float, float]:
    """``(rtf, ttfa_s)`` of one stream alone, over a few minutes of back-to-back
    utterances: wall seconds per audio second between each utterance's first and last
    chunk (so prefill and time to first audio are excluded), and the median TTFA."""
    result = run_load(preset, 1, seed=seed, duration_s=240.0, warmup_s=1.0)
    return 1.0 / result.aggregate_delivery_ratio, result.ttfa_p50_s


def find_ceiling(
    preset: Preset, *, seed: int = 0, threshold: float = THRESHOLD, limit: int = 1024
) -> tuple[int, list[LoadResult]]:
    """``(ceiling, runs)``: ramp 1, 2, 4, ... until the worst-1% delivery ratio drops
    below ``threshold``, then bisect. ``ceiling`` is 0 when one stream already fails."""
    runs: dict[int, LoadResult] = {}

    def passes(n: int) -> bool:
        if n not in runs:
            runs[n] = run_load(preset, n, seed=seed)
        return runs[n].p01_delivery_ratio >= threshold

    if not passes(1):
        return 0, list(runs.values())
    low, high = 1, 2
    while passes(high):
        low, high = high, high * 2
        if high > limit:
            return low, sorted(runs.values(), key=lambda r: r.concurrency)
    while high - low > 1:
        mid = (low + high) // 2
        if passes(mid):
            low = mid
        else:
            high = mid
    return low, sorted(runs.values(), key=lambda r: r.concurrency)


@lru_cache(maxsize=64)
def _describe(name: str, seed: int) -> tuple[tuple[str, Any], ...]:
    preset = get_preset(name)
    engine = preset.engine
    rtf, ttfa = single_stream(preset, seed=seed)
    ceiling, runs = find_ceiling(preset, seed=seed)
    mean_ceiling = 0
    budget = 1.0 / (THRESHOLD * preset.token_rate_hz)
    while engine.mean_step_s(mean_ceiling + 1) <= budget and mean_ceiling < engine.max_num_seqs:
        mean_ceiling += 1
    info: dict[str, Any] = {
        "preset": preset.name,
        "kind": preset.kind,
        "model": preset.model,
        "gpu": preset.gpu.name,
        "description": preset.description,
        "token_rate_hz": preset.token_rate_hz,
        "sample_rate": preset.sample_rate,
        "first_chunk_tokens": preset.first_chunk_tokens,
        "chunk_tokens": preset.chunk_tokens,
        "single_stream_rtf": round(rtf, 4),
        "single_stream_delivery_ratio": round(1.0 / rtf, 3),
        "published_rtf": preset.published_rtf,
        "ttfa_s": round(ttfa, 4),
        "knee_batch": engine.knee_batch(300),
        "ceiling": ceiling,
        "ceiling_threshold": THRESHOLD,
        "ceiling_mean_model": mean_ceiling,
        "expected_ceiling": preset.expected_ceiling,
        "max_num_seqs": engine.max_num_seqs,
        "kv_cache_gib": round(engine.kv_budget_bytes / 2**30, 2),
        "step_ms": {
            "c0": round(engine.step_overhead_s * 1e3, 3),
            "c_seq": round(engine.per_seq_overhead_s * 1e3, 4),
            "memory_at_1": round(engine.memory_term(0) * 1e3, 3),
            "per_stream_compute": round(engine.compute_term(1) * 1e3, 3),
            "mean_at_1": round(engine.mean_step_s(1) * 1e3, 3),
        },
        "ramp": [r.as_json() for r in runs],
        "sources": list(preset.sources),
        "seed": seed,
    }
    return tuple(info.items())


def describe(preset: str, seed: int = 0) -> dict[str, Any]:
    """The preset's figures and its measured ``single_stream_rtf`` and ``ceiling``
    (memoised per ``(preset, seed)``)."""
    return copy.deepcopy(dict(_describe(preset, seed)))
