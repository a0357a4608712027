"""``--plot``: delivery ratios and throughput against concurrency (matplotlib, optional).

matplotlib is the ``plot`` extra (``pip install 'headroom-proxy[plot]'``); it is imported
only here, lazily, and its absence is a clear :class:`PlotUnavailable`. The figure, one
point per level measured (its first failed trial, else its last: the trial that decided
it): the worst-1% and median per-chunk delivery ratio (left axis, log scale; a failed
level's worst-1% marker hollow), the threshold as a horizontal line, the ceiling as a
vertical line labelled above every marker, and the aggregate throughput in audio seconds
per second (right axis). Below it, the rules strip: one row per rule the run judged, a
cross at each level that broke it (a diamond where the wait before the stream opened
broke the TTFA rule), so a level that failed with its worst-1% above the threshold
shows why.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from proxy.probe.analysis import LevelStats
from proxy.probe.ramp import ProbeResult

__all__ = ["FORMATS", "PlotUnavailable", "figure", "require_matplotlib", "write_plot"]

#: File suffixes :func:`write_plot` can render.
FORMATS = (".png", ".svg")


class PlotUnavailable(RuntimeError):
    """matplotlib is missing, or the file type is not one of :data:`FORMATS`."""


def require_matplotlib(path: str | Path | None = None) -> Any:
    """``matplotlib.pyplot`` on the Agg backend; checks ``path``'s suffix first."""
    if path is not None and Path(path).suffix.lower() not in FORMATS:
        raise PlotUnavailable(f"--plot writes {' or '.join(FORMATS)} files, not {path}")
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib, an optional extra: pip install 'headroom-proxy[plot]' "
            "(or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rows(result: ProbeResult, levels: list[LevelStats]) -> list[tuple[str, str]]:
    """``(key, label)`` of the rules strip, top to bottom: the rules this run judged,
    and ``served`` when a level failed on errors, refusals or no data."""
    settings, asr = result.settings, result.settings.kind == "asr"
    rows = [("steady", f"worst-1% \u2265 {settings.threshold:g}x")]
    if not asr and settings.max_stall_share is not None:
        rows.append(("stalls", f"no stall ({settings.client.prebuffer_s:g} s buffer)"))
    if settings.ttfa_limit_s is not None:
        name = "TTFT" if asr else "TTFA"
        rows.append(("ttfa", f"{name} p99 \u2264 {settings.ttfa_limit_s:g} s"))
    if any(s.verdict in _NOT_SERVED for s in levels):
        rows.append(("served", "no errors, refusals"))
    return rows


#: Verdicts of a level that was not served well enough to judge a rule.
_NOT_SERVED = ("errors", "refused", "no data")


def _mark(stats: LevelStats, key: str) -> str:
    """``broken``, ``queue`` (the TTFA rule, broken by the wait before the stream
    opened) or ``held`` for one level and one row of the rules strip."""
    if key == "served":
        return "broken" if stats.verdict in _NOT_SERVED else "held"
    if key not in stats.failed_rules:
        return "held"
    return "queue" if key == "ttfa" and stats.ttfa_cause == "queue" else "broken"


#: The share of the plot's height kept free above every marker, for the ceiling's label.
_TOP_BAND = 0.14


def _top_margin(low: float, high: float) -> float:
    """The upper y limit (log scale) that leaves :data:`_TOP_BAND` of the axis above
    ``high`` free."""
    return math.exp((math.log(high) - _TOP_BAND * math.log(low)) / (1.0 - _TOP_BAND))


def write_plot(result: ProbeResult, path: str | Path) -> None:
    """Render the run to ``path`` (.png at 150 dpi, or .svg)."""
    plt = require_matplotlib(path)
    fig = figure(result)
    try:
        fig.savefig(str(path), dpi=150)
    finally:
        plt.close(fig)


def figure(result: ProbeResult) -> Any:
    """The run's matplotlib figure (module docstring); the caller closes it
    (``matplotlib.pyplot.close``)."""
    plt = require_matplotlib()
    summary = result.summary
    measured = sorted({s.level for s in summary.levels if s.complete})
    levels = [s for s in map(summary.failing, measured) if s is not None]
    rows = _rows(result, levels)
    fig, (left, strip) = plt.subplots(
        2,
        1,
        figsize=(8.0, 5.2 + 0.22 * len(rows)),
        sharex=True,
        height_ratios=(4.0, 0.35 + 0.3 * len(rows)),
        layout="constrained",
    )
    try:
        right = _draw_ratios(result, levels, left, strip)
        handles, labels = left.get_legend_handles_labels()
        more, more_labels = right.get_legend_handles_labels()
        marks = _draw_rules(strip, levels, rows)
        fig.legend(
            handles + more + [h for h, _ in marks],
            labels + more_labels + [label for _, label in marks],
            loc="outside lower center",
            ncol=3,
            fontsize=8,
            frameon=False,
        )
        model = f" - {result.model}" if result.model else ""
        left.set_title(
            f"headroom probe: {result.settings.client.protocol}{model}\n"
            f"{result.settings.client.url}",
            fontsize=10,
        )
    except BaseException:
        plt.close(fig)
        raise
    return fig


