"""The replica collector: per-chunk metrics accumulated in plain Python, exported at scrape
time exactly as the prometheus_client Histogram/Counter objects they replace exported them."""

from __future__ import annotations

import math
import re
from bisect import bisect_left

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric

from proxy.metering.replica_series import bucket_index, le_label
from proxy.metering.rolling import ReplicaSignals
from proxy.metering.series import DELIVERY_RATIO_BUCKETS, GAP_BUCKETS, Metrics
from proxy.metering.session_meter import PrometheusReplicaSink, SessionMeter
from tests.hypothesis_profiles import examples

REPLICA_FAMILIES = (
    "headroom_chunk_gap_seconds",
    "headroom_chunk_delivery_ratio",
    "headroom_playback_underruns",
    "headroom_playback_stall_seconds",
    "headroom_audio_delivered_seconds",
    "headroom_stream_active_seconds",
)


def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def family_block(text: str, name: str) -> str:
    """The ``# HELP`` line, ``# TYPE`` line and samples of one family."""
    match = re.search(rf"^# HELP {name}(?:_total)? .*?(?=^# HELP |\Z)", text, re.M | re.S)
    assert match, f"{name} not exported"
    return match.group(0)


def sink(metrics: Metrics, pool: str, replica: str) -> PrometheusReplicaSink:
    return PrometheusReplicaSink(metrics, pool, replica, ReplicaSignals())


# --- known values ----------------------------------------------------------------------------

#: What prometheus_client 0.26 exported for :func:`fixed_observations` before the collector
#: (captured from the Histogram/Counter implementation): edges 0.032 (a configured chunk
#: duration), 0.2, 1.0 and 1.2 are hit exactly; 0.0 goes to the first bucket, 6.768 s to +Inf.
GAP_GPU0 = """\
# HELP headroom_chunk_gap_seconds Gap between consecutive upstream chunks of one stream (what a listener waits).
# TYPE headroom_chunk_gap_seconds histogram
headroom_chunk_gap_seconds_bucket{le="0.005",pool="tts",replica="gpu0"} 1.0
headroom_chunk_gap_seconds_bucket{le="0.01",pool="tts",replica="gpu0"} 1.0
headroom_chunk_gap_seconds_bucket{le="0.02",pool="tts",replica="gpu0"} 1.0
headroom_chunk_gap_seconds_bucket{le="0.032",pool="tts",replica="gpu0"} 2.0
headroom_chunk_gap_seconds_bucket{le="0.04",pool="tts",replica="gpu0"} 2.0
headroom_chunk_gap_seconds_bucket{le="0.08",pool="tts",replica="gpu0"} 2.0
headroom_chunk_gap_seconds_bucket{le="0.1",pool="tts",replica="gpu0"} 2.0
headroom_chunk_gap_seconds_bucket{le="0.15",pool="tts",replica="gpu0"} 2.0
headroom_chunk_gap_seconds_bucket{le="0.2",pool="tts",replica="gpu0"} 3.0
headroom_chunk_gap_seconds_bucket{le="0.25",pool="tts",replica="gpu0"} 3.0
headroom_chunk_gap_seconds_bucket{le="0.3",pool="tts",replica="gpu0"} 4.0
headroom_chunk_gap_seconds_bucket{le="0.4",pool="tts",replica="gpu0"} 4.0
headroom_chunk_gap_seconds_bucket{le="0.5",pool="tts",replica="gpu0"} 4.0
headroom_chunk_gap_seconds_bucket{le="0.75",pool="tts",replica="gpu0"} 4.0
headroom_chunk_gap_seconds_bucket{le="1.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_gap_seconds_bucket{le="1.5",pool="tts",replica="gpu0"} 5.0
headroom_chunk_gap_seconds_bucket{le="2.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_gap_seconds_bucket{le="2.5",pool="tts",replica="gpu0"} 5.0
headroom_chunk_gap_seconds_bucket{le="3.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_gap_seconds_bucket{le="4.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_gap_seconds_bucket{le="5.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_gap_seconds_bucket{le="+Inf",pool="tts",replica="gpu0"} 6.0
headroom_chunk_gap_seconds_count{pool="tts",replica="gpu0"} 6.0
headroom_chunk_gap_seconds_sum{pool="tts",replica="gpu0"} 8.3
"""  # noqa: E501

