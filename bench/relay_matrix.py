"""Rounds, the load gate and the summary of bench/relay.py.

A run repeats the whole matrix ``--rounds`` times in a balanced order: rounds go in
pairs, the second of a pair the first reversed, and each pair rotated one place from the
one before (A B C D, D C B A, B C D A, A D C B, ...). Rotation alone keeps the cyclic
order, so with fewer rounds than targets one target always ran before another (a
Headroom tree before its baseline in every round); reversing every other round puts each
pair of targets in both orders over any two rounds, so neither a drift in the machine nor
what the cell before left behind (sockets in TIME_WAIT, a warm or cold cache) falls on one
side of a comparison. Before each cell the run waits, within a bound, for the 1-minute
load average to fall below ``--max-load``; a cell that started above it, or that saw
other processes' CPU in its window, is marked noisy. The summary gives, per target and
cell, the median and the range over the rounds of each figure, and of the ratios to
nginx and to the baseline taken within each round; the issue's targets are judged on
those medians.

Everything here but :func:`wait_quiet` and :func:`busy_share` is a pure function of
the cells' dicts.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import Any

from harness import cpu_busy  # type: ignore[import-not-found,unused-ignore]

__all__ = [
    "FIGURES",
    "LIMITS",
    "busy_share",
    "load_markdown",
    "rotated",
    "spread",
    "summarize",
    "summary_markdown",
    "targets_met",
    "wait_quiet",
]

#: Figures summarised per target and cell: (cell key, label, digits).
FIGURES = (
    ("relay_cpu_us_per_chunk", "CPU us/chunk", 1),
    ("setup_cpu_ms_per_session", "set-up ms/session", 3),
    ("mem_kb_per_session", "KB/session", 1),
    ("added_p50_ms", "added p50 ms", 2),
    ("added_p99_ms", "added p99 ms", 2),
)
#: Ratios to nginx taken within each round: (cell key, label).
NGINX_RATIOS = (
    ("relay_cpu_us_per_chunk", "x nginx CPU/chunk"),
    ("setup_cpu_ms_per_session", "x nginx set-up"),
    ("mem_kb_per_session", "x nginx memory"),
)
#: Each Headroom target and the baseline target of the same build.
BASELINE_OF = {"headroom": "baseline", "headroom-compiled": "baseline-compiled"}
#: The targets the table is judged against (Headroom, metering on, same run).
LIMITS = {
    "cpu_x_nginx_500x25": 1.0,  # compiled build, x nginx CPU per chunk at 500 x 25/s
    "setup_ms": 0.35,  # per session, every cell
    "mem_kb": 20.0,  # per streaming session, every cell that kept up
    "cpu_x_baseline": 1.0,  # x the baseline revision's CPU per chunk, same build
}


def rotated(targets: list[str], round_index: int) -> list[str]:
    """The targets' order in round ``round_index`` (0-based): rotated left by
    ``round_index // 2``, and reversed when ``round_index`` is odd."""
    if not targets:
        return []
    k = (round_index // 2) % len(targets)
    order = targets[k:] + targets[:k]
    return order[::-1] if round_index % 2 else order


def spread(values: list[float | None]) -> dict[str, Any]:
    """Median, min, max and count of the measured values (None: not measured)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "values": xs}  # fmt: skip


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return float(a) / float(b)


def _shape(cell: dict[str, Any]) -> tuple[int, float]:
    return int(cell["sessions"]), float(cell["pacing_ms"])


def summarize(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (cell shape, target): each figure's spread over the rounds, and the
    spread of the per-round ratios to nginx and to the baseline of the same build."""
    by: dict[tuple[int, float, str, int], dict[str, Any]] = {
        (*_shape(c), c["target"], int(c.get("round", 0))): c for c in cells
    }
    shapes = sorted({_shape(c) for c in cells}, key=lambda s: (s[1], s[0]))
    order: list[str] = []
    for c in cells:
        if c["target"] not in order:
            order.append(c["target"])
    rows = []
    for n, p in shapes:
        for target in order:
            mine = sorted(
                (c for (cn, cp, t, _), c in by.items() if (cn, cp, t) == (n, p, target)),
                key=lambda c: int(c.get("round", 0)),
            )
            if not mine:
                continue
            row: dict[str, Any] = {
                "sessions": n,
                "pacing_ms": p,
                "target": target,
                "rounds": len(mine),
                "noisy_rounds": sum(1 for c in mine if c.get("noisy")),
                "load1_before": spread([c.get("load_before", [None])[0] for c in mine]),
                "kept_up_rounds": sum(1 for c in mine if kept_up(c)),
            }
            for key, _, _ in FIGURES:
                row[key] = spread([c.get(key) for c in mine])
            for key, _ in NGINX_RATIOS:
                row[f"{key}_x_nginx"] = spread([
                    _ratio(c.get(key), by.get((n, p, "nginx", int(c.get("round", 0))), {}).get(key))
                    for c in mine
                ]) if target != "nginx" else spread([])  # fmt: skip
            base = BASELINE_OF.get(target)
            row["cpu_x_baseline"] = spread([
                _ratio(c.get("relay_cpu_us_per_chunk"),
                       by.get((n, p, base, int(c.get("round", 0))), {}).get(
                           "relay_cpu_us_per_chunk"))
                for c in mine
            ]) if base else spread([])  # fmt: skip
            rows.append(row)
    return rows


def kept_up(cell: dict[str, Any]) -> bool:
    """Delivered (almost) every paced chunk, and the median chunk is not a whole pacing
    interval late (a backlog)."""
    p50 = (cell.get("latency_ms") or {}).get("p50")
    return (cell.get("delivered_ratio") or 0.0) >= 0.98 and (
        p50 is not None and p50 < cell["pacing_ms"]
    )


def _check(name: str, target: str, where: str, s: dict[str, Any], limit: float) -> dict[str, Any]:
    value = s["median"]
    return {
        "name": name, "target": target, "cell": where, "median": value, "min": s["min"],
        "max": s["max"], "rounds": s["n"], "limit": limit,
        "ok": None if value is None else bool(value <= limit),
        "rounds_within": None if value is None else sum(1 for v in s["values"] if v <= limit),
    }  # fmt: skip


def targets_met(
    rows: list[dict[str, Any]], limits: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """The issue's targets on the summary: the median over rounds against the limit,
    with the range and how many rounds were within it."""
    lim = {**LIMITS, **(limits or {})}
    out = []
    for row in rows:
        where = f"{row['sessions']}x{row['pacing_ms']:g}ms"
        target = row["target"]
        if not target.startswith("headroom") or target == "headroom-qf":
            continue
        if target == "headroom-compiled" and (row["sessions"], row["pacing_ms"]) == (500, 40.0):
            out.append(
                _check(
                    "CPU per chunk x nginx",
                    target,
                    where,
                    row["relay_cpu_us_per_chunk_x_nginx"],
                    lim["cpu_x_nginx_500x25"],
                )
            )
        out.append(
            _check(
                "set-up ms per session",
                target,
                where,
                row["setup_cpu_ms_per_session"],
                lim["setup_ms"],
            )
        )
        if row["kept_up_rounds"] == row["rounds"]:  # a backlog is saturation, not a session
            out.append(
                _check(
                    "KB per streaming session",
                    target,
                    where,
                    row["mem_kb_per_session"],
                    lim["mem_kb"],
                )
            )
        if row["cpu_x_baseline"]["n"]:
            out.append(_check("CPU per chunk x baseline", target, where, row["cpu_x_baseline"],
                              lim["cpu_x_baseline"]))  # fmt: skip
    return out


def _num(value: Any, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cell(s: dict[str, Any], digits: int) -> str:
    if s["median"] is None:
        return "-"
    if s["n"] == 1:
        return _num(s["median"], digits)
    return f"{_num(s['median'], digits)} ({_num(s['min'], digits)}-{_num(s['max'], digits)})"


def summary_markdown(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    """The table the issue asks for: per cell and target, median (min-max) over rounds."""
    head = ["sessions", "pacing", "target", "rounds (noisy)"]
    head += [label for _, label, _ in FIGURES]
    head += [label for _, label in NGINX_RATIOS] + ["x baseline CPU/chunk"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" if i != 2 else "---" for i in range(len(head))) + "|",
    ]
    for r in rows:
        cols = [str(r["sessions"]), f"{r['pacing_ms']:g} ms", r["target"],
                f"{r['rounds']} ({r['noisy_rounds']})"]  # fmt: skip
        cols += [_cell(r[key], digits) for key, _, digits in FIGURES]
        cols += [_cell(r[f"{key}_x_nginx"], 2) for key, _ in NGINX_RATIOS]
        cols.append(_cell(r["cpu_x_baseline"], 3))
        lines.append("| " + " | ".join(cols) + " |")
    lines += ["", "Median (min-max) over the rounds; ratios are taken within each round.", "",
              "| check | target | cell | median | range | rounds within | limit | met |",
              "|---|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for c in checks:
        ok = "not measured" if c["ok"] is None else ("yes" if c["ok"] else "**NO**")
        within = "-" if c["rounds_within"] is None else f"{c['rounds_within']} of {c['rounds']}"
        lines.append(
            f"| {c['name']} | {c['target']} | {c['cell']} | {_num(c['median'], 3)} "
            f"| {_num(c['min'], 3)}-{_num(c['max'], 3)} | {within} | {c['limit']:g} | {ok} |"
        )
    return "\n".join(lines)


def load_markdown(cells: list[dict[str, Any]]) -> str:
    """The machine around each cell: load averages and CPU busy share before and after,
    other processes' cores in the window, and why a cell is noisy."""
    lines = ["| round | cell | target | load 1/5/15 before | load 1/5/15 after | busy before "
             "| busy after | other cores in window | waited s | noisy |",
             "|---:|---|---|---|---|---:|---:|---:|---:|---|"]  # fmt: skip

    def load(v: Any) -> str:
        return "-" if not v else "/".join(f"{x:.2f}" for x in v)

    for c in cells:
        lines.append(
            f"| {int(c.get('round', 0)) + 1} | {c['sessions']}x{c['pacing_ms']:g}ms "
            f"| {c['target']} | {load(c.get('load_before'))} | {load(c.get('load_after'))} "
            f"| {_pct(c.get('busy_before'))} | {_pct(c.get('busy_after'))} "
            f"| {_num(c.get('other_cpu_cores'), 2)} | {_num(c.get('load_waited_s'), 0)} "
            f"| {'; '.join(c.get('noisy') or []) or 'no'} |"
        )
    return "\n".join(lines)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0%}"


async def busy_share(seconds: float = 1.0) -> float:
    """The machine's CPU busy share over ``seconds`` (all cores, /proc/stat)."""
    b0, t0 = cpu_busy()
    await asyncio.sleep(seconds)
    b1, t1 = cpu_busy()
    return float((b1 - b0) / max(1, t1 - t0))


async def wait_quiet(max_load: float, wait_s: float, poll_s: float = 2.0) -> dict[str, Any]:
    """Wait up to ``wait_s`` for the 1-minute load average to fall below ``max_load``:
    the load averages at the start, how long it waited, and whether it got there."""
    started = time.monotonic()
    first = os.getloadavg()
    while True:
        now = os.getloadavg()
        if now[0] < max_load:
            return {"load_at_gate": list(first), "load_waited_s": time.monotonic() - started,
                    "quiet": True}  # fmt: skip
        if time.monotonic() - started >= wait_s:
            return {"load_at_gate": list(first), "load_waited_s": time.monotonic() - started,
                    "quiet": False}  # fmt: skip
        await asyncio.sleep(poll_s)
