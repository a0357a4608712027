"""Rolling per-replica signals and the log-bucket quantiles behind them."""

from __future__ import annotations

import math
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.metering.rolling import ReplicaSignals
from proxy.metering.sketches import (
    _SPAN,
    GAMMA,
    LogHistogram,
    QuantileSketch,
    SparseLogHistogram,
    _key,
)

ERROR = (GAMMA - 1) / (GAMMA + 1) + 1e-9


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered) - 1e-9), 1) - 1]


positive = st.floats(1e-6, 1e6)


@given(st.lists(positive, min_size=1, max_size=300), st.sampled_from([0.01, 0.5, 0.99, 1.0]))
def test_histogram_quantile_within_documented_error(values: list[float], q: float) -> None:
    hist = LogHistogram()
    for v in values:
        hist.add(v)
    assert hist.quantile(q) == pytest.approx(nearest_rank(values, q), rel=ERROR)


def test_histogram_zero_bucket_and_clamping() -> None:
    hist = LogHistogram()
    for v in (0.0, -1.0, 1e-12, 1e12):
        hist.add(v)
    assert hist.quantile(0.25) == 0.0
    assert hist.quantile(0.5) == 0.0
    assert hist.quantile(0.75) == pytest.approx(1e-6, rel=ERROR)
    assert hist.quantile(1.0) == pytest.approx(1e6, rel=ERROR)
    assert LogHistogram().quantile(0.5) is None


def test_histogram_subtract_undoes_merge() -> None:
    a, b = LogHistogram(), LogHistogram()
    for v in (0.1, 0.2, 0.3):
        a.add(v)
    for v in (5.0, 6.0):
        b.add(v)
    a.merge(b)
    assert a.quantile(1.0) == pytest.approx(6.0, rel=ERROR)
    a.subtract(b)
    assert a.count == 3
    assert a.quantile(1.0) == pytest.approx(0.3, rel=ERROR)
    assert len(a.buckets) == 3


@given(st.lists(positive, min_size=1, max_size=40))
def test_sketch_is_exact_below_its_limit(values: list[float]) -> None:
    sketch = QuantileSketch(exact_limit=64)
    for v in values:
        sketch.add(v)
    assert sketch.quantile(0.99) == nearest_rank(values, 0.99)
    assert sketch.quantile(0.01) == nearest_rank(values, 0.01)


@given(st.lists(positive, min_size=65, max_size=200))
def test_sketch_beyond_its_limit_is_within_error(values: list[float]) -> None:
    sketch = QuantileSketch(exact_limit=64)
    for v in values:
        sketch.add(v)
    assert sketch.count == len(values)
    assert sketch.quantile(0.99) == pytest.approx(nearest_rank(values, 0.99), rel=ERROR)


def test_empty_sketch() -> None:
    assert QuantileSketch().quantile(0.5) is None
    assert QuantileSketch().count == 0


def test_worst_ratio_is_the_first_percentile() -> None:
    signals = ReplicaSignals(30.0, min_samples=100)
    for i in range(200):
        signals.observe(1000.0 + i * 0.01, ratio=1.5, gap=0.04)
    signals.observe(1002.0, ratio=0.5, gap=0.4)
    signals.observe(1002.0, ratio=0.7, gap=0.3)
    signals.observe(1002.0, ratio=0.9, gap=0.2)
    # 203 samples: rank ceil(2.03) = 3 -> the third-lowest ratio.
    assert signals.worst_ratio(1002.0) == pytest.approx(0.9, rel=ERROR)
    # rank ceil(0.99 * 203) = 201 of the gaps -> 0.2
    assert signals.p99_gap(1002.0) == pytest.approx(0.2, rel=ERROR)
    assert signals.samples(1002.0) == 203


def test_too_few_samples_give_none() -> None:
    signals = ReplicaSignals(min_samples=20)
    for i in range(19):
        signals.observe(float(i), 1.0, 0.1)
    assert signals.worst_ratio(19.0) is None
    assert signals.p99_gap(19.0) is None
    signals.observe(19.0, 1.0, 0.1)
    assert signals.worst_ratio(19.0) == pytest.approx(1.0, rel=ERROR)