RATIO_GPU0 = """\
# HELP headroom_chunk_delivery_ratio A chunk's audio seconds / wall seconds since the previous chunk; <1 is slower than realtime.
# TYPE headroom_chunk_delivery_ratio histogram
headroom_chunk_delivery_ratio_bucket{le="0.25",pool="tts",replica="gpu0"} 2.0
headroom_chunk_delivery_ratio_bucket{le="0.5",pool="tts",replica="gpu0"} 2.0
headroom_chunk_delivery_ratio_bucket{le="0.75",pool="tts",replica="gpu0"} 2.0
headroom_chunk_delivery_ratio_bucket{le="0.9",pool="tts",replica="gpu0"} 2.0
headroom_chunk_delivery_ratio_bucket{le="1.0",pool="tts",replica="gpu0"} 3.0
headroom_chunk_delivery_ratio_bucket{le="1.1",pool="tts",replica="gpu0"} 3.0
headroom_chunk_delivery_ratio_bucket{le="1.2",pool="tts",replica="gpu0"} 4.0
headroom_chunk_delivery_ratio_bucket{le="1.3",pool="tts",replica="gpu0"} 4.0
headroom_chunk_delivery_ratio_bucket{le="1.5",pool="tts",replica="gpu0"} 4.0
headroom_chunk_delivery_ratio_bucket{le="2.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_delivery_ratio_bucket{le="3.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_delivery_ratio_bucket{le="5.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_delivery_ratio_bucket{le="10.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_delivery_ratio_bucket{le="25.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_delivery_ratio_bucket{le="100.0",pool="tts",replica="gpu0"} 5.0
headroom_chunk_delivery_ratio_bucket{le="+Inf",pool="tts",replica="gpu0"} 6.0
headroom_chunk_delivery_ratio_count{pool="tts",replica="gpu0"} 6.0
headroom_chunk_delivery_ratio_sum{pool="tts",replica="gpu0"} 1004.1362174940898
"""  # noqa: E501

COUNTERS = """\
# HELP headroom_playback_underruns_total Modelled client playback buffer ran dry mid-stream (a listener heard a stall).
# TYPE headroom_playback_underruns_total counter
headroom_playback_underruns_total{pool="tts",replica="gpu0"} 2.0
headroom_playback_underruns_total{pool="tts",replica="gpu1"} 0.0
headroom_playback_underruns_total{pool="asr",replica="gpu2"} 0.0
# HELP headroom_playback_stall_seconds_total Modelled seconds of silence heard by listeners because audio arrived late.
# TYPE headroom_playback_stall_seconds_total counter
headroom_playback_stall_seconds_total{pool="tts",replica="gpu0"} 2.625
headroom_playback_stall_seconds_total{pool="tts",replica="gpu1"} 0.0
headroom_playback_stall_seconds_total{pool="asr",replica="gpu2"} 0.0
# HELP headroom_audio_delivered_seconds_total Seconds of audio relayed to clients.
# TYPE headroom_audio_delivered_seconds_total counter
headroom_audio_delivered_seconds_total{pool="tts",replica="gpu0"} 1.5784
headroom_audio_delivered_seconds_total{pool="tts",replica="gpu1"} 0.0
headroom_audio_delivered_seconds_total{pool="asr",replica="gpu2"} 0.0
# HELP headroom_stream_active_seconds_total Wall seconds listeners waited for or received audio: admission to a stream's first chunk, then the gaps between chunks; audio_delivered / this = aggregate delivery ratio.
# TYPE headroom_stream_active_seconds_total counter
headroom_stream_active_seconds_total{pool="tts",replica="gpu0"} 8.3
headroom_stream_active_seconds_total{pool="tts",replica="gpu1"} 0.0
headroom_stream_active_seconds_total{pool="asr",replica="gpu2"} 0.0
"""  # noqa: E501


