"""The search (ramp, then bisection), the ceiling rule, and the throughput estimates."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.probe.analysis import LevelStats
from proxy.probe.ceiling import CeilingSearch, ceiling_of, doubling, largest_passing, summarize

RAMPS = [
    ((1, 2, 4, 8, 16), True),
    ((1, 2, 4, 8, 16), False),
    ((2, 4), True),
    ((3, 5, 7), True),
    ((1,), True),
    ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10), False),
]


def search(true_ceiling: int, levels: tuple[int, ...], extend: bool, **kw: int) -> CeilingSearch:
    """Run a search against an oracle: a level passes iff it is <= the true ceiling."""
    s = CeilingSearch(levels, extend=extend, **kw)  # type: ignore[arg-type]
    measured = []
    while (level := s.next_level()) is not None:
        assert level not in s.results, f"{level} measured twice"
        measured.append(level)
        s.record(level, level <= true_ceiling)
        assert len(measured) < 64
    return s


@pytest.mark.parametrize(("levels", "extend"), RAMPS)
def test_search_finds_every_ceiling_exactly(levels: tuple[int, ...], extend: bool) -> None:
    max_level = 512
    top = max(levels)
    if extend:
        while top * 2 <= max_level:
            top *= 2
    for true in range(0, 300):
        s = search(true, levels, extend, max_level=max_level)
        ceiling, bounded = s.ceiling
        assert ceiling == min(true, top), (true, s)
        assert bounded == (true < top)
        # Cost: the ramp up to its first failure, then a binary search of that bracket.
        ramp = list(levels)
        while extend and ramp[-1] * 2 <= max_level:
            ramp.append(ramp[-1] * 2)
        fail = next((lv for lv in ramp if lv > true), None)
        ramped = [lv for lv in ramp if fail is None or lv <= fail]
        assert set(ramped) <= set(s.results)
        if fail is not None:
            width = fail - max((lv for lv in ramped if lv <= true), default=0)
            assert len(s.results) - len(ramped) <= math.ceil(math.log2(width))


def test_default_ramp_order_and_phases() -> None:
    s = CeilingSearch((1, 2, 4, 8, 16), extend=True)
    order = []
    while (level := s.next_level()) is not None:
        order.append((level, s.phase))
        s.record(level, level <= 11)
    assert order == [
        (1, "ramp"),
        (2, "ramp"),
        (4, "ramp"),
        (8, "ramp"),
        (16, "ramp"),
        (12, "bisect"),
        (10, "bisect"),
        (11, "bisect"),
    ]
    assert s.ceiling == (11, True) and s.phase == "done"
    assert repr(s) == (
        "<CeilingSearch phase=done ceiling=11 results="
        "{1: True, 2: True, 4: True, 8: True, 10: True, 11: True, 12: False, 16: False}>"
    )


def test_extension_doubles_up_to_the_maximum() -> None:
    s = search(10_000, (1, 2), True, max_level=100)
    assert sorted(s.results) == [1, 2, 4, 8, 16, 32, 64]
    assert s.ceiling == (64, False)


def test_largest_passing_runs_the_search_with_a_predicate() -> None:
    """The simulator's entry to the search: each level judged once, the limit measured."""
    assert doubling(20) == (1, 2, 4, 8, 16, 20)
    assert doubling(16) == (1, 2, 4, 8, 16)
    assert doubling(1) == (1,)
    with pytest.raises(ValueError, match="limit"):
        doubling(0)
    for true in range(0, 40):
        measured: list[int] = []

        def passes(level: int, true: int = true, measured: list[int] = measured) -> bool:
            measured.append(level)
            return level <= true

        assert largest_passing(passes, doubling(20)) == min(true, 20)
        assert len(measured) == len(set(measured))
        assert (20 in measured) == (true >= 16)
    # One level: passing ends the search there, failing bisects below it.
    assert largest_passing(lambda p: p <= 100, (100,)) == 100
    assert largest_passing(lambda p: p <= 37, (100,)) == 37
    assert largest_passing(lambda p: False, (100,)) == 0


def test_without_bisection_the_first_failure_ends_the_search() -> None:
    s = search(11, (1, 2, 4, 8, 16), True, bisect=False)
    assert sorted(s.results) == [1, 2, 4, 8, 16]
    assert s.ceiling == (8, False)
    s = search(0, (1, 2, 4), False, bisect=False)
    assert s.ceiling == (0, True)