def test_samples_leave_the_window() -> None:
    signals = ReplicaSignals(30.0, min_samples=1)
    signals.observe(100.2, ratio=0.5, gap=1.0)
    signals.observe(110.0, ratio=2.0, gap=0.1)
    assert signals.samples(130.0) == 2
    assert signals.worst_ratio(130.0) == pytest.approx(0.5, rel=ERROR)
    assert signals.samples(131.0) == 1  # between window_s and window_s + 1 s after 100.2
    assert signals.worst_ratio(131.0) == pytest.approx(2.0, rel=ERROR)
    assert signals.p99_gap(131.0) == pytest.approx(0.1, rel=ERROR)
    assert signals.samples(141.0) == 0
    assert signals.worst_ratio(141.0) is None


def test_gap_only_events_count_for_gaps_not_ratios() -> None:
    signals = ReplicaSignals(min_samples=1)
    signals.observe_gap(5.0, 0.7)
    assert signals.samples(5.0) == 0
    assert signals.worst_ratio(5.0) is None
    assert signals.p99_gap(5.0) == pytest.approx(0.7, rel=ERROR)


def test_memory_stays_bounded_over_a_long_run() -> None:
    signals = ReplicaSignals(30.0, min_samples=1)
    now = 0.0
    for i in range(100_000):
        now += 0.01
        signals.observe(now, 0.5 + (i % 97) / 10, 0.01 + (i % 89) / 100)
    assert len(signals._closed) <= 31
    assert signals.samples(now) <= 3100
    assert len(signals._ratios.buckets) < 200


def test_an_older_time_is_filed_in_the_newest_slice() -> None:
    signals = ReplicaSignals(10.0, min_samples=1)
    signals.observe(50.0, 1.0, 0.1)
    signals.observe(40.0, 3.0, 0.1)
    assert signals.samples(55.0) == 2


@pytest.mark.parametrize(
    "kwargs", [{"window_s": 0.0}, {"slice_s": 0.0}, {"min_samples": 0}, {"window_s": math.nan}]
)
def test_invalid_configuration_is_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        ReplicaSignals(**kwargs)  # type: ignore[arg-type]


@given(
    st.lists(
        st.tuples(st.floats(0.0, 5.0), st.floats(0.01, 20.0), st.floats(0.0, 2.0)), max_size=80
    ),
    st.floats(1.0, 20.0),
)
def test_window_matches_a_brute_force_reference(
    steps: list[tuple[float, float, float]], window: float
) -> None:
    signals = ReplicaSignals(window, min_samples=1)
    kept = math.ceil(window)  # the window in whole 1 s slices
    now, seen = 0.0, []
    for advance, ratio, gap in steps:
        now += advance
        signals.observe(now, ratio, gap)
        seen.append((now, ratio))
        # Kept: at least `kept` seconds, at most `kept` + one slice.
        surely_in = [r for t, r in seen if now - t <= kept - 1e-9]
        maybe_in = [r for t, r in seen if now - t <= kept + 1.0 + 1e-9]
        assert len(surely_in) <= signals.samples(now) <= len(maybe_in)
        worst = signals.worst_ratio(now)
        assert worst is not None
        assert min(maybe_in) * (1 - ERROR) <= worst <= max(maybe_in) * (1 + ERROR)


# --- one bucket key for every path ------------------------------------------------------------


def reference_key(value: float) -> int:
    """The bucket key as first computed (builtin min/max)."""
    if not value > 0.0:
        return -(10**9)
    return math.ceil(math.log(min(max(value, 1e-6), 1e6)) * (1.0 / math.log(GAMMA)))


any_value = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-6, 1e6, math.nextafter(1e-6, 0), math.nextafter(1e6, 2e6)]),
    st.sampled_from([GAMMA**k for k in range(-40, 41)]),  # bucket edges, as floats
)