def fixed_observations() -> Metrics:
    metrics = Metrics(chunk_durations_s=[0.032])
    tts0, _, asr = (
        sink(metrics, "tts", "gpu0"),
        sink(metrics, "tts", "gpu1"),
        sink(metrics, "asr", "gpu2"),
    )
    for now, audio_s, gap, ratio in [
        (1.0, 0.2, None, None),
        (1.2, 0.2, 0.2, 1.0),
        (2.2, 0.24, 1.0, 0.24),
        (2.232, 0.0384, 0.032, 1.2),
        (2.232, 0.2, 0.0, 1000.0),
        (9.0, 0.2, 6.768, 0.2 / 6.768),
        (9.3, 0.5, 0.3, 0.5 / 0.3),
    ]:
        tts0.chunk(now, audio_s, gap, ratio)
    tts0.underrun(2.5)
    tts0.underrun(0.125)
    asr.chunk(1.0, 0.0, None, None)
    asr.chunk(1.25, 0.0, 0.25, None)  # a gap-only event: gap, no ratio, no active time
    return metrics


def test_histograms_export_the_known_buckets_sums_and_counts() -> None:
    text = exposition(fixed_observations().registry)
    gap = family_block(text, "headroom_chunk_gap_seconds")
    ratio = family_block(text, "headroom_chunk_delivery_ratio")
    assert (
        "\n".join(line for line in gap.splitlines() if "gpu0" in line or "#" in line) + ("\n")
        == GAP_GPU0
    )
    assert (
        "\n".join(line for line in ratio.splitlines() if "gpu0" in line or "#" in line) + ("\n")
        == RATIO_GPU0
    )
    # Every replica a sink was built for is exported, with zeros until it observes.
    assert 'headroom_chunk_gap_seconds_count{pool="tts",replica="gpu1"} 0.0\n' in gap
    assert 'headroom_chunk_gap_seconds_bucket{le="+Inf",pool="tts",replica="gpu1"} 0.0\n' in gap
    assert 'headroom_chunk_gap_seconds_bucket{le="0.25",pool="asr",replica="gpu2"} 1.0\n' in gap
    assert 'headroom_chunk_gap_seconds_bucket{le="0.2",pool="asr",replica="gpu2"} 0.0\n' in gap
    assert 'headroom_chunk_gap_seconds_sum{pool="asr",replica="gpu2"} 0.25\n' in gap
    assert 'headroom_chunk_delivery_ratio_count{pool="asr",replica="gpu2"} 0.0\n' in ratio


def test_counters_export_the_known_totals() -> None:
    text = exposition(fixed_observations().registry)
    blocks = "".join(
        family_block(text, name)
        for name in REPLICA_FAMILIES[2:]  # the four counters
    )
    assert blocks == COUNTERS


def test_registry_sample_lookup_sees_the_collector() -> None:
    metrics = fixed_observations()
    rep = {"pool": "tts", "replica": "gpu0"}
    value = metrics.registry.get_sample_value
    assert value("headroom_chunk_gap_seconds_bucket", {**rep, "le": "0.032"}) == 2.0
    assert value("headroom_chunk_delivery_ratio_bucket", {**rep, "le": "1.2"}) == 4.0
    assert value("headroom_chunk_delivery_ratio_count", rep) == 6.0
    assert value("headroom_playback_underruns_total", rep) == 2.0
    assert value("headroom_audio_delivered_seconds_total", {"pool": "tts", "replica": "x"}) is None


# --- the same numbers as prometheus_client, for any observations ------------------------------


