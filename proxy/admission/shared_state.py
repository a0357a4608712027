"""What the shared gate keeps of each pool, and the lease and queue place it hands out
(:class:`proxy.admission.shared_gate.SharedGate`, ``admission.backend: redis``).

:class:`PoolState` is this gateway's state of one pool: its configuration view (caps,
health, guard flags, retired replicas, queue policy, reserves), its leases, its
waiters and their futures, the last renewal's pool-wide figures, and its Retry-After
model -- the session lengths it saw end (:class:`~proxy.admission.retry_after.SessionLengths`,
the in-process core's estimator) and the jitter's draws -- with the forecasts made
from them (:meth:`PoolState.wait_s`, :meth:`PoolState.retry_after`,
:meth:`PoolState.tenant_wait`). :class:`ReplicaState` and :class:`WaiterState` are one
replica and one waiter in it. :class:`SharedAdmissionMetrics` is the gate's own series;
:class:`SharedLease` and :class:`SharedWaiting` are what a session holds.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.admission import Admit, QueuePolicy, Reject, ReplicaSpec, Reserve, TenantSpec
from proxy.admission.redis_backend import ReplicaView
from proxy.admission.retry_after import SessionLengths, refusal_estimate_s, retry_after_s
from proxy.admission.session_lease import (
    Lease,
    MoveLease,
    PositionCallback,
    ReleaseLease,
    Waiting,
)
from proxy.clock import TimerHandle
from proxy.errors import FallbackHint

__all__ = [
    "WAKE_BLOCK_S",
    "PoolState",
    "ReplicaState",
    "SharedAdmissionMetrics",
    "SharedLease",
    "SharedPoolSpec",
    "SharedWaiting",
    "WaiterState",
]

#: How long one wake-up read blocks in Redis (seconds).
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
    #: When this gateway ejected it as unhealthy (None while healthy).
    ejected_at: float | None = None


@dataclass(eq=False)
class WaiterState:
    future: asyncio.Future[Admit | Reject]
    on_position: PositionCallback | None
    arrived: float
    position: int = 0
    #: When its wait in the queue ends (set once it is queued).
    deadline: float = float("inf")
    queued: bool = False
    timer: TimerHandle | None = None
    tenant: TenantSpec | None = None


@dataclass(eq=False)
class PoolState:
    """This gateway's state of one pool (module docstring)."""

    name: str
    replicas: dict[str, ReplicaState]
    queue: QueuePolicy
    fallback: FallbackHint | None
    #: The configured ``session_estimate_s``: the seed of :attr:`lengths`.
    session_estimate_s: float
    #: The pool's reserves as this gateway sends them with every script call.
    reserves: tuple[Reserve, ...] = ()
    #: The jitter of this pool's Retry-After (seeded, as the in-process core's).
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    draining: bool = False
    generation: str = ""
    last_renewed: float | None = None
    #: Until when (this gateway's clock) Redis blocks grants: a new generation.
    blocked_until: float = 0.0
    fence_timer: TimerHandle | None = None
    leases: dict[str, SharedLease] = field(default_factory=dict)
    waiters: dict[str, WaiterState] = field(default_factory=dict)
    #: Sessions held per replica over every gateway, and the queue's depth, as of the
    #: last renewal.
    held: dict[str, int] = field(default_factory=dict)
    queue_depth: int = 0
    #: Slot-seconds of this gateway's finished sessions per (key name, class).
    finished: dict[tuple[str, int], float] = field(default_factory=dict)
    #: The lengths of the sessions this gateway saw end (Retry-After's model).
    lengths: SessionLengths = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = SessionLengths(self.session_estimate_s)

    def view(self) -> list[ReplicaView]:
        """The replicas this gateway offers for placement (healthy, not retired), with their caps
        and guard flags, as every script call sends them."""
        return [
            ReplicaView(name, r.cap, r.guarded)
            for name, r in self.replicas.items()
            if r.healthy and not r.retired
        ]

    def queued(self) -> int:
        """This gateway's waiters in the queue now."""
        return sum(1 for w in self.waiters.values() if w.queued and not w.future.done())

    def wait_s(self, position: int, now: float) -> float:
        """Expected seconds until a waiter at ``position`` (1 = head) is handed a slot:
        when the ``position``-th usable slot frees
        (:meth:`~proxy.admission.retry_after.SessionLengths.forecast`, the in-process
        core's rule), from what this gateway knows: the ages of its own sessions, the
        sessions held per replica over every gateway at the last renewal, and the
        session lengths it saw end. The ages of other gateways' sessions are not known
        here: they are taken to be spread like this gateway's own (evenly over one mean
        session length if it holds none)."""
        mine: dict[str, list[float]] = {}
        for lease in self.leases.values():
            mine.setdefault(lease.replica, []).append(max(0.0, now - lease.admitted_at))
        own = sorted(age for ages in mine.values() for age in ages)
        mean = self.lengths.mean
        groups: list[tuple[list[float], int]] = []
        free_now = 0
        for name, r in self.replicas.items():
            if not r.healthy or r.retired:
                continue
            ages = mine.get(name, [])
            held = max(self.held.get(name, 0), len(ages))
            others = held - len(ages)
            if own:  # stand-ins for other gateways' sessions, spread like ours
                ages = ages + [own[(i * len(own)) // others] for i in range(others)]
            else:
                ages = ages + [mean * (i + 0.5) / others for i in range(others)]
            if not r.guarded:
                free_now += max(0, r.cap - held)
            groups.append((ages, max(0, held - r.cap)))
        return self.lengths.forecast(groups, free_now).wait_s(position)

    def retry_after(
        self, reason: str, position: int, now: float, recheck_interval_s: float | None = None
    ) -> float:
        """The ``Retry-After`` (whole seconds, jittered upward) for a client refused for
        ``reason`` that would stand at queue ``position``: the in-process core's rule
        (:func:`~proxy.admission.retry_after.refusal_estimate_s`)."""
        ejected_for = (
            now - r.ejected_at
            for r in self.replicas.values()
            if not r.healthy and not r.retired and r.ejected_at is not None
        )
        estimate = refusal_estimate_s(
            reason, lambda: self.wait_s(position, now), ejected_for, recheck_interval_s
        )
        return retry_after_s(estimate, self.rng.random())

    def tenant_wait(self, name: str, now: float) -> float | None:
        """Expected seconds until one of key ``name``'s sessions this gateway runs here
        ends (None if it runs none here), as the in-process core judges it: past
        ``max_sessions`` only the key's own sessions ending help. (Its sessions on other
        gateways are not seen here.)"""
        ages = [now - lease.admitted_at for lease in self.leases.values()
                if lease.tenant is not None and lease.tenant.name == name]  # fmt: skip
        if not name or not ages:
            return None
        return self.lengths.forecast([(ages, 0)]).wait_s(1)


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
    """A slot held through Redis: a :class:`Lease` with its Redis id. Its release (the
    gate's, idempotent) never awaits: the Redis release runs in the background."""

    __slots__ = ("fenced", "lease_id")

    def __init__(
        self, pool: str, lease_id: str, replica: str, *, waited_s: float, admitted_at: float,
        tenant: TenantSpec | None, release: ReleaseLease, move: MoveLease,
    ) -> None:  # fmt: skip
        super().__init__(
            pool, int(lease_id.rsplit(":", 1)[1]), replica, waited_s=waited_s,
            admitted_at=admitted_at, tenant=tenant, release=release, move=move,
        )  # fmt: skip
        self.lease_id = lease_id
        #: A fence already told this lease's session to close: the lease being found
        #: gone again (its session is still ending) does not fence the pool again.
        self.fenced = False


class SharedWaiting(Waiting):
    """A place in the pool's Redis FIFO; cancelling :meth:`wait` leaves it."""

    __slots__ = ("waiter_id",)

    def __init__(
        self, pool: str, waiter_id: str, position: int, eta_s: float,
        wait: Callable[[], Awaitable[Lease]],
    ) -> None:  # fmt: skip
        super().__init__(pool, int(waiter_id.rsplit(":", 1)[1]), position, eta_s, wait)
        self.waiter_id = waiter_id
