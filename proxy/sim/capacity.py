"""A preset's capacity as ``headroom sim --describe`` reports it, and the ceilings table.

:func:`describe` measures a preset with the virtual-clock load runs and the ceiling
search of :mod:`proxy.sim.virtual_load`: its ``single_stream_rtf``, its ``ceiling``
and the cap to recommend.

One seed's ceiling is one draw of the step-time jitter and the utterance lengths; the
*recommended cap* is the largest level at or below the low end of the ceiling over
:data:`RANGE_SEEDS` (and the seed asked for) that every one of those seeds passes, so a
cap that Headroom recommends keeps the rules on every draw measured, not only on the
lucky one.

``python -m proxy.sim.capacity`` prints :func:`ceiling_table`: the ceilings of every
preset over several seeds (docs/sim.md, "Ceilings").
"""

from __future__ import annotations

import copy
from dataclasses import asdict, replace
from functools import lru_cache
from typing import Any

from proxy.sim.presets import Preset, get_preset
from proxy.sim.virtual_load import (
    THRESHOLD,
    LoadResult,
    Rules,
    find_ceiling,
    min_prebuffer,
    run_load,
    single_stream,
)

__all__ = [
    "BEGIN",
    "END",
    "RANGE_SEEDS",
    "ceiling_range",
    "ceiling_rows",
    "ceiling_table",
    "describe",
    "main",
]

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
        "release": preset.release,
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
