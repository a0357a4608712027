"""The per-chunk metrics of a replica, as plain numbers, and their scrape-time export.

The gap and delivery-ratio histograms, the audio-delivered and stream-active counters, and
the underrun counters next to them are not prometheus_client metrics: a prometheus_client
observation takes a lock per value, and the relay makes four per audio chunk.
:class:`ReplicaSeries` accumulates them in plain Python (bucket counts found by bisection
on the same upper bounds, sums and counter totals as floats, added in the same order, so
every exported number is what prometheus_client would have exported) and a collector turns
them into histogram and counter families at scrape time, with the same names, help, labels
and buckets. :class:`proxy.metering.series.Metrics` owns the store and registers its collectors.

Threading: one writer, the event-loop thread (the meters). ``/metrics`` is served from the
same loop (:mod:`proxy.app` calls ``generate_latest`` in its handler), so a scrape never
sees a half-applied chunk; a scrape from another thread would read, at worst, one chunk's
sum without its bucket (never a torn count: ``_count`` is the sum of the buckets).

This module runs compiled (proxy/speedups.py).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Final

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "STREAM_ACTIVE",
    "AUDIO_DELIVERED",
    "COMPILED",
    "FIRST_CHUNK_UNDERRUNS",
    "CHUNK_GAP",
    "CHUNK_DELIVERY_RATIO",
    "REPLICA_LABELS",
    "PLAYBACK_STALL",
    "PLAYBACK_UNDERRUNS",
    "ReplicaCollector",
    "ReplicaSeries",
    "ReplicaStore",
    "bucket_index",
    "le_label",
]

#: The series' labels, and each family's name and help: exported here, and the
#: definitions :class:`proxy.metering.series.Metrics` keeps for code that inspects them.
REPLICA_LABELS = ("pool", "replica")
CHUNK_GAP = (
    "headroom_chunk_gap_seconds",
    "Gap between consecutive upstream chunks of one stream (what a listener waits).",
)
CHUNK_DELIVERY_RATIO = (
    "headroom_chunk_delivery_ratio",
    "A chunk's audio seconds / wall seconds since the previous chunk; <1 is slower than realtime.",
)
PLAYBACK_UNDERRUNS = (
    "headroom_playback_underruns_total",
    "Modelled client playback buffer ran dry mid-stream (a listener heard a stall).",
)
FIRST_CHUNK_UNDERRUNS = (
    "headroom_playback_first_chunk_underruns_total",
    "Of headroom_playback_underruns_total, those ended by a stream's second chunk: the "
    "buffer ran dry on the first chunk alone (a start-up transient, not a slow replica).",
)
PLAYBACK_STALL = (
    "headroom_playback_stall_seconds_total",
    "Modelled seconds of silence heard by listeners because audio arrived late.",
)
AUDIO_DELIVERED = ("headroom_audio_delivered_seconds_total", "Seconds of audio relayed to clients.")
STREAM_ACTIVE = (
    "headroom_stream_active_seconds_total",
    "Wall seconds listeners waited for or received audio: admission to a stream's first "
    "chunk, then the gaps between chunks; audio_delivered / this = aggregate delivery ratio.",
)

#: This module runs compiled (proxy/speedups.py): :class:`ReplicaSeries` then finds a
#: bucket with :func:`bucket_index`, whose comparisons are of C doubles; interpreted, the
#: C ``bisect_left`` is the faster of the two.
COMPILED: Final = not __file__.endswith(".py")


def bucket_index(bounds: tuple[float, ...], value: float) -> int:
    """``bisect.bisect_left(bounds, value)`` for ascending float ``bounds``: the first
    index whose bound is ``>= value`` (``len(bounds)`` if none is)."""
    lo = 0
    hi = len(bounds)
    while lo < hi:
        mid = (lo + hi) >> 1
        if bounds[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


class ReplicaSeries:
    """The per-chunk metrics of one (pool, replica), as plain numbers.

    ``*_bounds`` are a histogram's upper bounds with ``+Inf`` last (its buckets' ``le``
    labels, in order); an observation ``v`` goes to ``counts[bucket_index(bounds, v)]``,
    the first bucket whose bound is ``>= v`` (non-cumulative; the collector accumulates),
    and is added to ``*_sum``. Counters are float totals. Values must not be NaN (the meter
    never produces one). Written by :class:`proxy.metering.session_meter.PrometheusReplicaSink`,
    read at
    scrape time by :meth:`proxy.metering.series.Metrics.replica_series`'s collector."""

    __slots__ = (
        "active",
        "audio",
        "first_chunk_underruns",
        "gap_bounds",
        "gap_counts",
        "gap_sum",
        "pool",
        "ratio_bounds",
        "ratio_counts",
        "ratio_sum",
        "replica",
        "stall",
        "underruns",
    )

    def __init__(
        self,
        pool: str,
        replica: str,
        gap_bounds: tuple[float, ...],
        ratio_bounds: tuple[float, ...],
    ) -> None:
        self.pool = pool
        self.replica = replica
        self.gap_bounds = gap_bounds
        self.gap_counts = [0] * len(gap_bounds)
        self.gap_sum = 0.0
        self.ratio_bounds = ratio_bounds
        self.ratio_counts = [0] * len(ratio_bounds)
        self.ratio_sum = 0.0
        self.underruns = 0.0
        self.first_chunk_underruns = 0.0
        self.stall = 0.0
        self.audio = 0.0
        self.active = 0.0

    def observe_gap(self, gap: float) -> None:
        bounds = self.gap_bounds
        self.gap_counts[bucket_index(bounds, gap) if COMPILED else bisect_left(bounds, gap)] += 1
        self.gap_sum += gap

    def observe_ratio(self, ratio: float) -> None:
        bounds = self.ratio_bounds
        self.ratio_counts[
            bucket_index(bounds, ratio) if COMPILED else bisect_left(bounds, ratio)
        ] += 1
        self.ratio_sum += ratio

    def __repr__(self) -> str:
        return (
            f"<ReplicaSeries {self.pool}/{self.replica} chunks={sum(self.gap_counts)} "
            f"audio={self.audio:.3f}s>"
        )


