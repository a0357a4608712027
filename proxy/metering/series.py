"""The Prometheus metrics of the contract (docs/contracts.md, "Metrics").

All names carry the ``headroom_`` prefix and base units; labels are only ``pool``,
``replica``, ``route``, ``decision``/``reason``, ``kind``, ``pipeline`` (a configured
pipeline's name) and ``tenant``/``priority`` (an API key's configured name and class;
sessions without a key are not in the tenant series) -- never a session.
Each :class:`Metrics` owns its own ``CollectorRegistry`` so several apps (tests,
``headroom demo``) can live in one process.

Gauges that describe the gate's state (active sessions, slots, queue depth, health,
guard, rolling delivery ratio) are not pushed: collectors read the gate's frozen
snapshots at scrape time (:mod:`proxy.metering.scrape`), so they can never drift from
the truth.

Naming: the slow tail of the delivery ratio is the *worst 1%* (the 1st percentile; low is
bad) everywhere: ``headroom_delivery_ratio_worst_1pct`` here, ``delivery_ratio_worst_1pct``
on the session log line, ``worst_1pct`` in the probe's output, and the recording rule
``pool_replica:headroom_chunk_delivery_ratio:worst_1pct_5m``. The gauge's old name,
``headroom_delivery_ratio_p99`` (a misnomer: it never was a 99th percentile), is exported
too, with the same value, for one release (:data:`DEPRECATED_ALIASES`).

The per-chunk metrics of a replica (gap and delivery-ratio histograms, audio-delivered and
stream-active counters, and the underrun counters next to them) are not prometheus_client
metrics either: :class:`proxy.metering.replica_series.ReplicaSeries` accumulates them in plain
numbers and a collector exports them at scrape time, with the same names, help, labels and
buckets (see that module for how, and for the threading assumption).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

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
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from proxy.metering.replica_series import (
    AUDIO_DELIVERED,
    CHUNK_DELIVERY_RATIO,
    CHUNK_GAP,
    FIRST_CHUNK_UNDERRUNS,
    PLAYBACK_STALL,
    PLAYBACK_UNDERRUNS,
    REPLICA_LABELS,
    STREAM_ACTIVE,
    ReplicaCollector,
    ReplicaSeries,
    ReplicaStore,
)
from proxy.metering.scrape import (
    TENANT_LABELS,
    TENANT_SESSION_SECONDS,
    EngineScrapeCollector,
    HeadroomCollector,
    ReplicaGauges,
    StateCollector,
    TenantCollector,
    TenantGauges,
)

if TYPE_CHECKING:
    from proxy.pool_headroom import HeadroomReport

_M = TypeVar("_M", bound=MetricWrapperBase)

__all__ = [
    "DELIVERY_RATIO_BUCKETS",
    "DEPRECATED_ALIASES",
    "GAP_BUCKETS",
    "Metrics",
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
#: The client's time to first audio adds the queue wait (up to a pool's ``max_wait_s``) to
#: the engine's part: the engine's edges, one more between 5 and 10 s, then on to the
#: queue-wait histogram's top edge.
_CLIENT_TTFA_BUCKETS = (
    0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
)  # fmt: skip
_DURATION_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_FINALIZE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


#: Deprecated metric name -> its replacement (same value, same labels). Removed in the
#: release after the one that introduced the new name; see README "Metrics".
DEPRECATED_ALIASES: dict[str, str] = {
    "headroom_delivery_ratio_p99": "headroom_delivery_ratio_worst_1pct",
}


def gap_buckets(chunk_durations_s: Iterable[float] = ()) -> tuple[float, ...]:
    """The gap buckets with the configured chunk durations added as edges."""
    extra = {round(d, 4) for d in chunk_durations_s if 0.005 <= d <= 5.0}
    return tuple(sorted(set(GAP_BUCKETS) | extra))


def _name(metric: MetricWrapperBase) -> str:
    """The metric's family name, as its collector describes it (a counter's without
    ``_total``)."""
    family: Metric = next(iter(metric.describe()))
    return family.name


class _CollectedHistogram(Histogram):
    """The definition of a histogram that a :class:`~proxy.metering.replica_series.ReplicaCollector`
    exports: name, help, labels and buckets, for code that inspects the metrics. Not
    registered; observing through it would be lost, so it refuses label children."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> NoReturn:
        raise TypeError(f"{_name(self)} is fed through Metrics.replica_series(pool, replica)")


