"""The Prometheus metrics of the contract (docs/contracts.md, "Metrics").

All names carry the ``headroom_`` prefix and base units; labels are only ``pool``,
``replica``, ``route``, ``decision``/``reason``, ``kind``, ``pipeline`` (a configured
pipeline's name) and ``tenant``/``priority`` (an API key's configured name and class;
sessions without a key are not in the tenant series) -- never a session.
Each :class:`Metrics` owns its own ``CollectorRegistry`` so several apps (tests,
``headroom demo``) can live in one process.

Gauges that describe the gate's state (active sessions, slots, queue depth, health,
guard, rolling delivery ratio) are not pushed: a collector reads the gate's frozen
snapshots at scrape time, so they can never drift from the truth.

Naming: the slow tail of the delivery ratio is the *worst 1%* (the 1st percentile; low is
bad) everywhere: ``headroom_delivery_ratio_worst_1pct`` here, ``delivery_ratio_worst_1pct``
on the session log line, ``worst_1pct`` in the probe's output, and the recording rule
``pool_replica:headroom_chunk_delivery_ratio:worst_1pct_5m``. The gauge's old name,
``headroom_delivery_ratio_p99`` (a misnomer: it never was a 99th percentile), is exported
too, with the same value, for one release (:data:`DEPRECATED_ALIASES`).

The per-chunk metrics of a replica (gap and delivery-ratio histograms, audio-delivered and
stream-active counters, and the underrun counters next to them) are not prometheus_client
metrics either: a prometheus_client observation takes a lock per value, and the relay
makes four per audio chunk. :class:`ReplicaSeries` accumulates
them in plain Python (bucket counts found by bisection on the same upper bounds, sums and
counter totals as floats, added in the same order, so every exported number is what
prometheus_client would have exported) and a collector turns them into histogram and
counter families at scrape time, with the same names, help, labels and buckets.

Threading: one writer, the event-loop thread (the meters). ``/metrics`` is served from the
same loop (:mod:`proxy.app` calls ``generate_latest`` in its handler), so a scrape never
sees a half-applied chunk; a scrape from another thread would read, at worst, one chunk's
sum without its bucket (never a torn count: ``_count`` is the sum of the buckets).
"""

from __future__ import annotations

import math
import platform
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeVar, cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from proxy.pool_headroom import Headroom

_M = TypeVar("_M", bound=MetricWrapperBase)

__all__ = [
    "DELIVERY_RATIO_BUCKETS",
    "DEPRECATED_ALIASES",
    "GAP_BUCKETS",
    "Metrics",
    "ReplicaGauges",
    "ReplicaSeries",
    "COMPILED",
    "TenantGauges",
    "bucket_index",
    "build_labels",
    "gap_buckets",
]

#: Inter-chunk gap buckets, 5 ms .. 5 s. Alert thresholds (0.25, 0.5, 1 s) and common
#: chunk durations (20, 40, 80, 100, 200 ms; 2 s for Qwen3-TTS codec chunks) are edges.
GAP_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0,
)  # fmt: skip

#: Delivery ratio (audio seconds per wall second) buckets; 1.0 (realtime) and 1.2 (the
#: default guard threshold) are edges.
DELIVERY_RATIO_BUCKETS: tuple[float, ...] = (
    0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 5.0, 10.0, 25.0, 100.0,
)  # fmt: skip


def build_labels() -> tuple[str, str, str]:
    """``headroom_build_info``'s labels: version, Python version, and ``compiled`` when
    every per-chunk module runs compiled, ``interpreted`` when none does (``mixed``
    otherwise: a partial build; :mod:`proxy.speedups`)."""
    from proxy import __version__
    from proxy.speedups import build_status

    status = build_status()
    build = "mixed" if status.compiled and status.interpreted else (
        "compiled" if status.compiled else "interpreted")  # fmt: skip
    return __version__, platform.python_version(), build


# ``*_created`` series double the scrape size and no dashboard or alert uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]

