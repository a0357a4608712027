"""The shared gate's state and what each of its jobs uses
(:class:`proxy.admission.shared_gate.SharedGate`, ``admission.backend: redis``).

What this gateway keeps locally of each pool (:class:`PoolState`: its configuration
view, its leases, its waiters and their futures, the last renewal's pool-wide figures),
its own series (:class:`SharedAdmissionMetrics`), the lease and queue place it hands
out (:class:`SharedLease`, :class:`SharedWaiting`), and :class:`SharedGateState`: the
gate's attributes and the helpers every job calls -- refusals and their Retry-After,
the background task set, the Redis release retried until it lands, leaving the queue,
shedding a waiter. The jobs build on it: tenant quotas
(:mod:`proxy.admission.shared_tenants`), renewal and fencing
(:mod:`proxy.admission.shared_renewal`), wake-ups and queue deadlines
(:mod:`proxy.admission.shared_wakeups`), live pool changes
(:mod:`proxy.admission.shared_pools`), the read side
(:mod:`proxy.admission.shared_views`), admitting and releasing sessions
(:mod:`proxy.admission.shared_sessions`), and the gate's life and builder
(:mod:`proxy.admission.shared_gate`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.admission import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    Admit,
    QueuePolicy,
    Reject,
    ReplicaSpec,
    Reserve,
    TenantSpec,
)
from proxy.admission.gate_series import count_decision, observe_queue_wait
from proxy.admission.interface import FenceCallback
from proxy.admission.lease_keeper import Keeper
from proxy.admission.redis_backend import BackendUnavailable, RedisAdmission, ReplicaView
from proxy.admission.retry_after import (
    SessionLengths,
    SlotForecast,
    next_recheck_s,
    retry_after_s,
)
from proxy.admission.session_lease import Lease, PositionCallback, Waiting
from proxy.admission.shared_withdrawals import Withdrawals
from proxy.clock import Clock, TimerHandle
from proxy.errors import FallbackHint, Refused, refusal_for
from proxy.metering.series import Metrics

if TYPE_CHECKING:
    from proxy.admission.shared_sessions import SharedSessions

__all__ = [
    "EWMA_ALPHA",
    "WAKE_BLOCK_S",
    "PoolState",
    "ReplicaState",
    "SharedAdmissionMetrics",
    "SharedGateState",
    "SharedLease",
    "SharedPoolSpec",
    "SharedWaiting",
    "WaiterState",
]

log = logging.getLogger("headroom.shared_gate")

EWMA_ALPHA = 0.2
WAKE_BLOCK_S = 1.0


@dataclass(frozen=True, slots=True)
class SharedPoolSpec:
    name: str
    replicas: tuple[ReplicaSpec, ...]
    queue: QueuePolicy
    fallback: FallbackHint | None = None
    session_estimate_s: float = 20.0
    reserves: tuple[Reserve, ...] = ()


@dataclass(eq=False, slots=True)
class ReplicaState:
    cap: int
    healthy: bool = True
    guarded: bool = False
    retired: bool = False


@dataclass(eq=False)
class WaiterState:
    future: asyncio.Future[Admit | Reject]
    on_position: PositionCallback | None
    arrived: float
    position: int = 0
    queued: bool = False
    timer: TimerHandle | None = None
    tenant: TenantSpec | None = None


@dataclass(eq=False)
class PoolState:
    name: str
    replicas: dict[str, ReplicaState]
    queue: QueuePolicy
    fallback: FallbackHint | None
    session_estimate_s: float
    draining: bool = False
    generation: str = ""
    last_renewed: float | None = None
    #: Until when (this gateway's clock) Redis blocks grants: a new generation.
    blocked_until: float = 0.0
    fence_timer: TimerHandle | None = None
    leases: dict[str, SharedLease] = field(default_factory=dict)
    waiters: dict[str, WaiterState] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    queue_depth: int = 0
    #: The spread of the session lengths this gateway saw end (Retry-After's model).
    lengths: SessionLengths | None = None
    #: Slot-seconds of this gateway's finished sessions per (key name, class).
    finished: dict[tuple[str, int], float] = field(default_factory=dict)

    def view(self) -> list[ReplicaView]:
        return [
            ReplicaView(name, r.cap, r.guarded)
            for name, r in self.replicas.items()
            if r.healthy and not r.retired
        ]


class SharedAdmissionMetrics:
    """The shared gate's own series, registered beside :class:`~proxy.metering.series.Metrics`.
    Pool-wide figures carry ``scope="pool"``: every gateway reports the same value, so
    dashboards take ``max``, never ``sum``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.backend_up = Gauge(
            "headroom_admission_backend_up",
            "1 if this gateway's last call to the shared admission store succeeded.",
            ["backend"], registry=registry,
        )  # fmt: skip
        self.held = Gauge(
            "headroom_shared_sessions_active",
            "Sessions holding a slot on the replica, counted over every gateway.",
            ["pool", "replica", "scope"], registry=registry,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "headroom_shared_queue_depth",
            "Sessions waiting in the pool's queue, over every gateway.",
            ["pool", "scope"], registry=registry,
        )  # fmt: skip
        self.lease_loss_closes = Counter(
            "headroom_lease_loss_closes_total",
            "Times this gateway ended its sessions because it could not prove its leases "
            "(renewals failing past lease_ttl_s - fence_margin_s, or a lease found gone).",
            ["pool"], registry=registry,
        )  # fmt: skip


