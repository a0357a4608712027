"""Admitting and releasing sessions, for the shared gate.

:class:`SharedSessions` is the job of :class:`proxy.admission.shared_gate.SharedGate`
that hands out slots and queue places: :meth:`~SharedSessions.admit` asks Redis
(acquire.lua) for a slot or a queue place of the pool with this gateway's view of it,
a waiter's :meth:`~proxy.admission.session_lease.Waiting.wait` takes the outcome its
wake-up or deadline resolved, and each slot becomes a
:class:`~proxy.admission.shared_state.SharedLease` whose idempotent release runs in a
task of the gate (retried until it lands). A call cancelled mid-flight gives back what
it took. It also holds and adopts the slots of gang reservations
(:mod:`proxy.admission.shared_reservations`) and moves a lease to another replica
before the first byte (failover). Any Redis failure refuses with
``backend_unavailable``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

from proxy.admission import Admit, Reject, TenantSpec
from proxy.admission.interface import TenantQuota
from proxy.admission.redis_backend import BackendUnavailable, ReplicaView
from proxy.admission.retry_after import SessionLengths
from proxy.admission.session_lease import Lease, PositionCallback, Waiting
from proxy.admission.shared_pools import SharedPoolChanges
from proxy.admission.shared_state import (
    EWMA_ALPHA,
    PoolState,
    SharedLease,
    SharedWaiting,
    WaiterState,
)
from proxy.admission.shared_views import SharedViews

__all__ = ["SharedSessions"]

log = logging.getLogger("headroom.shared_gate")


class SharedSessions(SharedPoolChanges, SharedViews):
    """The shared gate's admissions, releases and failovers (module docstring)."""

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
        """A :class:`Lease` if admitted at once, a :class:`Waiting` already in the
        Redis queue, or raises :class:`~proxy.errors.Refused`. Cancellation-safe: a
        slot or queue place taken by a call cancelled mid-flight is given back.
        ``queue=False``: a slot now or a refusal, never a queue place. ``tenant``: the
        session's key's scheduling identity (None: no key); ``quota``: the key's
        ``max_sessions``, counted in Redis over every gateway before the slot is asked
        for (past it: ``tenant_limit``); ``max_wait_s``: the session's own bound on its
        wait, if shorter than the pool's (0: as ``queue=False``)."""
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
        wait_s = p.queue.max_wait_s if max_wait_s is None else min(max_wait_s, p.queue.max_wait_s)
        depth = p.queue.max_depth if p.queue.enabled and queue and wait_s > 0 else 0
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
            # The call may have run before its answer was lost, or may run when Redis
            # answers again: withdrawn either way.
            self.withdrawals.add(pool, waiter_id)
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
                now + wait_s, lambda: self._on_deadline(pool, waiter_id)
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

    def release_held(self, pool: str, lease_id: str) -> None:
        """Give back a reserved slot no session took, in the background: withdrawn
        (:class:`~proxy.admission.shared_withdrawals.Withdrawals`), so a hold whose
        answer was lost takes nothing when it runs late; otherwise it lapses at the
        reservation's deadline."""
        if pool in self._pools:
            self.withdrawals.add(pool, lease_id)

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