_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TTFA_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_DURATION_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_FINALIZE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


#: Deprecated metric name -> its replacement (same value, same labels). Removed in the
#: release after the one that introduced the new name; see README "Metrics".
DEPRECATED_ALIASES: dict[str, str] = {
    "headroom_delivery_ratio_p99": "headroom_delivery_ratio_worst_1pct",
}

_WORST_1PCT_HELP = (
    "Rolling worst-1% (1st percentile) per-chunk delivery ratio (audio s per wall s); below "
    "1.0 listeners hear stalls, below 1.2 the guard engages. Absent without recent audio."
)


def gap_buckets(chunk_durations_s: Iterable[float] = ()) -> tuple[float, ...]:
    """The gap buckets with the configured chunk durations added as edges."""
    extra = {round(d, 4) for d in chunk_durations_s if 0.005 <= d <= 5.0}
    return tuple(sorted(set(GAP_BUCKETS) | extra))


@dataclass(frozen=True, slots=True)
class ReplicaGauges:
    """What the scrape-time collector reports for one replica."""

    pool: str
    replica: str
    active: int
    slots: int
    healthy: bool
    guarded: bool
    delivery_ratio_worst_1pct: float | None
    engine_waiting: float | None = None
    engine_running: float | None = None
    engine_kv_usage: float | None = None
    engine_unadmitted: int | None = None


@dataclass(frozen=True, slots=True)
class TenantGauges:
    """What the scrape-time collector reports for one API key in one pool."""

    pool: str
    tenant: str
    priority: int
    active: int
    queued: int
    session_seconds: float


_TENANT_LABELS = ["pool", "tenant", "priority"]
_TENANT_SESSION_SECONDS = (
    "headroom_tenant_session_seconds",
    "Slot-seconds the API key's sessions have held in the pool (running sessions count up "
    "to the scrape): what the fair share charges.",
)


class _TenantCollector(Collector):
    def __init__(self, tenants: Callable[[], Sequence[TenantGauges]]) -> None:
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            "headroom_tenant_sessions_active",
            "Sessions of the API key holding a slot in the pool.",
            labels=_TENANT_LABELS,
        )
        queued = GaugeMetricFamily(
            "headroom_tenant_queued",
            "Sessions of the API key waiting in the pool's queue.",
            labels=_TENANT_LABELS,
        )
        held = CounterMetricFamily(*_TENANT_SESSION_SECONDS, labels=_TENANT_LABELS)
        for t in self._tenants():
            key = [t.pool, t.tenant, str(t.priority)]
            active.add_metric(key, t.active)
            queued.add_metric(key, t.queued)
            held.add_metric(key, t.session_seconds)
        yield from (active, queued, held)

    def describe(self) -> Iterator[Metric]:
        return iter(())


