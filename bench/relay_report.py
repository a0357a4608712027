"""The report of bench/relay.py: the summary and the issue's targets first, then the
machine around each cell, every cell, and what to distrust (metered audio that differs
from the relayed audio, relay CPU whose two /proc accountings disagree).
"""

from __future__ import annotations

from typing import Any

from relay_matrix import (  # type: ignore[import-not-found,unused-ignore]
    load_markdown,
    summary_markdown,
)

__all__ = ["METERED_BAND", "TICKS_TO_COMPARE", "accounting_gaps", "cells_markdown", "markdown"]

#: Metered audio / relayed audio outside this band: the meter did not see the chunks.
METERED_BAND = (0.97, 1.03)
#: utime+stime ticks in a window from which it must agree with schedstat.
TICKS_TO_COMPARE = 200


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _cpu(c: dict[str, Any]) -> str:
    if c["relay_cpu_us_per_chunk"] is None:
        return "-"
    share = c["relay_sys_share"]
    return f"{c['relay_cpu_us_per_chunk']:.1f}" + (f" ({share:.0%})" if share is not None else "")


def cells_markdown(cells: list[dict[str, Any]]) -> str:
    """Every cell of every round."""
    lines = [
        "| round | sessions | pacing | chunks/s | target | p50 ms | p99 ms | added p50 "
        "| added p99 | CPU us/chunk (sys) | stat us/chunk | relay cores | setup ms/sess "
        "| KB/sess (idle) | delivered | metered | other load |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        lines.append(
            f"| {int(c.get('round', 0)) + 1} | {c['sessions']} | {c['pacing_ms']:g} ms "
            f"| {_fmt(c['chunks_per_s'], 0)} | {c['target']} | {_fmt(c['latency_ms']['p50'])} "
            f"| {_fmt(c['latency_ms']['p99'])} | {_fmt(c['added_p50_ms'])} "
            f"| {_fmt(c['added_p99_ms'])} | {_cpu(c)} "
            f"| {_fmt(c['relay_cpu_us_per_chunk_stat'], 1)} | {_fmt(c['relay_cpu_cores'])} "
            f"| {_fmt(c['setup_cpu_ms_per_session'], 3)} "
            f"| {_fmt(c['mem_kb_per_session'], 1)} ({_fmt(c['mem_kb_per_session_connected'], 1)}) "
            f"| {_fmt(c['delivered_ratio'])} | {_fmt(c.get('metered_audio_ratio'))} "
            f"| {_fmt(c['other_cpu_cores'], 1)} |"
        )
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The report: the summary and the issue's targets first, then the machine around
    each cell, every cell, and what to distrust."""
    cfg = result["config"]
    lines = [
        f"## bench/relay.py: {', '.join(cfg['targets'])}; "
        f"{', '.join(f'{n}x{p:g}ms' for n, p in cfg['cells'])}; {cfg['rounds']} round(s)",
        "",
        f"Machine: {result['machine'].get('nproc')} cores, {result['machine'].get('cpu_model')}, "
        f"nginx {result['machine'].get('nginx')}, Python {result['machine'].get('python')}; "
        f"load average 1/5/15 at start {'/'.join(f'{x:.2f}' for x in result['load_start'])}, "
        f"at end {'/'.join(f'{x:.2f}' for x in result['load_end'])}; "
        f"{result['elapsed_s']:.0f} s.",
        "",
    ]
    for t, info in result["trees"].items():
        lines.append(f"- `{t}`: {info['revision']}, {info['build']}")
    lines += ["", summary_markdown(result["summary"], result["checks"]), ""]
    noisy = [c for c in result["cells"] if c.get("noisy")]
    lines.append(
        f"Noisy cells: {len(noisy)} of {len(result['cells'])} (load average 1 min >= "
        f"{cfg['max_load']:g} after waiting {cfg['load_wait_s']:g} s, or more than "
        f"{cfg['max_other_cores']:g} cores of other processes in the window)."
    )
    low, high = METERED_BAND
    bad_meter = [
        f"{c['target']} r{c['round'] + 1} ({c['metered_audio_ratio']})"
        for c in result["cells"]
        if c.get("metered_audio_ratio") is not None and not low <= c["metered_audio_ratio"] <= high
    ]
    if bad_meter:
        lines.append("**Metered audio differs from relayed audio** in: " + ", ".join(bad_meter))
    gaps = accounting_gaps(result["cells"])
    if gaps:
        lines.append("**Relay CPU from schedstat and from stat differ** (threads that "
                     "exited, or processes not counted) in: " + ", ".join(gaps))  # fmt: skip
    lines += ["", "### The machine around each cell", "", load_markdown(result["cells"]),
              "", "### Every cell", "", cells_markdown(result["cells"])]  # fmt: skip
    bursts = [c for c in result["cells"] if len(c["setup_cpu_ms_per_session_bursts"]) > 1]
    if bursts:
        lines += ["", "Set-up ms per session, each burst (the tables give their median):"]
        lines += [
            f"- r{int(c.get('round', 0)) + 1} {c['target']} {c['sessions']}x{c['pacing_ms']:g}ms: "
            + " ".join(_fmt(x, 3) for x in c["setup_cpu_ms_per_session_bursts"])
            for c in bursts
        ]
    return "\n".join(lines)


def accounting_gaps(cells: list[dict[str, Any]], tolerance: float = 0.1) -> list[str]:
    """Cells whose relay CPU from schedstat (live threads) and from utime+stime (the
    whole process, exited threads too) differ by more than ``tolerance``, among those
    with ticks enough to compare."""
    out = []
    for c in cells:
        sched, stat = c.get("relay_cpu_us_per_chunk"), c.get("relay_cpu_us_per_chunk_stat")
        enough = (c.get("relay_cpu_ticks") or 0) >= TICKS_TO_COMPARE
        if sched and stat and enough and abs(stat / sched - 1.0) > tolerance:
            out.append(f"{c['target']} r{int(c.get('round', 0)) + 1} ({sched} / {stat} us)")
    return out
