"""The asyncio shell around the pure admission core.

:meth:`Gate.acquire` admits a session at once, holds it in the pool's FIFO queue, or
raises :class:`~proxy.errors.Refused`. It is cancellation-safe: a waiter that is
cancelled (its client went away) leaves the queue in the same step and the next
waiter is served; a slot handed to a waiter that was cancelled in the same instant
is released again at once. Every admission is a
:class:`~proxy.admission.session_lease.Lease` whose
:meth:`~proxy.admission.session_lease.Lease.release` is idempotent, so callers release
on every exit path in a ``finally`` and the slot is freed exactly once.

Queue deadlines run on the injected :class:`~proxy.clock.Clock`: tests advance a
:class:`~proxy.clock.FakeClock` instead of sleeping. The gate is built of parts it
holds: handing the core's decisions to the waiting sessions and arming those deadlines
is ``waiters``' job (:class:`~proxy.admission.gate_waiters.GateWaiters`); the decision
counts, the wait for idle and the acquire/take-now steps are the ones the shared gate
uses too (:mod:`proxy.admission.gate_common`). This module admits, releases, fails
over, changes pools live and answers queries.

Tenants: a session is admitted as the :class:`~proxy.admission.TenantSpec` passed to
:meth:`Gate.enter` (the one :meth:`proxy.runtime.Runtime.authorize` returned for its
key; None: no key); the core decides the order, reserves and shedding. Per-key series:
``headroom_tenant_*``.

:class:`Gate` implements :class:`~proxy.admission.interface.AdmissionGate`, the
interface the rest of the gateway holds; what only the shared gate needs (background
work, fencing, an admission store that may be unreachable) is a no-op here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from proxy.admission import (
    Admit,
    Enqueue,
    PoolCore,
    PoolStatistics,
    QueuePolicy,
    Reject,
    ReplicaSpec,
    Reserve,
    TenantSpec,
    gate_common,
)
from proxy.admission.gate_common import GateCounts, IdleWaiters, await_outcome
from proxy.admission.gate_waiters import GateWaiters, LocalPool, LocalWaiter
from proxy.admission.session_lease import Lease, PositionCallback, Waiting
from proxy.clock import Clock
from proxy.errors import FallbackHint
from proxy.metering.scrape import ReplicaGauges, TenantGauges
from proxy.metering.series import Metrics

if TYPE_CHECKING:
    from proxy.admission.auth import TenantQuotas
    from proxy.admission.interface import (
        FenceCallback,
        ReservationStore,
        SlotCallback,
        TenantQuota,
    )

__all__ = ["Gate"]

log = logging.getLogger("headroom.gate")


class Gate:
    """Admission for every pool, on one event loop."""

    def __init__(
        self,
        pools: Iterable[PoolCore],
        *,
        clock: Clock,
        metrics: Metrics | None = None,
        fallbacks: Mapping[str, FallbackHint | None] | None = None,
        recheck_interval_s: float | None = None,
    ) -> None:
        self.clock = clock
        self.metrics = metrics
        #: The decision, queue-wait and session-length series.
        self.counts = GateCounts(metrics)
        #: Hands each core's decisions to its waiting sessions and arms the deadlines.
        self.waiters = GateWaiters(clock, self.counts)
        #: Callers of :meth:`wait_idle`.
        self.idle = IdleWaiters(lambda: self.active)
        fallbacks = fallbacks or {}
        self._pools = {core.name: LocalPool(core, fallbacks.get(core.name)) for core in pools}
        self.recheck_interval_s = recheck_interval_s
        if recheck_interval_s is not None:
            self.set_recheck_interval(recheck_interval_s)
        self._healthy_listeners: list[Callable[[str, str, bool], None]] = []
        self.draining = False
        if metrics is not None:
            metrics.bind_tenants(self.tenant_gauges)

    # -- lifecycle: nothing runs in the background here ---------------------------

    async def start(self) -> None:
        """Nothing to start: every decision is made in the caller's step."""

    async def stop(self) -> None:
        """Nothing to stop: a running session's lease is released by its session."""

    async def quiesce(self) -> None:
        """Nothing runs in the background: returns at once."""

    # -- public API -------------------------------------------------------------

    def enter(
        self,
        pool: str,
        *,
        on_position: PositionCallback | None = None,
        tenant: TenantSpec | None = None,
        queue: bool = True,
        max_wait_s: float | None = None,
    ) -> Lease | Waiting:
        """Ask ``pool`` for a slot without suspending: a :class:`Lease` if admitted at
        once, a :class:`Waiting` (already in the queue) to await, or raises
        :class:`~proxy.errors.Refused`. ``tenant``: the session's key's scheduling
        identity (None: no key). ``queue=False``: a slot now or a refusal, never a queue
        place. ``max_wait_s``: the session's own bound on its wait, if shorter than the
        pool's."""
        p = self._pool(pool)
        now = self.clock.now()
        decision = p.core.arrive(now, tenant, queue=queue, max_wait_s=max_wait_s)
        if isinstance(decision, Admit):
            self.counts.decision(pool, "admitted", tenant)
            return self._lease(pool, decision, now, tenant)
        if isinstance(decision, Reject):
            self.counts.decision(pool, f"rejected_{decision.reason}", tenant)
            raise self.waiters.refusal(p, decision)
        assert isinstance(decision, Enqueue)
        self.counts.decision(pool, "queued", tenant)
        future: asyncio.Future[Admit | Reject] = asyncio.get_running_loop().create_future()
        p.waiters[decision.ticket] = LocalWaiter(future, on_position, decision.position, tenant)
        p.enqueued_at[decision.ticket] = now
        for shed in decision.displaced:
            self.waiters.resolve(p, shed)
        self.waiters.arm_timer(p)
        if on_position is not None:
            on_position(decision.position, decision.eta_s)
        if decision.displaced or decision.position < p.core.queue_depth:
            self.waiters.notify_positions(p)  # it went ahead of others: they moved back
        ticket = decision.ticket
        return Waiting(pool, ticket, decision.position, decision.eta_s,
                       lambda: self._wait(pool, ticket))  # fmt: skip

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
        """:meth:`enter`, awaitable as the interface has it (the shared gate's
        ``admit`` awaits Redis). ``quota`` is not counted here: this process's count of
        the key's sessions is the runtime's :class:`~proxy.admission.auth.TenantQuotas`."""
        return self.enter(
            pool, on_position=on_position, tenant=tenant, queue=queue, max_wait_s=max_wait_s
        )

    async def acquire(
        self,
        pool: str,
        *,
        on_position: PositionCallback | None = None,
        tenant: TenantSpec | None = None,
        quota: TenantQuota | None = None,
    ) -> Lease:
        """Admit a session to ``pool``, waiting in its queue if need be: returns a
        :class:`Lease` or raises :class:`~proxy.errors.Refused`. Cancellation-safe.
        ``quota`` as for :meth:`admit`."""
        return await gate_common.acquire(
            self, pool, on_position=on_position, tenant=tenant, quota=quota
        )

    async def take_now(self, pool: str, tenant: TenantSpec | None) -> Lease:
        """One slot of ``pool`` now, never a place in its queue (a gang reservation's
        slot): the decision for a plain session of ``tenant``'s class (reserves, no
        barging past its class), as :meth:`enter` with ``queue=False`` makes it. Raises
        :class:`~proxy.errors.Refused`."""
        return await gate_common.take_now(self, pool, tenant)

    async def _wait(self, pool: str, ticket: int) -> Lease:
        p = self._pools[pool]
        waiter = p.waiters[ticket]
        outcome = await await_outcome(waiter.future, lambda: self.waiters.leave(p, ticket))
        p.waiters.pop(ticket, None)
        if isinstance(outcome, Reject):
            raise self.waiters.refusal(p, outcome)
        return self._lease(pool, outcome, self.clock.now(), waiter.tenant)

    def _lease(self, pool: str, admit: Admit, now: float, tenant: TenantSpec | None) -> Lease:
        return Lease(pool, admit.ticket, admit.replica, waited_s=admit.waited_s,
                     admitted_at=now, tenant=tenant, release=self._release,
                     move=self._move)  # fmt: skip

    def drain(self) -> None:
        """Refuse everything new and every waiter with ``draining``."""
        self.draining = True
        now = self.clock.now()
        for p in self._pools.values():
            for reject in p.core.drain(now):
                self.waiters.resolve(p, reject)
            self.waiters.arm_timer(p)

    async def wait_idle(self) -> None:
        """Return once no session holds a slot (used by drain)."""
        await self.idle.wait()

    def set_healthy(self, pool: str, replica: str, healthy: bool) -> None:
        """Eject a replica (``healthy=False``) or restore it: logs the change, hands freed capacity
        to waiters and tells the health listeners. A replica the pool does not have is ignored;
        an unknown pool raises LookupError."""
        p = self._pool(pool)
        stats = {r.name: r for r in p.core.statistics().replicas}
        if replica in stats and stats[replica].healthy != healthy:
            log.warning(
                "replica %s/%s is now %s", pool, replica, "healthy" if healthy else "unhealthy"
            )
            self.waiters.dispatch(p, p.core.set_healthy(replica, healthy, self.clock.now()))
            for listener in self._healthy_listeners:
                listener(pool, replica, healthy)

    def set_recheck_interval(self, interval_s: float) -> None:
        """How often an ejected replica is re-checked (``health.recheck_interval_s``):
        a ``no_healthy_replica`` refusal advises retrying around the next re-check."""
        self.recheck_interval_s = interval_s
        for p in self._pools.values():
            p.core.recheck_interval_s = interval_s

    def set_guarded(self, pool: str, replica: str, guarded: bool) -> None:
        """Take a replica out of placement for the delivery guard, or give it back (waiters may be
        admitted at once). Raises LookupError for an unknown pool or replica."""
        p = self._pool(pool)
        self.waiters.dispatch(p, p.core.set_guarded(replica, guarded, self.clock.now()))

    def set_cap(self, pool: str, replica: str, cap: int) -> None:
        """Change a replica's cap live; lowering never evicts. Raises LookupError for an unknown
        pool or replica, ValueError for a cap below 1."""
        p = self._pool(pool)
        self.waiters.dispatch(p, p.core.set_cap(replica, cap, self.clock.now()))

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
        """Create a pool, or change one live (reload): caps, queue limits, reserves,
        replicas added or retired, fallback hint. Running sessions are never cut: a
        lowered cap or a retired replica only stops new admissions there."""
        now = self.clock.now()
        p = self._pools.get(name)
        if p is None:
            core = PoolCore(
                name,
                replicas,
                queue,
                session_estimate_s=session_estimate_s,
                recheck_interval_s=self.recheck_interval_s,
                reserves=reserves,
            )
            if self.draining:  # a pool added by a reload during drain drains too
                core.drain(now)
            self._pools[name] = LocalPool(core, fallback)
            return
        p.fallback = fallback
        if p.core.draining and not self.draining:  # a retired pool configured again
            self.waiters.dispatch(p, p.core.undrain(now))
        for reject in p.core.set_queue(queue, now):
            self.waiters.resolve(p, reject)
        current = {r.name: r for r in p.core.statistics().replicas}
        wanted = {spec.name for spec in replicas}
        for spec in replicas:
            existing = current.get(spec.name)
            if existing is None or existing.retired:
                self.waiters.dispatch(p, p.core.add_replica(spec, now))
            elif existing.cap != spec.max_sessions:
                self.waiters.dispatch(p, p.core.set_cap(spec.name, spec.max_sessions, now))
        for replica in current:
            if replica not in wanted and not current[replica].retired:
                p.core.retire_replica(replica)
        if tuple(reserves) != p.core.reserves:
            self.waiters.dispatch(p, p.core.set_reserves(reserves, now))
        self.waiters.dispatch(p, [])

    def retire_pool(self, name: str) -> None:
        """A pool left the configuration: refuse its waiters and newcomers
        (``draining``); its running sessions finish."""
        p = self._pool(name)
        for reject in p.core.drain(self.clock.now()):
            self.waiters.resolve(p, reject)
        self.waiters.arm_timer(p)

    def on_health_change(self, listener: Callable[[str, str, bool], None]) -> None:
        """Call ``listener(pool, replica, healthy)`` after each change :meth:`set_healthy` makes
        (not for calls that change nothing)."""
        self._healthy_listeners.append(listener)

    def on_fence(self, listener: FenceCallback) -> None:
        """Never called: this gate's slots are this process's, so they cannot be lost
        while its sessions run."""

    def core(self, pool: str) -> PoolCore:
        """The pure core of ``pool`` (tests read it); raises LookupError for an unknown pool."""
        return self._pool(pool).core

    @property
    def available(self) -> bool:
        """Always: there is no admission store to lose."""
        return True

    @property
    def gateway_id(self) -> str:
        """This process's id: the admission store is this process."""
        return str(os.getpid())

    def grants_blocked_s(self) -> float:
        """Never blocked: no store to lose its data."""
        return 0.0

    def reserves(self, pool: str) -> tuple[Reserve, ...]:
        return self._pool(pool).core.reserves

    def estimate_wait(self, pool: str, position: int) -> float:
        """Expected seconds until a waiter at ``position`` (1 = head) gets a slot."""
        return self._pool(pool).core.estimate_wait(position, self.clock.now())

    def tenant_wait(self, pool: str, name: str) -> float | None:
        """Expected seconds until one of key ``name``'s sessions in ``pool`` ends (None
        if it runs none): past ``max_sessions`` only those ending help."""
        return self._pool(pool).core.tenant_wait(name, self.clock.now())

    def held_per_replica(self, pool: str) -> dict[str, int]:
        """Sessions holding a slot per replica: this process holds them all."""
        return {r.name: r.active for r in self._pool(pool).core.statistics().replicas}

    def reservation_store(
        self, clock: Clock, on_slot: SlotCallback, quotas: TenantQuotas | None
    ) -> ReservationStore:
        """Gang reservations held in this process
        (:class:`~proxy.admission.local_reservations.LocalReservations`)."""
        from proxy.admission.local_reservations import LocalReservations

        return LocalReservations(self, clock, on_slot, quotas)

    def pools(self) -> list[str]:
        return list(self._pools)

    def fallback(self, pool: str) -> FallbackHint | None:
        return self._pool(pool).fallback

    def statistics(self) -> dict[str, PoolStatistics]:
        return {name: p.core.statistics() for name, p in self._pools.items()}

    @property
    def active(self) -> int:
        return sum(p.core.active for p in self._pools.values())

    @property
    def queued(self) -> int:
        return sum(p.core.queue_depth for p in self._pools.values())

    def replica_gauges(
        self,
        ratio: Callable[[str, str], float | None] | None = None,
        guarded: Callable[[str, str], bool] | None = None,
    ) -> list[ReplicaGauges]:
        """Per-replica gauges; ``ratio`` and ``guarded`` supply what the gate does not
        know itself (the rolling delivery ratio; the guard's state in observe mode)."""
        out: list[ReplicaGauges] = []
        for name, p in self._pools.items():
            for r in p.core.statistics().replicas:
                out.append(
                    ReplicaGauges(
                        name,
                        r.name,
                        r.active,
                        r.cap,
                        r.healthy,
                        guarded(name, r.name) if guarded else r.guarded,
                        ratio(name, r.name) if ratio else None,
                    )
                )
        return out

    def tenant_gauges(self) -> list[TenantGauges]:
        """Per API key and pool: sessions active and queued, and session-seconds held
        (finished plus running so far). Keys that never used a pool are absent; sessions
        without a key are not counted here."""
        out: list[TenantGauges] = []
        now = self.clock.now()
        for name, p in self._pools.items():
            # A reload that changes a key's weight or max_queued leaves its sessions
            # under two specs with one (name, class): sum them, as the seconds below.
            counts: dict[tuple[str, int], tuple[int, int]] = {}
            for t, (active, queued) in p.core.tenant_counts().items():
                was = counts.get((t.name, t.priority), (0, 0))
                counts[(t.name, t.priority)] = (was[0] + active, was[1] + queued)
            held: dict[tuple[str, int], float] = {}
            for t, seconds in p.core.session_seconds(now).items():
                held[(t.name, t.priority)] = held.get((t.name, t.priority), 0.0) + seconds
            for key in sorted(set(counts) | set(held)):
                if key[0]:
                    active, queued = counts.get(key, (0, 0))
                    out.append(
                        TenantGauges(name, key[0], key[1], active, queued, held.get(key, 0.0))
                    )
        return out

    def queue_depths(self) -> list[tuple[str, int]]:
        return [(name, p.core.queue_depth) for name, p in self._pools.items()]

    def __repr__(self) -> str:
        inner = ", ".join(repr(p.core) for p in self._pools.values())
        return f"<Gate{' draining' if self.draining else ''} [{inner}]>"

    # -- internals --------------------------------------------------------------

    def _pool(self, name: str) -> LocalPool:
        try:
            return self._pools[name]
        except KeyError:
            raise LookupError(f"no pool named {name!r}") from None

    def _release(self, lease: Lease) -> None:
        p = self._pools[lease.pool]
        now = self.clock.now()
        self.counts.session(lease.pool, now - lease.admitted_at)
        self.waiters.dispatch(p, p.core.release(lease.ticket, now))
        self.idle.released()

    async def _move(self, lease: Lease, eject: bool, exclude: Collection[str]) -> bool:
        """:meth:`Lease.fail_over`, decided at once."""
        p = self._pools[lease.pool]
        if eject:
            self.set_healthy(lease.pool, lease.replica, False)
        moved = p.core.relocate(lease.ticket, self.clock.now(), exclude)
        if moved is None:
            return False
        lease.replica = moved.replica
        return True