class SharedLease(Lease):
    """A slot held through Redis; :meth:`release` is idempotent and never awaits."""

    __slots__ = ("_shared", "fenced", "lease_id")

    def __init__(
        self, gate: SharedSessions, pool: str, lease_id: str, replica: str, waited_s: float,
        admitted_at: float, tenant: TenantSpec | None = None,
    ) -> None:  # fmt: skip
        self._shared = gate
        self.tenant = tenant
        self.pool = pool
        self.lease_id = lease_id
        #: A fence already told this lease's session to close: the lease being found
        #: gone again (its session is still ending) does not fence the pool again.
        self.fenced = False
        self.ticket = int(lease_id.rsplit(":", 1)[1])
        self.replica = replica
        self.waited_s = waited_s
        self.admitted_at = admitted_at
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._shared._release(self)

    async def fail_over(self, *, eject: bool = True, exclude: Collection[str] = ()) -> bool:
        """Connecting to :attr:`replica` failed before any byte was relayed: move this
        lease, in Redis, to another replica with a free slot, not one in ``exclude``,
        ejecting this one first if ``eject``. Returns False (lease unchanged) if there is
        none or Redis did not answer (within its ``timeout_s``)."""
        return await self._shared._fail_over(self, eject, exclude)


class SharedWaiting(Waiting):
    """A place in the pool's Redis FIFO; cancelling :meth:`wait` leaves it."""

    __slots__ = ("_shared", "waiter_id")

    def __init__(
        self, gate: SharedSessions, pool: str, waiter_id: str, position: int, eta_s: float
    ):
        self._shared = gate
        self.pool = pool
        self.waiter_id = waiter_id
        self.ticket = int(waiter_id.rsplit(":", 1)[1])
        self.position = position
        self.eta_s = eta_s

    async def wait(self) -> Lease:
        return await self._shared._wait(self.pool, self.waiter_id)


