"""Live progress of a probe run on a terminal: one bar per level, then its verdict.

On a TTY the current level's line is redrawn in place (``\\r``) a few times a second;
otherwise (a log, CI) each level prints one line when it starts and one when it ends.
"""

from __future__ import annotations

import sys
from typing import TextIO

from proxy.probe.analysis import LevelStats
from proxy.probe.ramp import LiveFigures

__all__ = ["TerminalProgress"]


def _ratio(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


class TerminalProgress:
    """Implements :class:`proxy.probe.ramp.Progress` on a text stream (stderr)."""

    def __init__(self, out: TextIO | None = None, *, tty: bool | None = None, width: int = 24):
        self.out = out or sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.width = width
        self._total = 0.0
        self._warmup = 0.0
        self._level = 0
        self._phase = ""
        self._drawn = False

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def level_started(self, level: int, phase: str, warmup_s: float, hold_s: float) -> None:
        self._level, self._phase = level, phase
        self._warmup, self._total = warmup_s, warmup_s + hold_s
        if not self.tty:
            self._write(
                f"level {level:>4} ({phase}): {level} sessions, warm-up {warmup_s:g} s, "
                f"hold {hold_s:g} s\n"
            )

    def tick(self, live: LiveFigures) -> None:
        if not self.tty:
            return
        done = min(live.elapsed_s / self._total, 1.0) if self._total > 0 else 1.0
        filled = round(done * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        stage = "warm-up" if live.elapsed_s < self._warmup else "hold"
        self._write(
            f"\rlevel {self._level:>4} {self._phase:6} [{bar}] {done:4.0%} {stage:7} "
            f"open {live.open_sessions:>3}  chunks {live.chunks:>5}  "
            f"worst-1% {_ratio(live.worst_1pct, 3):>6}  median {_ratio(live.median_ratio):>5}  "
            f"err {live.errors}  refused {live.refusals}\x1b[K"
        )
        self._drawn = True

    def level_done(self, stats: LevelStats) -> None:
        prefix = "\r" if self.tty and self._drawn else ""
        clear = "\x1b[K" if self.tty else ""
        self._drawn = False
        extra = f"  ({stats.details[0]})" if stats.details and not stats.passed else ""
        if stats.failed_rules and not stats.passed:
            causes = {"queue": "ttfa by queue wait", "engine": "ttfa by the engine"}
            rules = [
                causes.get(stats.ttfa_cause or "", rule) if rule == "ttfa" else rule
                for rule in stats.failed_rules
            ]
            extra = f"  (broke {', '.join(rules)}){extra}"
        self._write(
            f"{prefix}level {stats.level:>4} {stats.phase:6} {stats.verdict:11} "
            f"worst-1% {_ratio(stats.worst_1pct, 3):>6}  median {_ratio(stats.median_ratio):>5}  "
            f"{stats.throughput:6.2f} audio-s/s  sessions {stats.sessions}  "
            f"err {stats.errors}  refused {stats.refusals}{extra}{clear}\n"
        )

    def note(self, message: str) -> None:
        if self.tty and self._drawn:
            self._write("\n")
            self._drawn = False
        self._write(f"headroom probe: {message}\n")
