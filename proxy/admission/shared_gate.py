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
(:mod:`~proxy.admission.shared_wakeups`), live pool changes and the drain
(:mod:`~proxy.admission.shared_pools`), the read side
(:mod:`~proxy.admission.shared_views`), admitting, releasing and failing over sessions
(:mod:`~proxy.admission.shared_sessions`); this module is the gate's life (start,
stop, quiesce, wait for idle) and builds it from the settings.

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
import sys
from collections.abc import Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Literal

from proxy.admission import QueuePolicy, ReplicaSpec, Reserve
from proxy.admission.interface import FenceCallback, ReservationStore, SlotCallback
from proxy.admission.lease_keeper import Keeper, LeaseKeeper
from proxy.admission.redis_backend import BackendUnavailable, RedisAdmission
from proxy.admission.redis_clients import SentinelNodes
from proxy.admission.shared_sessions import SharedSessions
from proxy.admission.shared_state import (
    SharedAdmissionMetrics,
    SharedLease,
    SharedPoolSpec,
    SharedWaiting,
)
from proxy.admission.shared_withdrawals import Withdrawals
from proxy.clock import Clock
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


class SharedGate(SharedSessions):
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
        keeper: Keeper | None = None,
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
        #: Renews the leases while the event loop is late: a process of its own
        #: (:mod:`proxy.admission.keeper_process`), or a thread.
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
        self.withdrawals = Withdrawals(self._withdraw_now, self._spawn, lambda: self._stopped)
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

    def background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` as one of the gate's background tasks (:meth:`quiesce` waits
        for it; :meth:`stop` gives it a last chance to land)."""
        self._spawn(work)

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

    def reservation_store(
        self, clock: Clock, on_slot: SlotCallback, quotas: TenantQuotas | None
    ) -> ReservationStore:
        """Gang reservations in Redis, claimable on any gateway
        (:class:`~proxy.admission.shared_reservations.SharedReservations`); the key's
        quota is counted there, not in ``quotas``."""
        from proxy.admission.shared_reservations import SharedReservations

        return SharedReservations(self, clock, on_slot)


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