@given(st.lists(any_value, min_size=1, max_size=30))
def test_every_path_files_a_value_under_the_same_key(values: list[float]) -> None:
    expected: dict[int, int] = {}
    for v in values:
        key = reference_key(v)
        expected[key] = expected.get(key, 0) + 1
    hist = LogHistogram()
    signals = ReplicaSignals(min_samples=1)
    for v in values:
        hist.add(v)
        signals.observe(1.0, ratio=v, gap=v)
    assert hist.buckets == expected
    assert signals._open.ratios.buckets == expected
    assert signals._open.gaps.buckets == expected
    sketch = QuantileSketch(exact_limit=0)  # straight to its histogram
    for v in values:
        sketch.add(v)
    assert sketch._hist is not None and sketch._hist.buckets == expected


@given(st.lists(st.floats(allow_nan=False), min_size=1, max_size=64))
def test_exact_samples_keep_every_double(values: list[float]) -> None:
    """array('d') stores the very floats it is given: the exact quantiles are unchanged."""
    sketch = QuantileSketch(exact_limit=64)
    for v in values:
        sketch.add(v)
    for q in (0.01, 0.5, 0.99, 1.0):
        got = sketch.quantile(q)
        assert got == nearest_rank(values, q)
        assert type(got) is float


def test_exact_samples_cost_eight_bytes_each() -> None:
    sketch = QuantileSketch()
    for i in range(256):
        sketch.add(i * 0.001)
    assert sketch._exact is not None and sketch._exact.itemsize == 8
    assert sys.getsizeof(sketch._exact) < 256 * 8 + 512  # a list of floats: ~8 KB
    sketch.add(1.0)  # one over the limit: the histogram takes over
    assert sketch._exact is None and sketch.count == 257


def test_startup_signals_roll_with_the_window() -> None:
    signals = ReplicaSignals(window_s=10, slice_s=1)
    assert signals.startup(0.0).stalled_share is None
    for i in range(4):
        signals.observe_first_seam(float(i), stalled=i % 2 == 0)
        signals.observe_ttfa(float(i), 0.1 * (i + 1))
    startup = signals.startup(4.0)
    assert (startup.seams, startup.stalled, startup.stalled_share) == (4, 2, 0.5)
    assert startup.ttfas == 4
    assert startup.ttfa_p99 == pytest.approx(0.4, rel=ERROR)
    signals.observe_first_seam(12.5, stalled=False)  # seams at 0 and 1 left the window
    later = signals.startup(12.5)
    assert (later.seams, later.stalled, later.ttfas) == (3, 1, 2)
    empty = signals.startup(40.0)
    assert (empty.seams, empty.stalled, empty.ttfas, empty.ttfa_p99) == (0, 0, 0, None)


def _reference_buckets(values: list[float]) -> dict[int, int]:
    buckets: dict[int, int] = {}
    for v in values:
        key = reference_key(v)
        buckets[key] = buckets.get(key, 0) + 1
    return buckets


def _reference_quantile(buckets: dict[int, int], q: float) -> float | None:
    """Nearest rank over the buckets in key order, each reported at its representative
    value (the zero bucket at 0.0)."""
    count = sum(buckets.values())
    if not count:
        return None
    rank, seen = max(math.ceil(q * count - 1e-9), 1), 0
    for key in sorted(buckets):
        seen += buckets[key]
        if seen >= rank:
            return 0.0 if key == -(10**9) else 2.0 * GAMMA**key / (GAMMA + 1.0)
    raise AssertionError("unreachable")


