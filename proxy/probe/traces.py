"""``--save-traces``: every session's arrivals as JSON Lines, to re-analyse or to test with.

One line per measured level::

    {"window": {"level": 4, "started_at": ..., "warm_end": ..., "ended_at": ...,
                "complete": true, "phase": "ramp"},
     "share": null,
     "sessions": [{"started_at": ..., "ended_at": ..., "outcome": "ok",
                   "arrivals": [[at, audio_s, gap|null, ratio|null], ...],
                   "underruns": [[at, stall_s], ...], "audio_sent_s": 0.0,
                   "finalize_s": null, "detail": "", "opened_at": ...}, ...]}

Times are the probe's monotonic clock in seconds; ``share`` is the ASR fallback share
(audio seconds per transcript event) the level was analysed with; ``opened_at`` is when
the target opened the session's stream (null, or absent in older files: not recorded).
:func:`read_traces` returns :class:`RecordedLevel` values, what
:func:`proxy.probe.analysis.level_stats` takes, so a saved run can be analysed again
(with another threshold, say) without touching the GPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from proxy.probe.analysis import Arrival, LevelWindow, SessionTrace

__all__ = ["RecordedLevel", "read_traces", "trace_from_json", "trace_json", "write_traces"]

_OUTCOMES = ("ok", "error", "refused", "cancelled")


class RecordedLevel(NamedTuple):
    """One level of a saved run."""

    window: LevelWindow
    traces: list[SessionTrace]
    share: float | None = None


def trace_json(trace: SessionTrace) -> dict[str, Any]:
    """One session's trace as a JSON object (its arrivals, outcome and times)."""
    return {
        "started_at": trace.started_at,
        "ended_at": trace.ended_at,
        "outcome": trace.outcome,
        "arrivals": [[a.at, a.audio_s, a.gap, a.ratio] for a in trace.arrivals],
        "underruns": [list(u) for u in trace.underruns],
        "audio_sent_s": trace.audio_sent_s,
        "finalize_s": trace.finalize_s,
        "detail": trace.detail,
        "opened_at": trace.opened_at,
    }


def trace_from_json(data: dict[str, Any]) -> SessionTrace:
    """The trace :func:`trace_json` wrote; ``ValueError`` for an unknown outcome."""
    outcome = data["outcome"]
    if outcome not in _OUTCOMES:
        raise ValueError(f"unknown session outcome {outcome!r}")
    return SessionTrace(
        started_at=float(data["started_at"]),
        ended_at=float(data["ended_at"]),
        outcome=outcome,
        arrivals=tuple(Arrival(*a) for a in data.get("arrivals", ())),
        underruns=tuple((float(at), float(s)) for at, s in data.get("underruns", ())),
        audio_sent_s=float(data.get("audio_sent_s", 0.0)),
        finalize_s=data.get("finalize_s"),
        detail=str(data.get("detail", "")),
        opened_at=None if data.get("opened_at") is None else float(data["opened_at"]),
    )


def _window_json(w: LevelWindow) -> dict[str, Any]:
    return {
        "level": w.level,
        "started_at": w.started_at,
        "warm_end": w.warm_end,
        "ended_at": w.ended_at,
        "complete": w.complete,
        "phase": w.phase,
    }


def write_traces(levels: Iterable[RecordedLevel], path: str | Path) -> None:
    """Write each recorded level as one JSON line (see the module docstring)."""
    with open(path, "w", encoding="utf-8") as out:
        for window, traces, share in levels:
            line = {
                "window": _window_json(window),
                "share": share,
                "sessions": [trace_json(t) for t in traces],
            }
            out.write(json.dumps(line, separators=(",", ":")) + "\n")


def read_traces(path: str | Path) -> list[RecordedLevel]:
    """The levels :func:`write_traces` wrote, in order."""
    levels = []
    with open(path, encoding="utf-8") as src:
        for line in src:
            if line.strip():
                data = json.loads(line)
                window = LevelWindow(**data["window"])
                traces = [trace_from_json(s) for s in data["sessions"]]
                levels.append(RecordedLevel(window, traces, data.get("share")))
    return levels