class Reference:
    """The pre-collector implementation: prometheus_client metrics with the definitions
    copied literally from the old ``proxy.metering.series``, observed the way the old
    ``PrometheusReplicaSink`` observed them."""

    def __init__(self, gap_buckets: tuple[float, ...]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.gap = Histogram(
            "headroom_chunk_gap_seconds",
            "Gap between consecutive upstream chunks of one stream (what a listener waits).",
            ["pool", "replica"], buckets=gap_buckets, registry=r,
        )  # fmt: skip
        self.ratio = Histogram(
            "headroom_chunk_delivery_ratio",
            "A chunk's audio seconds / wall seconds since the previous chunk; <1 is slower "
            "than realtime.",
            ["pool", "replica"],
            buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 5.0, 10.0, 25.0,
                     100.0),
            registry=r,
        )  # fmt: skip
        self.underruns = Counter(
            "headroom_playback_underruns_total",
            "Modelled client playback buffer ran dry mid-stream (a listener heard a stall).",
            ["pool", "replica"], registry=r,
        )  # fmt: skip
        self.stall = Counter(
            "headroom_playback_stall_seconds_total",
            "Modelled seconds of silence heard by listeners because audio arrived late.",
            ["pool", "replica"], registry=r,
        )  # fmt: skip
        self.audio = Counter(
            "headroom_audio_delivered_seconds_total",
            "Seconds of audio relayed to clients.",
            ["pool", "replica"], registry=r,
        )  # fmt: skip
        self.active = Counter(
            "headroom_stream_active_seconds_total",
            "Wall seconds listeners waited for or received audio: admission to a stream's first "
            "chunk, then the gaps between chunks; audio_delivered / this = aggregate delivery "
            "ratio.",
            ["pool", "replica"], registry=r,
        )  # fmt: skip

    def touch(self, pool: str, replica: str) -> None:
        for metric in (self.gap, self.ratio, self.underruns, self.stall, self.audio, self.active):
            metric.labels(pool, replica)

    def chunk(self, pool: str, replica: str, audio_s: float, gap: float | None,
              ratio: float | None) -> None:  # fmt: skip
        if audio_s > 0.0:
            self.audio.labels(pool, replica).inc(audio_s)
        if gap is None:
            return
        self.gap.labels(pool, replica).observe(gap)
        if ratio is None:
            return
        self.ratio.labels(pool, replica).observe(ratio)
        self.active.labels(pool, replica).inc(gap)

    def opening(self, pool: str, replica: str, wait_s: float) -> None:
        self.active.labels(pool, replica).inc(wait_s)

    def underrun(self, pool: str, replica: str, stall_s: float) -> None:
        self.underruns.labels(pool, replica).inc()
        self.stall.labels(pool, replica).inc(stall_s)


OLD_GAP_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0,
)  # fmt: skip

# Values near and on every edge, and anything else a gap or ratio can be.
edges = sorted({*OLD_GAP_BUCKETS, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 10.0, 25.0,
                100.0, 1000.0})  # fmt: skip
values = st.one_of(
    st.sampled_from(edges),
    st.sampled_from(edges).map(lambda e: math.nextafter(e, math.inf)),
    st.sampled_from(edges).map(lambda e: math.nextafter(e, 0.0)),
    st.just(0.0),
    st.floats(0.0, 2000.0),
    st.just(math.inf),
)
replicas = st.sampled_from([("tts", "gpu0"), ("tts", "gpu1"), ("asr", "gpu0")])
events = st.lists(
    st.one_of(
        st.tuples(st.just("chunk"), replicas, st.floats(0.0, 5.0), st.none(), st.none()),
        st.tuples(st.just("chunk"), replicas, st.floats(0.0, 5.0), values, st.none()),
        st.tuples(st.just("chunk"), replicas, st.floats(0.0, 5.0), values, values),
        st.tuples(st.just("underrun"), replicas, st.floats(0.001, 10.0), st.none(), st.none()),
    ),
    max_size=60,
)


