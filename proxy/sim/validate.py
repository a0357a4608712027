"""The simulator against every published serving figure: the table in docs/sim.md.

    python -m proxy.sim.validate              # print the table (Markdown)
    python -m proxy.sim.validate --write docs/sim.md   # replace the table in the doc

Each published point is re-run on the virtual clock the way serving benchmarks run:
``concurrency`` clients start together and each sends its next request the moment the
previous one ends (closed loop, no think time), for 120 virtual seconds, averaged over
seeds 0-2. Requests are ``audio_s`` long (the run's own numbers give it: docs/sim.md),
or drawn uniformly within ``spread`` of it. A point with ``prompts`` runs that many
requests instead, as ``vllm bench serve --num-prompts`` does, and its throughput spans
the whole run; one with ``rate`` too sends them open-loop at that rate, as ``--request-rate``
does (the load column shows the rate). Per point:

- **RTF**: the mean over requests of (last audio - submit) / audio seconds (what
  vLLM-Omni's benchmarks report per request);
- **RTF median**: their median (vLLM-Omni's CI baselines report medians);
- **TTFA**: the mean (or 95th percentile) time from submit to the first audio chunk;
  **TTFP median** its median;
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
from dataclasses import dataclass
from pathlib import Path

from proxy.sim.capacity import describe
from proxy.sim.codec_presets import get_validation_preset as get_preset
from proxy.sim.validate_data import (
    EFFECT_TOLERANCE,
    NOT_SIMULATED,
    PUBLISHED,
    TOLERANCE,
    Metric,
    Point,
    Setup,
)
from proxy.sim.virtual_load import LoadResult, RequestLengths, run_load

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

SEEDS = (0, 1, 2)
BEGIN, END = "<!-- validate:begin -->", "<!-- validate:end -->"


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


_RunKey = tuple[str, Setup, int, RequestLengths, int | None, float | None, tuple[int, ...]]


def _figure(result: LoadResult, metric: Metric) -> float:
    return {
        "rtf": result.request_rtf,
        "rtf_p50": result.request_rtf_p50,
        "ttfa": result.ttfa_mean_s,
        "ttfa_p50": result.ttfa_p50_s,
        "ttfa_p95": result.ttfa_p95_s,
        "e2e_mean": result.e2e_mean_s,
        "e2e_p95": result.e2e_p95_s,
        "req_s": result.requests_per_s,
        "aggregate": result.throughput,
    }[metric]


def _measure(
    point: Point, setup: Setup, seeds: tuple[int, ...], runs: dict[_RunKey, list[LoadResult]]
) -> float:
    lengths = RequestLengths(point.audio_s, point.spread, point.sigma)
    key = (point.preset, setup, point.concurrency, lengths, point.prompts, point.rate, seeds)
    if key not in runs:
        preset = setup.apply(get_preset(point.preset))
        runs[key] = [
            run_load(
                preset,
                point.concurrency,
                seed=seed,
                duration_s=120.0 if point.prompts is None else 3600.0,
                warmup_s=0.0,
                utterance_s=lengths,
                stagger_s=0.0,
                think_s=0.0,
                requests=point.prompts,
                request_rate=point.rate,
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
    "rtf_p50": "RTF median",
    "ttfa": "TTFA",
    "ttfa_p50": "TTFP median",
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
    if metric in ("ttfa", "ttfa_p50", "ttfa_p95", "e2e_mean", "e2e_p95"):
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


def _load(point: Point) -> str:
    """The table's load column: the concurrency, or an open-loop run's request rate."""
    if point.rate is not None:
        return f"{point.rate:g}/s"
    return str(point.concurrency or "-")


def table(rows: list[Row]) -> str:
    """The Markdown table (and the list of figures not simulated)."""
    lines = [
        "| preset | c | figure | published | simulated | error | sample | source, unknowns |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p = row.point
        error = f"{row.error:+.1%}"
        if not row.within:
            error += f" **outside {p.tolerance:.0%}**"
        lines.append(
            f"| `{p.preset}` | {_load(p)} | {_figure_name(p)} | "
            f"{_fmt(p, p.value)} | {_fmt(p, row.simulated)} | "
            f"{error} | {p.sample} | {p.note} |"
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
        f"worst: {worst.point.preset} c={_load(worst.point)} "
        f"{_figure_name(worst.point)} {worst.error:+.1%} "
        f"(tolerance {worst.point.tolerance:.0%})",
        file=sys.stderr,
    )
    outside = [row for row in rows if not row.within]
    for row in outside:
        p = row.point
        print(
            f"OUTSIDE its tolerance: {p.preset} c={_load(p)} {_figure_name(p)} "
            f"{row.error:+.1%} (tolerance {p.tolerance:.0%}): a preset drifted",
            file=sys.stderr,
        )
    print(f"{len(rows) - len(outside)} of {len(rows)} rows within their tolerance", file=sys.stderr)
    return 0 if not outside else 1


if __name__ == "__main__":
    sys.exit(main())
