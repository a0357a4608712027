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
:class:`~proxy.clock.FakeClock` instead of sleeping. Handing the core's decisions to the
waiting sessions and arming those deadlines is the base class's job
(:class:`~proxy.admission.gate_waiters.GateWaiters`); this module admits, releases,
fails over, changes pools live and answers queries.

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
)
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


class Gate(GateWaiters):
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
        fallbacks = fallbacks or {}
        self._pools = {core.name: LocalPool(core, fallbacks.get(core.name)) for core in pools}
        self.recheck_interval_s = recheck_interval_s
        if recheck_interval_s is not None:
            self.set_recheck_interval(recheck_interval_s)
        self._healthy_listeners: list[Callable[[str, str, bool], None]] = []
        self._idle_waiters: list[asyncio.Future[None]] = []
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
            self._count(pool, "admitted", tenant)
            return Lease(self, pool, decision, now, tenant)
        if isinstance(decision, Reject):
            self._count(pool, f"rejected_{decision.reason}", tenant)
            raise self._refusal(pool, decision)
        assert isinstance(decision, Enqueue)
        self._count(pool, "queued", tenant)
        future: asyncio.Future[Admit | Reject] = asyncio.get_running_loop().create_future()
        p.waiters[decision.ticket] = LocalWaiter(future, on_position, decision.position, tenant)
        p.enqueued_at[decision.ticket] = now
        for shed in decision.displaced:
            self._resolve(pool, p, shed)
        self._arm_timer(p)
        if on_position is not None:
            on_position(decision.position, decision.eta_s)
        if decision.displaced or decision.position < p.core.queue_depth:
            self._notify_positions(p)  # it went ahead of others: they moved back
        return Waiting(self, pool, decision)

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
        entry = self.enter(pool, on_position=on_position, tenant=tenant)
        if isinstance(entry, Lease):
            return entry
        return await entry.wait()

    async def take_now(self, pool: str, tenant: TenantSpec | None) -> Lease:
        """One slot of ``pool`` now, never a place in its queue (a gang reservation's
        slot): the decision for a plain session of ``tenant``'s class (reserves, no
        barging past its class), as :meth:`enter` with ``queue=False`` makes it. Raises
        :class:`~proxy.errors.Refused`."""
        entry = self.enter(pool, tenant=tenant, queue=False)
        assert isinstance(entry, Lease)  # queue=False: a slot or a refusal
        return entry

    async def _wait(self, pool: str, ticket: int) -> Lease:
        p = self._pools[pool]
        waiter = p.waiters[ticket]
        try:
            outcome = await waiter.future
        except BaseException:
            self._leave(p, ticket)
            raise
        p.waiters.pop(ticket, None)
        if isinstance(outcome, Reject):
            raise self._refusal(pool, outcome)
        return Lease(self, pool, outcome, self.clock.now(), waiter.tenant)

    def drain(self) -> None:
        """Refuse everything new and every waiter with ``draining``."""
        self.draining = True
        now = self.clock.now()
        for name, p in self._pools.items():
            for reject in p.core.drain(now):
                self._resolve(name, p, reject)
            self._arm_timer(p)

    async def wait_idle(self) -> None:
        """Return once no session holds a slot (used by drain)."""
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
        p = self._pool(pool)
        stats = {r.name: r for r in p.core.statistics().replicas}
        if replica in stats and stats[replica].healthy != healthy:
            log.warning(
                "replica %s/%s is now %s", pool, replica, "healthy" if healthy else "unhealthy"
            )
            self._dispatch(pool, p, p.core.set_healthy(replica, healthy, self.clock.now()))
            for listener in self._healthy_listeners:
                listener(pool, replica, healthy)

    def set_recheck_interval(self, interval_s: float) -> None:
        """How often an ejected replica is re-checked (``health.recheck_interval_s``):
        a ``no_healthy_replica`` refusal advises retrying around the next re-check."""
        self.recheck_interval_s = interval_s
        for p in self._pools.values():
            p.core.recheck_interval_s = interval_s

    def set_guarded(self, pool: str, replica: str, guarded: bool) -> None:
        p = self._pool(pool)
        self._dispatch(pool, p, p.core.set_guarded(replica, guarded, self.clock.now()))

    def set_cap(self, pool: str, replica: str, cap: int) -> None:
        p = self._pool(pool)
        self._dispatch(pool, p, p.core.set_cap(replica, cap, self.clock.now()))

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
            self._dispatch(name, p, p.core.undrain(now))
        for reject in p.core.set_queue(queue, now):
            self._resolve(name, p, reject)
        current = {r.name: r for r in p.core.statistics().replicas}
        wanted = {spec.name for spec in replicas}
        for spec in replicas:
            existing = current.get(spec.name)
            if existing is None or existing.retired:
                self._dispatch(name, p, p.core.add_replica(spec, now))
            elif existing.cap != spec.max_sessions:
                self._dispatch(name, p, p.core.set_cap(spec.name, spec.max_sessions, now))
        for replica in current:
            if replica not in wanted and not current[replica].retired:
                p.core.retire_replica(replica)
        if tuple(reserves) != p.core.reserves:
            self._dispatch(name, p, p.core.set_reserves(reserves, now))
        self._dispatch(name, p, [])

    def retire_pool(self, name: str) -> None:
        """A pool left the configuration: refuse its waiters and newcomers
        (``draining``); its running sessions finish."""
        p = self._pool(name)
        for reject in p.core.drain(self.clock.now()):
            self._resolve(name, p, reject)
        self._arm_timer(p)

    def on_health_change(self, listener: Callable[[str, str, bool], None]) -> None:
        self._healthy_listeners.append(listener)

    def on_fence(self, listener: FenceCallback) -> None:
        """Never called: this gate's slots are this process's, so they cannot be lost
        while its sessions run."""

    def core(self, pool: str) -> PoolCore:
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

    def _release(self, lease: Lease) -> None:
        p = self._pools[lease.pool]
        now = self.clock.now()
        if self.metrics is not None:
            duration = self.metrics.child(self.metrics.session_duration, lease.pool)
            duration.observe(now - lease.admitted_at)
        self._dispatch(lease.pool, p, p.core.release(lease.ticket, now))
        if self._idle_waiters and self.active == 0:
            for future in self._idle_waiters:
                if not future.done():
                    future.set_result(None)

    def _fail_over(self, lease: Lease, eject: bool, exclude: Collection[str]) -> bool:
        p = self._pools[lease.pool]
        if eject:
            self.set_healthy(lease.pool, lease.replica, False)
        moved = p.core.relocate(lease.ticket, self.clock.now(), exclude)
        if moved is None:
            return False
        lease.replica = moved.replica
        return True
