"""Measure a preset by running its engine model on a virtual clock.

Nothing here sleeps or reads a clock: :func:`run_load` steps an :class:`Engine` from
one emission time to the next, so a minute of GPU time costs a few milliseconds to
a few hundred of CPU. This is how ``headroom sim --describe`` finds a preset's
``single_stream_rtf`` and ``ceiling``, and how the tests check the knee.

Load model: ``concurrency`` closed-loop clients, each submitting one utterance
(8-20 s of audio, seeded) after another, starts staggered over the first second. A
chunk's *delivery ratio* is its audio seconds divided by the wall seconds since the
stream's previous chunk (docs/architecture.md, the meter); a stream's first chunk has no
previous one and is not counted. Ratios from the warm-up period are discarded.

The *ceiling* is the largest concurrency whose worst-1% (1st percentile) delivery
ratio stays at or above ``threshold`` (1.2), found by ramping 1, 2, 4, 8, ... and
bisecting the first failing bracket, as ``headroom probe`` does against a real GPU.

One seed's ceiling is one draw of the step-time jitter and the utterance lengths; the
*recommended cap* is the largest level at or below the low end of the ceiling over
:data:`RANGE_SEEDS` (and the seed asked for) that every one of those seeds passes, so a
cap that Headroom recommends keeps the rules on every draw measured, not only on the
lucky one.
"""

from __future__ import annotations

import copy
import heapq
import random
import statistics
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

from proxy.playback import PlaybackBuffer
from proxy.sim.engine import Emission, Engine
from proxy.sim.presets import Preset, get_preset

__all__ = [
    "RANGE_SEEDS",
    "LoadResult",
    "Rules",
    "ceiling_range",
    "describe",
    "find_ceiling",
    "min_prebuffer",
    "percentile",
    "run_load",
    "single_stream",
]