@given(
    st.lists(any_value, max_size=40),
    st.lists(any_value, max_size=40),
    st.sampled_from([0.01, 0.25, 0.5, 0.99, 1.0]),
)
def test_merge_subtract_and_quantile_keep_every_bucket(
    kept: list[float], passing: list[float], q: float
) -> None:
    """Merging widens the window of counts whichever side the other's keys are on,
    subtracting takes exactly the merged samples back out, and a quantile walks the
    buckets in key order: the same as a plain dict of buckets."""
    mine, theirs, total = LogHistogram(), LogHistogram(), LogHistogram()
    for v in kept:
        mine.add(v)
    for v in passing:
        theirs.add(v)
    total.merge(theirs)  # the window first takes the other's keys, then widens
    total.merge(mine)
    both = _reference_buckets(kept + passing)
    assert total.buckets == both and total.count == len(kept) + len(passing)
    assert total.quantile(q) == _reference_quantile(both, q)
    sparse = SparseLogHistogram()  # a session's: a window of at most _SPAN keys, a dict
    for v in kept + passing:
        sparse.add(v)
    assert sparse.buckets == both and sparse.quantile(q) == _reference_quantile(both, q)
    assert len(sparse._counts) <= _SPAN
    total.subtract(theirs)
    assert total.buckets == _reference_buckets(kept) and total.count == len(kept)
    assert total.quantile(q) == _reference_quantile(_reference_buckets(kept), q)
    assert mine.buckets == _reference_buckets(kept)


def test_a_session_histogram_lists_its_cluster_and_files_far_values_apart() -> None:
    """Chunk gaps around 40 ms fill the list; back-to-back arrivals, stalls and zero go
    to the dict, and the list never spans more than _SPAN keys, whichever comes first."""
    cluster = [0.04 * (1 + 0.01 * (i % 21 - 10)) for i in range(300)]
    far = [0.0, 1e-4, 2.5, 30.0, 1e-4]
    for values in (cluster + far, far + cluster):
        hist = SparseLogHistogram()
        for v in values:
            hist.add(v)
        assert hist.buckets == _reference_buckets(values)
        assert hist.count == len(values) and len(hist._counts) <= _SPAN
        assert hist._far is not None and sum(hist._far.values()) >= len(far) - 1
        for q in (0.01, 0.5, 0.99, 1.0):
            assert hist.quantile(q) == _reference_quantile(_reference_buckets(values), q)
    clustered = SparseLogHistogram()
    for v in cluster:
        clustered.add(v)
    assert clustered._far is None  # nothing far: no dict at all
    # far values first: the window held by the first of them, the cluster misses it...
    assert hist._far is not None and sum(hist._far.values()) > len(cluster)
    # ...unless it is centred first, as a sketch does on its median when it turns
    sketch = QuantileSketch(exact_limit=len(far) + 50)
    for v in far + cluster:
        sketch.add(v)
    turned = sketch._hist
    assert turned is not None and turned.buckets == _reference_buckets(far + cluster)
    assert sum(turned._counts) == len(cluster)
    # the list is as wide as the cluster, not the whole range: 40 ms +-10 % is 6 keys
    assert len(clustered._counts) <= 6 and len(turned._counts) <= 6


def test_a_session_histogram_carries_a_full_count_into_a_second_list() -> None:
    """A listed bucket's count never reaches 256 in the list (ints up to 256 are shared,
    so an insertion allocates none): the carries are counted in a list as wide, and the
    buckets and quantiles are those of a plain count."""
    # the window widens both ways after the first carry: the carries stay aligned
    values = [0.04] * 1000 + [0.041] * 300 + [0.0, 2.5, 0.03, 0.06] + [0.04] * 24 + [0.03] * 300
    hist = SparseLogHistogram()
    for v in values:
        hist.add(v)
    reference = _reference_buckets(values)
    assert hist.buckets == reference and hist.count == len(values)
    assert max(hist._counts) < 256
    assert hist._carries is not None and len(hist._carries) == len(hist._counts)
    assert sum(hist._carries) == 4 + 1 + 1  # 1024 at 40 ms, 300 at 41 ms, 301 at 30 ms
    assert hist._far is not None and set(hist._far) == {-(10**9), _key(2.5)}
    for q in (0.01, 0.25, 0.5, 0.75, 0.99, 1.0):
        assert hist.quantile(q) == _reference_quantile(reference, q)
