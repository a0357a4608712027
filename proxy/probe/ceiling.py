"""Which level to measure next, and what the measured levels say. Pure: no I/O, no clock.

The one ceiling search of the project: the probe drives :class:`CeilingSearch` level by
level against a real endpoint, the simulator through :func:`largest_passing` with a
predicate that runs a virtual-clock load (:mod:`proxy.sim.virtual_load`,
:mod:`proxy.sim.colocated_ceilings`).

:class:`CeilingSearch` ramps through the given levels (1, 2, 4, 8, 16, ... by default,
optionally doubling past the list) until one fails, then bisects between the last
passing and the first failing level down to adjacent integers. With ``repeats`` it then
measures the boundary again (the ceiling and the level above it, ``repeats`` more times
each); a level passes only if every trial of it passed, so a failed repeat of the ceiling
lowers it and the bisection resumes below. The ceiling is :func:`ceiling_of` the
results: the highest passing level below the lowest failing one, so a level counts only
if every measured level below it passes too. The *range seen* is the ceiling with every
trial required to pass (the reported one) up to the ceiling with one passing trial per
level enough: ``(4, 5)`` says 5 passed once and failed once.

:func:`summarize` adds what a throughput-based estimate would have said:

- **RTF estimate**: the single-stream speed (the median stream delivery ratio at
  concurrency 1, i.e. 1 / RTF) divided by the threshold, rounded down: what dividing by
  a model card's single-stream RTF gives (it assumes batching gains nothing).
- **throughput estimate**: the peak aggregate throughput measured (audio seconds per
  second, any level) divided by the threshold, rounded down: "the card makes 18 s of
  audio per second and a listener needs 1.2". It ignores the slow tail, so it overstates.
- **utilisation at the ceiling**: the ceiling level's throughput as a fraction of that
  peak, and the ceiling as a fraction of the throughput estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from proxy.probe.analysis import LevelStats

__all__ = [
    "CeilingSearch",
    "Estimates",
    "ProbeSummary",
    "ceiling_of",
    "doubling",
    "largest_passing",
    "summarize",
]


def ceiling_of(results: Mapping[int, bool]) -> tuple[int, bool]:
    """``(ceiling, bounded)`` from ``{level: passed}``: the highest passing level below
    the lowest failing one (0 if none passes); ``bounded`` when ``ceiling + 1`` failed,
    i.e. the ceiling is exact rather than a lower bound."""
    fails = [level for level, ok in results.items() if not ok]
    lowest_fail = min(fails) if fails else None
    passes = [
        level
        for level, ok in results.items()
        if ok and (lowest_fail is None or level < lowest_fail)
    ]
    ceiling = max(passes, default=0)
    return ceiling, lowest_fail == ceiling + 1


class CeilingSearch:
    """Ramp, then bisect. Call :meth:`next_level`, measure it, :meth:`record` the verdict.

    ``levels``: the ramp (sorted, de-duplicated, each >= 1). ``extend``: after the last
    listed level keep doubling, up to ``max_level``. ``bisect``: narrow the failing
    bracket to adjacent integers (else stop at the first failure)."""

    def __init__(
        self,
        levels: Sequence[int],
        *,
        extend: bool = False,
        max_level: int = 1024,
        bisect: bool = True,
        repeats: int = 0,
    ) -> None:
        if repeats < 0:
            raise ValueError("repeats must be >= 0")
        ramp = sorted({int(level) for level in levels})
        if not ramp or ramp[0] < 1:
            raise ValueError("levels must be integers >= 1")
        if max_level < 1:
            raise ValueError("max_level must be >= 1")
        self._ramp = [level for level in ramp if level <= max_level] or [max_level]
        self._extend = extend
        self._max = max_level
        self._bisect = bisect
        self._next = 0  # index into the ramp
        self._repeats = repeats
        #: level -> passed, every trial of it (a level with a failed trial fails).
        self.results: dict[int, bool] = {}
        #: level -> the verdict of each trial, in order.
        self.trials: dict[int, list[bool]] = {}

    @property
    def phase(self) -> str:
        """``ramp`` until a level fails, then ``bisect``; ``repeat`` while the boundary
        is measured again; ``done`` when nothing is left."""
        if self.next_level() is None:
            return "done"
        if self._search_level() is None:
            return "repeat"
        return "ramp" if all(self.results.values()) else "bisect"

    def _ramp_level(self) -> int | None:
        if self._next < len(self._ramp):
            return self._ramp[self._next]
        if self._extend:
            level = self._ramp[-1] * 2
            return level if level <= self._max else None
        return None

    def next_level(self) -> int | None:
        """The next level to measure, or None when the search is over."""
        level = self._search_level()
        if level is not None or not self._repeats:
            return level
        ceiling, _ = self.ceiling
        due = [
            (len(self.trials[b]), b)
            for b in (ceiling, ceiling + 1)
            if b >= 1 and 0 < len(self.trials.get(b, ())) <= self._repeats
        ]
        return min(due)[1] if due else None  # alternate: the one measured least first

    def _search_level(self) -> int | None:
        """The ramp's or the bisection's next level (None: the bracket is closed)."""
        if all(self.results.values()):
            return self._ramp_level()
        if not self._bisect:
            return None
        low, _ = ceiling_of(self.results)
        high = min(level for level, ok in self.results.items() if not ok)
        while high - low > 1:
            mid = (low + high) // 2
            if mid not in self.results:
                return mid
            if self.results[mid]:
                low = mid
            else:
                high = mid
        return None

    def record(self, level: int, passed: bool) -> None:
        """The verdict of ``level`` (normally the one :meth:`next_level` returned)."""
        self.trials.setdefault(level, []).append(passed)
        self.results[level] = all(self.trials[level])
        if self._next < len(self._ramp) and level == self._ramp[self._next]:
            self._next += 1
        elif self._next >= len(self._ramp) and level > self._ramp[-1]:
            self._ramp.append(level)
            self._next = len(self._ramp)

    @property
    def ceiling(self) -> tuple[int, bool]:
        """``(ceiling, bounded)`` of the levels measured so far (:func:`ceiling_of`)."""
        return ceiling_of(self.results)

    def __repr__(self) -> str:
        ceiling, bounded = self.ceiling
        return (
            f"<CeilingSearch phase={self.phase} ceiling={ceiling}"
            f"{'' if bounded else '+'} results={dict(sorted(self.results.items()))}>"
        )


def doubling(limit: int) -> tuple[int, ...]:
    """The ramp 1, 2, 4, ... below ``limit``, then ``limit`` itself, so that a search
    over it measures its limit: ``doubling(20)`` is ``(1, 2, 4, 8, 16, 20)``."""
    if limit < 1:
        raise ValueError("limit must be >= 1")
    levels = [1]
    while levels[-1] * 2 < limit:
        levels.append(levels[-1] * 2)
    return (*levels, limit) if levels[-1] != limit else tuple(levels)


def largest_passing(passes: Callable[[int], bool], levels: Sequence[int]) -> int:
    """The ceiling a :class:`CeilingSearch` over ``levels`` (no extension, with bisection)
    finds when ``passes(level)`` is each level's verdict: ramp until a level fails, then
    bisect. Each level is measured at most once; 0 when the first level fails, the last
    level when every level of the ramp passes."""
    search = CeilingSearch(levels, max_level=max(levels))
    while (level := search.next_level()) is not None:
        search.record(level, passes(level))
    ceiling, _ = search.ceiling
    return ceiling


@dataclass(frozen=True, slots=True)
class Estimates:
    """Throughput-based estimates next to the measured ceiling (module docstring)."""

    single_stream_speed: float | None
    single_stream_rtf: float | None
    rtf_estimate: int | None
    peak_throughput: float | None
    peak_level: int | None
    throughput_estimate: int | None
    throughput_at_ceiling: float | None
    utilisation_of_peak: float | None
    ceiling_of_throughput_estimate: float | None


@dataclass(frozen=True, slots=True)
class ProbeSummary:
    """The run's conclusion: ``ceiling`` (exact when ``bounded``, else a lower bound)."""

    threshold: float
    ceiling: int
    bounded: bool
    bracket: tuple[int, int | None]
    estimates: Estimates
    levels: tuple[LevelStats, ...]
    #: The range seen (module docstring): ``(ceiling, ceiling with one pass enough)``.
    range: tuple[int, int] = (0, 0)

    def at(self, level: int) -> LevelStats | None:
        """The last complete measurement of ``level``."""
        found = None
        for stats in self.levels:
            if stats.level == level and stats.complete:
                found = stats
        return found

    def failing(self, level: int) -> LevelStats | None:
        """The first complete trial of ``level`` that failed, else its last one."""
        trials = [s for s in self.levels if s.level == level and s.complete]
        return next((s for s in trials if not s.passed), trials[-1] if trials else None)

    def trials(self, level: int) -> tuple[int, int]:
        """``(passed, measured)`` complete trials of ``level``."""
        trials = [s for s in self.levels if s.level == level and s.complete]
        return sum(s.passed for s in trials), len(trials)

    @property
    def limited_by(self) -> tuple[str, ...]:
        """What failed at the lowest failing level, in every failed trial of it: the
        rules ``steady``, ``stalls``, ``ttfa`` (as ``describe`` names them), or the
        verdict of a level that broke none (``errors``, ``refused``, ``no data``)."""
        out: list[str] = []
        for s in self.levels:
            if s.level == self.bracket[1] and s.complete and not s.passed:
                for reason in s.failed_rules or (s.verdict,):
                    if reason not in out:
                        out.append(reason)
        return tuple(out)

    @property
    def limited_by_queue(self) -> bool:
        """Every failed trial of the lowest failing level broke the TTFA rule alone (no
        errors or refusals, the other rules kept), with the wait before the stream
        opened as its cause (``ttfa_cause`` ``queue``): the engine kept every rule once
        it served the sessions, so the run measured a queue in front of it (a
        gateway's), not the engine."""
        failed = [
            s for s in self.levels if s.level == self.bracket[1] and s.complete and not s.passed
        ]
        return bool(failed) and all(s.verdict == "ttfa" and s.ttfa_cause == "queue" for s in failed)