#: Delivery-ratio threshold of the ceiling: 1.2x realtime, as the probe's and the guard's
#: (docs/probe.md).
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
    """What one virtual load run measured (chunks and streams after the warm-up)."""

    concurrency: int
    chunks: int  #: delivery ratios measured
    worst_1pct: float  #: worst 1%
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
class _Stream:
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
) -> LoadResult:
    """Drive ``concurrency`` closed-loop streams through the engine for ``duration_s``
    virtual seconds; see the module docstring. ``stagger_s`` 0 starts every client at
    once (a benchmark's burst); ``prebuffer_s`` is the modelled listener's buffer."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    rng = random.Random(seed * 1_000_003 + concurrency)
    engine = Engine(preset.engine, seed=seed * 7919 + concurrency)
    rate = preset.token_rate_hz
    arrivals: list[tuple[float, int]] = [
        (rng.uniform(0.0, stagger_s) if stagger_s > 0 else 0.0, i) for i in range(concurrency)
    ]
    heapq.heapify(arrivals)
    streams: dict[int, _Stream] = {}
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

    def deliver(em: Emission) -> None:
        nonlocal audio_total, wall_total, delivered, finished
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
        if em.final:
            stream.playback.finish(at)
            del streams[em.seq_id]
            if stream.counted:
                rtfs.append((at - stream.submitted_at) / stream.audio_s)
                e2es.append(at - stream.submitted_at)
            if warmup_s <= at <= duration_s:
                finished += 1
            think = rng.uniform(0.0, think_s) if think_s > 0 else 0.0
            heapq.heappush(arrivals, (at + think, stream.client))

    while now < duration_s:
        while arrivals and arrivals[0][0] <= now:
            _, client = heapq.heappop(arrivals)
            audio_s = rng.uniform(*utterance_s)
            text_tokens = 0 if preset.kind == "asr" else round(audio_s * _TEXT_TOKENS_PER_AUDIO_S)
            output = max(1, round(audio_s * rate))
            seq_id = engine.submit(
                now=now,
                prompt_tokens=preset.prompt_overhead_tokens + text_tokens,
                output_tokens=output,
                schedule=preset.schedule,
            )
            streams[seq_id] = _Stream(client, now, output / rate, PlaybackBuffer(prebuffer_s))
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
        throughput=delivered / max(duration_s - warmup_s, 1e-9),
        e2e_mean_s=statistics.fmean(e2es) if e2es else float("nan"),
        e2e_p95_s=percentile(e2es, 0.95) if e2es else float("nan"),
        requests_per_s=finished / max(duration_s - warmup_s, 1e-9),
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


#: The seeds ``describe()``'s ``ceiling_range`` (and so the recommended cap) covers.
RANGE_SEEDS = (0, 1, 2, 3, 4)


@lru_cache(maxsize=256)
def _ceiling(preset: Preset, seed: int) -> tuple[int, tuple[LoadResult, ...]]:
    ceiling, runs = find_ceiling(preset, seed=seed, rules=Rules())
    return ceiling, tuple(runs)


def ceiling_range(preset: str | Preset, seeds: tuple[int, ...] = RANGE_SEEDS) -> dict[str, Any]:
    """The ceiling (every rule of :class:`Rules`) of each seed in ``seeds`` and the cap
    to recommend: ``{"seeds", "ceilings", "low", "high", "cap", "failing"}``.

    A seed's ceiling is found by bisection, which never measures most levels below it,
    and the worst 1 % is not monotonic in the load (each level is its own draw). So the
    cap is the largest level at or below the low end that every seed passes when
    measured there; ``failing`` maps each level above the cap that was checked to the
    seeds that broke a rule at it."""
    target = get_preset(preset) if isinstance(preset, str) else preset
    if not seeds:
        raise ValueError("ceiling_range needs at least one seed")
    rules = Rules()
    ceilings = [_ceiling(target, seed)[0] for seed in seeds]
    cap = min(ceilings)
    failing: dict[int, list[int]] = {}
    while cap > 0:
        broke = [s for s in seeds if rules.failed(_load(target, cap, s, rules.prebuffer_s))]
        if not broke:
            break
        failing[cap] = broke
        cap -= 1
    return {"seeds": list(seeds), "ceilings": ceilings, "low": min(ceilings),
            "high": max(ceilings), "cap": cap, "failing": failing}  # fmt: skip


@lru_cache(maxsize=256)
def _load(preset: Preset, concurrency: int, seed: int, prebuffer_s: float) -> LoadResult:
    return run_load(preset, concurrency, seed=seed, prebuffer_s=prebuffer_s)


def _seed_text(seeds: list[int]) -> str:
    if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2:
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return "seeds " + ", ".join(map(str, seeds))


@lru_cache(maxsize=64)
def _describe(name: str, seed: int) -> tuple[tuple[str, Any], ...]:
    return _measure(get_preset(name), seed)


def _measure(preset: Preset, seed: int) -> tuple[tuple[str, Any], ...]:
    engine = preset.engine
    rtf, ttfa = single_stream(preset, seed=seed)
    rules = Rules()
    ceiling, ramp = _ceiling(preset, seed)
    runs = list(ramp)
    spread = ceiling_range(preset, tuple(sorted({*RANGE_SEEDS, seed})))
    cap, low, high = spread["cap"], spread["low"], spread["high"]
    over = _seed_text(spread["seeds"])
    span = str(low) if low == high else f"{low}-{high}"
    if cap <= 0:
        cap_note = f"no level keeps the rules on every one of {over}: no cap keeps them"
    elif cap == low:
        cap_note = (
            f"the low end of the ceiling over {over} ({span}), and every seed passes at "
            f"{cap}: each seed is one draw of the step-time jitter and the utterance "
            "lengths, and the cap must keep the rules on every draw measured"
        )
    else:
        broke = "; ".join(
            f"at {n}: seed{'s' if len(b) > 1 else ''} {', '.join(map(str, b))}"
            for n, b in sorted(spread["failing"].items(), reverse=True)
        )
        cap_note = (
            f"the largest level at or below the low end of the ceiling over {over} ({span}) "
            f"that every seed passes ({broke} broke a rule): each seed is one draw of the "
            "step-time jitter and the utterance lengths, and the cap must keep the rules on "
            "every draw measured"
        )
    steady_limit = min(1024, 2 * engine.max_num_seqs)
    steady: int | None
    steady, _ = find_ceiling(preset, seed=seed, limit=steady_limit)
    steady_note = ""
    if steady >= steady_limit:
        steady = None
        steady_note = (
            f"unbounded: the steady ratio still holds at {steady_limit} streams; past "
            f"max_num_seqs ({engine.max_num_seqs}) the engine queues newcomers (their "
            "TTFA grows) instead of slowing the streams it runs"
        )
    buffer_needed = min_prebuffer(preset, seed=seed, rules=rules)
    ceiling_with_buffer: int | None = None
    if ceiling == 0 and buffer_needed is not None:
        ceiling_with_buffer, _ = find_ceiling(
            preset, seed=seed, rules=replace(rules, prebuffer_s=buffer_needed)
        )
    failing = next((r for r in runs if r.concurrency == ceiling + 1), None)
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
        "ceiling_range": [low, high],
        "ceiling_by_seed": dict(zip(map(str, spread["seeds"]), spread["ceilings"], strict=True)),
        "recommended_cap": cap,
        "recommended_cap_note": cap_note,
        "ceiling_threshold": THRESHOLD,
        "ceiling_rules": asdict(rules),
        "limited_by": rules.failed(failing) if failing is not None else [],
        "ceiling_steady_only": steady,
        "ceiling_steady_only_note": steady_note,
        "min_prebuffer_s": buffer_needed,
        "ceiling_at_min_prebuffer": ceiling_with_buffer,
        "chunk_schedule": preset.schedule.describe(),
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


def describe(preset: str | Preset, seed: int = 0) -> dict[str, Any]:
    """The preset's figures and its measured ``single_stream_rtf`` and ``ceiling`` (of
    ``seed``), the ceiling over :data:`RANGE_SEEDS` (``ceiling_range``,
    ``ceiling_by_seed``) and the cap to set, its low end (``recommended_cap``, with
    ``recommended_cap_note`` saying why). Memoised per ``(name, seed)``; a
    :class:`Preset` value, e.g. one with another chunk schedule, is measured every time
    except for its ceilings, which are memoised per ``(preset, seed)``."""
    if isinstance(preset, str):
        return copy.deepcopy(dict(_describe(preset, seed)))
    return dict(_measure(preset, seed))


#: Rows of the ceilings table besides the presets: vLLM-Omni's documented
#: ``codec_chunk_ramp`` on the Qwen3-TTS presets (what ``headroom demo`` runs).
RAMP_VARIANTS = (
    ("l40s-qwen3tts-1.7b", (4, 4, 8, 16, 25)),
    ("h200-qwen3tts-1.7b", (4, 4, 8, 16, 25)),
)
SEEDS = RANGE_SEEDS
BEGIN, END = "<!-- ceilings:begin -->", "<!-- ceilings:end -->"


def _span(values: list[Any], unit: str = "") -> str:
    low, high = min(values), max(values)
    return f"{low:g}{unit}" if low == high else f"{low:g}-{high:g}{unit}"


def ceiling_rows(seeds: tuple[int, ...] = SEEDS) -> list[dict[str, Any]]:
    """``describe()`` of every preset (and :data:`RAMP_VARIANTS`) for each seed: the
    ceiling per seed, what limited it, the steady-only ceiling and the prebuffer one
    stream needs."""
    from proxy.sim.presets import preset_names

    targets: list[tuple[str, Preset | str]] = [(name, name) for name in preset_names()]
    for name, ramp in RAMP_VARIANTS:
        label = f"{name} + codec_chunk_ramp {','.join(map(str, ramp))}"
        targets.append((label, get_preset(name).with_schedule(ramp=ramp)))
    rows = []
    for label, target in targets:
        runs = [describe(target, seed) for seed in seeds]
        first = runs[0]
        limits: dict[str, int] = {}
        for run in runs:
            for rule in run["limited_by"] or ["none"]:
                limits[rule] = limits.get(rule, 0) + 1
        rows.append(
            {
                "preset": label,
                "chunks": first["chunk_schedule"],
                "max_num_seqs": first["max_num_seqs"],
                "seeds": list(seeds),
                "ceilings": [run["ceiling"] for run in runs],
                "recommended_cap": first["recommended_cap"],
                "limited_by": limits,
                "steady_only": [run["ceiling_steady_only"] for run in runs],
                "min_prebuffer_s": [run["min_prebuffer_s"] for run in runs],
            }
        )
    return rows


def ceiling_table(seeds: tuple[int, ...] = SEEDS) -> str:
    """The Markdown table of :func:`ceiling_rows` (docs/sim.md, "Ceilings")."""
    n = len(seeds)
    out = [
        f"Seeds {', '.join(map(str, seeds))}; `python -m proxy.sim.capacity` prints this "
        "table (`--write docs/sim.md` replaces it here).",
        "",
        "| preset | chunks | max_num_seqs | ceiling (seed 0) | range | **recommended cap** | "
        "limited by (seeds) | steady ratio alone | prebuffer 1 stream needs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in ceiling_rows(seeds):
        limits = ", ".join(f"{rule} {k}/{n}" for rule, k in row["limited_by"].items())
        steady = [s for s in row["steady_only"] if s is not None]
        if len(steady) == n:
            steady_text = _span(steady)
        elif not steady:
            steady_text = f"unbounded (queues past {row['max_num_seqs']})"
        else:
            steady_text = f"{_span(steady)}, or unbounded"
        buffers = [b for b in row["min_prebuffer_s"] if b is not None]
        buffer_text = _span(buffers, " s") if buffers else "-"
        out.append(
            f"| `{row['preset']}` | {row['chunks']} | {row['max_num_seqs']} | "
            f"{row['ceilings'][0]} | {_span(row['ceilings'])} | **{row['recommended_cap']}** | "
            f"{limits} | "
            f"{steady_text} | {buffer_text} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="python -m proxy.sim.capacity",
        description="describe()'s ceiling of every preset over several seeds (Markdown)",
    )
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="e.g. 0,1,2")
    parser.add_argument("--write", type=Path, metavar="DOC", help="replace the table in DOC")
    args = parser.parse_args(argv)
    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    if len(seeds) < 1:
        parser.error("--seeds needs at least one seed")
    text = ceiling_table(seeds)
    if args.write is None:
        print(text)
        return 0
    doc = args.write.read_text()
    if BEGIN not in doc or END not in doc:
        print(f"{args.write}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    args.write.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
