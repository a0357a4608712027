"""A probe result as a table, a summary, JSON, CSV and a configuration snippet.

JSON (``schema: 1``; docs/probe.md lists every field): ``ceiling``, ``exact`` (the level
above the ceiling was measured and failed), ``threshold``, ``bracket``, ``complete``,
``stopped``, ``estimates``, ``settings`` and ``levels``: one object per measured level in
the order measured, with the figures of :class:`proxy.probe.analysis.LevelStats`. CSV:
one row per level, the same scalar figures (:data:`CSV_COLUMNS`).
"""

from __future__ import annotations

import csv
import datetime
import io
import math
import textwrap
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from proxy.probe.analysis import LevelStats
from proxy.probe.ceiling import ProbeSummary
from proxy.probe.ramp import ProbeResult, ProbeSettings

__all__ = [
    "CSV_COLUMNS",
    "LAG_WARNING_S",
    "advice",
    "config_snippet",
    "csv_text",
    "format_summary",
    "format_table",
    "level_json",
    "replica_url",
    "result_json",
]

#: Client event-loop lag (p99) above which the summary warns.
LAG_WARNING_S = 0.05
#: Columns of the CSV, one row per measured level.
CSV_COLUMNS = (
    "order",
    "level",
    "phase",
    "verdict",
    "passed",
    "worst_1pct",
    "median_ratio",
    "stream_ratio_min",
    "stream_ratio_p50",
    "p99_gap_s",
    "ttfa_p50_s",
    "ttfa_p99_s",
    "wait_p99_s",
    "engine_ttfa_p99_s",
    "ttfa_cause",
    "underruns",
    "stall_s",
    "throughput",
    "sessions",
    "completed",
    "errors",
    "refusals",
    "chunks",
    "hold_s",
    "finalize_p99_s",
    "client_lag_p99_s",
    "streams",
    "stalled_streams",
    "startup_stalls",
)