def le_label(bound: float) -> str:
    """A bucket's ``le`` label as the exposition formats spell it (and prometheus_client
    its own histograms' buckets): ``+Inf``, Python's shortest round-trip repr (``0.005``,
    ``1.0``), and Go's exponent form from 10**7 up (``1.0e+07`` is ``1e+07``)."""
    if math.isnan(bound):
        return "NaN"
    if math.isinf(bound):
        return "+Inf" if bound > 0 else "-Inf"
    text = repr(float(bound))
    dot = text.find(".")
    if bound > 0 and dot > 6:  # repr has no exponent below 1e16: digits, dot, digits
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _cumulative(counts: Sequence[int], les: Sequence[str]) -> list[tuple[str, float]]:
    acc = 0.0  # float, like prometheus_client's bucket values
    out = []
    for le, n in zip(les, counts, strict=True):
        acc += n
        out.append((le, acc))
    return out


class ReplicaStore:
    """Every :class:`ReplicaSeries` of one :class:`proxy.metering.series.Metrics`, and the
    scrape-time export. ``*_buckets`` are the histograms' upper bounds without ``+Inf``."""

    def __init__(self, gap_buckets: Sequence[float], ratio_buckets: Sequence[float]) -> None:
        self.gap_bounds = (*(float(b) for b in gap_buckets), math.inf)
        self.ratio_bounds = (*(float(b) for b in ratio_buckets), math.inf)
        self._gap_les = tuple(le_label(b) for b in self.gap_bounds)
        self._ratio_les = tuple(le_label(b) for b in self.ratio_bounds)
        self._series: dict[tuple[str, str], ReplicaSeries] = {}

    def series(self, pool: str, replica: str) -> ReplicaSeries:
        """The one series of ``pool``/``replica``, created with zeros on first use."""
        key = (pool, replica)
        series = self._series.get(key)
        if series is None:
            series = ReplicaSeries(pool, replica, self.gap_bounds, self.ratio_bounds)
            self._series[key] = series
        return series

    def histograms(self, samples: bool = True) -> tuple[Metric, ...]:
        """The gap and delivery-ratio histogram families of every series (without
        samples when ``samples`` is False: the collector's describe)."""
        gap = HistogramMetricFamily(*CHUNK_GAP, labels=REPLICA_LABELS)
        ratio = HistogramMetricFamily(*CHUNK_DELIVERY_RATIO, labels=REPLICA_LABELS)
        for s in list(self._series.values()) if samples else ():
            key = [s.pool, s.replica]
            gap.add_metric(key, _cumulative(s.gap_counts, self._gap_les), s.gap_sum)
            ratio.add_metric(key, _cumulative(s.ratio_counts, self._ratio_les), s.ratio_sum)
        return gap, ratio

    def counters(self, samples: bool = True) -> tuple[Metric, ...]:
        """The underrun, stall, audio and active-time counter families of every series
        (without samples when ``samples`` is False)."""
        underruns, first, stall, audio, active = (
            CounterMetricFamily(*spec, labels=REPLICA_LABELS)
            for spec in (
                PLAYBACK_UNDERRUNS,
                FIRST_CHUNK_UNDERRUNS,
                PLAYBACK_STALL,
                AUDIO_DELIVERED,
                STREAM_ACTIVE,
            )
        )
        for s in list(self._series.values()) if samples else ():
            key = [s.pool, s.replica]
            underruns.add_metric(key, s.underruns)
            first.add_metric(key, s.first_chunk_underruns)
            stall.add_metric(key, s.stall)
            audio.add_metric(key, s.audio)
            active.add_metric(key, s.active)
        return underruns, first, stall, audio, active


class ReplicaCollector(Collector):
    """Exports a :class:`ReplicaStore`'s histograms or its counters. Two collectors, each
    registered where prometheus_client metrics of those names used to be, keep the
    exposition's family order what it was."""

    def __init__(self, families: Callable[[bool], tuple[Metric, ...]]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(True))

    def describe(self) -> Iterator[Metric]:
        """The families without samples: the registry learns their names (and refuses a
        second metric of the same name)."""
        return iter(self._families(False))
