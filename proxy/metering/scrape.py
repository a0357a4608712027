"""The gauges that describe the gate's state, read at scrape time.

Active sessions, slots, queue depth, health, guard, rolling delivery ratio, the engine's
own queue and the age of its figures, each API key's sessions, and the headroom left per
pool are not pushed: a collector reads the gate's frozen snapshots at scrape time, so they
can never drift from the truth. :class:`proxy.metering.series.Metrics` registers these collectors
(``bind_state``, ``bind_tenants``, ``bind_headroom``, ``bind_engine_scrape``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.metering.rolling import DELIVERY_THRESHOLD

if TYPE_CHECKING:
    from proxy.pool_headroom import HeadroomReport

__all__ = [
    "TENANT_LABELS",
    "TENANT_SESSION_SECONDS",
    "EngineScrapeCollector",
    "HeadroomCollector",
    "ReplicaGauges",
    "StateCollector",
    "TenantCollector",
    "TenantGauges",
]

_WORST_1PCT_HELP = (
    "Rolling worst-1% (1st percentile) per-chunk delivery ratio (audio s per wall s); below "
    f"1.0 listeners hear stalls, below {DELIVERY_THRESHOLD:g} the guard engages. Absent "
    "without recent audio."
)


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


TENANT_LABELS = ["pool", "tenant", "priority"]
TENANT_SESSION_SECONDS = (
    "headroom_tenant_session_seconds",
    "Slot-seconds the API key's sessions have held in the pool (running sessions count up "
    "to the scrape): what the fair share charges.",
)


class TenantCollector(Collector):
    def __init__(self, tenants: Callable[[], Sequence[TenantGauges]]) -> None:
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            "headroom_tenant_sessions_active",
            "Sessions of the API key holding a slot in the pool.",
            labels=TENANT_LABELS,
        )
        queued = GaugeMetricFamily(
            "headroom_tenant_queued",
            "Sessions of the API key waiting in the pool's queue.",
            labels=TENANT_LABELS,
        )
        held = CounterMetricFamily(*TENANT_SESSION_SECONDS, labels=TENANT_LABELS)
        for t in self._tenants():
            key = [t.pool, t.tenant, str(t.priority)]
            active.add_metric(key, t.active)
            queued.add_metric(key, t.queued)
            held.add_metric(key, t.session_seconds)
        yield from (active, queued, held)

    def describe(self) -> Iterator[Metric]:
        return iter(())


class StateCollector(Collector):
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


class HeadroomCollector(Collector):
    """Headroom left per pool and each pipeline's limiting stage (:mod:`proxy.pool_headroom`),
    computed at scrape time like the state gauges above."""

    def __init__(self, headroom: Callable[[], HeadroomReport]) -> None:
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


class EngineScrapeCollector(Collector):
    """How old each replica's engine figures are (:meth:`proxy.upstreams.Upstreams.figure_ages`):
    seconds since its scrape last gave figures, read at scrape time, so a replica whose
    scrapes stop (failing, timing out, or not running) shows an age that grows."""

    def __init__(self, ages: Callable[[], Sequence[tuple[str, str, float]]]) -> None:
        self._ages = ages

    def collect(self) -> Iterator[Metric]:
        age = GaugeMetricFamily(
            "headroom_engine_figures_age_seconds",
            "Seconds since the replica's engine /metrics scrape last gave figures; absent "
            "for a replica that never gave any, and while engine scraping is off. Grows "
            "while its scrapes fail (headroom_engine_scrape_errors_total says why).",
            labels=["pool", "replica"],
        )
        for pool, replica, seconds in self._ages():
            age.add_metric([pool, replica], seconds)
        yield age

    def describe(self) -> Iterator[Metric]:
        return iter(())
