"""The simulator against every published serving figure: the table in docs/sim.md.

    python -m proxy.sim.validate              # print the table (Markdown)
    python -m proxy.sim.validate --write docs/sim.md   # replace the table in the doc

Each published point is re-run on the virtual clock the way serving benchmarks run:
``concurrency`` clients start together and each sends its next request the moment the
previous one ends (closed loop, no think time), every request the same length, for
120 virtual seconds, averaged over seeds 0-2. Per point:

- **RTF**: the mean over requests of (last audio - submit) / audio seconds (what
  vLLM-Omni's benchmarks report per request);
- **TTFA**: the mean time from submit to the first audio chunk (TTFP, "latency");
- **aggregate**: audio seconds delivered per wall second, all streams together;
- **ceiling**: :func:`proxy.sim.capacity.describe`'s ceiling.

``in-sample`` marks a figure the preset's parameters were fitted to; ``held-out`` one
they were not. A published figure on a GPU or model without a preset is listed with
the reason, not simulated. :func:`compare` is what the drift test checks (every
simulated figure within :data:`TOLERANCE`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from proxy.sim.capacity import describe, run_load
from proxy.sim.presets import get_preset

__all__ = ["NOT_SIMULATED", "PUBLISHED", "TOLERANCE", "Point", "Row", "compare", "table"]

TOLERANCE = 0.15
SEEDS = (0, 1, 2)
BEGIN, END = "<!-- validate:begin -->", "<!-- validate:end -->"

Metric = Literal["rtf", "ttfa", "aggregate", "ceiling"]


@dataclass(frozen=True, slots=True)
class Point:
    """One published figure and how to reproduce it."""

    preset: str
    concurrency: int
    metric: Metric
    value: float
    sample: Literal["in-sample", "held-out"]
    audio_s: float  #: request length in the benchmark
    note: str  #: where it comes from; what of its configuration is unknown


_QWEN_H200 = "vllm-omni Qwen3-TTS performance doc, H200; request length unknown [U: 10 s]"
_QWEN_L40S = "AWS DLC PR #6022, g6e L40S; config and request length unknown [U: 10 s]"
_VOXTRAL = "Voxtral TTS model card via secondary sources [U]; 500 characters = 37 s [D]"

#: Every published point of docs/sim.md §2 that a preset simulates.
PUBLISHED: tuple[Point, ...] = (
    Point("h200-qwen3tts-1.7b", 1, "rtf", 0.160, "in-sample", 10.0, _QWEN_H200),
    Point("h200-qwen3tts-1.7b", 10, "rtf", 0.314, "in-sample", 10.0, _QWEN_H200),
    Point("h200-qwen3tts-1.7b", 1, "ttfa", 0.064, "in-sample", 10.0, _QWEN_H200),
    Point("h200-qwen3tts-1.7b", 4, "ttfa", 0.119, "in-sample", 10.0, _QWEN_H200),
    Point("h200-qwen3tts-1.7b", 10, "ttfa", 0.425, "in-sample", 10.0, _QWEN_H200),
    Point("l40s-qwen3tts-1.7b", 1, "aggregate", 4.08, "in-sample", 10.0, _QWEN_L40S),
    Point("l40s-qwen3tts-1.7b", 4, "aggregate", 8.17, "in-sample", 10.0, _QWEN_L40S),
    Point("l40s-qwen3tts-1.7b", 8, "aggregate", 13.0, "in-sample", 10.0, _QWEN_L40S),
    Point("l40s-qwen3tts-1.7b", 16, "aggregate", 18.0, "in-sample", 10.0, _QWEN_L40S),
    Point("h200-voxtral-tts-4b", 1, "rtf", 0.103, "in-sample", 37.0, _VOXTRAL),
    Point("h200-voxtral-tts-4b", 16, "rtf", 0.237, "in-sample", 37.0, _VOXTRAL),
    Point("h200-voxtral-tts-4b", 32, "rtf", 0.302, "in-sample", 37.0, _VOXTRAL),
    Point("h200-voxtral-tts-4b", 1, "ttfa", 0.070, "in-sample", 37.0, _VOXTRAL),
    Point("h200-voxtral-tts-4b", 16, "ttfa", 0.331, "in-sample", 37.0, _VOXTRAL),
    Point("h200-voxtral-tts-4b", 32, "ttfa", 0.552, "in-sample", 37.0, _VOXTRAL),
    Point(
        "h100-orpheus-3b",
        0,
        "ceiling",
        24,
        "in-sample",
        0.0,
        "SAIL: ~24 streams per H100, Baseten's stock deployment (16-24 in a Baseten "
        "talk); workload unknown",
    ),
)

#: Published figures no preset simulates, and why.
NOT_SIMULATED: tuple[tuple[str, str], ...] = (
    (
        "Qwen3-TTS Base (voice clone) on H20-3e: RTF/TTFP 0.15/165 ms, 0.28/412 ms, "
        "0.49/1,701 ms, 0.72/3,355 ms, 0.77/3,772 ms at c=1/4/8/16/32",
        "no H20-3e preset (its bandwidth and compute are unconfirmed)",
    ),
    ("Qwen3-TTS L40S Base voice clone, saturating near 7x", "no voice-clone preset"),
    ("Qwen3-TTS 0.6B on L4, 16.59x at batch 16 (third party)", "no 0.6B preset; [U]"),
    ("Qwen3-TTS custom engine on H100, 10 RPS (third party)", "not vLLM-Omni; [U]"),
    (
        "CosyVoice 2 on L20 (TRT-LLM): RTF 0.089 at c=1, first chunk 197/511/1,215 ms "
        "at c=1/4/10; CosyVoice 3 RTF 0.109",
        "no L20 preset; l4-cosyvoice2-0.5b is scaled from the L20 RTF, not fitted",
    ),
    ("VoxCPM2 on RTX 4090, L40, H100", "no VoxCPM2 preset"),
    ("Fish S2 Pro on H200 (SGLang): RTF 0.195, TTFA ~100 ms", "no Fish preset; [U]"),
    ("Orpheus 3B on A10G (vLLM 0.7.3): RTF ~1.57", "no A10G preset"),
)


@dataclass(frozen=True, slots=True)
class Row:
    point: Point
    simulated: float

    @property
    def error(self) -> float:
        return self.simulated / self.point.value - 1.0


def simulate(point: Point, seeds: tuple[int, ...] = SEEDS) -> float:
    """The simulator's figure for ``point`` (mean over ``seeds``)."""
    if point.metric == "ceiling":
        return statistics.fmean(describe(point.preset, seed)["ceiling"] for seed in seeds)
    preset = get_preset(point.preset)
    values = []
    for seed in seeds:
        result = run_load(
            preset,
            point.concurrency,
            seed=seed,
            duration_s=120.0,
            warmup_s=0.0,
            utterance_s=(point.audio_s, point.audio_s),
            stagger_s=0.0,
            think_s=0.0,
        )
        values.append(
            {"rtf": result.request_rtf, "ttfa": result.ttfa_mean_s}.get(
                point.metric, result.throughput
            )
        )
    return statistics.fmean(values)