def _r(value: float | None, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def level_json(stats: LevelStats, order: int) -> dict[str, Any]:
    """One level's JSON object."""
    return {
        "order": order,
        "level": stats.level,
        "phase": stats.phase,
        "verdict": stats.verdict,
        "passed": stats.passed,
        "complete": stats.complete,
        "worst_1pct": _r(stats.worst_1pct),
        "median_ratio": _r(stats.median_ratio),
        "stream_ratio_min": _r(stats.stream_ratio_min),
        "stream_ratio_p50": _r(stats.stream_ratio_p50),
        "stream_ratios": [_r(r) for r in stats.stream_ratios],
        "p99_gap_s": _r(stats.p99_gap_s),
        "ttfa_p50_s": _r(stats.ttfa_p50_s),
        "ttfa_p99_s": _r(stats.ttfa_p99_s),
        "wait_p99_s": _r(stats.wait_p99_s),
        "engine_ttfa_p99_s": _r(stats.engine_ttfa_p99_s),
        "ttfa_cause": stats.ttfa_cause,
        "underruns": stats.underruns,
        "stall_s": _r(stats.stall_s),
        "throughput": _r(stats.throughput),
        "sessions": stats.sessions,
        "completed": stats.completed,
        "errors": stats.errors,
        "refusals": stats.refusals,
        "chunks": stats.chunks,
        "hold_s": _r(stats.hold_s, 3),
        "finalize_p99_s": _r(stats.finalize_p99_s),
        "client_lag_p99_s": _r(stats.client_lag_p99_s),
        "streams": stats.streams,
        "stalled_streams": stats.stalled_streams,
        "stalled_share": _r(stats.stalled_share),
        "startup_stalls": stats.startup_stalls,
        "failed_rules": list(stats.failed_rules),
        "details": list(stats.details),
    }


def result_json(result: ProbeResult) -> dict[str, Any]:
    """The whole run as a JSON-ready dict."""
    s, summary = result.settings, result.summary
    e = summary.estimates
    started = datetime.datetime.fromtimestamp(result.started_at, datetime.UTC)
    return {
        "tool": "headroom probe",
        "schema": 1,
        "target": s.client.url,
        "protocol": s.client.protocol,
        "kind": s.kind,
        "model": result.model,
        "threshold": summary.threshold,
        "ceiling": summary.ceiling,
        "exact": summary.bounded,
        "bracket": list(summary.bracket),
        "ceiling_range": list(summary.range),
        "limited_by": list(summary.limited_by),
        "limited_by_queue": summary.limited_by_queue,
        "trials": {
            str(level): dict(zip(("passed", "runs"), summary.trials(level), strict=True))
            for level in sorted({s.level for s in summary.levels})
        },
        "complete": result.stopped is None,
        "stopped": result.stopped,
        "started_at": started.isoformat(timespec="seconds"),
        "duration_s": _r(result.duration_s, 1),
        "estimates": {
            "single_stream_speed": _r(e.single_stream_speed),
            "single_stream_rtf": _r(e.single_stream_rtf),
            "rtf_estimate": e.rtf_estimate,
            "peak_throughput": _r(e.peak_throughput),
            "peak_level": e.peak_level,
            "throughput_estimate": e.throughput_estimate,
            "throughput_at_ceiling": _r(e.throughput_at_ceiling),
            "utilisation_of_peak": _r(e.utilisation_of_peak),
            "ceiling_of_throughput_estimate": _r(e.ceiling_of_throughput_estimate),
        },
        "settings": {
            "levels": list(s.levels),
            "extend": s.extend,
            "max_level": s.max_level,
            "bisect": s.bisect,
            "hold_s": s.hold_s,
            "warmup_s": s.warmup_s,
            "seed": s.seed,
            "workload": s.workload.source,
            "time_limit_s": s.time_limit_s,
            "session_timeout_s": s.session_timeout_s,
            "max_error_rate": s.max_error_rate,
            "prebuffer_s": s.client.prebuffer_s,
            "stream_format": s.client.stream_format,
            "asr_pace": s.client.asr_pace,
            "tokens_per_audio_second": s.client.tokens_per_audio_second,
            "max_stall_share": s.max_stall_share,
            "ttfa_limit_s": s.ttfa_limit_s,
            "repeats": s.repeats,
        },
        "notes": list(result.notes),
        "levels": [level_json(stats, i + 1) for i, stats in enumerate(summary.levels)],
    }


def csv_text(result: ProbeResult) -> str:
    """The CSV document (header + one row per measured level)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for i, stats in enumerate(result.summary.levels):
        row = level_json(stats, i + 1)
        writer.writerow({k: "" if row[k] is None else row[k] for k in CSV_COLUMNS})
    return out.getvalue()


def _f(value: float | None, fmt: str = "{:.2f}", unit: str = "") -> str:
    return "-" if value is None else fmt.format(value) + unit


def format_table(result: ProbeResult) -> str:
    """The per-level table, in the order measured."""
    asr = result.settings.kind == "asr"
    head = (
        f"{'level':>5}  {'phase':6}  {'verdict':11}  {'worst-1%':>8}  {'median':>6}  "
        f"{'p99 gap':>8}  {'TTFT p50' if asr else 'TTFA p50':>8}  {'p99':>7}  {'wait p99':>8}  "
        f"{'underruns':>9}  {'stalled':>7}  {'text-s/s' if asr else 'audio-s/s':>9}  "
        f"{'sessions':>8}  "
        f"{'errors':>6}  {'refused':>7}"
    )
    lines = [head]
    for s in result.summary.levels:
        lines.append(
            f"{s.level:>5}  {s.phase:6}  {s.verdict:11}  {_f(s.worst_1pct, '{:.3f}'):>8}  "
            f"{_f(s.median_ratio):>6}  {_f(s.p99_gap_s, '{:.3f}', ' s'):>8}  "
            f"{_f(s.ttfa_p50_s, '{:.3f}', ' s'):>8}  {_f(s.ttfa_p99_s, '{:.2f}', ' s'):>7}  "
            f"{_f(s.wait_p99_s, '{:.2f}', ' s'):>8}  "
            f"{s.underruns:>9}  {_stalled(s):>7}  {s.throughput:>9.2f}  {s.sessions:>8}  "
            f"{s.errors:>6}  "
            f"{s.refusals:>7}"
        )
    return "\n".join(lines)


def _stalled(stats: LevelStats) -> str:
    """Streams whose playback ran dry, of those that played: ``3/12``."""
    return f"{stats.stalled_streams}/{stats.streams}" if stats.streams else "-"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def _broken(stats: LevelStats | None, settings: ProbeSettings) -> str:
    """What a failing level broke, in words: every rule with its figure (the TTFA rule
    with its cause), else the verdict (``errors``, ``refused``, ``no data``)."""
    if stats is None:
        return "?"
    if not stats.failed_rules or stats.verdict not in _RULE_VERDICTS:
        return stats.verdict
    out = []
    for rule in stats.failed_rules:
        if rule == "steady":
            out.append(f"worst-1% {_f(stats.worst_1pct, '{:.3f}')}x < {settings.threshold:g}x")
        elif rule == "stalls":
            out.append(
                f"{stats.stalled_streams} of {stats.streams} streams stalled "
                f"({stats.startup_stalls} at the first seam)"
            )
        else:
            out.append(_ttfa_broken(stats, settings.ttfa_limit_s))
    return "; ".join(out)


#: Verdicts that name a rule (the level ran, was served and measured).
_RULE_VERDICTS = ("slow", "stalls", "ttfa")


def _ttfa_broken(stats: LevelStats, limit: float | None) -> str:
    """``TTFA p99 9.41 s > 1 s`` and what the time went to: the wait before the stream
    opened or the engine."""
    text = f"TTFA p99 {_f(stats.ttfa_p99_s, '{:.2f}', ' s')} > {_f(limit, '{:g}', ' s')}"
    wait = _f(stats.wait_p99_s, "{:.2f}", " s")
    engine = _f(stats.engine_ttfa_p99_s, "{:.2f}", " s")
    if stats.ttfa_cause == "queue":
        return f"{text} (queue wait {wait} before the stream opened, engine {engine})"
    if stats.ttfa_cause == "engine":
        return f"{text} (engine {engine} after the stream opened, wait {wait} before)"
    return text


def _stream_speeds(summary: ProbeSummary, level: int) -> str:
    """The range of stream ratios over the complete trials of ``level``: ``1.57-1.61x``."""
    ratios = [r for s in summary.levels if s.level == level and s.complete for r in s.stream_ratios]
    if not ratios:
        return "-"
    low, high = min(ratios), max(ratios)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def advice(result: ProbeResult) -> str | None:
    """What to do about the rule that set the ceiling, when the run says something a
    configuration cannot fix: the run measured a queue in front of the engine (any
    ceiling), or level 1 failed (ceiling 0: there is no cap to set). None otherwise.
    When the probe's own event loop lagged at the failing level, its readings (the wait
    before the stream opened included) may be its own: the advice says so first."""
    summary, settings = result.summary, result.settings
    level = summary.bracket[1]
    failing = summary.failing(level) if level is not None else None
    if level is None or failing is None or not summary.bounded:
        return None
    lag = failing.client_lag_p99_s
    if (
        lag is not None
        and lag > LAG_WARNING_S
        and (summary.ceiling == 0 or summary.limited_by_queue)
    ):
        return (
            f"this client's event loop lagged {lag * 1e3:.0f} ms (p99) at {level} "
            f"session{'s' * (level != 1)}, so the rule may have broken in this client, not "
            "in the target: probe again from a less busy machine before acting on this "
            "ceiling"
        )
    if summary.limited_by_queue:
        return (
            f"only the wait before the streams opened broke a rule at {level} "
            f"session{'s' * (level != 1)} (the engine's own TTFA stayed within "
            f"--ttfa-limit and the streams kept {_stream_speeds(summary, level)} once "
            "served): this run measured a queue in front of the engine (a gateway's, full "
            "at its cap or with other traffic), not the engine. Probe the engine directly "
            "(--target its URL), or a gateway whose pool nothing else uses and whose caps "
            "are above the levels probed"
        )
    if summary.ceiling != 0:
        return None
    rules = failing.failed_rules if failing.verdict in _RULE_VERDICTS else ()
    prebuffer = f"{settings.client.prebuffer_s:g} s"
    if "steady" in rules:
        return (
            f"not even one session kept {settings.threshold:g}x realtime: serve this model "
            "on a faster GPU, or lower --threshold only if listeners buffer more than "
            "--prebuffer"
        )
    if "stalls" in rules and failing.startup_stalls == failing.stalled_streams:
        return (
            f"a lone stream's playback ran dry at its first seam: the engine's first chunk "
            f"is too short to cover the wait for the second with a {prebuffer} prebuffer. "
            "Make the first chunks longer (vLLM-Omni: codec_chunk_ramp), or raise "
            "--prebuffer if your listeners buffer more"
        )
    if "stalls" in rules:
        return (
            f"a lone stream's playback ran dry mid-stream with a {prebuffer} prebuffer: "
            "the engine does not stay ahead of one listener. Serve this model on a faster "
            "GPU, or raise --prebuffer if your listeners buffer more"
        )
    if "ttfa" in rules and failing.ttfa_cause == "engine":
        return (
            "the engine's own time to first audio for a lone session exceeds --ttfa-limit: "
            "a faster GPU or a shorter first chunk, or raise --ttfa-limit if your "
            "listeners accept the wait"
        )
    if "ttfa" in rules:
        return (
            "time to first audio for a lone session exceeds --ttfa-limit (this run cannot "
            "tell the wait before the stream opened from the engine's part): probe the "
            "engine directly if --target is a gateway, or raise --ttfa-limit if your "
            "listeners accept the wait"
        )
    return None


def _evidence(summary: ProbeSummary) -> str:
    """Trials at the boundary, the range seen and the rules that limited the ceiling."""
    c = summary.ceiling
    trials = ", ".join(
        f"{level}: {passed}/{runs} passed"
        for level in (c, c + 1)
        if level >= 1
        for passed, runs in [summary.trials(level)]
        if runs
    )
    low, high = summary.range
    seen = f"{low}" if low == high else f"{low}-{high}"
    limited = ", ".join(summary.limited_by) or "-"
    if summary.limited_by_queue:
        limited += " (queue wait)"
    return f"evidence: {trials}; range seen {seen}; limited by {limited}"


def format_summary(result: ProbeResult) -> str:
    """The conclusion in a few lines: ceiling, estimates, utilisation, duration."""
    summary, settings = result.summary, result.settings
    t, c = summary.threshold, summary.ceiling
    at, above = summary.at(c), summary.failing(c + 1)
    lines = []
    if not summary.levels:
        lines.append("ceiling: not measured (no level completed)")
    elif summary.bounded and c == 0:
        lines.append(f"ceiling: 0 - one session already fails: {_broken(above, settings)}")
    elif summary.bounded:
        lines.append(
            f"ceiling: {c} concurrent sessions (worst-1% delivery ratio "
            f"{_f(at.worst_1pct if at else None, '{:.3f}')}x at {c}, "
            f"{_broken(above, settings)} at {c + 1}; threshold {t:g}x)"
        )
    else:
        first_fail = summary.bracket[1]
        if first_fail is not None:
            why = (
                f"{first_fail} failed; levels {c + 1}..{first_fail - 1} were not measured: "
                "bisect (the default) to find the exact integer"
            )
        elif result.stopped:
            why = "the run stopped before a level failed"
        else:
            why = "no measured level failed: raise --max-level or add levels"
        lines.append(f"ceiling: at least {c} ({why})")
    if summary.bounded and summary.levels:
        lines.append(_evidence(summary))
    remedy = advice(result)
    if remedy is not None:
        lines.append(f"advice: {remedy}")
    e = summary.estimates
    if e.throughput_estimate is not None and e.peak_throughput is not None:
        line = (
            f"throughput-based estimate: {e.throughput_estimate} (peak {e.peak_throughput:.2f} "
            f"audio-s/s at {e.peak_level} / {t:g})"
        )
        if e.rtf_estimate is not None and e.single_stream_rtf is not None:
            line += f"; single-stream RTF {e.single_stream_rtf:.3f} -> {e.rtf_estimate}"
        lines.append(line)
    if e.throughput_at_ceiling is not None and e.utilisation_of_peak is not None:
        line = (
            f"utilisation at the ceiling: {e.throughput_at_ceiling:.2f} audio-s/s = "
            f"{e.utilisation_of_peak:.0%} of the peak"
        )
        if e.ceiling_of_throughput_estimate is not None:
            line += f"; the ceiling is {e.ceiling_of_throughput_estimate:.0%} of the estimate"
        lines.append(line)
    lags = [(s.client_lag_p99_s, s.level) for s in summary.levels if s.client_lag_p99_s]
    worst_lag = max(lags, default=None)
    if worst_lag is not None and worst_lag[0] > LAG_WARNING_S:
        lines.append(
            f"warning: this client's event loop lagged {worst_lag[0] * 1e3:.0f} ms (p99) at level "
            f"{worst_lag[1]}: it reads arrivals late, so ratios may be understated; probe "
            "from a less busy machine"
        )
    levels = len(summary.levels)
    lines.append(f"took {_duration(result.duration_s)} ({levels} level{'s' * (levels != 1)})")
    if result.stopped:
        lines.append(f"stopped early: {result.stopped}")
    return "\n".join(lines)


def replica_url(endpoint: str) -> str:
    """The replica's base URL for a configuration: http(s) scheme, no path."""
    parts = urlsplit(endpoint)
    scheme = "https" if parts.scheme in ("https", "wss") else "http"
    return urlunsplit((scheme, parts.netloc, "", "", ""))