@settings(max_examples=examples(200), deadline=None)
@given(events, st.sampled_from([(), (0.032, 0.48), (0.2, 0.04)]))
def test_exposition_is_byte_identical_to_prometheus_client(
    events: list[tuple[str, tuple[str, str], float, float | None, float | None]],
    chunk_durations: tuple[float, ...],
) -> None:
    metrics = Metrics(chunk_durations_s=chunk_durations)
    reference = Reference(tuple(sorted(set(OLD_GAP_BUCKETS) | set(chunk_durations))))
    sinks: dict[tuple[str, str], PrometheusReplicaSink] = {}
    for kind, (pool, replica), amount, gap, ratio in events:
        if (pool, replica) not in sinks:
            sinks[pool, replica] = sink(metrics, pool, replica)
            reference.touch(pool, replica)
        if kind == "underrun":
            sinks[pool, replica].underrun(amount)
            reference.underrun(pool, replica, amount)
        else:
            sinks[pool, replica].chunk(1.0, amount, gap, ratio)
            reference.chunk(pool, replica, amount, gap, ratio)
    ours, theirs = exposition(metrics.registry), exposition(reference.registry)
    for name in REPLICA_FAMILIES:
        assert family_block(ours, name) == family_block(theirs, name), name


@settings(max_examples=examples(300), deadline=None)
@given(
    st.lists(st.floats(-1e3, 1e3), max_size=25).map(lambda b: (*sorted(set(b)), math.inf)),
    st.floats(allow_nan=False) | st.sampled_from([0.0, -0.0, 0.005, 1.0, math.inf]),
)
def test_the_bucket_search_is_bisect_left(bounds: tuple[float, ...], value: float) -> None:
    """Compiled, a series finds its bucket with ``bucket_index``; interpreted, with
    ``bisect_left``: both give the same bucket, on a bound and between bounds."""
    assert bucket_index(bounds, value) == bisect_left(bounds, value)
    for bound in bounds:
        assert bucket_index(bounds, bound) == bisect_left(bounds, bound)


# --- registration ------------------------------------------------------------------------------


def test_each_replica_family_is_exported_once_in_the_old_order() -> None:
    metrics = Metrics()
    sink(metrics, "tts", "gpu0")
    types = re.findall(r"^# TYPE (\S+) ", exposition(metrics.registry), re.M)
    assert len(types) == len(set(types))
    # the process's own series (process_*, python_*) come from prometheus_client
    types = [name for name in types if name.startswith("headroom_")]
    assert types == [
        "headroom_queue_wait_seconds",
        "headroom_session_decisions_total",
        "headroom_chunk_gap_seconds",
        "headroom_chunk_delivery_ratio",
        "headroom_stream_gap_p99_seconds",
        "headroom_time_to_first_audio_seconds",
        "headroom_playback_underruns_total",
        "headroom_playback_first_chunk_underruns_total",
        "headroom_playback_stall_seconds_total",
        "headroom_audio_delivered_seconds_total",
        "headroom_stream_active_seconds_total",
        "headroom_session_duration_seconds",
        "headroom_upstream_errors_total",
        "headroom_engine_scrape_errors_total",
        "headroom_asr_finalize_seconds",
        "headroom_tenant_decisions_total",  # issue 18: per API key, after the old families
        "headroom_tenant_queue_wait_seconds",
        "headroom_client_time_to_first_audio_seconds",  # the client's, queue included
        "headroom_build_info",
    ]


@pytest.mark.parametrize(
    "name", ["headroom_chunk_gap_seconds", "headroom_audio_delivered_seconds_total"]
)
def test_the_registry_refuses_a_second_metric_of_a_collected_name(name: str) -> None:
    metrics = Metrics()
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter(name, "again", registry=metrics.registry)


def definition_family(metric: Histogram | Counter) -> Metric:
    """A definition's family as it exports one (p, r) child: the child made through the
    base class's ``labels`` (the definition's own refuses), read through ``collect``."""
    base = Histogram if isinstance(metric, Histogram) else Counter
    base.labels(metric, "p", "r")
    (family,) = metric.collect()
    return family


def bucket_edges(family: Metric) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]