def test_invalid_levels_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        CeilingSearch(())
    with pytest.raises(ValueError, match=">= 1"):
        CeilingSearch((0, 1))
    with pytest.raises(ValueError, match="max_level"):
        CeilingSearch((1,), max_level=0)
    assert CeilingSearch((64, 128), max_level=32).next_level() == 32


def test_an_already_measured_midpoint_is_reused() -> None:
    s = CeilingSearch((1, 2, 3, 4, 8))
    for level, ok in ((1, True), (2, True), (3, True), (4, True), (8, False)):
        assert s.next_level() == level
        s.record(level, ok)
    assert s.next_level() == 6


@given(st.dictionaries(st.integers(1, 64), st.booleans(), max_size=20))
def test_ceiling_of_matches_its_definition(results: dict[int, bool]) -> None:
    ceiling, bounded = ceiling_of(results)
    fails = [lv for lv, ok in results.items() if not ok]
    lowest_fail = min(fails, default=math.inf)
    assert ceiling == max((lv for lv, ok in results.items() if ok and lv < lowest_fail), default=0)
    assert bounded == (lowest_fail == ceiling + 1)
    # A pass above a failure never raises the ceiling.
    assert all(ceiling < lv for lv in fails)


def stats(level: int, worst: float, throughput: float, complete: bool = True) -> LevelStats:
    return LevelStats(
        level=level,
        phase="ramp",
        complete=complete,
        hold_s=30.0,
        sessions=level,
        completed=level,
        errors=0,
        refusals=0,
        chunks=100,
        worst_1pct=worst,
        median_ratio=worst * 1.2,
        stream_ratios=tuple([throughput / level] * level),
        p99_gap_s=1.0,
        ttfa_p50_s=0.1,
        ttfa_p99_s=0.2,
        underruns=0,
        stall_s=0.0,
        throughput=throughput,
        finalize_p99_s=None,
        passed=complete and worst >= 1.2,
        verdict="pass" if worst >= 1.2 else "slow",
    )


def test_summary_estimates_next_to_the_ceiling() -> None:
    # l40s-qwen3tts-like: 4.08x alone, throughput peaks near 18 audio-s/s at 16.
    levels = [
        stats(1, 3.1, 4.08),
        stats(2, 3.1, 7.9),
        stats(4, 1.9, 11.9),
        stats(8, 1.5, 16.9),
        stats(16, 0.92, 18.1),
        stats(12, 1.19, 17.8),
        stats(10, 1.36, 17.7),
        stats(11, 1.33, 17.85),
        stats(13, 1.5, 99.0, complete=False),  # interrupted: ignored
    ]
    summary = summarize(levels, 1.2)
    assert (summary.ceiling, summary.bounded, summary.bracket) == (11, True, (11, 12))
    e = summary.estimates
    assert e.single_stream_speed == pytest.approx(4.08)
    assert e.single_stream_rtf == pytest.approx(1 / 4.08)
    assert e.rtf_estimate == 3  # 4.08 / 1.2
    assert (e.peak_throughput, e.peak_level, e.throughput_estimate) == (18.1, 16, 15)
    assert e.throughput_at_ceiling == 17.85
    assert e.utilisation_of_peak == pytest.approx(17.85 / 18.1)
    assert e.ceiling_of_throughput_estimate == pytest.approx(11 / 15)
    assert summary.at(11) is levels[7] and summary.at(13) is None


def test_summary_of_nothing_and_of_a_failing_first_level() -> None:
    empty = summarize([], 1.2)
    assert (empty.ceiling, empty.bounded, empty.estimates.throughput_estimate) == (0, False, None)
    one = summarize([stats(1, 0.8, 0.9)], 1.2)
    assert (one.ceiling, one.bounded) == (0, True)
    assert one.estimates.rtf_estimate == 0 and one.estimates.throughput_at_ceiling is None
    tiny = replace(stats(1, 0.8, 0.0), stream_ratios=())
    assert summarize([tiny], 1.2).estimates.single_stream_rtf is None


# -- repeated trials at the boundary ------------------------------------------------------