def _comment(text: str) -> str:
    """``text`` as YAML comment lines."""
    return textwrap.fill(text, 88, initial_indent="# ", subsequent_indent="# ") + "\n"


def config_snippet(result: ProbeResult, pool: str, replica: str) -> str:
    """YAML for this replica with ``max_sessions`` = the ceiling. Only comments, saying
    why and what to do instead, with a ceiling of 0 (a replica that cannot serve one
    stream has no cap to suggest) or when the run measured a queue in front of the
    engine (:attr:`ProbeSummary.limited_by_queue`: its ceiling is not the engine's)."""
    s, summary = result.settings, result.summary
    c = summary.ceiling
    head = f"headroom probe: {s.client.protocol} at {s.client.url}: ceiling {c}"
    remedy = advice(result)
    if summary.limited_by_queue or c < 1:
        failing = summary.failing(summary.bracket[1]) if summary.bracket[1] else None
        if summary.limited_by_queue:
            why = ", set by the wait before the streams opened, not by the engine"
        elif failing is not None and summary.bounded:
            why = f" ({_broken(failing, s)} at 1 session)"
        else:
            why = " (no level passed)"
        text = _comment(f"{head}{why}, so there is no max_sessions to suggest.")
        return text + (_comment(remedy[0].upper() + remedy[1:] + ".") if remedy else "")
    exact = "" if summary.bounded else " (a lower bound)"
    return (
        f"# {head}{exact}, worst-1% delivery >= {s.threshold:g}x realtime\n"
        "# One run's ceiling, with no margin below the knee: to choose a cap, see \"Which\n"
        '# number to set" in docs/probe.md.\n'
        "pools:\n"
        f"  - name: {pool}\n"
        "    replicas:\n"
        f'      - {{name: {replica}, url: "{replica_url(s.client.url)}", '
        f"max_sessions: {c}}}\n"
    )