class _CollectedCounter(Counter):
    """Like :class:`_CollectedHistogram`, for a counter."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> NoReturn:
        raise TypeError(f"{_name(self)} is fed through Metrics.replica_series(pool, replica)")


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
        # time by a collector (proxy.metering.replica_series). The attributes below are their
        # definitions, for code that inspects them; they are not registered.
        self._replica = ReplicaStore(gaps, DELIVERY_RATIO_BUCKETS)
        r.register(ReplicaCollector(self._replica.histograms))
        self.chunk_gap = _CollectedHistogram(
            *CHUNK_GAP, REPLICA_LABELS, buckets=gaps, registry=None
        )
        self.chunk_delivery_ratio = _CollectedHistogram(
            *CHUNK_DELIVERY_RATIO, REPLICA_LABELS, buckets=DELIVERY_RATIO_BUCKETS, registry=None
        )
        self.underruns = _CollectedCounter(*PLAYBACK_UNDERRUNS, REPLICA_LABELS, registry=None)
        self.first_chunk_underruns = _CollectedCounter(
            *FIRST_CHUNK_UNDERRUNS, REPLICA_LABELS, registry=None
        )
        self.stall_seconds = _CollectedCounter(*PLAYBACK_STALL, REPLICA_LABELS, registry=None)
        self.audio_delivered = _CollectedCounter(*AUDIO_DELIVERED, REPLICA_LABELS, registry=None)
        self.stream_active = _CollectedCounter(*STREAM_ACTIVE, REPLICA_LABELS, registry=None)
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
        r.register(ReplicaCollector(self._replica.counters))
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
        self.engine_scrape_errors = Counter(
            "headroom_engine_scrape_errors_total",
            "Engine /metrics scrapes whose figures were dropped, by reason: timeout, "
            "unreachable, too_large, unparseable, not_finite (a NaN or infinite figure), "
            "listener (the gateway's own handling raised), error.",
            ["pool", "replica", "reason"], registry=r,
        )  # fmt: skip
        # A pool's series appears with its first answered ASR commit
        # (proxy.metering.session_meter), so
        # pools that only speak (TTS) export none.
        self.asr_finalize = Histogram(
            "headroom_asr_finalize_seconds",
            "ASR: client's final commit to the final transcript event.",
            ["pool"], buckets=_FINALIZE_BUCKETS, registry=r,
        )  # fmt: skip
        self.tenant_decisions = Counter(
            "headroom_tenant_decisions_total",
            "Admission decisions per API key: admitted, queued, rejected_<reason>, abandoned.",
            [*TENANT_LABELS, "decision"], registry=r,
        )  # fmt: skip
        self.tenant_queue_wait = Histogram(
            "headroom_tenant_queue_wait_seconds",
            "Time the API key's sessions spent in the queue, whether then admitted or not.",
            TENANT_LABELS, buckets=_WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        # Registered after the older families, which keep their place in the exposition.
        self.client_time_to_first_audio = Histogram(
            "headroom_client_time_to_first_audio_seconds",
            "The session's arrival at the gateway (queue wait included) to the first audio "
            "chunk relayed to the client.",
            ["pool"], buckets=_CLIENT_TTFA_BUCKETS, registry=r,
        )  # fmt: skip
        # Exported by the tenant collector (bind_tenants); the definition, not registered.
        self.tenant_session_seconds = _CollectedCounter(
            *TENANT_SESSION_SECONDS, TENANT_LABELS, registry=None
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
        self.registry.register(StateCollector(replicas, queues))

    def bind_tenants(self, tenants: Callable[[], Sequence[TenantGauges]]) -> None:
        """Report each API key's active and queued sessions and session-seconds at
        scrape time. Call once per registry."""
        self.registry.register(TenantCollector(tenants))

    def bind_headroom(self, headroom: Callable[[], HeadroomReport]) -> None:
        """Report each pool's headroom left and each pipeline's limiting stage at scrape
        time (:mod:`proxy.pool_headroom`). Call once per registry."""
        self.registry.register(HeadroomCollector(headroom))

    def bind_engine_scrape(self, ages: Callable[[], Sequence[tuple[str, str, float]]]) -> None:
        """Report how old each replica's engine figures are at scrape time
        (:class:`~proxy.metering.scrape.EngineScrapeCollector`). Call once per registry."""
        self.registry.register(EngineScrapeCollector(ages))
