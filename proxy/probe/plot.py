"""``--plot``: delivery ratios and throughput against concurrency (matplotlib, optional).

matplotlib is the ``plot`` extra (``pip install 'headroom-proxy[plot]'``); it is imported
only here, lazily, and its absence is a clear :class:`PlotUnavailable`. The figure: the
worst-1% and median per-chunk delivery ratio of every complete level (left axis, log
scale), the threshold as a horizontal line, the ceiling as a vertical line, and the
aggregate throughput in audio seconds per second (right axis).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proxy.probe.ramp import ProbeResult

__all__ = ["FORMATS", "PlotUnavailable", "require_matplotlib", "write_plot"]

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


def write_plot(result: ProbeResult, path: str | Path) -> None:
    """Render the run to ``path`` (.png at 150 dpi, or .svg)."""
    plt = require_matplotlib(path)
    summary = result.summary
    levels = sorted((s for s in summary.levels if s.complete), key=lambda s: s.level)
    asr = result.settings.kind == "asr"
    fig, left = plt.subplots(figsize=(8.0, 4.8))
    try:
        xs = [s.level for s in levels]
        worst = [s.worst_1pct for s in levels]
        median = [s.median_ratio for s in levels]
        left.plot(xs, median, "o-", color="#4c72b0", label="median delivery ratio")
        left.plot(xs, worst, "s-", color="#c44e52", label="worst-1% delivery ratio")
        t = summary.threshold
        left.axhline(t, color="#555555", linestyle="--", linewidth=1, label=f"threshold {t:g}x")
        if levels:
            exact = "" if summary.bounded else "+"
            left.axvline(summary.ceiling, color="#55a868", linewidth=2, alpha=0.8)
            left.annotate(
                f"ceiling {summary.ceiling}{exact}",
                xy=(summary.ceiling, t),
                xytext=(6, 14),
                textcoords="offset points",
                color="#2d7a3e",
                fontweight="bold",
            )
        left.set_xlabel("concurrent sessions")
        left.set_ylabel("delivery ratio (x realtime)")
        left.set_yscale("log")
        left.set_xscale("log", base=2)
        left.set_xticks(xs, [str(x) for x in xs])
        left.minorticks_off()
        values = [v for v in (*worst, *median) if v is not None and v > 0] + [t]
        low, high = min(values) / 1.25, max(values) * 1.25
        left.set_ylim(low, high)
        ticks = [v for v in (0.25, 0.5, 0.75, 1, t, 1.5, 2, 3, 5, 10, 20, 50) if low <= v <= high]
        left.set_yticks(ticks, [f"{v:g}" for v in ticks])
        left.grid(True, which="major", alpha=0.3)
        right = left.twinx()
        right.plot(
            xs,
            [s.throughput for s in levels],
            "^:",
            color="#8172b2",
            label="transcribed s per s" if asr else "audio s per s (throughput)",
        )
        right.set_ylabel("transcribed audio s / s" if asr else "audio s / s (all streams)")
        right.set_ylim(bottom=0)
        handles = left.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        fig.legend(
            handles[0] + more[0],
            handles[1] + more[1],
            loc="lower center",
            ncol=4,
            fontsize=8,
            frameon=False,
        )
        model = f" - {result.model}" if result.model else ""
        left.set_title(
            f"headroom probe: {result.settings.client.protocol}{model}\n"
            f"{result.settings.client.url}",
            fontsize=10,
        )
        fig.tight_layout(rect=(0.0, 0.06, 1.0, 1.0))
        fig.savefig(str(path), dpi=150)
    finally:
        plt.close(fig)