class _StateCollector(Collector):
    def __init__(
        self,
        replicas: Callable[[], Sequence[ReplicaGauges]],
        queues: Callable[[], Sequence[tuple[str, int]]],
    ) -> None:
        self._replicas = replicas
        self._queues = queues

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "replica"]
        active = GaugeMetricFamily(
            "headroom_sessions_active", "Sessions holding a slot on the replica.", labels=labels
        )
        slots = GaugeMetricFamily(
            "headroom_session_slots",
            "The replica's current session cap (per-GPU concurrency ceiling).",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "headroom_replica_healthy",
            "1 if the replica takes sessions, 0 if ejected.",
            labels=labels,
        )
        guarded = GaugeMetricFamily(
            "headroom_replica_guarded",
            "1 while the guard holds admissions because listeners' delivery ratio is too low.",
            labels=labels,
        )
        ratio = GaugeMetricFamily(
            "headroom_delivery_ratio_worst_1pct", _WORST_1PCT_HELP, labels=labels
        )
        ratio_alias = GaugeMetricFamily(
            "headroom_delivery_ratio_p99",
            "DEPRECATED (removed in the next release): the same value as "
            "headroom_delivery_ratio_worst_1pct, which it was always measuring. "
            + _WORST_1PCT_HELP,
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "headroom_engine_requests_waiting",
            "The engine's own queue (vllm:num_requests_waiting), scraped from the replica. "
            "Stays near 0 while listeners stall: watch the delivery ratio instead.",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "headroom_engine_requests_running",
            "Requests running in the engine's batch (vllm:num_requests_running).",
            labels=labels,
        )
        kv = GaugeMetricFamily(
            "headroom_engine_kv_cache_usage_ratio",
            "The engine's KV-cache usage, 0..1 (vllm:kv_cache_usage_perc).",
            labels=labels,
        )
        unadmitted = GaugeMetricFamily(
            "headroom_engine_unadmitted_streams",
            "Requests in the engine (running + waiting) beyond the sessions Headroom holds "
            "there (every gateway's on the redis backend), at the last engine scrape: "
            "traffic that bypassed Headroom. Pools with engine_reconcile take a sustained "
            "difference off the cap.",
            labels=labels,
        )
        for r in self._replicas():
            key = [r.pool, r.replica]
            if r.engine_unadmitted is not None:
                unadmitted.add_metric(key, r.engine_unadmitted)
            if r.engine_waiting is not None:
                waiting.add_metric(key, r.engine_waiting)
            if r.engine_running is not None:
                running.add_metric(key, r.engine_running)
            if r.engine_kv_usage is not None:
                kv.add_metric(key, r.engine_kv_usage)
            active.add_metric(key, r.active)
            slots.add_metric(key, r.slots)
            healthy.add_metric(key, 1.0 if r.healthy else 0.0)
            guarded.add_metric(key, 1.0 if r.guarded else 0.0)
            if r.delivery_ratio_worst_1pct is not None:
                ratio.add_metric(key, r.delivery_ratio_worst_1pct)
                ratio_alias.add_metric(key, r.delivery_ratio_worst_1pct)
        depth = GaugeMetricFamily(
            "headroom_queue_depth", "Sessions waiting in Headroom's FIFO queue.", labels=["pool"]
        )
        for pool, n in self._queues():
            depth.add_metric([pool], n)
        yield from (active, slots, depth, healthy, guarded, ratio, ratio_alias)
        yield from (waiting, running, kv, unadmitted)

    def describe(self) -> Iterator[Metric]:
        return iter(())


class _HeadroomCollector(Collector):
    """Headroom left per pool and each pipeline's limiting stage (:mod:`proxy.pool_headroom`),
    computed at scrape time like the state gauges above."""

    def __init__(self, headroom: Callable[[], Headroom]) -> None:
        self._headroom = headroom

    def collect(self) -> Iterator[Metric]:
        pool = ["pool"]
        usable = GaugeMetricFamily(
            "headroom_pool_slots_usable",
            "Session cap summed over the pool's replicas that take sessions now (healthy, "
            "not retired, not held by the guard in enforce mode).",
            labels=pool,
        )
        free = GaugeMetricFamily(
            "headroom_pool_slots_free",
            "Free slots on those replicas (cap - active, each at least 0; on the redis "
            "backend active counts every gateway's sessions).",
            labels=pool,
        )
        worst = GaugeMetricFamily(
            "headroom_pool_delivery_ratio_worst_1pct",
            "The lowest rolling worst-1% delivery ratio among the pool's usable replicas. "
            "Absent without recent audio (an ASR pool).",
            labels=pool,
        )
        margin = GaugeMetricFamily(
            "headroom_pool_delivery_margin_ratio",
            "headroom_pool_delivery_ratio_worst_1pct / guard.threshold - 1: 0 at the guard "
            "threshold, negative below it. Absent without recent audio.",
            labels=pool,
        )
        left = GaugeMetricFamily(
            "headroom_pool_headroom_left_ratio",
            "Headroom left, 0..1: the lesser of slots_free / slots_usable and the delivery "
            "margin (capped to 0..1); 0 when no replica is usable.",
            labels=pool,
        )
        stage_left = GaugeMetricFamily(
            "headroom_pipeline_stage_headroom_left_ratio",
            "headroom_pool_headroom_left_ratio of each stage (pool) of a configured pipeline.",
            labels=["pipeline", "pool"],
        )
        limiting = GaugeMetricFamily(
            "headroom_pipeline_limiting_stage",
            "1 for the stage (pool) of the pipeline with the least headroom left, 0 for the "
            "others.",
            labels=["pipeline", "pool"],
        )
        snapshot = self._headroom()
        for h in snapshot.pools:
            key = [h.pool]
            usable.add_metric(key, h.slots_usable)
            free.add_metric(key, h.slots_free)
            if h.delivery_ratio_worst_1pct is not None:
                worst.add_metric(key, h.delivery_ratio_worst_1pct)
            if (m := h.delivery_margin) is not None:
                margin.add_metric(key, m)
            left.add_metric(key, h.left)
        for p in snapshot.pipelines:
            for stage in p.stages:
                key = [p.name, stage.pool]
                stage_left.add_metric(key, stage.left)
                limiting.add_metric(key, 1.0 if stage.pool == p.limiting else 0.0)
        yield from (usable, free, worst, margin, left, stage_left, limiting)

    def describe(self) -> Iterator[Metric]:
        return iter(())


