"""The simulator against every published serving figure: the table in docs/sim.md.

    python -m proxy.sim.validate              # print the table (Markdown)
    python -m proxy.sim.validate --write docs/sim.md   # replace the table in the doc

Each published point is re-run on the virtual clock the way serving benchmarks run:
``concurrency`` clients start together and each sends its next request the moment the
previous one ends (closed loop, no think time), for 120 virtual seconds, averaged over
seeds 0-2. Requests are ``audio_s`` long (the run's own numbers give it: docs/sim.md),
or drawn uniformly within ``spread`` of it. Per point:

- **RTF**: the mean over requests of (last audio - submit) / audio seconds (what
  vLLM-Omni's benchmarks report per request);
- **TTFA**: the mean (or 95th percentile) time from submit to the first audio chunk;
- **E2EL**: the mean or 95th percentile of (last audio - submit);
- **req/s**: requests finished per second; **aggregate**: audio seconds delivered
  per wall second, all streams together;
- **ceiling**: :func:`proxy.sim.capacity.describe`'s ceiling.

A point runs the preset in the :class:`Setup` the published run used (async chunk,
CUDA graphs, ``max_num_seqs``, codec batch). An *effect* point (``versus`` set) is the
ratio of the figure in ``setup`` to the figure in ``versus``, as the source's own
comparison gives it; it is held to :data:`EFFECT_TOLERANCE`, every other point to
:data:`TOLERANCE`.

``in-sample`` marks a figure the preset's parameters were fitted to; ``held-out`` one
they were not. A published figure on a GPU or model without a preset is listed with
the reason, not simulated. :func:`compare` is what the drift test checks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from proxy.sim.capacity import LoadResult, describe, run_load
from proxy.sim.presets import Preset, get_preset

__all__ = [
    "EFFECT_TOLERANCE",
    "NOT_SIMULATED",
    "PUBLISHED",
    "TOLERANCE",
    "Point",
    "Row",
    "Setup",
    "compare",
    "table",
]

TOLERANCE = 0.15
EFFECT_TOLERANCE = 0.25
SEEDS = (0, 1, 2)
BEGIN, END = "<!-- validate:begin -->", "<!-- validate:end -->"

Metric = Literal["rtf", "ttfa", "ttfa_p95", "e2e_mean", "e2e_p95", "req_s", "aggregate", "ceiling"]


@dataclass(frozen=True, slots=True)
class Setup:
    """The engine options a published run used (``None``: the preset's own)."""

    label: str = ""
    async_chunk: bool = True
    cuda_graph: bool = True
    max_num_seqs: int | None = None
    codec_batch: int | None = None

    def apply(self, preset: Preset) -> Preset:
        return preset.with_overrides(
            async_chunk=self.async_chunk,
            cuda_graph=self.cuda_graph,
            max_num_seqs=self.max_num_seqs,
            codec_batch=self.codec_batch,
        )


@dataclass(frozen=True, slots=True)
class Point:
    """One published figure and how to reproduce it."""

    preset: str
    concurrency: int
    metric: Metric
    value: float
    sample: Literal["in-sample", "held-out"]
    audio_s: float  #: mean request length in the benchmark
    note: str  #: where it comes from; what of its configuration is unknown
    spread: float = 0.0  #: request lengths uniform within audio_s x (1 +- spread)
    setup: Setup = field(default_factory=Setup)
    versus: Setup | None = None  #: set: the figure is value(setup) / value(versus)

    @property
    def tolerance(self) -> float:
        return TOLERANCE if self.versus is None else EFFECT_TOLERANCE


#: The design doc's stacked configurations: async chunk on top of CUDA graphs on top
#: of batching (the preset's own), and each step without the one above it.
ASYNC = Setup("async chunk")
NO_ASYNC = Setup("no async chunk", async_chunk=False)
EAGER = Setup("eager, batch 10", async_chunk=False, cuda_graph=False)
EAGER_1 = Setup("eager, batch 1", async_chunk=False, cuda_graph=False, max_num_seqs=1)

_QWEN_H200 = "vllm-omni Qwen3-TTS design doc, H200; 5.9 s requests [D]"
_QWEN_L40S = "AWS DLC PR #6022, g6e L40S; config unknown [U]; length [D], spread [U]"
_VOXTRAL = "Voxtral TTS model card via secondary sources [U]; 500 characters = 37 s [D]"
_H200_LEN = 5.9
_L40S_SPREAD = 0.35
#: Each L40S concurrency's audio seconds per request: its aggregate / its req/s.
_L40S_LEN = {1: 4.08 / 1.14, 4: 8.17 / 2.10, 8: 13.0 / 3.47, 16: 18.0 / 4.63}


Sample = Literal["in-sample", "held-out"]


def _h200(
    c: int,
    metric: Metric,
    value: float,
    sample: Sample = "in-sample",
    *,
    setup: Setup = ASYNC,
    versus: Setup | None = None,
) -> Point:
    return Point(
        "h200-qwen3tts-1.7b", c, metric, value, sample, _H200_LEN, _QWEN_H200,
        setup=setup, versus=versus,
    )  # fmt: skip


def _l40s(c: int, metric: Metric, value: float, sample: Sample) -> Point:
    return Point(
        "l40s-qwen3tts-1.7b", c, metric, value, sample, _L40S_LEN[c], _QWEN_L40S,
        spread=_L40S_SPREAD,
    )  # fmt: skip


#: Every published point of docs/sim.md §2 that a preset simulates.
PUBLISHED: tuple[Point, ...] = (
    _h200(1, "rtf", 0.160),
    _h200(10, "rtf", 0.314),
    _h200(1, "ttfa", 0.064),
    _h200(4, "ttfa", 0.119),
    _h200(10, "ttfa", 0.425),
    _h200(1, "e2e_mean", 0.941, "held-out"),
    _h200(10, "e2e_mean", 1.767, "held-out"),
    _h200(1, "rtf", 0.124, setup=NO_ASYNC),
    _h200(10, "rtf", 0.203, setup=NO_ASYNC),
    _h200(1, "e2e_mean", 0.733, "held-out", setup=NO_ASYNC),
    _h200(4, "e2e_mean", 0.987, "held-out", setup=NO_ASYNC),
    _h200(10, "e2e_mean", 1.197, "held-out", setup=NO_ASYNC),
    _h200(10, "aggregate", 47.15, "held-out", setup=NO_ASYNC),
    _h200(1, "rtf", 0.160 / 0.124, setup=ASYNC, versus=NO_ASYNC),
    _h200(10, "rtf", 0.314 / 0.203, setup=ASYNC, versus=NO_ASYNC),
    _h200(1, "ttfa", 0.064 / 0.733, "held-out", setup=ASYNC, versus=NO_ASYNC),
    _h200(10, "ttfa", 0.425 / 1.197, "held-out", setup=ASYNC, versus=NO_ASYNC),
    _h200(1, "rtf", 0.234, setup=EAGER),
    _h200(4, "rtf", 0.255, "held-out", setup=EAGER),
    _h200(10, "rtf", 0.292, setup=EAGER),
    _h200(10, "e2e_mean", 1.705, "held-out", setup=EAGER),
    _h200(10, "aggregate", 33.53, "held-out", setup=EAGER),
    _h200(1, "rtf", 0.230, "held-out", setup=EAGER_1),
    _h200(10, "rtf", 2.186, "held-out", setup=EAGER_1),
    _h200(10, "e2e_mean", 12.141, "held-out", setup=EAGER_1),
    _h200(10, "rtf", 2.186 / 0.292, "held-out", setup=EAGER_1, versus=EAGER),
    _h200(10, "aggregate", 33.53 / 3.99, "held-out", setup=EAGER, versus=EAGER_1),
    _l40s(1, "aggregate", 4.08, "in-sample"),
    _l40s(4, "aggregate", 8.17, "in-sample"),
    _l40s(8, "aggregate", 13.0, "in-sample"),
    _l40s(16, "aggregate", 18.0, "in-sample"),
    _l40s(1, "req_s", 1.14, "held-out"),
    _l40s(4, "req_s", 2.10, "held-out"),
    _l40s(8, "req_s", 3.47, "held-out"),
    _l40s(16, "req_s", 4.63, "held-out"),
    _l40s(1, "e2e_p95", 1.123, "in-sample"),
    _l40s(4, "e2e_p95", 2.387, "in-sample"),
    _l40s(8, "e2e_p95", 3.637, "in-sample"),
    _l40s(16, "e2e_p95", 4.237, "in-sample"),
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
    (
        "Code2Wav at batch 1 against cross-request batching (vllm-omni PR #3322, H20-3e, "
        "1.7B, c=4/8/16): Base TTFA p95 3,293/8,313/12,638 -> 1,063/1,927/6,719 ms, "
        "audio throughput 2.39/2.55/3.49x -> 2.34/2.74/3.36x; CustomVoice TTFA p95 "
        "188/815/2,004 -> 275/474/2,341 ms, throughput 15.6/20.6/22.7x -> 9.7/15.1/17.6x",
        "no H20-3e preset; its codec queue at batch 1 is what batching relieves, and the "
        "H200 and L40S codec queues are not that full (docs/sim.md, not modelled)",
    ),
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

    @property
    def within(self) -> bool:
        return abs(self.error) <= self.point.tolerance


_RunKey = tuple[str, Setup, int, float, float, tuple[int, ...]]


def _figure(result: LoadResult, metric: Metric) -> float:
    return {
        "rtf": result.request_rtf,
        "ttfa": result.ttfa_mean_s,
        "ttfa_p95": result.ttfa_p95_s,
        "e2e_mean": result.e2e_mean_s,
        "e2e_p95": result.e2e_p95_s,
        "req_s": result.requests_per_s,
        "aggregate": result.throughput,
    }[metric]


def _measure(
    point: Point, setup: Setup, seeds: tuple[int, ...], runs: dict[_RunKey, list[LoadResult]]
) -> float:
    key = (point.preset, setup, point.concurrency, point.audio_s, point.spread, seeds)
    if key not in runs:
        preset = setup.apply(get_preset(point.preset))
        low, high = point.audio_s * (1 - point.spread), point.audio_s * (1 + point.spread)
        runs[key] = [
            run_load(
                preset,
                point.concurrency,
                seed=seed,
                duration_s=120.0,
                warmup_s=0.0,
                utterance_s=(low, high),
                stagger_s=0.0,
                think_s=0.0,
            )
            for seed in seeds
        ]
    return statistics.fmean(_figure(result, point.metric) for result in runs[key])


def simulate(
    point: Point,
    seeds: tuple[int, ...] = SEEDS,
    runs: dict[_RunKey, list[LoadResult]] | None = None,
) -> float:
    """The simulator's figure for ``point`` (mean over ``seeds``); ``runs`` caches load
    runs that several points share."""
    if point.metric == "ceiling":
        return statistics.fmean(describe(point.preset, seed)["ceiling"] for seed in seeds)
    runs = {} if runs is None else runs
    value = _measure(point, point.setup, seeds, runs)
    if point.versus is not None:
        value /= _measure(point, point.versus, seeds, runs)
    return value


def compare(seeds: tuple[int, ...] = SEEDS, points: tuple[Point, ...] | None = None) -> list[Row]:
    """Every published point (or ``points``) next to the simulator's figure."""
    runs: dict[_RunKey, list[LoadResult]] = {}
    chosen = PUBLISHED if points is None else points
    return [Row(point, simulate(point, seeds, runs)) for point in chosen]


_NAMES = {
    "rtf": "RTF",
    "ttfa": "TTFA",
    "ttfa_p95": "TTFA p95",
    "e2e_mean": "E2EL",
    "e2e_p95": "E2EL p95",
    "req_s": "req/s",
    "aggregate": "aggregate",
    "ceiling": "ceiling",
}


def _fmt(point: Point, value: float) -> str:
    metric = point.metric
    if point.versus is not None:
        return f"{value:.2f}x"
    if metric in ("ttfa", "ttfa_p95", "e2e_mean", "e2e_p95"):
        return f"{value * 1e3:,.0f} ms"
    if metric == "aggregate":
        return f"{value:.2f}x"
    if metric == "ceiling":
        return f"{value:.1f}"
    if metric == "req_s":
        return f"{value:.2f}"
    return f"{value:.3f}"


def _figure_name(point: Point) -> str:
    name = _NAMES[point.metric]
    if point.versus is not None:
        return f"{name}: {point.setup.label} / {point.versus.label}"
    return f"{name} ({point.setup.label})" if point.setup.label else name


def table(rows: list[Row]) -> str:
    """The Markdown table (and the list of figures not simulated)."""
    lines = [
        "| preset | c | figure | published | simulated | error | sample | source, unknowns |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p = row.point
        lines.append(
            f"| `{p.preset}` | {p.concurrency or '-'} | {_figure_name(p)} | "
            f"{_fmt(p, p.value)} | {_fmt(p, row.simulated)} | "
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
    worst = max(rows, key=lambda r: abs(r.error) / r.point.tolerance)
    print(
        f"worst: {worst.point.preset} c={worst.point.concurrency} "
        f"{_figure_name(worst.point)} {worst.error:+.1%} "
        f"(tolerance {worst.point.tolerance:.0%})",
        file=sys.stderr,
    )
    return 0 if all(row.within for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