def test_repeats_measure_the_boundary_again() -> None:
    s = CeilingSearch((1, 2, 4, 8, 16), extend=False, repeats=2)
    order = []
    while (level := s.next_level()) is not None:
        order.append((level, s.phase))
        s.record(level, level <= 11)
    # The search as without repeats, then the ceiling and the level above, twice more.
    assert [lv for lv, _ in order] == [1, 2, 4, 8, 16, 12, 10, 11, 11, 12, 11, 12]
    assert [ph for _, ph in order[-4:]] == ["repeat"] * 4
    assert s.ceiling == (11, True) and s.trials[11] == [True] * 3


def test_a_failed_repeat_lowers_the_ceiling_and_bisection_resumes_below() -> None:
    # 11 passes once, then fails: it fails, and 10 (measured again) is the ceiling.
    verdicts = {11: [True, False]}
    s = CeilingSearch((1, 2, 4, 8, 16), extend=False, repeats=1)
    order = []
    while (level := s.next_level()) is not None:
        order.append(level)
        queue = verdicts.get(level)
        s.record(level, queue.pop(0) if queue else level <= 11)
    assert order == [1, 2, 4, 8, 16, 12, 10, 11, 11, 10]
    assert s.results[11] is False and s.trials[11] == [True, False]
    assert s.ceiling == (10, True)
    # Without a repeat the flaky level would have been the ceiling.
    once = search(11, (1, 2, 4, 8, 16), False)
    assert once.ceiling == (11, True)


def test_summary_gives_the_range_seen_and_what_limited_it() -> None:
    # 4 passed twice; 5 failed (stalls) once and passed once: the ceiling is 4 (every
    # trial must pass), the range seen 4-5; 6 was never passed.
    stalled = replace(
        stats(5, 1.4, 8.0), passed=False, verdict="stalls", failed_rules=("stalls", "ttfa")
    )
    levels = [
        stats(1, 3.0, 2.0),
        stats(2, 2.0, 4.0),
        stats(4, 1.5, 7.0),
        stats(8, 0.9, 9.0),
        stats(6, 1.1, 8.5),
        stalled,
        stats(4, 1.5, 7.0),
        stats(5, 1.4, 8.0),
    ]
    summary = summarize(levels, 1.2)
    assert (summary.ceiling, summary.bounded, summary.range) == (4, True, (4, 5))
    assert summary.trials(4) == (2, 2) and summary.trials(5) == (1, 2)
    assert summary.failing(5) is stalled and summary.at(5) is levels[-1]
    assert summary.limited_by == ("stalls", "ttfa")
    slow = summarize(levels[:5], 1.2)
    assert (slow.ceiling, slow.range, slow.limited_by) == (4, (4, 4), ("slow",))


def test_a_ceiling_set_by_queue_wait_alone_says_so() -> None:
    def ttfa(level: int, cause: str | None) -> LevelStats:
        broken = replace(stats(level, 1.6, 3.0), passed=False, verdict="ttfa")
        return replace(broken, failed_rules=("ttfa",), ttfa_cause=cause)

    base = [stats(1, 1.6, 1.6), stats(2, 1.6, 3.0)]
    queued = summarize([*base, ttfa(4, "queue"), ttfa(3, "queue")], 1.2)
    assert (queued.ceiling, queued.limited_by) == (2, ("ttfa",))
    assert queued.limited_by_queue
    # One trial of the lowest failing level broke it in the engine: not the queue alone.
    mixed = summarize([*base, ttfa(3, "queue"), stats(2, 1.6, 3.0), ttfa(3, "engine")], 1.2)
    assert mixed.limited_by == ("ttfa",) and not mixed.limited_by_queue
    # Another rule broken beside it, or a cause not known: not the queue alone.
    stalls = replace(ttfa(3, "queue"), verdict="stalls", failed_rules=("stalls", "ttfa"))
    assert not summarize([*base, stalls], 1.2).limited_by_queue
    assert not summarize([*base, ttfa(3, None)], 1.2).limited_by_queue
    # Refused sessions (the gateway's queue was full) are a refusal, not a TTFA cause.
    refused = replace(ttfa(3, "queue"), verdict="refused")
    assert not summarize([*base, refused], 1.2).limited_by_queue
    assert not summarize(base, 1.2).limited_by_queue  # nothing failed