_REPLICA_LABELS = ("pool", "replica")
_GAP = (
    "headroom_chunk_gap_seconds",
    "Gap between consecutive upstream chunks of one stream (what a listener waits).",
)
_RATIO = (
    "headroom_chunk_delivery_ratio",
    "A chunk's audio seconds / wall seconds since the previous chunk; <1 is slower than realtime.",
)
_UNDERRUNS = (
    "headroom_playback_underruns_total",
    "Modelled client playback buffer ran dry mid-stream (a listener heard a stall).",
)
_FIRST_CHUNK_UNDERRUNS = (
    "headroom_playback_first_chunk_underruns_total",
    "Of headroom_playback_underruns_total, those ended by a stream's second chunk: the "
    "buffer ran dry on the first chunk alone (a start-up transient, not a slow replica).",
)
_STALL = (
    "headroom_playback_stall_seconds_total",
    "Modelled seconds of silence heard by listeners because audio arrived late.",
)
_AUDIO = ("headroom_audio_delivered_seconds_total", "Seconds of audio relayed to clients.")
_ACTIVE = (
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

    ``*_bounds`` are a histogram's upper bounds with ``+Inf`` last (prometheus_client's
    ``_upper_bounds``); an observation ``v`` goes to ``counts[bucket_index(bounds, v)]``,
    the first bucket whose bound is ``>= v`` (non-cumulative; the collector accumulates),
    and is added to ``*_sum``. Counters are float totals. Values must not be NaN (the meter
    never produces one). Written by :class:`proxy.meter.PrometheusReplicaSink`, read at
    scrape time by :meth:`Metrics.replica_series`'s collector."""

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


def _le(bound: float) -> str:
    """A bucket's ``le`` label, spelled as prometheus_client spells it."""
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]


def _cumulative(counts: Sequence[int], les: Sequence[str]) -> list[tuple[str, float]]:
    acc = 0.0  # float, like prometheus_client's bucket values
    out = []
    for le, n in zip(les, counts, strict=True):
        acc += n
        out.append((le, acc))
    return out