def _draw_ratios(result: ProbeResult, levels: list[LevelStats], left: Any, strip: Any) -> Any:
    """The ratios (left axis), the threshold, the ceiling and the throughput (the right
    axis, returned)."""
    summary = result.summary
    xs = [s.level for s in levels]
    worst = [s.worst_1pct for s in levels]
    median = [s.median_ratio for s in levels]
    left.plot(xs, median, "o-", color="#4c72b0", label="median delivery ratio")
    left.plot(xs, worst, "s-", color="#c44e52", label="worst-1% delivery ratio")
    failed = [(s.level, s.worst_1pct) for s in levels if not s.passed and s.worst_1pct]
    if failed:
        left.plot(
            *zip(*failed, strict=True),
            "s",
            color="#c44e52",
            markerfacecolor="white",
            markeredgewidth=1.5,
            label="failed level (rules below)",
        )
    t = summary.threshold
    left.axhline(t, color="#555555", linestyle="--", linewidth=1, label=f"threshold {t:g}x")
    left.set_ylabel("delivery ratio (x realtime)")
    left.set_yscale("log")
    left.set_xscale("log", base=2)
    left.minorticks_off()
    values = [v for v in (*worst, *median) if v is not None and v > 0] + [t]
    low = min(values) / 1.25
    high = _top_margin(low, max(values) * 1.1)
    left.set_ylim(low, high)
    ticks = _ticks(low, high, t)
    left.set_yticks(ticks, [f"{v:g}" for v in ticks])
    left.grid(True, which="major", alpha=0.3)
    if levels:
        left.set_xlim(min(xs) / 1.25, max(xs) * 1.25)
        _mark_ceiling(left, strip, summary.ceiling, summary.bounded, max(xs))
    strip.set_xlabel("concurrent sessions")
    strip.set_xticks(xs, [str(x) for x in xs])
    strip.minorticks_off()
    right = left.twinx()
    asr = result.settings.kind == "asr"
    throughput = [s.throughput for s in levels]
    right.plot(
        xs,
        throughput,
        "^:",
        color="#8172b2",
        label="transcribed s per s" if asr else "audio s per s (throughput)",
    )
    right.set_ylabel("transcribed audio s / s" if asr else "audio s / s (all streams)")
    # The same free band at the top as the ratio axis.
    right.set_ylim(0.0, max(throughput, default=0.0) * 1.1 / (1.0 - _TOP_BAND) or 1.0)
    return right


def _ticks(low: float, high: float, threshold: float) -> list[float]:
    """Round ratios between ``low`` and ``high`` and the threshold, leaving out those
    closer than 5 % of the (log) axis to one kept before them: labels that would touch."""
    room = 0.05 * math.log(high / low)
    candidates = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)
    kept = [threshold]
    for v in candidates:
        if low <= v <= high and all(abs(math.log(v / k)) >= room for k in kept):
            kept.append(v)
    return sorted(kept)


def _mark_ceiling(left: Any, strip: Any, ceiling: int, bounded: bool, highest: int) -> None:
    """The ceiling's vertical line (none at 0, left of every level) and its label, at the
    top of the ratio axis: its y limit leaves that band above every marker. The label
    sits right of the line, or left of it at the highest level measured."""
    text = f"ceiling {ceiling}{'' if bounded else '+'}"
    style = {"va": "top", "color": "#2d7a3e", "fontweight": "bold"}
    if ceiling < 1:
        left.text(0.01, 0.985, text, transform=left.transAxes, ha="left", **style)
        return
    for ax in (left, strip):
        ax.axvline(ceiling, color="#55a868", linewidth=2, alpha=0.8)
    last = ceiling >= highest
    left.annotate(
        text,
        xy=(ceiling, 0.985),
        xycoords=("data", "axes fraction"),
        xytext=(-5 if last else 5, 0),
        textcoords="offset points",
        ha="right" if last else "left",
        **style,
    )


def _draw_rules(strip: Any, levels: list[LevelStats], rows: list[tuple[str, str]]) -> list[Any]:
    """The rules strip: per level and rule, a cross where the level broke it (a diamond
    where the wait before the stream opened broke the TTFA rule), a dot where it held.
    Returns ``(handle, label)`` pairs for the legend."""
    styles = {
        "broken": {"marker": "X", "color": "#c44e52", "markersize": 8},
        "queue": {"marker": "D", "color": "#dd8452", "markersize": 6},
        "held": {"marker": "o", "color": "#bbbbbb", "markersize": 3},
    }
    labels = {"broken": "rule broken", "queue": "TTFA broken by queue wait"}
    seen: dict[str, Any] = {}
    for y, (key, _) in enumerate(rows):
        for stats in levels:
            mark = _mark(stats, key)
            (line,) = strip.plot([stats.level], [y], linestyle="none", **styles[mark])
            if mark in labels:
                seen.setdefault(mark, line)
    strip.set_ylim(len(rows) - 0.5, -0.5)
    strip.set_yticks(range(len(rows)), [label for _, label in rows], fontsize=8)
    strip.tick_params(axis="y", length=0)
    strip.grid(True, axis="x", alpha=0.3)
    return [(seen[m], labels[m]) for m in ("broken", "queue") if m in seen]
