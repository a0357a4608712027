"""Everything one running gateway shares: settings, gate, metrics, tenants' quotas,
per-replica signals and meters, the list of live sessions (for drain), and live reload.

It composes the parts that run on their own: :class:`~proxy.upstreams.Upstreams` (the
upstream HTTP client, health checks and re-checks, engine scraping) and
:class:`~proxy.admission.guard.GuardLoop` (the guard's evaluation loop). The session relays see
only :class:`~proxy.relay.services.RelayServices`, which this class provides (the
upstream members delegate to :attr:`Runtime.upstreams`).

Built from a validated :class:`~proxy.settings.Settings`; started and stopped by the
ASGI lifespan of :mod:`proxy.app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from proxy.admission import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    PoolCore,
    QueuePolicy,
    ReplicaSpec,
    Reserve,
)
from proxy.admission.auth import NO_KEY, Authorization, TenantQuotas, authenticate, tenant_spec
from proxy.admission.gate import Gate
from proxy.admission.gate_common import count_decision
from proxy.admission.guard import GuardLoop, GuardPolicy
from proxy.admission.interface import AdmissionGate, TenantQuota
from proxy.admission.reconcile import EngineReconciler
from proxy.admission.reservations import Reservations
from proxy.admission.shared_gate import build_shared_gate
from proxy.client_request import ClientRequest
from proxy.clock import Clock, LoopClock
from proxy.errors import Refused
from proxy.metering.adapters import AudioFormat, HttpAdapter, WsAdapter, http_adapter, ws_adapter
from proxy.metering.loop_lateness import LoopWatch
from proxy.metering.rolling import ReplicaSignals
from proxy.metering.series import Metrics
from proxy.metering.session_meter import PrometheusReplicaSink, SessionMeter
from proxy.pool_headroom import headroom_of
from proxy.settings import GuardSettings, PoolSettings, RouteSettings, Settings
from proxy.tracing import SessionTracer, make_tracer
from proxy.upstreams import Upstreams

if TYPE_CHECKING:
    import httpx

__all__ = ["Runtime", "build_admission_gate", "build_gate"]

log = logging.getLogger("headroom.runtime")

StopSession = Callable[[int, str], None]


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


def guard_policy(g: GuardSettings) -> GuardPolicy:
    """The :class:`~proxy.admission.guard.GuardPolicy` the ``guard`` settings describe."""
    return GuardPolicy(
        g.threshold, g.hysteresis, g.hold_s, g.min_samples,
        max_startup_stall_share=g.startup_stall_share, ttfa_p99_s=g.ttfa_p99_s,
        startup_min_streams=g.startup_min_streams,
    )  # fmt: skip


def _pool_specs(pool: PoolSettings) -> tuple[list[ReplicaSpec], QueuePolicy]:
    return (
        [ReplicaSpec(r.name, r.max_sessions) for r in pool.replicas],
        QueuePolicy(pool.queue.max_depth, pool.queue.max_wait_s),
    )


def build_gate(settings: Settings, clock: Clock, metrics: Metrics | None) -> Gate:
    """The in-process gate (``admission.backend: memory``) over every configured pool, each core
    seeded by its position in the configuration."""
    return Gate(
        [_core(p, seed=i) for i, p in enumerate(settings.pools)],
        clock=clock,
        metrics=metrics,
        fallbacks={p.name: p.fallback.as_hint() if p.fallback else None for p in settings.pools},
        recheck_interval_s=settings.health.recheck_interval_s,
    )


def build_admission_gate(
    settings: Settings, clock: Clock, metrics: Metrics | None
) -> AdmissionGate:
    """The gate ``admission.backend`` names: in process (``memory``) or shared through
    Redis (``redis``). The one place that chooses; everything else holds the
    :class:`~proxy.admission.interface.AdmissionGate` it returns."""
    if settings.admission.backend == "redis":
        return build_shared_gate(settings, clock, metrics)
    return build_gate(settings, clock, metrics)


class Runtime:
    """The shared state of one gateway process (one event loop)."""

    def __init__(
        self, settings: Settings, *, clock: Clock | None = None, metrics: Metrics | None = None
    ) -> None:
        self.settings = settings
        self.clock: Clock = clock or LoopClock()
        self.metrics = metrics or Metrics(settings.meter.chunk_durations_s)
        self.gate: AdmissionGate = build_admission_gate(settings, self.clock, self.metrics)
        self.signals: dict[tuple[str, str], ReplicaSignals] = {}
        self.tenants = TenantQuotas()
        self._reservations: Reservations | None = None
        self._sinks: dict[tuple[str, str], PrometheusReplicaSink] = {}
        self._routes: dict[str, RouteSettings] = {}
        self._formats: dict[str, AudioFormat] = {}
        self.upstreams = Upstreams(settings, self.gate, self.clock, metrics=self.metrics)
        #: Streams the engines run that this gateway's pools did not admit (opt-in caps).
        self.reconcile = EngineReconciler(self.gate, self.clock, settings)
        self.upstreams.on_scrape(self._on_engine_scrape)
        self.guard = GuardLoop(self.gate, self.clock, self.signals)
        self.loop_watch = LoopWatch(self.metrics.registry)
        #: Session traces (proxy.tracing); None while tracing is off. Read at start-up:
        #: a reload does not change it.
        self.tracer: SessionTracer | None = (
            make_tracer(settings.tracing) if settings.tracing.enabled else None
        )
        self._apply_settings(settings)
        #: Every relaying session's stop, with the pool its lease is in.
        self._sessions: dict[StopSession, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started = False
        self.metrics.bind_state(self._replica_gauges, self.gate.queue_depths)
        self.metrics.bind_headroom(lambda: headroom_of(self))
        self.gate.on_fence(self._on_lease_loss)

    def _apply_settings(self, settings: Settings) -> None:
        self.settings = settings
        configured = [(p.name, r.name) for p in settings.pools for r in p.replicas]
        for key in configured:
            if key not in self.signals:
                self.signals[key] = ReplicaSignals(settings.meter.window_s)
        self.upstreams.apply(settings)
        self.guard.configure(guard_policy(settings.guard), settings.guard.mode, configured)
        self._routes = {r.path: r for r in settings.routes}
        self._formats = {
            r.path: AudioFormat(
                r.audio.sample_rate,
                r.audio.channels,
                r.audio.sample_width,
                tokens_per_second=r.tokens_per_audio_second,
            )
            for r in settings.routes
        }

    def apply(self, settings: Settings) -> list[str]:
        """Apply a reloaded configuration live; returns what changed, in words.

        Caps, queue limits, replicas (added or retired), pools, routes, limits, meter and
        guard settings take effect for new sessions at once; running sessions are never
        cut. ``listen`` and ``admin`` addresses need a restart (reported, not applied: the
        running ones are kept in :attr:`settings`, so it always says what runs); the admin
        key applies at once (logged at warning)."""
        old = self.settings
        changes: list[str] = []
        admin = settings.admin.model_copy(
            update={f: getattr(old.admin, f) for f in ("enabled", "host", "port")}
        )
        if settings.listen != old.listen or admin != settings.admin:
            changes.append("listen/admin address changes need a restart: not applied")
        if admin.api_key_sha256 != old.admin.api_key_sha256:
            done = "changed" if admin.api_key_sha256 and old.admin.api_key_sha256 else (
                "set" if admin.api_key_sha256 else "removed")  # fmt: skip
            changes.append(f"admin key {done}")
            log.warning("admin key %s by a reload; it applies to the next admin request", done)
        settings = settings.model_copy(update={"listen": old.listen, "admin": admin})
        old_pools = {p.name: p for p in old.pools}
        self.reconcile.configure(settings)
        for pool in settings.pools:
            replicas, queue = _pool_specs(pool)
            replicas = self.reconcile.specs(pool.name, replicas)
            if old_pools.get(pool.name) != pool:
                changes.append(f"pool {pool.name}: " + (
                    "updated" if pool.name in old_pools else "added"))  # fmt: skip
            hint = pool.fallback.as_hint() if pool.fallback else None
            self.gate.apply_pool(
                pool.name, replicas, queue, hint,
                session_estimate_s=pool.session_estimate_s, reserves=_reserves(pool),
            )  # fmt: skip
        for name in old_pools.keys() - {p.name for p in settings.pools}:
            self.gate.retire_pool(name)
            changes.append(f"pool {name}: removed (running sessions finish)")
        if settings.routes != old.routes:
            changes.append("routes updated")
        if settings.admission != old.admission:
            changes.append("admission backend changes need a restart: not applied")
        for section in (
            "limits",
            "forwarded",
            "meter",
            "guard",
            "health",
            "auth",
            "pipelines",
            "drain_timeout_s",
        ):
            if getattr(settings, section) != getattr(old, section):
                changes.append(f"{section} updated")
        self._apply_settings(settings)
        self.gate.set_recheck_interval(settings.health.recheck_interval_s)
        return changes

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Start the loop-lateness watch, the gate, the upstream checks and scrapes, then the guard;
        :meth:`ready` reports ready only after this."""
        self.loop_watch.start()
        await self.gate.start()
        await self.upstreams.start()
        self.started = True
        self.guard.start()

    async def stop(self) -> None:
        """Stop the loop-lateness watch, the guard, the background tasks (cancelled and awaited),
        the upstream checks and the gate, then flush the tracer's buffered spans (in a thread)."""
        self.loop_watch.stop()
        self.guard.stop()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.upstreams.stop()
        await self.gate.stop()
        if self.tracer is not None:  # exports what is buffered: off the event loop
            await asyncio.to_thread(self.tracer.shutdown)
        self.started = False

    @property
    def http(self) -> httpx.AsyncClient:
        """The upstream HTTP client (:attr:`Upstreams.http`)."""
        return self.upstreams.http

    @property
    def replicas_checked(self) -> asyncio.Event:
        """Set once the start-up reachability check of every replica has finished."""
        return self.upstreams.replicas_checked

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a background coroutine, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- sessions -------------------------------------------------------------------

    def register_session(self, stop: StopSession, pool: str) -> None:
        """A session relaying on a lease of ``pool`` (its ``lease.pool``): a drain ends
        it, and so does a fence of that pool."""
        self._sessions[stop] = pool

    def unregister_session(self, stop: StopSession) -> None:
        """Forget a session :meth:`register_session` recorded (idempotent)."""
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
        """Ask every relaying session (of ``pool`` only, if given) to close with
        ``code``; returns how many."""
        sessions = [s for s, of in self._sessions.items() if pool is None or of == pool]
        for stop in sessions:
            stop(code, reason)
        return len(sessions)

    @property
    def live_sessions(self) -> int:
        """Sessions relaying now (registered and not yet unregistered)."""
        return len(self._sessions)

    # -- routing and upstreams --------------------------------------------------------

    def route_for(self, path: str) -> RouteSettings | None:
        """The route configured for the request path ``path`` (exact match), or None."""
        return self._routes.get(path)

    def ws_url(self, pool: str, replica: str) -> str:
        """The replica's WebSocket base URL (its ``url`` with ``ws``/``wss``); raises KeyError for a
        replica not configured."""
        return self.upstreams.ws_url(pool, replica)

    def http_url(self, pool: str, replica: str) -> str:
        """The replica's configured base ``url``; raises KeyError for a replica not configured."""
        return self.upstreams.http_url(pool, replica)

    def authorize(self, request: ClientRequest, pool: str) -> Authorization:
        """Check the client's key for ``pool`` and reserve one session of its quota.
        Returns the session's :class:`~proxy.admission.auth.Authorization`: its ``token`` for
        :meth:`release_tenant` (call it on every exit path), and the tenant and quota
        the lifecycle passes to the gate's ``admit``. Raises Unauthorized / Forbidden /
        TenantLimitRefused. Runs before the gate."""
        key = authenticate(self.settings.auth, request, pool)
        if key is None:
            return NO_KEY
        # Past max_sessions only one of the key's own sessions ending helps.
        own = self.gate.tenant_wait(pool, key.name)
        estimate = self.gate.estimate_wait(pool, 1) if own is None else own
        retry = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, estimate))
        tenant = tenant_spec(key)
        try:
            # A stage connection claiming a reserved slot takes over the count the slot
            # holds (its reservation was checked against max_sessions).
            claims = bool(request.reservation_tokens)
            token = self.tenants.reserve(key, pool, retry, enforce=not claims)
        except Refused:
            count_decision(self.metrics, pool, "rejected_tenant_limit", tenant)
            raise
        # The gate admits the session as the key's tenant (class, weight, ...); a shared
        # gate counts the quota over every gateway too (the count above is this
        # process's part).
        quota = None if key.max_sessions is None else TenantQuota(key.name, key.max_sessions)
        return Authorization(token, tenant, quota, key)

    def release_tenant(self, token: str | None) -> None:
        """Give back the key's session count :meth:`authorize` took (``token`` None: nothing was
        counted). Once per token."""
        self.tenants.release(token)

    @property
    def reservations(self) -> Reservations:
        """This gateway's gang reservations (:mod:`proxy.admission.reservations`), made on first
        use (their metric families then follow the others in the exposition)."""
        if self._reservations is None:
            self._reservations = Reservations(
                self.gate, self.clock, self.metrics.registry, quotas=self.tenants,
                limits=lambda: self.settings.reservations,
            )  # fmt: skip
        return self._reservations

    def upstream_error(self, pool: str, replica: str, kind: str) -> None:
        """Count one upstream failure of ``kind`` on the replica
        (``headroom_upstream_errors_total``)."""
        self.metrics.upstream_errors.labels(pool, replica, kind).inc()

    def ready(self) -> tuple[bool, str]:
        """``/readyz``: whether this gateway should receive sessions, and why. With
        ``readiness: self`` only this process counts (listening, configuration loaded,
        not draining); with ``upstream`` (the default) so does :meth:`upstream_ready`."""
        if self.gate.draining:
            return False, "draining"
        if not self.started:
            return False, "starting"
        ok, why = self.upstream_ready()
        if self.settings.readiness == "self":
            return True, "ready" if ok else f"ready; upstream: {why}"
        return ok, why

    def upstream_ready(self) -> tuple[bool, str]:
        """Whether the admission backend and at least one replica can take a session."""
        if not self.gate.available:
            return False, "admission backend unavailable"
        blocked = self.gate.grants_blocked_s()
        if blocked > 0:
            return False, (
                f"admission grants blocked for {blocked:.1f} s more: the admission "
                "store lost its data and gateways are re-asserting their sessions"
            )
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

    def replica_sink(self, pool: str, replica: str) -> PrometheusReplicaSink:
        """The replica's Prometheus sink, shared by its sessions' meters; made on first use."""
        return self._sink(pool, replica)

    def new_meter(
        self, pool: str, replica: str, admitted_at: float, arrived_at: float | None = None
    ) -> SessionMeter:
        """A meter for one session on the replica, admitted at ``admitted_at`` (``arrived_at``: when
        it reached the gateway, before any queue wait; None: at admission), reporting to the
        replica's sink."""
        return SessionMeter(
            admitted_at, self._sink(pool, replica), prebuffer_s=self.settings.meter.prebuffer_s,
            arrived_at=arrived_at,
        )  # fmt: skip

    def ws_adapter(self, route: RouteSettings, meter: SessionMeter) -> WsAdapter:
        """The audio adapter metering one WebSocket session of ``route`` into ``meter``."""
        return ws_adapter(route.protocol, meter, self._formats[route.path], route.inner_protocol)

    def http_adapter(self, route: RouteSettings, meter: SessionMeter) -> HttpAdapter:
        """The audio adapter metering one streaming HTTP exchange of ``route`` into ``meter``."""
        return http_adapter(route.protocol, meter, self._formats[route.path])

    def delivery_ratio_worst_1pct(self, pool: str, replica: str) -> float | None:
        """The replica's rolling worst-1% per-chunk delivery ratio now (None while its window holds
        no chunk, or for a replica not metered)."""
        signals = self.signals.get((pool, replica))
        return signals.worst_ratio(self.clock.now()) if signals else None

    def _replica_gauges(self) -> list[Any]:
        gauges = self.gate.replica_gauges(self.delivery_ratio_worst_1pct, self.guard.guarded)
        engine = self.upstreams.engine
        if not engine:
            return gauges
        out = []
        for g in gauges:
            figures = engine.get((g.pool, g.replica))
            if figures is not None:
                unadmitted = self.reconcile.unadmitted(g.pool, g.replica)
                g = replace(g, engine_waiting=figures[0], engine_running=figures[1],
                            engine_kv_usage=figures[2], engine_unadmitted=unadmitted)  # fmt: skip
            out.append(g)
        return out

    def _on_engine_scrape(self, pool: str, replica: str, figures: Any) -> None:
        """An engine scrape: requests in the engine (running + waiting) to reconcile."""
        self.reconcile.observe(pool, replica, None if figures is None else figures[0] + figures[1])

    def explain_refusal(self, refusal: Refused) -> Refused:
        """``refusal``, its message extended when the engine runs streams Headroom did not admit
        (:meth:`~proxy.admission.reconcile.EngineReconciler.explain`)."""
        return self.reconcile.explain(refusal)
