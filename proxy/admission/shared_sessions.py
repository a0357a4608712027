"""Admitting and releasing sessions, for the shared gate.

:class:`SharedSessions` is the part of :class:`proxy.admission.shared_gate.SharedGate`
that hands out slots and queue places: :meth:`~SharedSessions.admit` asks Redis
(acquire.lua) for a slot or a queue place of the pool with this gateway's view of it,
a waiter's :meth:`~proxy.admission.session_lease.Waiting.wait` takes the outcome its
wake-up or deadline resolved, and each slot becomes a
:class:`~proxy.admission.shared_state.SharedLease` whose idempotent release runs in a
task of the gate (retried until it lands). A call cancelled mid-flight gives back what
it took. It also holds and adopts the slots of gang reservations
(:mod:`proxy.admission.shared_reservations`) and moves a lease to another replica
before the first byte (failover). Any Redis failure refuses with
``backend_unavailable``. The leases and waiters are their pool's
(:class:`~proxy.admission.shared_state.PoolState`); this part owns the ids given up on
(``withdrawals``) and the callers of ``wait_idle`` (``idle``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection
from typing import Any

from proxy.admission import Admit, Reject, TenantSpec
from proxy.admission.gate_common import IdleWaiters, await_outcome
from proxy.admission.interface import TenantQuota
from proxy.admission.lease_keeper import Keeper
from proxy.admission.redis_backend import BackendUnavailable, ReplicaView
from proxy.admission.session_lease import Lease, PositionCallback, Waiting
from proxy.admission.shared_pools import SharedPoolChanges
from proxy.admission.shared_renewal import SharedRenewal
from proxy.admission.shared_state import PoolState, SharedLease, SharedWaiting, WaiterState
from proxy.admission.shared_store import SharedStore
from proxy.admission.shared_tenants import SharedTenants
from proxy.admission.shared_wakeups import SharedWakeups
from proxy.admission.shared_withdrawals import Withdrawals

__all__ = ["SharedSessions"]

log = logging.getLogger("headroom.shared_gate")


class SharedSessions:
    """The shared gate's admissions, releases and failovers (module docstring)."""

    def __init__(
        self,
        store: SharedStore,
        tenants: SharedTenants,
        renewal: SharedRenewal,
        wakeups: SharedWakeups,
        changes: SharedPoolChanges,
        keeper: Keeper | None,
    ) -> None:
        self.store = store
        self.tenants = tenants
        self.renewal = renewal
        self.wakeups = wakeups
        self.changes = changes
        self.keeper = keeper
        #: Ids whose acquire or hold was given up on, withdrawn once Redis answers.
        self.withdrawals = Withdrawals(store.withdraw_now, store.spawn, lambda: store.stopped)
        #: Callers of ``wait_idle``.
        self.idle = IdleWaiters(self.active)

    def active(self) -> int:
        """This gateway's sessions holding a slot."""
        return sum(len(p.leases) for p in self.store.pools.values())

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
        store = self.store
        p = store.pool(pool)
        now = store.clock.now()
        view = self._open_view(p, tenant)
        waiter_id = store.new_id()
        if quota is not None:
            await self.tenants.reserve(p, waiter_id, quota, tenant)
        future: asyncio.Future[Admit | Reject] = asyncio.get_running_loop().create_future()
        # Registered before the call: a wake-up may arrive before the reply does.
        waiter = WaiterState(future, on_position, now, tenant=tenant)
        p.waiters[waiter_id] = waiter
        wait_s = p.queue.max_wait_s if max_wait_s is None else min(max_wait_s, p.queue.max_wait_s)
        depth = p.queue.max_depth if p.queue.enabled and queue and wait_s > 0 else 0
        call = asyncio.ensure_future(store.backend.acquire_as(pool, waiter_id, view, depth, tenant))
        try:
            got = await asyncio.shield(call)
        except asyncio.CancelledError:
            p.waiters.pop(waiter_id, None)
            store.spawn(self._give_back(pool, waiter_id, call))
            raise
        except BackendUnavailable as exc:
            p.waiters.pop(waiter_id, None)
            store.set_available(False)
            # The call may have run before its answer was lost, or may run when Redis
            # answers again: withdrawn either way.
            self.withdrawals.add(pool, waiter_id)
            self.tenants.drop(waiter_id)
            log.warning("refusing a session on %s: admission store unreachable (%s)", pool, exc)
            raise store.refuse(p, "backend_unavailable", 1, tenant) from None
        store.set_available(True)
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
                self.tenants.drop(waiter_id)
                store.counts.decision(pool, "queued", tenant)
                store.counts.decision(pool, f"rejected_{outcome.reason}", tenant)
                raise store.refusal(p, outcome)
            waiter.queued = True
            waiter.position = int(value)
            waiter.deadline = now + wait_s
            waiter.timer = store.clock.call_at(
                waiter.deadline, lambda: self.wakeups.on_deadline(pool, waiter_id)
            )
            store.counts.decision(pool, "queued", tenant)
            eta = p.wait_s(waiter.position, store.clock.now())
            if on_position is not None:
                on_position(waiter.position, eta)
            return SharedWaiting(pool, waiter_id, waiter.position, eta,
                                 lambda: self._wait(pool, waiter_id))  # fmt: skip
        p.waiters.pop(waiter_id, None)
        self.tenants.drop(waiter_id)
        if kind == "blocked":  # Redis lost its data: survivors are re-asserting
            p.blocked_until = max(p.blocked_until, store.clock.now() + int(value) / 1000)
            raise store.refuse(p, "backend_unavailable", int(value) / 1000, tenant)
        # Retry-After from where this key's session would have stood in the queue.
        reason = str(value)
        raise store.refuse(p, reason, store.retry_after(p, reason, got.position), tenant)

    def _open_view(self, p: PoolState, tenant: TenantSpec | None) -> list[ReplicaView]:
        """The replicas a new slot of ``p`` may go to; raises ``draining`` or
        ``no_healthy_replica`` (what :meth:`admit` and :meth:`hold` refuse before
        asking Redis)."""
        store = self.store
        if store.draining or p.draining:
            raise store.refuse(p, "draining", 1, tenant)
        view = p.view()
        if not view:
            retry = store.retry_after(p, "no_healthy_replica", p.queue_depth + 1)
            raise store.refuse(p, "no_healthy_replica", retry, tenant)
        return view

    async def _wait(self, pool: str, waiter_id: str) -> Lease:
        store = self.store
        p = store.pools[pool]
        waiter = p.waiters[waiter_id]
        outcome = await await_outcome(waiter.future, lambda: self._leave(p, waiter_id))
        self._forget_waiter(p, waiter_id)
        store.counts.queue_wait(pool, store.clock.now() - waiter.arrived, waiter.tenant)
        if isinstance(outcome, Reject):
            self.tenants.drop(waiter_id)
            store.counts.decision(pool, f"rejected_{outcome.reason}", waiter.tenant)
            if outcome.reason != "queue_timeout":  # (a timed-out waiter has left already)
                store.spawn(store.leave_remote(pool, waiter_id))
            raise store.refusal(p, outcome)
        return self._lease(p, waiter_id, outcome.replica, waiter.arrived, waiter.tenant)

    def _lease(
        self,
        p: PoolState,
        lease_id: str,
        replica: str,
        arrived: float,
        tenant: TenantSpec | None = None,
    ) -> SharedLease:
        now = self.store.clock.now()
        lease = SharedLease(p.name, lease_id, replica, waited_s=now - arrived, admitted_at=now,
                            tenant=tenant, release=self._release, move=self._move)  # fmt: skip
        p.leases[lease_id] = lease
        if self.keeper is not None:
            self.keeper.hold(p.name, lease_id)
        if p.last_renewed is None:  # the grant itself proves the lease until now + TTL
            p.last_renewed = arrived
            self.renewal.arm_fence(p)
        self.store.counts.decision(p.name, "admitted", tenant)
        return lease

    def _release(self, lease: Lease) -> None:
        assert isinstance(lease, SharedLease)
        store = self.store
        p = store.pools[lease.pool]
        p.leases.pop(lease.lease_id, None)
        if self.keeper is not None:
            self.keeper.drop(lease.pool, lease.lease_id)
        duration = max(0.0, store.clock.now() - lease.admitted_at)
        p.lengths.observe(duration)
        if lease.tenant is not None and lease.tenant.name:
            key = (lease.tenant.name, lease.tenant.priority)
            p.finished[key] = p.finished.get(key, 0.0) + duration
        store.counts.session(lease.pool, duration)
        store.spawn(store.release_remote(lease.pool, lease.lease_id))
        self.tenants.drop(lease.lease_id)
        self.idle.released()

    def _leave(self, p: PoolState, waiter_id: str) -> None:
        """The waiter's task ended without taking its outcome (cancelled)."""
        store = self.store
        waiter = self._forget_waiter(p, waiter_id)
        if waiter is None:
            return
        self.tenants.drop(waiter_id)
        store.counts.decision(p.name, "abandoned", waiter.tenant)
        if not waiter.future.done():
            store.counts.queue_wait(p.name, store.clock.now() - waiter.arrived, waiter.tenant)
        if waiter.future.done() and not waiter.future.cancelled():
            if isinstance(waiter.future.result(), Admit):
                store.spawn(store.release_remote(p.name, waiter_id))
            return
        store.spawn(store.leave_remote(p.name, waiter_id))

    @staticmethod
    def _forget_waiter(p: PoolState, waiter_id: str) -> WaiterState | None:
        waiter = p.waiters.pop(waiter_id, None)
        if waiter is not None and waiter.timer is not None:
            waiter.timer.cancel()
        return waiter

    async def _give_back(self, pool: str, waiter_id: str, call: asyncio.Future[Any]) -> None:
        """An acquire whose caller was cancelled: undo whatever it took, even if it
        runs after its answer was given up on (withdrawn)."""
        with contextlib.suppress(BaseException):
            await call
        self.tenants.drop(waiter_id)
        self.withdrawals.add(pool, waiter_id)

    # -- gang reservations (proxy/admission/shared_reservations.py) --------------------

    async def hold(self, pool: str, lease_id: str, hold_s: float, tenant: TenantSpec | None) -> str:
        """One slot of ``pool`` for a gang reservation, now or never, held ``hold_s`` in
        Redis without renewal (hold.lua): the decision :meth:`admit` with
        ``queue=False`` makes for a session of ``tenant``'s class. Returns the replica;
        raises :class:`~proxy.errors.Refused`."""
        store = self.store
        p = store.pool(pool)
        view = self._open_view(p, tenant)
        try:
            got = await store.backend.hold(pool, lease_id, hold_s, view, tenant)
        except BackendUnavailable as exc:
            store.set_available(False)
            log.warning("refusing a reservation on %s: admission store unreachable (%s)",
                        pool, exc)  # fmt: skip
            raise store.refuse(p, "backend_unavailable", 1, tenant) from None
        store.set_available(True)
        if got.kind == "admit":
            return str(got.value)
        if got.kind == "blocked":
            raise store.refuse(p, "backend_unavailable", int(got.value) / 1000, tenant)
        reason = str(got.value)
        raise store.refuse(p, reason, store.retry_after(p, reason, got.position), tenant)

    async def adopt(
        self, pool: str, lease_id: str, tenant: TenantSpec | None, quota: str | None
    ) -> SharedLease | None:
        """A reserved slot a stage connection claimed here: confirmed in Redis (leave.lua
        extends a granted lease by one TTL and never grants anything), it becomes one of
        this gateway's leases, renewed and fenced like its sessions' and released when
        the session ends. ``quota``: the key whose ``max_sessions`` counts it (renewed
        with this gateway's tenant reservations, dropped with the lease). None if the
        lease lapsed; raises ``backend_unavailable``. Cancellation-safe."""
        store = self.store
        p = store.pool(pool)
        since = store.clock.now()
        if quota is not None:
            self.tenants.adopt(lease_id, quota)
        call = asyncio.ensure_future(store.backend.leave(pool, lease_id, p.view()))
        try:
            kind, replica = await asyncio.shield(call)
        except asyncio.CancelledError:
            store.spawn(self._give_back(pool, lease_id, call))
            raise
        except BackendUnavailable as exc:
            store.set_available(False)
            self.tenants.drop(lease_id)
            store.spawn(store.release_remote(pool, lease_id))
            log.warning("refusing a reserved session on %s: admission store unreachable "
                        "(%s)", pool, exc)  # fmt: skip
            raise store.refuse(p, "backend_unavailable", 1, tenant) from None
        store.set_available(True)
        if kind != "granted" or replica is None:
            self.tenants.drop(lease_id)
            return None
        return self._lease(p, lease_id, replica, since, tenant)

    def release_held(self, pool: str, lease_id: str) -> None:
        """Give back a reserved slot no session took, in the background: withdrawn
        (:class:`~proxy.admission.shared_withdrawals.Withdrawals`), so a hold whose
        answer was lost takes nothing when it runs late; otherwise it lapses at the
        reservation's deadline."""
        if pool in self.store.pools:
            self.withdrawals.add(pool, lease_id)

    # -- failover before the first byte ----------------------------------------------

    async def _move(self, lease: Lease, eject: bool, exclude: Collection[str]) -> bool:
        """:meth:`Lease.fail_over`: move the lease, in Redis, to another replica with a
        free slot, not one in ``exclude``, ejecting this one first if ``eject``. False
        (lease unchanged) if there is none or Redis did not answer (within its
        ``timeout_s``)."""
        assert isinstance(lease, SharedLease)
        store = self.store
        p = store.pools[lease.pool]
        if eject:
            self.changes.set_healthy(lease.pool, lease.replica, False)
        try:
            kind, replica = await store.backend.relocate(
                lease.pool, lease.lease_id, lease.replica, p.view(), exclude=list(exclude)
            )
        except BackendUnavailable as exc:
            store.set_available(False)
            log.warning("failover of a session on %s not moved: admission store did not "
                        "answer (%s)", lease.pool, exc)  # fmt: skip
            return False
        if kind != "moved" or replica is None:
            return False
        lease.replica = replica
        return True