def compare(seeds: tuple[int, ...] = SEEDS) -> list[Row]:
    """Every published point next to the simulator's figure."""
    return [Row(point, simulate(point, seeds)) for point in PUBLISHED]


def _fmt(metric: Metric, value: float) -> str:
    if metric == "ttfa":
        return f"{value * 1e3:.0f} ms"
    if metric == "aggregate":
        return f"{value:.2f}x"
    if metric == "ceiling":
        return f"{value:.1f}"
    return f"{value:.3f}"


def table(rows: list[Row]) -> str:
    """The Markdown table (and the list of figures not simulated)."""
    lines = [
        "| preset | c | figure | published | simulated | error | sample | source, unknowns |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p = row.point
        name = {"rtf": "RTF", "ttfa": "TTFA", "aggregate": "aggregate", "ceiling": "ceiling"}
        lines.append(
            f"| `{p.preset}` | {p.concurrency or '-'} | {name[p.metric]} | "
            f"{_fmt(p.metric, p.value)} | {_fmt(p.metric, row.simulated)} | "
            f"{row.error:+.1%} | {p.sample} | {p.note} |"
        )
    lines += ["", "Published figures that no preset simulates:", ""]
    lines += [f"- {figure}: {why}." for figure, why in NOT_SIMULATED]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    doc = path.read_text(encoding="utf-8")
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"{path} has no {BEGIN} ... {END} section to replace")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{text}{END}{tail}", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.sim.validate",
        description="The simulator against every published serving figure.",
    )
    parser.add_argument("--write", metavar="DOC", help="replace the table in DOC (docs/sim.md)")
    args = parser.parse_args(argv)
    rows = compare()
    text = table(rows)
    if args.write:
        _write(Path(args.write), text)
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(text)
    worst = max(rows, key=lambda r: abs(r.error))
    print(
        f"worst: {worst.point.preset} c={worst.point.concurrency} {worst.point.metric} "
        f"{worst.error:+.1%} (tolerance {TOLERANCE:.0%})",
        file=sys.stderr,
    )
    return 0 if abs(worst.error) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