class _ReplicaStore:
    """Every :class:`ReplicaSeries` of one :class:`Metrics`, and the scrape-time export."""

    def __init__(self, gap_buckets: Sequence[float]) -> None:
        self.gap_bounds = (*(float(b) for b in gap_buckets), math.inf)
        self.ratio_bounds = (*DELIVERY_RATIO_BUCKETS, math.inf)
        self._gap_les = tuple(_le(b) for b in self.gap_bounds)
        self._ratio_les = tuple(_le(b) for b in self.ratio_bounds)
        self._series: dict[tuple[str, str], ReplicaSeries] = {}

    def series(self, pool: str, replica: str) -> ReplicaSeries:
        key = (pool, replica)
        series = self._series.get(key)
        if series is None:
            series = ReplicaSeries(pool, replica, self.gap_bounds, self.ratio_bounds)
            self._series[key] = series
        return series

    def histograms(self, samples: bool = True) -> tuple[Metric, ...]:
        gap = HistogramMetricFamily(*_GAP, labels=_REPLICA_LABELS)
        ratio = HistogramMetricFamily(*_RATIO, labels=_REPLICA_LABELS)
        for s in list(self._series.values()) if samples else ():
            key = [s.pool, s.replica]
            gap.add_metric(key, _cumulative(s.gap_counts, self._gap_les), s.gap_sum)
            ratio.add_metric(key, _cumulative(s.ratio_counts, self._ratio_les), s.ratio_sum)
        return gap, ratio

    def counters(self, samples: bool = True) -> tuple[Metric, ...]:
        underruns, first, stall, audio, active = (
            CounterMetricFamily(*spec, labels=_REPLICA_LABELS)
            for spec in (_UNDERRUNS, _FIRST_CHUNK_UNDERRUNS, _STALL, _AUDIO, _ACTIVE)
        )
        for s in list(self._series.values()) if samples else ():
            key = [s.pool, s.replica]
            underruns.add_metric(key, s.underruns)
            first.add_metric(key, s.first_chunk_underruns)
            stall.add_metric(key, s.stall)
            audio.add_metric(key, s.audio)
            active.add_metric(key, s.active)
        return underruns, first, stall, audio, active


class _ReplicaCollector(Collector):
    """Exports a :class:`_ReplicaStore`'s histograms or its counters. Two collectors, each
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


class _CollectedHistogram(Histogram):
    """The definition of a histogram that a :class:`_ReplicaCollector` exports: name, help,
    labels and buckets, for code that inspects the metrics. Not registered; observing
    through it would be lost, so it refuses label children."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> NoReturn:
        raise TypeError(f"{self._name} is fed through Metrics.replica_series(pool, replica)")


