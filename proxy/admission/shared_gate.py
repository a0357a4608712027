"""Admission shared by several gateway processes through Redis (``admission.backend: redis``).

:class:`SharedGate` offers what the relays and the runtime use of
:class:`~proxy.admission.gate.Gate` -- :meth:`admit` giving a
:class:`~proxy.admission.session_lease.Lease` or a
:class:`~proxy.admission.session_lease.Waiting`, idempotent release, drain, live pool
changes, health and guard, statistics -- but every slot and queue place is decided by
the atomic scripts of :mod:`proxy.admission.redis_backend`, so one cap per replica holds
over every gateway. What stays local: this gateway's configuration view (caps, health,
its own guard, retired replicas), its sessions, its waiters' futures and deadlines.

Safety rules:

* **Fail closed.** Any Redis failure refuses the new session with
  ``backend_unavailable`` (503); there is no per-process fallback.
* **Release always runs.** :meth:`Lease.release` is synchronous and idempotent; the
  Redis release runs in a task of the gate (retried until it lands or the lease has
  expired anyway), so a cancelled session task cannot skip it. A grant that arrives
  for a session already gone (cancelled during the acquire, or in the queue) is
  released the same way.
* **Self-fencing.** Leases are renewed every ``renew_interval_s``. If a pool's last
  successful renewal is older than ``lease_ttl_s - fence_margin_s`` on the monotonic
  clock, or Redis reports one of this gateway's leases gone, the gateway ends its own
  sessions (``on_backend_loss: close``, the default) before other gateways can reuse
  those slots; ``keep`` only logs and counts (the replica may then run over its cap).

:class:`SharedGate` implements :class:`~proxy.admission.interface.AdmissionGate`, the
interface the rest of the gateway holds.

Its jobs are modules of :mod:`proxy.admission`: the local state and the helpers every
job uses (:mod:`~proxy.admission.shared_state`), tenant quotas
(:mod:`~proxy.admission.shared_tenants`), renewal and fencing
(:mod:`~proxy.admission.shared_renewal`), wake-ups and queue deadlines
(:mod:`~proxy.admission.shared_wakeups`); this module is the asyncio shell that admits,
releases, fails over, changes pools live and answers queries, and builds the gate from
the settings.

Tenants: a session is admitted as the :class:`~proxy.admission.TenantSpec` passed to
:meth:`SharedGate.admit` (None: no key), and counted against the key's
``max_sessions`` over every gateway when a :class:`~proxy.admission.interface.TenantQuota`
is passed with it; the scripts apply the rules of
:mod:`proxy.admission.tenants` over every gateway (class, fair share, reserves,
``max_queued``, shedding). The ``headroom_tenant_*`` series count this gateway's own
sessions (sum them over gateways).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Collection, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from proxy.admission import (
    Admit,
    PoolStatistics,
    QueuePolicy,
    Reject,
    ReplicaSpec,
    ReplicaStatistics,
    Reserve,
    TenantSpec,
)
from proxy.admission.interface import FenceCallback, ReservationStore, SlotCallback, TenantQuota
from proxy.admission.lease_keeper import LeaseKeeper
from proxy.admission.redis_backend import BackendUnavailable, RedisAdmission, ReplicaView
from proxy.admission.redis_clients import SentinelNodes
from proxy.admission.retry_after import SessionLengths
from proxy.admission.session_lease import Lease, PositionCallback, Waiting
from proxy.admission.shared_renewal import SharedRenewal
from proxy.admission.shared_state import (
    EWMA_ALPHA,
    PoolState,
    ReplicaState,
    SharedAdmissionMetrics,
    SharedLease,
    SharedPoolSpec,
    SharedWaiting,
    WaiterState,
)
from proxy.admission.shared_wakeups import SharedWakeups
from proxy.clock import Clock
from proxy.errors import FallbackHint
from proxy.metrics import Metrics
from proxy.scrape_collectors import ReplicaGauges, TenantGauges

if TYPE_CHECKING:
    from proxy.admission.auth import TenantQuotas
    from proxy.settings import Settings

__all__ = [
    "FenceCallback",
    "SharedAdmissionMetrics",
    "SharedGate",
    "SharedLease",
    "SharedPoolSpec",
    "SharedWaiting",
    "build_shared_gate",
]

log = logging.getLogger("headroom.shared_gate")


class SharedGate(SharedRenewal, SharedWakeups):
    """Admission for every pool through one Redis, on one event loop."""

    def __init__(
        self,
        pools: Iterable[SharedPoolSpec],
        *,
        backend: RedisAdmission,
        clock: Clock,
        metrics: Metrics | None = None,
        renew_interval_s: float = 2.0,
        fence_margin_s: float = 1.0,
        lease_ttl_s: float = 10.0,
        on_backend_loss: Literal["close", "keep"] = "close",
        seed: int = 0,
        keeper: LeaseKeeper | None = None,
    ) -> None:
        if not 0 < renew_interval_s < lease_ttl_s - fence_margin_s:
            raise ValueError("need 0 < renew_interval_s < lease_ttl_s - fence_margin_s")
        self.backend = backend
        self.clock = clock
        self.metrics = metrics
        self.renew_interval_s = renew_interval_s
        self.fence_margin_s = fence_margin_s
        self.lease_ttl_s = lease_ttl_s
        self.on_backend_loss = on_backend_loss
        #: Renews the leases from a thread of its own while the event loop is late.
        self.keeper = keeper
        self._pools = {}
        self._reserves = {}
        self._healthy_listeners = []
        self._fence_listeners = []
        self._idle_waiters = []
        self._tasks = set()
        self._loops = []
        self._next = 0
        self._rng = random.Random(seed)
        self._recheck_interval_s = None
        #: When this gateway ejected each (pool, replica) it holds as unhealthy.
        self._ejected_at = {}
        #: Tenant reservations held in Redis: lease or waiter id -> tenant.
        self._tenants = {}
        self.draining = False
        #: Set by :meth:`stop` first: the background loops end at their next turn.
        self._closing = False
        self._stopped = False
        #: Whether the last call to Redis succeeded (``/readyz``).
        self.available = False
        self._metrics = SharedAdmissionMetrics(metrics.registry) if metrics else None
        if metrics is not None:
            metrics.bind_tenants(self.tenant_gauges)
        for spec in pools:
            self.apply_pool(spec.name, spec.replicas, spec.queue, spec.fallback,
                            session_estimate_s=spec.session_estimate_s,
                            reserves=spec.reserves)  # fmt: skip

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Start renewing and listening for wake-ups. Redis may be down: the gate then
        refuses with ``backend_unavailable`` until it answers."""
        try:
            await self.backend.ping()
            self._set_available(True)
        except BackendUnavailable as exc:
            log.error("shared admission store unreachable at start-up: %s", exc)
            self._set_available(False)
        self._loops.append(asyncio.ensure_future(self._renew_loop()))
        for name in self._pools:
            self._loops.append(asyncio.ensure_future(self._wake_loop(name)))
        if self.keeper is not None:
            self.keeper.start()

    async def stop(self) -> None:
        self._closing = True
        if self.keeper is not None:
            await asyncio.to_thread(self.keeper.stop)
        # Cancel the loops until they have ended, not once: on Python 3.11 a cancel
        # that lands just as a Redis command has been sent is lost (redis-py sends
        # through asyncio.wait_for, which then returns normally: CPython gh-86296), and
        # a loop that missed it went on renewing while this waited for it forever.
        loops = set(self._loops)
        while loops:
            for task in loops:
                task.cancel()
            _, loops = await asyncio.wait(loops, timeout=0.1)
        for task in self._loops:
            with contextlib.suppress(BaseException):
                task.result()
        self._loops.clear()
        self._stopped = True
        if self._tasks:  # releases still in flight: a last chance to land
            await asyncio.wait(set(self._tasks), timeout=self.backend.timeout_s * 3)
        for task in list(self._tasks):  # the rest lapse with their leases' TTL
            task.cancel()
        for p in self._pools.values():
            if p.fence_timer is not None:
                p.fence_timer.cancel()
        await self.backend.close()

    async def quiesce(self) -> None:
        """Wait for every Redis call this gate has started in the background (releases,
        renewals asked for by a configuration, health or guard change) to finish."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    # -- admission --------------------------------------------------------------------

    async def admit(
        self,
        pool: str,
        *,
        on_position: PositionCallback | None = None,
        queue: bool = True,
        tenant: TenantSpec | None = None,
        quota: TenantQuota | None = None,
    ) -> Lease | Waiting:
        """A :class:`Lease` if admitted at once, a :class:`Waiting` already in the
        Redis queue, or raises :class:`~proxy.errors.Refused`. Cancellation-safe: a
        slot or queue place taken by a call cancelled mid-flight is given back.
        ``queue=False``: a slot now or a refusal, never a queue place. ``tenant``: the
        session's key's scheduling identity (None: no key); ``quota``: the key's
        ``max_sessions``, counted in Redis over every gateway before the slot is asked
        for (past it: ``tenant_limit``)."""
        p = self._pool(pool)
        now = self.clock.now()
        view = self._open_view(p, now, tenant)
        waiter_id = self.new_id()
        if quota is not None:
            await self._reserve_tenant(p, waiter_id, quota, tenant)
        future: asyncio.Future[Admit | Reject] = asyncio.get_running_loop().create_future()
        # Registered before the call: a wake-up may arrive before the reply does.
        waiter = WaiterState(future, on_position, now, tenant=tenant)
        p.waiters[waiter_id] = waiter
        depth = p.queue.max_depth if p.queue.enabled and queue else 0
        call = asyncio.ensure_future(self.backend.acquire_as(pool, waiter_id, view, depth, tenant))
        try:
            got = await asyncio.shield(call)
        except asyncio.CancelledError:
            p.waiters.pop(waiter_id, None)
            self._spawn(self._give_back(pool, waiter_id, call))
            raise
        except BackendUnavailable as exc:
            p.waiters.pop(waiter_id, None)
            self._set_available(False)
            # The call may have run before its answer was lost: undo it if Redis lets us
            # (if not, the lease expires and the queue place lapses on their own).
            self._spawn(self._leave_remote(pool, waiter_id))
            self._drop_tenant(waiter_id)
            log.warning("refusing a session on %s: admission store unreachable (%s)", pool, exc)
            raise self._refuse(p, "backend_unavailable", 1, tenant) from None
        self._set_available(True)
        kind, value = got.kind, got.value
        if kind == "admit":
            p.waiters.pop(waiter_id, None)
            return self._lease(p, waiter_id, str(value), now, tenant)
        if kind == "queued":
            if future.done():  # handed a slot (or shed) before the reply arrived
                outcome = future.result()
                p.waiters.pop(waiter_id, None)
                if isinstance(outcome, Admit):
                    return self._lease(p, waiter_id, outcome.replica, now, tenant)
                self._drop_tenant(waiter_id)
                self._count(pool, "queued", tenant)
                self._count(pool, f"rejected_{outcome.reason}", tenant)
                raise self._refusal(p, outcome)
            waiter.queued = True
            waiter.position = int(value)
            waiter.timer = self.clock.call_at(
                now + p.queue.max_wait_s, lambda: self._on_deadline(pool, waiter_id)
            )
            self._count(pool, "queued", tenant)
            eta = self.estimate_wait(pool, waiter.position)
            if on_position is not None:
                on_position(waiter.position, eta)
            return SharedWaiting(self, pool, waiter_id, waiter.position, eta)
        p.waiters.pop(waiter_id, None)
        self._drop_tenant(waiter_id)
        if kind == "blocked":  # Redis lost its data: survivors are re-asserting
            p.blocked_until = max(p.blocked_until, self.clock.now() + int(value) / 1000)
            raise self._refuse(p, "backend_unavailable", int(value) / 1000, tenant)
        # Retry-After from where this key's session would have stood in the queue.
        raise self._refuse(p, str(value), self._estimate(p, got.position), tenant)

    def _open_view(self, p: PoolState, now: float, tenant: TenantSpec | None) -> list[ReplicaView]:
        """The replicas a new slot of ``p`` may go to; raises ``draining`` or
        ``no_healthy_replica`` (what :meth:`admit` and :meth:`hold` refuse before
        asking Redis)."""
        if self.draining or p.draining:
            raise self._refuse(p, "draining", 1, tenant)
        view = p.view()
        if not view:
            raise self._refuse(p, "no_healthy_replica", self._no_replica_wait(p, now), tenant)
        return view

    async def acquire(
        self,
        pool: str,
        *,
        on_position: PositionCallback | None = None,
        tenant: TenantSpec | None = None,
        quota: TenantQuota | None = None,
    ) -> Lease:
        entry = await self.admit(pool, on_position=on_position, tenant=tenant, quota=quota)
        if isinstance(entry, Lease):
            return entry
        return await entry.wait()

    async def take_now(self, pool: str, tenant: TenantSpec | None) -> Lease:
        """One slot of ``pool`` now, never a queue place: :meth:`admit` with
        ``queue=False`` (the scripts never let it pass a waiter of its class or above).
        Raises :class:`~proxy.errors.Refused`."""
        entry = await self.admit(pool, queue=False, tenant=tenant)
        assert isinstance(entry, Lease)
        return entry

    async def _wait(self, pool: str, waiter_id: str) -> Lease:
        p = self._pools[pool]
        waiter = p.waiters[waiter_id]
        try:
            outcome = await waiter.future
        except BaseException:
            self._leave(p, waiter_id)
            raise
        self._forget_waiter(p, waiter_id)
        self._observe_wait(p, waiter)
        if isinstance(outcome, Reject):
            self._drop_tenant(waiter_id)
            self._count(pool, f"rejected_{outcome.reason}", waiter.tenant)
            if outcome.reason != "queue_timeout":  # (a timed-out waiter has left already)
                self._spawn(self._leave_remote(pool, waiter_id))
            raise self._refusal(p, outcome)
        return self._lease(p, waiter_id, outcome.replica, waiter.arrived, waiter.tenant)

    def _lease(
        self,
        p: PoolState,
        lease_id: str,
        replica: str,
        arrived: float,
        tenant: TenantSpec | None = None,
    ) -> SharedLease:
        now = self.clock.now()
        lease = SharedLease(self, p.name, lease_id, replica, now - arrived, now, tenant)
        p.leases[lease_id] = lease
        if self.keeper is not None:
            self.keeper.hold(p.name, lease_id)
        if p.last_renewed is None:  # the grant itself proves the lease until now + TTL
            p.last_renewed = arrived
            self._arm_fence(p)
        self._count(p.name, "admitted", tenant)
        return lease

    def _release(self, lease: SharedLease) -> None:
        p = self._pools[lease.pool]
        p.leases.pop(lease.lease_id, None)
        if self.keeper is not None:
            self.keeper.drop(lease.pool, lease.lease_id)
        now = self.clock.now()
        duration = max(0.0, now - lease.admitted_at)
        p.session_estimate_s += EWMA_ALPHA * (duration - p.session_estimate_s)
        if p.lengths is None:
            p.lengths = SessionLengths(p.session_estimate_s)
        p.lengths.observe(duration)
        p.session_estimate_s = max(p.session_estimate_s, 0.05)
        if lease.tenant is not None and lease.tenant.name:
            key = (lease.tenant.name, lease.tenant.priority)
            p.finished[key] = p.finished.get(key, 0.0) + duration
        if self.metrics is not None:
            self.metrics.child(self.metrics.session_duration, lease.pool).observe(duration)
        self._spawn(self._release_remote(lease.pool, lease.lease_id))
        self._drop_tenant(lease.lease_id)
        if self._idle_waiters and self.active == 0:
            for future in self._idle_waiters:
                if not future.done():
                    future.set_result(None)

    def _leave(self, p: PoolState, waiter_id: str) -> None:
        """The waiter's task ended without taking its outcome (cancelled)."""
        waiter = self._forget_waiter(p, waiter_id)
        if waiter is None:
            return
        self._drop_tenant(waiter_id)
        self._count(p.name, "abandoned", waiter.tenant)
        if not waiter.future.done():
            self._observe_wait(p, waiter)
        if waiter.future.done() and not waiter.future.cancelled():
            if isinstance(waiter.future.result(), Admit):
                self._spawn(self._release_remote(p.name, waiter_id))
            return
        self._spawn(self._leave_remote(p.name, waiter_id))

    def _forget_waiter(self, p: PoolState, waiter_id: str) -> WaiterState | None:
        waiter = p.waiters.pop(waiter_id, None)
        if waiter is not None and waiter.timer is not None:
            waiter.timer.cancel()
        return waiter

    # -- gang reservations (proxy/admission/shared_reservations.py) --------------------

    def new_id(self) -> str:
        """A fresh lease id of this gateway (``<gateway>:<n>``)."""
        self._next += 1
        return f"{self.backend.gateway_id}:{self._next}"

    async def hold(self, pool: str, lease_id: str, hold_s: float, tenant: TenantSpec | None) -> str:
        """One slot of ``pool`` for a gang reservation, now or never, held ``hold_s`` in
        Redis without renewal (hold.lua): the decision :meth:`admit` with
        ``queue=False`` makes for a session of ``tenant``'s class. Returns the replica;
        raises :class:`~proxy.errors.Refused`."""
        p = self._pool(pool)
        view = self._open_view(p, self.clock.now(), tenant)
        try:
            got = await self.backend.hold(pool, lease_id, hold_s, view, tenant)
        except BackendUnavailable as exc:
            self._set_available(False)
            log.warning("refusing a reservation on %s: admission store unreachable (%s)",
                        pool, exc)  # fmt: skip
            raise self._refuse(p, "backend_unavailable", 1, tenant) from None
        self._set_available(True)
        if got.kind == "admit":
            return str(got.value)
        if got.kind == "blocked":
            raise self._refuse(p, "backend_unavailable", int(got.value) / 1000, tenant)
        raise self._refuse(p, str(got.value), self._estimate(p, got.position), tenant)

    async def adopt(
        self, pool: str, lease_id: str, tenant: TenantSpec | None, quota: str | None
    ) -> SharedLease | None:
        """A reserved slot a stage connection claimed here: confirmed in Redis (leave.lua
        extends a granted lease by one TTL and never grants anything), it becomes one of
        this gateway's leases, renewed and fenced like its sessions' and released when
        the session ends. ``quota``: the key whose ``max_sessions`` counts it (renewed
        with this gateway's tenant reservations, dropped with the lease). None if the
        lease lapsed; raises ``backend_unavailable``. Cancellation-safe."""
        p = self._pool(pool)
        since = self.clock.now()
        if quota is not None:
            self._tenants[lease_id] = quota
        call = asyncio.ensure_future(self.backend.leave(pool, lease_id, p.view()))
        try:
            kind, replica = await asyncio.shield(call)
        except asyncio.CancelledError:
            self._spawn(self._give_back(pool, lease_id, call))
            raise
        except BackendUnavailable as exc:
            self._set_available(False)
            self._drop_tenant(lease_id)
            self._spawn(self._release_remote(pool, lease_id))
            log.warning("refusing a reserved session on %s: admission store unreachable "
                        "(%s)", pool, exc)  # fmt: skip
            raise self._refuse(p, "backend_unavailable", 1, tenant) from None
        self._set_available(True)
        if kind != "granted" or replica is None:
            self._drop_tenant(lease_id)
            return None
        return self._lease(p, lease_id, replica, since, tenant)

    def background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` as one of the gate's background tasks (:meth:`quiesce` waits
        for it; :meth:`stop` gives it a last chance to land)."""
        self._spawn(work)

    def release_held(self, pool: str, lease_id: str) -> None:
        """Give back a reserved slot no session took, in the background (retried like a
        session's release; otherwise it lapses at the reservation's deadline)."""
        if pool in self._pools:
            self._spawn(self._release_remote(pool, lease_id))

    # -- failover before the first byte ----------------------------------------------

    async def _fail_over(self, lease: SharedLease, eject: bool, exclude: Collection[str]) -> bool:
        p = self._pools[lease.pool]
        if eject:
            self.set_healthy(lease.pool, lease.replica, False)
        try:
            kind, replica = await self.backend.relocate(
                lease.pool, lease.lease_id, lease.replica, p.view(), exclude=list(exclude)
            )
        except BackendUnavailable as exc:
            self._set_available(False)
            log.warning("failover of a session on %s not moved: admission store did not "
                        "answer (%s)", lease.pool, exc)  # fmt: skip
            return False
        if kind != "moved" or replica is None:
            return False
        lease.replica = replica
        return True

    # -- drain, configuration, health, guard --------------------------------------------

    def drain(self) -> None:
        self.draining = True
        for p in self._pools.values():
            self._refuse_waiters(p, "draining")

    def _refuse_waiters(self, p: PoolState, reason: str) -> None:
        for waiter in list(p.waiters.values()):
            if waiter.queued and not waiter.future.done():
                waiter.future.set_result(
                    Reject(
                        0, reason, self._estimate(p, 1), waited_s=self.clock.now() - waiter.arrived
                    )
                )

    async def wait_idle(self) -> None:
        if self.active == 0:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(future)
        try:
            await future
        finally:
            if future in self._idle_waiters:
                self._idle_waiters.remove(future)

    def set_healthy(self, pool: str, replica: str, healthy: bool) -> None:
        r = self._pool(pool).replicas.get(replica)
        if r is not None and r.healthy != healthy:
            log.warning("replica %s/%s is now %s", pool, replica,
                        "healthy" if healthy else "unhealthy")  # fmt: skip
            r.healthy = healthy
            if healthy:
                self._ejected_at.pop((pool, replica), None)
            else:
                self._ejected_at[(pool, replica)] = self.clock.now()
            self._poke(pool)
            for listener in self._healthy_listeners:
                listener(pool, replica, healthy)

    def set_guarded(self, pool: str, replica: str, guarded: bool) -> None:
        r = self._pool(pool).replicas.get(replica)
        if r is not None and r.guarded != guarded:
            r.guarded = guarded
            self._poke(pool)

    def set_cap(self, pool: str, replica: str, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"replica {replica!r}: cap must be >= 1 (got {cap})")
        self._pool(pool).replicas[replica].cap = cap
        self._poke(pool)

    def apply_pool(
        self,
        name: str,
        replicas: Sequence[ReplicaSpec],
        queue: QueuePolicy,
        fallback: FallbackHint | None,
        *,
        session_estimate_s: float = 20.0,
        reserves: Sequence[Reserve] | None = None,
    ) -> None:
        """Create a pool or change one live. Caps and reserves (None: unchanged) take
        effect for new admissions on every gateway at once (each gateway's calls carry
        its own view and reserves); running sessions are never cut."""
        if reserves is None:
            reserves = self._reserves.get(name, ())
        self._reserves[name] = tuple(reserves)
        self.backend.configure_pool(name, session_estimate_s=session_estimate_s, reserves=reserves)
        p = self._pools.get(name)
        if p is None:
            self._pools[name] = PoolState(
                name, {r.name: ReplicaState(r.max_sessions) for r in replicas}, queue, fallback,
                session_estimate_s,
            )  # fmt: skip
            if self._loops:
                self._loops.append(asyncio.ensure_future(self._wake_loop(name)))
            return
        p.fallback = fallback
        p.queue = queue
        if not self.draining:
            p.draining = False
        wanted = {r.name: r.max_sessions for r in replicas}
        for r_name, r in p.replicas.items():
            r.retired = r_name not in wanted
        for r_name, cap in wanted.items():
            existing = p.replicas.get(r_name)
            if existing is None:
                p.replicas[r_name] = ReplicaState(cap)
            else:
                existing.cap = cap
        self._poke(name)

    def retire_pool(self, name: str) -> None:
        p = self._pool(name)
        p.draining = True
        self._refuse_waiters(p, "draining")

    def on_health_change(self, listener: Callable[[str, str, bool], None]) -> None:
        self._healthy_listeners.append(listener)

    def set_recheck_interval(self, interval_s: float | None) -> None:
        """How often an ejected replica is re-checked (``health.recheck_interval_s``):
        a ``no_healthy_replica`` refusal advises retrying around the next re-check."""
        self._recheck_interval_s = interval_s

    def on_fence(self, listener: FenceCallback) -> None:
        self._fence_listeners.append(listener)

    def _poke(self, pool: str) -> None:
        """Renew now: hands freed capacity to waiters and publishes guard flags."""
        if self._loops:
            self._spawn(self._renew_pool(pool))

    # -- queries --------------------------------------------------------------------------

    def pools(self) -> list[str]:
        return list(self._pools)

    def fallback(self, pool: str) -> FallbackHint | None:
        return self._pool(pool).fallback

    def reserves(self, pool: str) -> tuple[Reserve, ...]:
        """The pool's reserves as this gateway sends them with every script call."""
        self._pool(pool)
        return self._reserves.get(pool, ())

    def statistics(self) -> dict[str, PoolStatistics]:
        """This gateway's view: its own sessions per replica (``active``) and waiters."""
        out = {}
        for name, p in self._pools.items():
            mine: dict[str, int] = {}
            for lease in p.leases.values():
                mine[lease.replica] = mine.get(lease.replica, 0) + 1
            out[name] = PoolStatistics(
                name=name,
                replicas=tuple(
                    ReplicaStatistics(
                        r_name, mine.get(r_name, 0), r.cap, r.healthy, r.guarded, r.retired
                    )
                    for r_name, r in p.replicas.items()
                ),
                queue_depth=self._queued(p),
                max_depth=p.queue.max_depth,
                max_wait_s=p.queue.max_wait_s,
                draining=p.draining or self.draining,
                session_estimate_s=p.session_estimate_s,
            )
        return out

    def held_per_replica(self, pool: str) -> dict[str, int]:
        """Sessions holding a slot per replica over every gateway, as of the last
        renewal."""
        return dict(self._pool(pool).held)

    @property
    def gateway_id(self) -> str:
        """This gateway's name in Redis (its lease and waiter ids start with it)."""
        return self.backend.gateway_id

    def reservation_store(
        self, clock: Clock, on_slot: SlotCallback, quotas: TenantQuotas | None
    ) -> ReservationStore:
        """Gang reservations in Redis, claimable on any gateway
        (:class:`~proxy.admission.shared_reservations.SharedReservations`); the key's
        quota is counted there, not in ``quotas``."""
        from proxy.admission.shared_reservations import SharedReservations

        return SharedReservations(self, clock, on_slot)

    @property
    def active(self) -> int:
        return sum(len(p.leases) for p in self._pools.values())

    @property
    def queued(self) -> int:
        return sum(self._queued(p) for p in self._pools.values())

    def replica_gauges(
        self,
        ratio: Callable[[str, str], float | None] | None = None,
        guarded: Callable[[str, str], bool] | None = None,
    ) -> list[ReplicaGauges]:
        out: list[ReplicaGauges] = []
        for name, stats in self.statistics().items():
            for r in stats.replicas:
                out.append(ReplicaGauges(
                    name, r.name, r.active, r.cap, r.healthy,
                    guarded(name, r.name) if guarded else r.guarded,
                    ratio(name, r.name) if ratio else None,
                ))  # fmt: skip
        return out

    def queue_depths(self) -> list[tuple[str, int]]:
        return [(name, self._queued(p)) for name, p in self._pools.items()]

    def tenant_gauges(self) -> list[TenantGauges]:
        """Per API key and pool, this gateway's part (sum over gateways): sessions
        active and queued, and session-seconds held (finished plus running so far), as
        :meth:`proxy.admission.gate.Gate.tenant_gauges` reports them in process."""
        out: list[TenantGauges] = []
        now = self.clock.now()
        for name, p in self._pools.items():
            counts: dict[tuple[str, int], list[int]] = {}
            held = dict(p.finished)
            for lease in p.leases.values():
                t = lease.tenant
                if t is not None and t.name:
                    key = (t.name, t.priority)
                    counts.setdefault(key, [0, 0])[0] += 1
                    held[key] = held.get(key, 0.0) + max(0.0, now - lease.admitted_at)
            for w in p.waiters.values():
                t = w.tenant
                if t is not None and t.name and w.queued and not w.future.done():
                    counts.setdefault((t.name, t.priority), [0, 0])[1] += 1
            for key in sorted(set(counts) | set(held)):
                active, queued = counts.get(key, [0, 0])
                out.append(TenantGauges(name, key[0], key[1], active, queued, held.get(key, 0.0)))
        return out

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{n} leases={len(p.leases)} waiters={self._queued(p)}" for n, p in self._pools.items()
        )
        state = " draining" if self.draining else ""
        return f"<SharedGate {self.backend.gateway_id}{state} [{inner}]>"


def build_shared_gate(settings: Settings, clock: Clock, metrics: Metrics | None) -> SharedGate:
    """The gate for ``admission.backend: redis``. Raises RuntimeError with what to do if
    the ``redis`` package is missing."""
    r = settings.admission.redis
    backend = RedisAdmission(
        r.url,
        key_prefix=r.key_prefix,
        lease_ttl_s=r.lease_ttl_s,
        heartbeat_ttl_s=r.renew_interval_s * 2.5,
        timeout_s=r.timeout_s,
        sentinel=None
        if r.sentinel is None
        else SentinelNodes.parse(r.sentinel.master, r.sentinel.nodes, r.sentinel.password),
    )
    gate = SharedGate(
        [
            SharedPoolSpec(
                p.name,
                tuple(ReplicaSpec(x.name, x.max_sessions) for x in p.replicas),
                QueuePolicy(p.queue.max_depth, p.queue.max_wait_s),
                p.fallback.as_hint() if p.fallback else None,
                p.session_estimate_s,
                tuple(Reserve(r.priority, r.slots, r.per_replica) for r in p.reserve),
            )
            for p in settings.pools
        ],
        backend=backend,
        clock=clock,
        metrics=metrics,
        renew_interval_s=r.renew_interval_s,
        fence_margin_s=r.fence_margin_s,
        lease_ttl_s=r.lease_ttl_s,
        on_backend_loss=settings.admission.on_backend_loss,
        keeper=_keeper(backend, r.renew_interval_s),
    )
    gate.set_recheck_interval(settings.health.recheck_interval_s)
    return gate


def _keeper(backend: RedisAdmission, interval_s: float) -> LeaseKeeper:
    renewer = backend.lease_renewer()
    return LeaseKeeper(renewer.keep, interval_s=interval_s, close=renewer.close)