def test_definitions_describe_the_exported_metrics_and_refuse_observations() -> None:
    metrics = Metrics(chunk_durations_s=[0.032])
    series = metrics.replica_series("p", "r")
    definitions = (
        metrics.chunk_gap, metrics.chunk_delivery_ratio, metrics.audio_delivered,
        metrics.underruns,
    )  # fmt: skip
    for metric in definitions:
        with pytest.raises(TypeError, match="replica_series"):
            metric.labels("p", "r")
    gap = definition_family(metrics.chunk_gap)
    assert bucket_edges(gap) == [*sorted({*OLD_GAP_BUCKETS, 0.032}), math.inf]
    assert tuple(bucket_edges(gap)) == series.gap_bounds
    ratio = definition_family(metrics.chunk_delivery_ratio)
    assert tuple(bucket_edges(ratio)) == series.ratio_bounds
    exported = {family.name: family for family in metrics.registry.collect()}
    for metric in definitions:
        family = definition_family(metric)
        assert {name for s in family.samples for name in s.labels} - {"le"} == {"pool", "replica"}
        twin = exported[family.name]
        assert (family.type, family.documentation) == (twin.type, twin.documentation)
        assert [(s.name, s.labels) for s in family.samples] == [
            (s.name, s.labels) for s in twin.samples
        ]


def test_sinks_of_one_replica_share_its_series() -> None:
    metrics = Metrics()
    a, b = sink(metrics, "tts", "gpu0"), sink(metrics, "tts", "gpu0")
    a.chunk(1.0, 0.2, 0.1, 2.0)
    b.chunk(1.1, 0.2, 0.1, 2.0)
    text = exposition(metrics.registry)
    assert text.count('headroom_chunk_gap_seconds_count{pool="tts",replica="gpu0"}') == 1
    assert 'headroom_chunk_gap_seconds_count{pool="tts",replica="gpu0"} 2.0' in text
    assert 'headroom_audio_delivered_seconds_total{pool="tts",replica="gpu0"} 0.4' in text


def test_a_metered_session_matches_prometheus_client() -> None:
    """End to end through SessionMeter: gaps, ratios, an underrun, text events."""
    metrics = Metrics()
    reference = Reference(OLD_GAP_BUCKETS)
    reference.touch("tts", "gpu0")

    class Both:
        """Our sink, with the reference fed the same observations (a wrapper, not a
        subclass: the sink may be compiled, see proxy/speedups.py)."""

        def __init__(self, ours: PrometheusReplicaSink) -> None:
            self.ours = ours
            self.pool, self.replica = ours.pool, ours.replica

        def __getattr__(self, name: str) -> object:
            return getattr(self.ours, name)

        def chunk(self, now: float, audio_s: float, gap: float | None, ratio: float | None) -> None:
            self.ours.chunk(now, audio_s, gap, ratio)
            reference.chunk(self.pool, self.replica, audio_s, gap, ratio)

        def opening(self, wait_s: float) -> None:
            self.ours.opening(wait_s)
            reference.opening(self.pool, self.replica, wait_s)

        def underrun(self, stall_s: float) -> None:
            self.ours.underrun(stall_s)
            reference.underrun(self.pool, self.replica, stall_s)

    both = Both(PrometheusReplicaSink(metrics, "tts", "gpu0", ReplicaSignals()))
    session = SessionMeter(0.0, both)  # type: ignore[arg-type]
    now = 0.3
    for i in range(600):  # past the sketches' exact limit
        now += (0.05, 0.2, 0.2, 0.21, 0.0, 1.3)[i % 6]
        session.audio(now, 0.2)
        if i % 100 == 99:
            session.utterance_end(now)  # the next chunk opens a segment: an opening
    session.event(now + 0.1)
    session.finish(now + 1.0)
    ours, theirs = exposition(metrics.registry), exposition(reference.registry)
    for name in REPLICA_FAMILIES:
        assert family_block(ours, name) == family_block(theirs, name), name
    assert 'headroom_playback_underruns_total{pool="tts",replica="gpu0"} 0.0' not in ours


