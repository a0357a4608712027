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
interface the rest of the gateway holds. It is built of parts it holds, each a class
of its own module with its own state:

* ``store`` (:class:`~proxy.admission.shared_store.SharedStore`): the Redis backend,
  the clock, this gateway's pools (:class:`~proxy.admission.shared_state.PoolState`:
  configuration view, leases, waiters, Retry-After model), background tasks and loops,
  availability, the drain and stop flags;
* ``tenants`` (:class:`~proxy.admission.shared_tenants.SharedTenants`): the key quota
  entries held in Redis;
* ``renewal`` (:class:`~proxy.admission.shared_renewal.SharedRenewal`): renewal,
  fencing, the fence listeners, the lease keeper;
* ``wakeups`` (:class:`~proxy.admission.shared_wakeups.SharedWakeups`): the wake loops
  and queue deadlines;
* ``changes`` (:class:`~proxy.admission.shared_pools.SharedPoolChanges`): live pool,
  health and guard changes, the drain, the health listeners;
* ``views`` (:class:`~proxy.admission.shared_views.SharedViews`): the read side;
* ``sessions`` (:class:`~proxy.admission.shared_sessions.SharedSessions`): admitting,
  releasing and failing over sessions, gang reservations' slots, the withdrawals and
  the callers of ``wait_idle``.

This module is the gate's life (start, stop, quiesce) and its one face: each method
of the interface hands over to the part that owns it. It also builds the gate from
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
import sys
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from proxy.admission import (
    PoolStatistics,
    QueuePolicy,
    ReplicaSpec,
    Reserve,
    TenantSpec,
    gate_common,
)
from proxy.admission.interface import (
    FenceCallback,
    ReservationStore,
    SlotCallback,
    TenantQuota,
)
from proxy.admission.lease_keeper import Keeper, LeaseKeeper
from proxy.admission.redis_backend import BackendUnavailable, RedisAdmission
from proxy.admission.redis_clients import SentinelNodes
from proxy.admission.session_lease import Lease, PositionCallback, Waiting
from proxy.admission.shared_pools import SharedPoolChanges
from proxy.admission.shared_renewal import SharedRenewal
from proxy.admission.shared_sessions import SharedSessions
from proxy.admission.shared_state import (
    SharedAdmissionMetrics,
    SharedLease,
    SharedPoolSpec,
    SharedWaiting,
)
from proxy.admission.shared_store import SharedStore
from proxy.admission.shared_tenants import SharedTenants
from proxy.admission.shared_views import SharedViews
from proxy.admission.shared_wakeups import SharedWakeups
from proxy.admission.shared_withdrawals import Withdrawals
from proxy.clock import Clock
from proxy.errors import FallbackHint
from proxy.metering.scrape import ReplicaGauges, TenantGauges
from proxy.metering.series import Metrics

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


