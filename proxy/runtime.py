"""Everything one running gateway shares: settings, gate, metrics, upstream clients,
health re-checks, per-replica signals, and the list of live sessions (for drain).

Built from a validated :class:`~proxy.settings.Settings`; started and stopped by the
ASGI lifespan of :mod:`proxy.app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.admission import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    PoolCore,
    QueuePolicy,
    ReplicaSpec,
    Reserve,
    TenantSpec,
)
from proxy.auth import TenantQuotas, authenticate
from proxy.clock import Clock, LoopClock, TimerHandle
from proxy.errors import Refused
from proxy.gate import CURRENT_TENANT, Gate
from proxy.guard import GuardPolicy, ReplicaGuard
from proxy.meter import PrometheusReplicaSink, SessionMeter
from proxy.metrics import Metrics
from proxy.pipelines import headroom_of
from proxy.protocols import AudioFormat, HttpAdapter, WsAdapter, http_adapter, ws_adapter
from proxy.relay.failover import Unreachable, open_tcp
from proxy.settings import ApiKeySettings, PoolSettings, RouteSettings, Settings
from proxy.shared_gate import ADMITTED_POOL, TENANT_QUOTA, SharedGate, build_shared_gate
from proxy.signals import ReplicaSignals

__all__ = ["Runtime", "build_gate", "parse_engine_metrics"]

log = logging.getLogger("headroom.runtime")

StopSession = Callable[[int, str], None]

#: How often the guard evaluates every replica's rolling signals.
GUARD_INTERVAL_S = 1.0


def _core(pool: PoolSettings, seed: int) -> PoolCore:
    return PoolCore(
        pool.name,
        [ReplicaSpec(r.name, r.max_sessions) for r in pool.replicas],
        QueuePolicy(pool.queue.max_depth, pool.queue.max_wait_s),
        session_estimate_s=pool.session_estimate_s,
        seed=seed,
        reserves=_reserves(pool),
    )


def _reserves(pool: PoolSettings) -> tuple[Reserve, ...]:
    return tuple(Reserve(r.priority, r.slots, r.per_replica) for r in pool.reserve)


def tenant_spec(key: ApiKeySettings) -> TenantSpec:
    """The scheduling identity of an API key (issue 18)."""
    return TenantSpec(key.name, key.priority, key.weight, key.max_queued)


_ENGINE_NAMES = {
    "vllm:num_requests_waiting": 0,
    "vllm:num_requests_running": 1,
    "vllm:kv_cache_usage_perc": 2,
}


def parse_engine_metrics(text: str) -> tuple[float, float, float]:
    """(waiting, running, KV usage 0..1) from a vLLM ``/metrics`` page, summed over
    label sets (one engine may report per model). Raises ValueError if none is there."""
    values = [0.0, 0.0, 0.0]
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            index = _ENGINE_NAMES.get(sample.name)
            if index is not None:
                values[index] += sample.value
                seen = True
    if not seen:
        raise ValueError("no vLLM engine metrics on that page")
    return values[0], values[1], values[2]


def _pool_specs(pool: PoolSettings) -> tuple[list[ReplicaSpec], QueuePolicy]:
    return (
        [ReplicaSpec(r.name, r.max_sessions) for r in pool.replicas],
        QueuePolicy(pool.queue.max_depth, pool.queue.max_wait_s),
    )


def build_gate(settings: Settings, clock: Clock, metrics: Metrics | None) -> Gate:
    return Gate(
        [_core(p, seed=i) for i, p in enumerate(settings.pools)],
        clock=clock,
        metrics=metrics,
        fallbacks={p.name: p.fallback.as_hint() if p.fallback else None for p in settings.pools},
        recheck_interval_s=settings.health.recheck_interval_s,
    )


class Runtime:
    """The shared state of one gateway process (one event loop)."""

    def __init__(
        self, settings: Settings, *, clock: Clock | None = None, metrics: Metrics | None = None
    ) -> None:
        self.settings = settings
        self.clock: Clock = clock or LoopClock()
        self.metrics = metrics or Metrics(settings.meter.chunk_durations_s)
        self.gate: Gate | SharedGate = (
            build_shared_gate(settings, self.clock, self.metrics)
            if settings.admission.backend == "redis"
            else build_gate(settings, self.clock, self.metrics)
        )
        self.signals: dict[tuple[str, str], ReplicaSignals] = {}
        self.guards: dict[tuple[str, str], ReplicaGuard] = {}
        self._guard_timer: TimerHandle | None = None
        self.engine: dict[tuple[str, str], tuple[float, float, float]] = {}
        self.tenants = TenantQuotas()
        self._sinks: dict[tuple[str, str], PrometheusReplicaSink] = {}
        self._urls: dict[tuple[str, str], tuple[str, str]] = {}
        self._routes: dict[str, RouteSettings] = {}
        self._formats: dict[str, AudioFormat] = {}
        self._apply_settings(settings)
        #: Every relaying session's stop, with the pool it was admitted to (None: not
        #: known, e.g. the in-process gate, which never fences).
        self._sessions: dict[StopSession, str | None] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._rechecks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._http: httpx.AsyncClient | None = None
        self.started = False
        #: Set once the start-up reachability check of every replica has finished.
        self.replicas_checked = asyncio.Event()
        self.metrics.bind_state(self._replica_gauges, self.gate.queue_depths)
        self.metrics.bind_headroom(lambda: headroom_of(self))
        if isinstance(self.gate, Gate):
            self.metrics.bind_tenants(self.gate.tenant_gauges)
        self.gate.on_health_change(self._on_health_change)
        if isinstance(self.gate, SharedGate):
            self.gate.on_fence(self._on_lease_loss)

    def _apply_settings(self, settings: Settings) -> None:
        self.settings = settings
        g = settings.guard
        policy = GuardPolicy(
            g.threshold, g.hysteresis, g.hold_s, g.min_samples,
            max_startup_stall_share=g.startup_stall_share, ttfa_p99_s=g.ttfa_p99_s,
            startup_min_streams=g.startup_min_streams,
        )  # fmt: skip
        configured = {(p.name, r.name) for p in settings.pools for r in p.replicas}
        self.guards = {k: v for k, v in self.guards.items() if k in configured}
        for pool in settings.pools:
            for r in pool.replicas:
                self._urls[(pool.name, r.name)] = (r.url, r.ws_url)
                key = (pool.name, r.name)
                if key not in self.signals:
                    self.signals[key] = ReplicaSignals(settings.meter.window_s)
                guard = self.guards.get(key)
                if guard is None:
                    self.guards[key] = ReplicaGuard(policy)
                else:
                    guard.policy = policy
        self._routes = {r.path: r for r in settings.routes}
        self._formats = {
            r.path: AudioFormat(r.audio.sample_rate, r.audio.channels, r.audio.sample_width)
            for r in settings.routes
        }

    def apply(self, settings: Settings) -> list[str]:
        """Apply a reloaded configuration live; returns what changed, in words.

        Caps, queue limits, replicas (added or retired), pools, routes, limits, meter and
        guard settings take effect for new sessions at once; running sessions are never
        cut. ``listen`` and ``admin`` addresses need a restart (reported, not applied)."""
        old = self.settings
        changes: list[str] = []
        if settings.listen != old.listen or settings.admin != old.admin:
            changes.append("listen/admin address changes need a restart: not applied")
        old_pools = {p.name: p for p in old.pools}
        for pool in settings.pools:
            replicas, queue = _pool_specs(pool)
            if old_pools.get(pool.name) != pool:
                changes.append(f"pool {pool.name}: " + (
                    "updated" if pool.name in old_pools else "added"))  # fmt: skip
            hint = pool.fallback.as_hint() if pool.fallback else None
            if isinstance(self.gate, Gate):
                self.gate.apply_pool(
                    pool.name, replicas, queue, hint,
                    session_estimate_s=pool.session_estimate_s, reserves=_reserves(pool),
                )  # fmt: skip
            else:
                self.gate.apply_pool(
                    pool.name, replicas, queue, hint, session_estimate_s=pool.session_estimate_s
                )
        for name in old_pools.keys() - {p.name for p in settings.pools}:
            self.gate.retire_pool(name)
            changes.append(f"pool {name}: removed (running sessions finish)")
        if settings.routes != old.routes:
            changes.append("routes updated")
        if settings.admission != old.admission:
            changes.append("admission backend changes need a restart: not applied")
        for section in ("limits", "forwarded", "meter", "guard", "health", "auth",
                        "pipelines", "drain_timeout_s"):
            if getattr(settings, section) != getattr(old, section):
                changes.append(f"{section} updated")
        self._apply_settings(settings)
        self.gate.set_recheck_interval(settings.health.recheck_interval_s)
        if settings.guard.mode != "enforce" and old.guard.mode == "enforce":
            for pool_name, replica in self.guards:
                if pool_name in self.gate.pools():
                    self.gate.set_guarded(pool_name, replica, False)
        if self._guard_timer is None:
            self._arm_guard()
        return changes

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        limits = self.settings.limits
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=limits.upstream_connect_timeout_s,
                read=limits.idle_timeout_s or None,
                write=limits.idle_timeout_s or None,
                pool=limits.upstream_connect_timeout_s,
            ),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            follow_redirects=False,
            trust_env=False,
        )
        if isinstance(self.gate, SharedGate):
            await self.gate.start()
        self.started = True
        self._arm_guard()
        self.spawn(self._check_replicas())
        if self.settings.health.engine_metrics_interval_s > 0:
            self.spawn(self._scrape_engines())

    async def stop(self) -> None:
        if self._guard_timer is not None:
            self._guard_timer.cancel()
            self._guard_timer = None
        for task in list(self._rechecks.values()) + list(self._tasks):
            task.cancel()
        for task in list(self._rechecks.values()) + list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if isinstance(self.gate, SharedGate):
            await self.gate.stop()
        self.started = False

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("runtime not started")
        return self._http

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a background coroutine, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- sessions -------------------------------------------------------------------

    def register_session(self, stop: StopSession) -> None:
        """Called from the session's own task, after its admission: the shared gate has
        recorded the pool there (:data:`~proxy.shared_gate.ADMITTED_POOL`)."""
        self._sessions[stop] = ADMITTED_POOL.get()

    def unregister_session(self, stop: StopSession) -> None:
        self._sessions.pop(stop, None)

    def _on_lease_loss(self, pool: str, why: str) -> None:
        """The shared gate can no longer prove this gateway's leases on ``pool``: end
        that pool's sessions before other gateways reuse their slots
        (admission.on_backend_loss: close). Renewals are per pool, so other pools'
        sessions hold proven leases and keep running."""
        closed = self.close_sessions(1012, "admission backend lost", pool=pool)
        log.error("closed %d sessions (1012) after losing leases on pool %s: %s",
                  closed, pool, why)  # fmt: skip

    def close_sessions(self, code: int, reason: str, *, pool: str | None = None) -> int:
        """Ask every relaying session (of ``pool`` only, if given; a session whose pool
        is not known counts as one of it) to close with ``code``; returns how many."""
        sessions = [s for s, of in self._sessions.items() if pool is None or of in (pool, None)]
        for stop in sessions:
            stop(code, reason)
        return len(sessions)

    @property
    def live_sessions(self) -> int:
        return len(self._sessions)

    # -- routing and upstreams --------------------------------------------------------

    def route_for(self, path: str) -> RouteSettings | None:
        return self._routes.get(path)

    def ws_url(self, pool: str, replica: str) -> str:
        return self._urls[(pool, replica)][1]

    def http_url(self, pool: str, replica: str) -> str:
        return self._urls[(pool, replica)][0]

    def authorize(self, scope: dict[str, Any], pool: str) -> str | None:
        """Check the client's key for ``pool`` and reserve one session of its quota.
        Returns a token for :meth:`release_tenant` (call it on every exit path);
        raises Unauthorized / Forbidden / TenantLimitRefused. Runs before the gate."""
        CURRENT_TENANT.set(None)
        key = authenticate(self.settings.auth, scope, pool)
        if key is None:
            return None
        if isinstance(self.gate, SharedGate):
            estimate = self.gate.estimate_wait(pool, 1)
        else:
            # Past max_sessions only one of the key's own sessions ending helps.
            core, now = self.gate.core(pool), self.clock.now()
            own = core.tenant_wait(key.name, now)
            estimate = core.estimate_wait(1, now) if own is None else own
        retry = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, estimate))
        try:
            token = self.tenants.reserve(key, pool, retry)
        except Refused:
            self.metrics.decisions.labels(pool, "rejected_tenant_limit").inc()
            labels = (pool, key.name, str(key.priority), "rejected_tenant_limit")
            self.metrics.tenant_decisions.labels(*labels).inc()
            raise
        # The gate admits this task's session as the key's tenant (class, weight, ...).
        CURRENT_TENANT.set(tenant_spec(key))
        if isinstance(self.gate, SharedGate) and key.max_sessions is not None:
            # Counted over every gateway too, by the shared gate's admission (this
            # process's count above is only its own part).
            TENANT_QUOTA.set((key.name, key.max_sessions))
        return token

    def release_tenant(self, token: str | None) -> None:
        self.tenants.release(token)

    def key_allows(self, scope: dict[str, Any], pool: str) -> bool:
        """Whether the (already authenticated) caller may use ``pool`` (fallback)."""
        try:
            authenticate(self.settings.auth, scope, pool)
        except Exception:
            return False
        return True

    def upstream_error(self, pool: str, replica: str, kind: str) -> None:
        self.metrics.upstream_errors.labels(pool, replica, kind).inc()

    def ready(self) -> tuple[bool, str]:
        if self.gate.draining:
            return False, "draining"
        if not self.started:
            return False, "starting"
        if isinstance(self.gate, SharedGate) and not self.gate.available:
            return False, "admission backend unavailable"
        if not self.replicas_checked.is_set():
            return False, "checking replicas"
        healthy = sum(s.healthy_replicas for s in self.gate.statistics().values())
        if healthy == 0:
            return False, "no healthy replica"
        return True, "ready"

    # -- metering -------------------------------------------------------------------

    def _sink(self, pool: str, replica: str) -> PrometheusReplicaSink:
        key = (pool, replica)
        sink = self._sinks.get(key)
        if sink is None:
            sink = PrometheusReplicaSink(self.metrics, pool, replica, self.signals[key])
            self._sinks[key] = sink
        return sink

    def new_meter(self, pool: str, replica: str, admitted_at: float) -> SessionMeter:
        return SessionMeter(
            admitted_at, self._sink(pool, replica), prebuffer_s=self.settings.meter.prebuffer_s
        )

    def ws_adapter(self, route: RouteSettings, meter: SessionMeter) -> WsAdapter:
        return ws_adapter(route.protocol, meter, self._formats[route.path], route.inner_protocol)

    def http_adapter(self, route: RouteSettings, meter: SessionMeter) -> HttpAdapter:
        return http_adapter(route.protocol, meter, self._formats[route.path])

    def delivery_ratio_worst_1pct(self, pool: str, replica: str) -> float | None:
        signals = self.signals.get((pool, replica))
        return signals.worst_ratio(self.clock.now()) if signals else None

    def _replica_gauges(self) -> list[Any]:
        gauges = self.gate.replica_gauges(self.delivery_ratio_worst_1pct, self.guarded)
        if not self.engine:
            return gauges
        out = []
        for g in gauges:
            figures = self.engine.get((g.pool, g.replica))
            if figures is not None:
                g = replace(g, engine_waiting=figures[0], engine_running=figures[1],
                            engine_kv_usage=figures[2])  # fmt: skip
            out.append(g)
        return out

    # -- engine metrics -------------------------------------------------------------------

    async def _scrape_engines(self) -> None:
        """Re-export each replica's own vLLM figures, so dashboards can show the engine's
        queue (near zero) beside the listeners' gaps (not)."""
        while True:
            interval = self.settings.health.engine_metrics_interval_s
            if interval <= 0:
                return
            for pool in self.settings.pools:
                for r in pool.replicas:
                    try:
                        response = await self.http.get(r.url + "/metrics", timeout=2.0)
                        figures = parse_engine_metrics(response.text)
                    except (httpx.HTTPError, ValueError):
                        self.engine.pop((pool.name, r.name), None)
                        continue
                    self.engine[(pool.name, r.name)] = figures
            await asyncio.sleep(interval)

    # -- guard ----------------------------------------------------------------------------

    def guarded(self, pool: str, replica: str) -> bool:
        guard = self.guards.get((pool, replica))
        return guard is not None and guard.guarded and self.settings.guard.mode != "off"

    def _arm_guard(self) -> None:
        if self.settings.guard.mode != "off" and self.started:
            self._guard_timer = self.clock.call_at(
                self.clock.now() + GUARD_INTERVAL_S, self.evaluate_guards
            )

    def evaluate_guards(self) -> None:
        """Feed every replica's rolling signals to its guard; apply changes (enforce)."""
        self._guard_timer = None
        now = self.clock.now()
        mode = self.settings.guard.mode
        for (pool, replica), guard in self.guards.items():
            signals = self.signals[(pool, replica)]
            startup = signals.startup(now)
            if guard.update(now, signals.worst_ratio(now), signals.samples(now), startup):
                share, p99 = startup.stalled_share, startup.ttfa_p99
                log.warning(
                    "guard %s %s/%s (%s): worst-1%% delivery ratio %s (threshold %.2f), "
                    "first seams stalled %s of %d, TTFA p99 %s, mode %s",
                    "engaged on" if guard.guarded else "released",
                    pool, replica, ",".join(guard.reasons),
                    f"{guard.last_ratio:.2f}" if guard.last_ratio is not None else "n/a",
                    guard.policy.threshold,
                    f"{share:.0%}" if share is not None else "n/a", startup.seams,
                    f"{p99:.2f} s" if p99 is not None else "n/a", mode,
                )  # fmt: skip
                if mode == "enforce":
                    self.gate.set_guarded(pool, replica, guard.guarded)
        self._arm_guard()

    # -- health -------------------------------------------------------------------------

    async def _check_replicas(self) -> None:
        """At start-up, before any client can fail on them: eject every replica whose
        TCP port refuses or does not accept within ``limits.upstream_connect_timeout_s``
        (the same test a session's connect makes; the background re-check restores it).
        Runs beside start-up, never blocking it; ``/readyz`` waits for it."""
        try:
            checks = [
                self._check_replica(pool.name, r.name, r.url)
                for pool in self.settings.pools
                for r in pool.replicas
            ]
            await asyncio.gather(*checks)
        finally:
            self.replicas_checked.set()

    async def _check_replica(self, pool: str, replica: str, url: str) -> None:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        timeout = self.settings.limits.upstream_connect_timeout_s
        try:
            sock = await open_tcp(host, port, clock=self.clock, timeout=timeout)
        except Unreachable as exc:
            log.warning(
                "replica %s/%s is unreachable at start-up (%s:%d: %s): ejected until its "
                "health check answers", pool, replica, host, port, exc,
            )  # fmt: skip
            with contextlib.suppress(LookupError):  # removed by a reload meanwhile
                self.gate.set_healthy(pool, replica, False)
            return
        sock.close()

    def _on_health_change(self, pool: str, replica: str, healthy: bool) -> None:
        key = (pool, replica)
        if not healthy and key not in self._rechecks and self.started:
            task = asyncio.ensure_future(self._recheck(pool, replica))
            self._rechecks[key] = task
            task.add_done_callback(lambda _t: self._rechecks.pop(key, None))

    async def _recheck(self, pool: str, replica: str) -> None:
        """Probe an ejected replica until it answers, then restore it."""
        interval = self.settings.health.recheck_interval_s
        url = self.http_url(pool, replica) + "/health"
        while True:
            await asyncio.sleep(interval)
            try:
                response = await self.http.get(url, timeout=min(interval, 5.0))
            except Exception as exc:
                # httpx errors, and whatever else the HTTP stack raises while a
                # connection is reset under it (the chaos soak found one): the probe
                # must outlive them all, or the replica would stay ejected for good.
                log.info("replica %s/%s still unreachable: %r", pool, replica, exc)
                continue
            if response.status_code < 500:
                self.gate.set_healthy(pool, replica, True)
                return