# --- the worst-1% gauge and its deprecated alias -----------------------------------------------


def test_the_deprecated_p99_gauge_is_the_worst_1pct_gauge_under_its_old_name() -> None:
    """``headroom_delivery_ratio_p99`` was the 1st percentile all along; it is renamed
    ``headroom_delivery_ratio_worst_1pct`` and kept, same value, for one release."""
    from proxy.metering.scrape import ReplicaGauges
    from proxy.metering.series import DEPRECATED_ALIASES

    metrics = Metrics()
    gauges = [
        ReplicaGauges("tts", "gpu0", 1, 2, True, False, delivery_ratio_worst_1pct=0.875),
        ReplicaGauges("tts", "gpu1", 1, 2, True, False, delivery_ratio_worst_1pct=None),
    ]
    metrics.bind_state(lambda: gauges, lambda: [("tts", 0)])
    value = metrics.registry.get_sample_value
    assert DEPRECATED_ALIASES == {
        "headroom_delivery_ratio_p99": "headroom_delivery_ratio_worst_1pct"
    }
    for old, new in DEPRECATED_ALIASES.items():
        rep = {"pool": "tts", "replica": "gpu0"}
        assert value(new, rep) == 0.875
        assert value(old, rep) == value(new, rep)
        idle = {"pool": "tts", "replica": "gpu1"}
        assert value(new, idle) is None and value(old, idle) is None  # absent without audio
        text = exposition(metrics.registry)
        assert f"# HELP {old} DEPRECATED" in text
        assert f"# TYPE {old} gauge" in text and f"# TYPE {new} gauge" in text


def test_a_cached_child_is_the_labelled_child_and_exports_the_same() -> None:
    """Metrics.child looks a labelled child up once (per session set-up saved a labels()
    call per metric): the same object labels() gives, observations exported as
    through labels(), distinct labels or metrics never mixed up."""
    metrics, reference = Metrics(), Metrics()
    admitted = metrics.child(metrics.decisions, "main", "admitted")
    assert admitted is metrics.decisions.labels("main", "admitted")
    assert metrics.child(metrics.decisions, "main", "admitted") is admitted
    assert metrics.child(metrics.decisions, "main", "queued") is not admitted
    assert metrics.child(metrics.decisions, "other", "admitted") is not admitted
    duration = metrics.child(metrics.session_duration, "main")
    assert duration is not metrics.child(metrics.queue_wait, "main")
    metrics = Metrics()
    for _ in range(3):
        metrics.child(metrics.decisions, "main", "admitted").inc()
        reference.decisions.labels("main", "admitted").inc()
        metrics.child(metrics.session_duration, "main").observe(1.5)
        reference.session_duration.labels("main").observe(1.5)
    metrics.child(metrics.decisions, "other", "queued").inc()
    reference.decisions.labels("other", "queued").inc()
    for name in ("headroom_session_decisions", "headroom_session_duration_seconds"):
        assert family_block(exposition(metrics.registry), name) == family_block(
            exposition(reference.registry), name
        )


def test_bucket_labels_are_spelled_as_prometheus_client_spells_its_own() -> None:
    """The collected histograms format their ``le`` labels themselves: the same text as
    a prometheus_client Histogram with the same buckets exposes, large bounds included."""
    bounds = (
        *GAP_BUCKETS, *DELIVERY_RATIO_BUCKETS, 0.1 + 0.2, 1e-7, 999_999.5, 1e6, 1e7,
        12_345_678.9, 1e15, 1e20,
    )  # fmt: skip
    registry = CollectorRegistry()
    Histogram("h", "h", buckets=sorted(set(bounds)), registry=registry)
    exposed = [
        line.split('le="')[1].split('"')[0]
        for line in exposition(registry).splitlines()
        if line.startswith("h_bucket")
    ]
    assert exposed == [le_label(b) for b in sorted(set(bounds))] + ["+Inf"]
    assert le_label(math.inf) == "+Inf" and le_label(math.nan) == "NaN"