class SharedGate:
    """Admission for every pool through one Redis, on one event loop (module
    docstring: its parts)."""

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
        keeper: Keeper | None = None,
    ) -> None:
        if not 0 < renew_interval_s < lease_ttl_s - fence_margin_s:
            raise ValueError("need 0 < renew_interval_s < lease_ttl_s - fence_margin_s")
        self.backend = backend
        self.clock = clock
        self.metrics = metrics
        #: Renews the leases while the event loop is late: a process of its own
        #: (:mod:`proxy.admission.keeper_process`), or a thread.
        self.keeper = keeper
        self.store = SharedStore(backend, clock, metrics, lease_ttl_s)
        self.tenants = SharedTenants(self.store)
        self.renewal = SharedRenewal(
            self.store, self.tenants, keeper=keeper, renew_interval_s=renew_interval_s,
            fence_margin_s=fence_margin_s, on_backend_loss=on_backend_loss,
        )  # fmt: skip
        self.wakeups = SharedWakeups(self.store)
        self.changes = SharedPoolChanges(self.store, self.renewal, self.wakeups, seed)
        self.views = SharedViews(self.store)
        self.sessions = SharedSessions(
            self.store, self.tenants, self.renewal, self.wakeups, self.changes, keeper
        )
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
        store = self.store
        try:
            await self.backend.ping()
            store.set_available(True)
        except BackendUnavailable as exc:
            log.error("shared admission store unreachable at start-up: %s", exc)
            store.set_available(False)
        store.loops.append(asyncio.ensure_future(self.renewal.loop()))
        for name in store.pools:
            store.loops.append(asyncio.ensure_future(self.wakeups.loop(name)))
        if self.keeper is not None:
            self.keeper.start()

    async def stop(self) -> None:
        """Stop the lease keeper and the background loops, give releases still in flight a last
        chance (three Redis timeouts) and close the connection. Leases not released by then lapse
        with their TTL."""
        store = self.store
        store.closing = True
        if self.keeper is not None:
            await asyncio.to_thread(self.keeper.stop)
        # Cancel the loops until they have ended, not once: on Python 3.11 a cancel
        # that lands just as a Redis command has been sent is lost (redis-py sends
        # through asyncio.wait_for, which then returns normally: CPython gh-86296), and
        # a loop that missed it went on renewing while this waited for it forever.
        loops = set(store.loops)
        while loops:
            for task in loops:
                task.cancel()
            _, loops = await asyncio.wait(loops, timeout=0.1)
        for task in store.loops:
            with contextlib.suppress(BaseException):
                task.result()
        store.loops.clear()
        store.stopped = True
        if store.tasks:  # releases still in flight: a last chance to land
            await asyncio.wait(set(store.tasks), timeout=self.backend.timeout_s * 3)
        for task in list(store.tasks):  # the rest lapse with their leases' TTL
            task.cancel()
        for p in store.pools.values():
            if p.fence_timer is not None:
                p.fence_timer.cancel()
        await self.backend.close()

    async def quiesce(self) -> None:
        """Wait for every Redis call this gate has started in the background (releases,
        the renewal round in flight, renewals asked for by a configuration, health or guard
        change) to finish."""
        while self.store.tasks:
            await asyncio.wait(set(self.store.tasks))

    def background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` as one of the gate's background tasks (:meth:`quiesce` waits
        for it; :meth:`stop` gives it a last chance to land)."""
        self.store.spawn(work)

    async def renew(self) -> None:
        """One renewal tick of every pool (:meth:`SharedRenewal.renew`)."""
        await self.renewal.renew()

    # -- admission ------------------------------------------------------------------

    async def admit(
        self,
        pool: str,
        *,
        on_position: PositionCallback | None = None,
        queue: bool = True,
        tenant: TenantSpec | None = None,
        quota: TenantQuota | None = None,
        max_wait_s: float | None = None,
    ) -> Lease | Waiting:
        """:meth:`SharedSessions.admit`: a slot or a queue place in Redis."""
        return await self.sessions.admit(pool, on_position=on_position, queue=queue,
                                         tenant=tenant, quota=quota,
                                         max_wait_s=max_wait_s)  # fmt: skip

    async def acquire(
        self,
        pool: str,
        *,
        on_position: PositionCallback | None = None,
        tenant: TenantSpec | None = None,
        quota: TenantQuota | None = None,
    ) -> Lease:
        return await gate_common.acquire(
            self, pool, on_position=on_position, tenant=tenant, quota=quota
        )

    async def take_now(self, pool: str, tenant: TenantSpec | None) -> Lease:
        """One slot of ``pool`` now, never a queue place: :meth:`admit` with
        ``queue=False`` (the scripts never let it pass a waiter of its class or above)."""
        return await gate_common.take_now(self, pool, tenant)

    @property
    def draining(self) -> bool:
        """Set by :meth:`drain`: everything new is refused."""
        return self.store.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.store.draining = value

    def drain(self) -> None:
        self.changes.drain()

    async def wait_idle(self) -> None:
        await self.sessions.idle.wait()

    @property
    def withdrawals(self) -> Withdrawals:
        """Ids whose acquire or hold was given up on (:attr:`SharedSessions.withdrawals`)."""
        return self.sessions.withdrawals

    # -- gang reservations' slots (proxy/admission/shared_reservations.py) ----------------

    def new_id(self) -> str:
        """A fresh lease id of this gateway (:meth:`SharedStore.new_id`)."""
        return self.store.new_id()

    async def hold(self, pool: str, lease_id: str, hold_s: float, tenant: TenantSpec | None) -> str:
        """:meth:`SharedSessions.hold`: a gang reservation's slot held in Redis; returns the
        replica."""
        return await self.sessions.hold(pool, lease_id, hold_s, tenant)

    async def adopt(
        self, pool: str, lease_id: str, tenant: TenantSpec | None, quota: str | None
    ) -> SharedLease | None:
        """:meth:`SharedSessions.adopt`: a claimed reserved slot becomes this gateway's lease (None
        if it lapsed)."""
        return await self.sessions.adopt(pool, lease_id, tenant, quota)

    def release_held(self, pool: str, lease_id: str) -> None:
        """:meth:`SharedSessions.release_held`: a reserved slot nobody took, given back in the
        background."""
        self.sessions.release_held(pool, lease_id)

    def reservation_store(
        self, clock: Clock, on_slot: SlotCallback, quotas: TenantQuotas | None
    ) -> ReservationStore:
        """Gang reservations in Redis, claimable on any gateway
        (:class:`~proxy.admission.shared_reservations.SharedReservations`); the key's
        quota is counted there, not in ``quotas``."""
        from proxy.admission.shared_reservations import SharedReservations

        return SharedReservations(self, clock, on_slot)

    # -- configuration, health, guard, fencing -----------------------------------------

    def apply_pool(
        self,
        name: str,
        replicas: Sequence[ReplicaSpec],
        queue: QueuePolicy,
        fallback: FallbackHint | None,
        *,
        session_estimate_s: float = 20.0,
        reserves: Sequence[Reserve] = (),
    ) -> None:
        self.changes.apply_pool(name, replicas, queue, fallback,
                                session_estimate_s=session_estimate_s,
                                reserves=reserves)  # fmt: skip

    def retire_pool(self, name: str) -> None:
        self.changes.retire_pool(name)

    def set_healthy(self, pool: str, replica: str, healthy: bool) -> None:
        self.changes.set_healthy(pool, replica, healthy)

    def set_guarded(self, pool: str, replica: str, guarded: bool) -> None:
        self.changes.set_guarded(pool, replica, guarded)

    def set_cap(self, pool: str, replica: str, cap: int) -> None:
        self.changes.set_cap(pool, replica, cap)

    def set_recheck_interval(self, interval_s: float) -> None:
        self.changes.set_recheck_interval(interval_s)

    def on_health_change(self, listener: Callable[[str, str, bool], None]) -> None:
        self.changes.on_health_change(listener)

    def on_fence(self, listener: FenceCallback) -> None:
        self.renewal.fence_listeners.append(listener)

    # -- queries ----------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.store.available

    @property
    def gateway_id(self) -> str:
        return self.views.gateway_id

    @property
    def active(self) -> int:
        return self.views.active

    @property
    def queued(self) -> int:
        return self.views.queued

    def grants_blocked_s(self) -> float:
        return self.renewal.grants_blocked_s()

    def pools(self) -> list[str]:
        return self.views.pools()

    def fallback(self, pool: str) -> FallbackHint | None:
        return self.views.fallback(pool)

    def reserves(self, pool: str) -> tuple[Reserve, ...]:
        return self.views.reserves(pool)

    def estimate_wait(self, pool: str, position: int) -> float:
        """:meth:`PoolState.wait_s <proxy.admission.shared_state.PoolState.wait_s>`."""
        return self.store.pool(pool).wait_s(position, self.clock.now())

    def tenant_wait(self, pool: str, name: str) -> float | None:
        return self.store.pool(pool).tenant_wait(name, self.clock.now())

    def statistics(self) -> dict[str, PoolStatistics]:
        return self.views.statistics()

    def held_per_replica(self, pool: str) -> dict[str, int]:
        return self.views.held_per_replica(pool)

    def replica_gauges(
        self,
        ratio: Callable[[str, str], float | None] | None = None,
        guarded: Callable[[str, str], bool] | None = None,
    ) -> list[ReplicaGauges]:
        return self.views.replica_gauges(ratio, guarded)

    def tenant_gauges(self) -> list[TenantGauges]:
        return self.views.tenant_gauges()

    def queue_depths(self) -> list[tuple[str, int]]:
        return self.views.queue_depths()

    def __repr__(self) -> str:
        return self.views.describe()


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
        keeper=_keeper(settings, backend),
    )
    gate.set_recheck_interval(settings.health.recheck_interval_s)
    return gate


def _keeper(settings: Settings, backend: RedisAdmission) -> Keeper:
    """A keeper process where the platform allows (Linux), else the thread keeper."""
    from proxy.admission.keeper_process import (
        KeeperConfig,
        ProcessKeeper,
        process_keeper_supported,
    )

    r = settings.admission.redis
    if process_keeper_supported():
        return ProcessKeeper(
            KeeperConfig(
                r.url,
                r.key_prefix,
                r.lease_ttl_s,
                r.timeout_s,
                r.renew_interval_s,
                r.fence_margin_s,
                None
                if r.sentinel is None
                else SentinelNodes.parse(r.sentinel.master, r.sentinel.nodes, r.sentinel.password),
            )
        )
    log.info("lease keeper: a thread (no keeper process on %s)", sys.platform)
    renewer = backend.lease_renewer()
    return LeaseKeeper(renewer.keep, interval_s=r.renew_interval_s, close=renewer.close)