def summarize(levels: Sequence[LevelStats], threshold: float) -> ProbeSummary:
    """The ceiling and estimates from the levels measured (incomplete ones ignored)."""
    results: dict[int, bool] = {}
    any_pass: dict[int, bool] = {}
    for s in levels:
        if s.complete:
            results[s.level] = results.get(s.level, True) and s.passed
            any_pass[s.level] = any_pass.get(s.level, False) or s.passed
    ceiling, bounded = ceiling_of(results)
    seen = (ceiling, max(ceiling, ceiling_of(any_pass)[0]))
    fails = [level for level, ok in results.items() if not ok]
    summary = ProbeSummary(
        threshold, ceiling, bounded, (ceiling, min(fails) if fails else None), _NONE, tuple(levels)
    )
    one = summary.at(1)
    speed = one.stream_ratio_p50 if one is not None else None
    complete = [s for s in levels if s.complete and s.throughput > 0.0]
    peak = max(complete, key=lambda s: s.throughput, default=None)
    at_ceiling = summary.at(ceiling)
    peak_tp = peak.throughput if peak is not None else None
    tp_estimate = math.floor(peak_tp / threshold + 1e-9) if peak_tp is not None else None
    tp_ceiling = at_ceiling.throughput if at_ceiling is not None else None
    estimates = Estimates(
        single_stream_speed=speed,
        single_stream_rtf=1.0 / speed if speed else None,
        rtf_estimate=math.floor(speed / threshold + 1e-9) if speed is not None else None,
        peak_throughput=peak_tp,
        peak_level=peak.level if peak is not None else None,
        throughput_estimate=tp_estimate,
        throughput_at_ceiling=tp_ceiling,
        utilisation_of_peak=tp_ceiling / peak_tp if tp_ceiling is not None and peak_tp else None,
        ceiling_of_throughput_estimate=ceiling / tp_estimate if tp_estimate else None,
    )
    return ProbeSummary(
        threshold, ceiling, bounded, summary.bracket, estimates, tuple(levels), seen
    )


_NONE = Estimates(None, None, None, None, None, None, None, None, None)