class SharedGateState:
    """The shared gate's attributes (set by :class:`proxy.admission.shared_gate.SharedGate`'s
    constructor) and the helpers every one of its jobs uses."""

    backend: RedisAdmission
    clock: Clock
    metrics: Metrics | None
    renew_interval_s: float
    fence_margin_s: float
    lease_ttl_s: float
    on_backend_loss: Literal["close", "keep"]
    #: Renews the leases while the event loop is late (a process, or a thread, of its own).
    keeper: Keeper | None
    _pools: dict[str, PoolState]
    _reserves: dict[str, tuple[Reserve, ...]]
    _healthy_listeners: list[Callable[[str, str, bool], None]]
    _fence_listeners: list[FenceCallback]
    _idle_waiters: list[asyncio.Future[None]]
    _tasks: set[asyncio.Task[Any]]
    _loops: list[asyncio.Task[None]]
    _next: int
    _rng: random.Random
    _recheck_interval_s: float | None
    #: When this gateway ejected each (pool, replica) it holds as unhealthy.
    _ejected_at: dict[tuple[str, str], float]
    #: Tenant reservations held in Redis: lease or waiter id -> tenant.
    _tenants: dict[str, str]
    #: Ids whose acquire or hold was given up on, withdrawn once Redis answers.
    withdrawals: Withdrawals
    draining: bool
    #: Set by ``stop`` first: the background loops end at their next turn.
    _closing: bool
    _stopped: bool
    #: Whether the last call to Redis succeeded (``/readyz``).
    available: bool
    _metrics: SharedAdmissionMetrics | None

    def _observe_wait(self, p: PoolState, waiter: WaiterState) -> None:
        observe_queue_wait(self.metrics, p.name, self.clock.now() - waiter.arrived, waiter.tenant)

    async def _release_remote(self, pool: str, lease_id: str) -> None:
        """Release in Redis, retrying while Redis is unreachable; gives up once the
        lease has expired on its own (it then frees its slot anyway)."""
        give_up = self.clock.now() + self.lease_ttl_s
        delay = 0.05
        while True:
            try:
                await self.backend.release(pool, lease_id, self._pools[pool].view())
                self._set_available(True)
                return
            except BackendUnavailable:
                self._set_available(False)
                if self._stopped or self.clock.now() + delay > give_up:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _withdraw_now(self, pool: str, lease_id: str) -> str:
        """withdraw.lua for ``lease_id`` (:class:`Withdrawals`' call); LookupError if
        ``pool`` is no longer configured."""
        reply = await self.backend.withdraw(pool, lease_id, self._pool(pool).view())
        self._set_available(True)
        return reply

    async def _leave_remote(self, pool: str, waiter_id: str) -> None:
        try:
            kind, _ = await self.backend.leave(pool, waiter_id, self._pools[pool].view())
        except BackendUnavailable:
            return  # its heartbeat stops: Redis drops it within the heartbeat TTL
        if kind == "granted":
            await self._release_remote(pool, waiter_id)

    def _shed(self, p: PoolState, waiter: WaiterState, position: int) -> None:
        """A sheddable waiter displaced by a higher class: ``preempted_in_queue``, with
        a Retry-After from where it would stand if it queued again."""
        if not waiter.future.done():
            waited = self.clock.now() - waiter.arrived
            retry = self._estimate(p, max(1, position))
            waiter.future.set_result(Reject(0, "preempted_in_queue", retry, waited_s=waited))

    def estimate_wait(self, pool: str, position: int) -> float:
        """Expected seconds until a waiter at ``position`` (1 = head) is handed a slot:
        when the ``position``-th usable slot frees
        (:class:`~proxy.admission.retry_after.SlotForecast`, the in-process gate's
        rule), from what this gateway knows: the ages of its own sessions, the sessions
        held per replica over every gateway at the last renewal, and the session
        lengths it saw end. The ages of other gateways' sessions are not known here:
        they are taken to be spread like this gateway's own (evenly over one mean
        session length if it holds none)."""
        p = self._pool(pool)
        now = self.clock.now()
        mine: dict[str, list[float]] = {}
        for lease in p.leases.values():
            mine.setdefault(lease.replica, []).append(max(0.0, now - lease.admitted_at))
        own = sorted(age for ages in mine.values() for age in ages)
        mean = p.session_estimate_s
        groups: list[tuple[list[float], int]] = []
        free_now = 0
        for name, r in p.replicas.items():
            if not r.healthy or r.retired:
                continue
            ages = mine.get(name, [])
            held = max(p.held.get(name, 0), len(ages))
            others = held - len(ages)
            if own:  # stand-ins for other gateways' sessions, spread like ours
                ages = ages + [own[(i * len(own)) // others] for i in range(others)]
            else:
                ages = ages + [mean * (i + 0.5) / others for i in range(others)]
            if not r.guarded:
                free_now += max(0, r.cap - held)
            groups.append((ages, max(0, held - r.cap)))
        cv = p.lengths.cv if p.lengths is not None else 0.0
        return SlotForecast(groups, mean_s=mean, cv=cv, free_now=free_now).wait_s(position)

    @staticmethod
    def _queued(p: PoolState) -> int:
        return sum(1 for w in p.waiters.values() if w.queued and not w.future.done())

    def _pool(self, name: str) -> PoolState:
        try:
            return self._pools[name]
        except KeyError:
            raise LookupError(f"no pool named {name!r}") from None

    def _set_available(self, up: bool) -> None:
        self.available = up
        if self._metrics is not None:
            self._metrics.backend_up.labels("redis").set(1 if up else 0)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count(self, pool: str, decision: str, tenant: TenantSpec | None = None) -> None:
        count_decision(self.metrics, pool, decision, tenant)

    def _estimate(self, p: PoolState, position: int) -> float:
        """Whole seconds, jittered upward (:func:`~proxy.admission.retry_after.retry_after_s`)
        from the simple estimate: this gateway does not see the ages of the sessions
        other gateways run."""
        return retry_after_s(self.estimate_wait(p.name, position), self._rng.random())

    def _no_replica_wait(self, p: PoolState, now: float) -> float:
        """Until the next health re-check of a replica this gateway ejected."""
        wait = None
        if self._recheck_interval_s is not None:
            ages = [now - at for (pool, _), at in self._ejected_at.items() if pool == p.name]
            wait = next_recheck_s(ages, self._recheck_interval_s)
        return retry_after_s(wait if wait is not None else 1.0, self._rng.random())

    def _refuse(
        self, p: PoolState, reason: str, retry_after_s: float, tenant: TenantSpec | None = None
    ) -> Refused:
        self._count(p.name, f"rejected_{reason}", tenant)
        retry = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, retry_after_s))
        return refusal_for(reason, retry_after_s=retry, pool=p.name, fallback=p.fallback)

    def _refusal(self, p: PoolState, reject: Reject) -> Refused:
        return refusal_for(
            reject.reason,
            retry_after_s=reject.retry_after_s,
            pool=p.name,
            queue_position=reject.queue_position,
            fallback=p.fallback,
        )