class _CollectedCounter(Counter):
    """Like :class:`_CollectedHistogram`, for a counter."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> NoReturn:
        raise TypeError(f"{self._name} is fed through Metrics.replica_series(pool, replica)")


class Metrics:
    """Every ``headroom_*`` metric, in one registry."""

    def __init__(self, chunk_durations_s: Iterable[float] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        r = self.registry
        gaps = gap_buckets(chunk_durations_s)
        self.queue_wait = Histogram(
            "headroom_queue_wait_seconds",
            "Time sessions spent in Headroom's queue, whether then admitted or not.",
            ["pool"], buckets=_WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "headroom_session_decisions_total",
            "Admission decisions: admitted, queued, rejected_<reason>, abandoned.",
            ["pool", "decision"], registry=r,
        )  # fmt: skip
        # The per-chunk replica metrics: accumulated by ReplicaSeries, exported at scrape
        # time by one collector (see the module docstring). The attributes below are their
        # definitions, for code that inspects them; they are not registered.
        self._replica = _ReplicaStore(gaps)
        r.register(_ReplicaCollector(self._replica.histograms))
        self.chunk_gap = _CollectedHistogram(*_GAP, _REPLICA_LABELS, buckets=gaps, registry=None)
        self.chunk_delivery_ratio = _CollectedHistogram(
            *_RATIO, _REPLICA_LABELS, buckets=DELIVERY_RATIO_BUCKETS, registry=None
        )
        self.underruns = _CollectedCounter(*_UNDERRUNS, _REPLICA_LABELS, registry=None)
        self.first_chunk_underruns = _CollectedCounter(
            *_FIRST_CHUNK_UNDERRUNS, _REPLICA_LABELS, registry=None
        )
        self.stall_seconds = _CollectedCounter(*_STALL, _REPLICA_LABELS, registry=None)
        self.audio_delivered = _CollectedCounter(*_AUDIO, _REPLICA_LABELS, registry=None)
        self.stream_active = _CollectedCounter(*_ACTIVE, _REPLICA_LABELS, registry=None)
        self.stream_gap_p99 = Histogram(
            "headroom_stream_gap_p99_seconds",
            "Each finished stream's own p99 inter-chunk gap, observed once per stream.",
            ["pool"], buckets=gaps, registry=r,
        )  # fmt: skip
        self.time_to_first_audio = Histogram(
            "headroom_time_to_first_audio_seconds",
            "Admission to the first audio chunk relayed to the client.",
            ["pool"], buckets=_TTFA_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_ReplicaCollector(self._replica.counters))
        self.session_duration = Histogram(
            "headroom_session_duration_seconds",
            "Length of admitted sessions, admission to end.",
            ["pool"], buckets=_DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "headroom_upstream_errors_total",
            "Upstream failures by kind: connect, handshake, midstream, protocol, timeout.",
            ["pool", "replica", "kind"], registry=r,
        )  # fmt: skip
        # A pool's series appears with its first answered ASR commit (proxy.meter), so
        # pools that only speak (TTS) export none.
        self.asr_finalize = Histogram(
            "headroom_asr_finalize_seconds",
            "ASR: client's final commit to the final transcript event.",
            ["pool"], buckets=_FINALIZE_BUCKETS, registry=r,
        )  # fmt: skip
        self.tenant_decisions = Counter(
            "headroom_tenant_decisions_total",
            "Admission decisions per API key: admitted, queued, rejected_<reason>, abandoned.",
            [*_TENANT_LABELS, "decision"], registry=r,
        )  # fmt: skip
        self.tenant_queue_wait = Histogram(
            "headroom_tenant_queue_wait_seconds",
            "Time the API key's sessions spent in the queue, whether then admitted or not.",
            _TENANT_LABELS, buckets=_WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        # Exported by the tenant collector (bind_tenants); the definition, not registered.
        self.tenant_session_seconds = _CollectedCounter(
            *_TENANT_SESSION_SECONDS, _TENANT_LABELS, registry=None
        )
        # The process: process_* (CPU, memory, file descriptors, start time), python_gc_*
        # and python_info, on this registry as on prometheus_client's default one.
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        PlatformCollector(registry=r)
        self.build_info = Gauge(
            "headroom_build_info",
            "Always 1: the running version, Python, and whether the per-chunk modules run "
            "compiled (mypyc) or interpreted.",
            ["version", "python", "build"], registry=r,
        )  # fmt: skip
        self.build_info.labels(*build_labels()).set(1)

    def child(self, metric: _M, *labels: str) -> _M:
        """``metric.labels(*labels)``, looked up once: every session counts its decision,
        its duration, its time to first audio and its gap p99 under its pool, and
        prometheus_client's labels() takes a lock, turns the values to str and checks
        them each time. Children are never removed, so a cached one stays the exported
        one."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return cast(_M, found)

    def replica_series(self, pool: str, replica: str) -> ReplicaSeries:
        """The (one, shared) per-chunk series of ``pool``/``replica``; exported from now on,
        with zeros until something is observed."""
        return self._replica.series(pool, replica)

    def bind_state(
        self,
        replicas: Callable[[], Sequence[ReplicaGauges]],
        queues: Callable[[], Sequence[tuple[str, int]]],
    ) -> None:
        """Report gate state at scrape time. Call once per registry."""
        self.registry.register(_StateCollector(replicas, queues))

    def bind_tenants(self, tenants: Callable[[], Sequence[TenantGauges]]) -> None:
        """Report each API key's active and queued sessions and session-seconds at
        scrape time. Call once per registry."""
        self.registry.register(_TenantCollector(tenants))

    def bind_headroom(self, headroom: Callable[[], Headroom]) -> None:
        """Report each pool's headroom left and each pipeline's limiting stage at scrape
        time (:mod:`proxy.pool_headroom`). Call once per registry."""
        self.registry.register(_HeadroomCollector(headroom))
