"""The pure admission core of one pool: caps, placement and a strict FIFO queue.

No asyncio, no clock: every method takes ``now`` (seconds, monotonic) and returns
decisions (:mod:`proxy.admission.decisions`). The asyncio :class:`~proxy.admission.gate.Gate`
is a thin shell that turns them into awaits.

Rules, all enforced here and nowhere else:

* A replica never holds more sessions than its cap (``max_sessions``, or a lower
  cap set live). Lowering a cap never evicts; it only stops admissions until the
  replica is below it.
* A newcomer is placed on the least-loaded (by ``active / cap``) healthy, unguarded,
  non-retired replica with a free slot -- but only if nobody of its class or a higher
  one is waiting. No barging: every freed slot goes directly to the waiter
  :class:`~proxy.admission.tenants.TenantQueue` serves next (class first, then fair
  share by session-seconds between keys with a ``weight``, FIFO within a key; with no
  tenant fields configured, one plain FIFO).
* Reserves: for each reserve of a class above ``c``, a session of class ``c`` takes a
  slot only while the sessions of the classes below that reserve hold fewer than the
  usable capacity minus it (:func:`~proxy.admission.tenants.reserve_allows`): the
  classes below a reserve see a smaller cap.
* A key's ``max_queued`` bounds its waiters in the queue (``tenant_limit``); a full
  queue refuses a newcomer (``queue_full``) unless it may displace a sheddable waiter of
  a lower class, which is refused at once (``preempted_in_queue``,
  :attr:`Enqueue.displaced`).
* The queue is bounded (``max_depth``) and every waiter has a deadline
  (``max_wait_s``, or the session's own shorter bound); :meth:`PoolCore.expire`
  refuses those past it with ``queue_timeout``. An abandoned waiter leaves at once and
  is never admitted.
* Draining refuses everything new and every waiter with ``draining``.
* Each admitted ticket is released exactly once; a second release is a bug and
  raises :class:`LookupError`.

Retry-After (:mod:`proxy.admission.retry_after`) is the expected time until the slot
the refused client would have been handed frees: from the ages of the running
sessions on usable replicas, the observed session lengths (mean and spread; the
pool's ``session_estimate_s`` until a session has ended) and how many waiters stand
ahead. ``no_healthy_replica`` advises the next health re-check of an ejected replica
(``recheck_interval_s``). Whole seconds in [1, 60], spread upward by seeded jitter so
refused clients do not come back in lock-step, even at the 1 s floor.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from proxy.admission.decisions import (
    Admit,
    Decision,
    Enqueue,
    PoolStatistics,
    QueuePolicy,
    Reject,
    ReplicaSpec,
    ReplicaStatistics,
)
from proxy.admission.retry_after import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    SessionLengths,
    SlotForecast,
    refusal_estimate_s,
    retry_after_s,
)
from proxy.admission.tenants import ANONYMOUS, Reserve, TenantQueue, TenantSpec, reserve_allows

__all__ = ["PoolCore", "RETRY_AFTER_MAX_S", "RETRY_AFTER_MIN_S"]

#: A slot forecast is reused (shifted by the time elapsed) for this long while nothing
#: changes, so a refusal storm does not recompute it per refusal.
FORECAST_REUSE_S = 0.5


class _Replica:
    __slots__ = ("active", "cap", "ejected_at", "guarded", "healthy", "name", "retired")

    def __init__(self, name: str, cap: int) -> None:
        self.name = name
        self.cap = cap
        self.active = 0
        self.healthy = True
        self.ejected_at: float | None = None
        self.guarded = False
        self.retired = False

    @property
    def live(self) -> bool:
        """Its freed slots can be handed out (perhaps after the guard lets go)."""
        return self.healthy and not self.retired

    @property
    def eligible(self) -> bool:
        """Takes a new session now: healthy, not guarded, not retired, under its cap."""
        return self.healthy and not self.guarded and not self.retired and self.active < self.cap

    def snapshot(self) -> ReplicaStatistics:
        return ReplicaStatistics(
            self.name, self.active, self.cap, self.healthy, self.guarded, self.retired
        )


@dataclass(slots=True)
class _Lease:
    replica: str
    admitted_at: float
    tenant: TenantSpec


class PoolCore:
    """Admission state of one pool. Not thread-safe; call from one thread."""

    #: Seconds between health re-checks of an ejected replica (the gateway's
    #: ``health.recheck_interval_s``); None if unknown. Sets ``no_healthy_replica``'s
    #: Retry-After.
    recheck_interval_s: float | None

    def __init__(
        self,
        name: str,
        replicas: Iterable[ReplicaSpec],
        queue: QueuePolicy | None = None,
        *,
        session_estimate_s: float = 20.0,
        recheck_interval_s: float | None = None,
        seed: int = 0,
        reserves: Sequence[Reserve] = (),
    ) -> None:
        self.name = name
        self._replicas: dict[str, _Replica] = {}
        for spec in replicas:
            if spec.name in self._replicas:
                raise ValueError(f"pool {name!r}: duplicate replica {spec.name!r}")
            self._replicas[spec.name] = _Replica(spec.name, spec.max_sessions)
        if not self._replicas:
            raise ValueError(f"pool {name!r}: needs at least one replica")
        self._lengths = SessionLengths(session_estimate_s)
        self.recheck_interval_s = recheck_interval_s
        self.queue = queue or QueuePolicy()
        self._waiters = TenantQueue()
        self.reserves: tuple[Reserve, ...] = tuple(reserves)
        self._leases: dict[int, _Lease] = {}
        self._next_ticket = 1
        self._draining = False
        self._forecast: SlotForecast | None = None
        self._forecast_at = 0.0
        self._rng = random.Random(seed)
        self._last_now = 0.0
        self._finished: dict[TenantSpec, float] = {}

    # -- events -----------------------------------------------------------------

    def arrive(
        self,
        now: float,
        tenant: TenantSpec | None = None,
        *,
        queue: bool = True,
        max_wait_s: float | None = None,
    ) -> Decision:
        """A new session (of ``tenant``; None: no key) asks for a slot: admit, enqueue
        or reject it. ``queue=False``: a slot now or a refusal, never a queue place
        (where it would have waited: ``pool_full``, or ``guard``). ``max_wait_s``: this
        session's own bound on its wait, if shorter than the queue's (0: as
        ``queue=False``)."""
        spec = tenant or ANONYMOUS
        ticket = self._next_ticket
        self._next_ticket += 1
        if self._draining:
            return self._reject(ticket, "draining", position=None, now=now)
        if not any(r.healthy and not r.retired for r in self._replicas.values()):
            return self._reject(ticket, "no_healthy_replica", position=None, now=now)
        if not self._waiters.waiting_at_or_above(spec.priority) and self._may_take(spec.priority):
            replica = self._pick()
            if replica is not None:
                return self._admit(ticket, spec, replica, now, now)
        wait_s = (
            self.queue.max_wait_s if max_wait_s is None else min(max_wait_s, self.queue.max_wait_s)
        )
        if not self.queue.enabled or not queue or wait_s <= 0:
            return self._reject(ticket, self.full_reason(), position=None, now=now, tenant=spec)
        if spec.max_queued is not None and self._waiters.queued_by(spec.name) >= spec.max_queued:
            return self._reject(ticket, "tenant_limit", position=None, now=now, tenant=spec)
        displaced: tuple[Reject, ...] = ()
        if len(self._waiters) >= self.queue.max_depth:
            victim = self._waiters.victim(spec.priority)
            if victim is None:
                return self._reject(ticket, "queue_full", position=None, now=now, tenant=spec)
            self._waiters.remove(victim.ticket)
            shed_at = self._waiters.position_of_new(victim.tenant, now, self._lengths.mean)
            displaced = (
                Reject(
                    victim.ticket,
                    "preempted_in_queue",
                    self.retry_after("preempted_in_queue", shed_at, now),
                    waited_s=now - victim.arrived,
                ),
            )
        deadline = now + wait_s
        self._waiters.push(ticket, spec, now, deadline, self._lengths.mean)
        position = self._waiters.position(ticket, now, self._lengths.mean) or 1
        return Enqueue(
            ticket, position, deadline, self.estimate_wait(position, now), displaced=displaced
        )

    def release(self, ticket: int, now: float) -> list[Admit]:
        """An admitted session ended (any way at all). Returns waiters handed a slot."""
        lease = self._leases.pop(ticket, None)
        if lease is None:
            raise LookupError(f"pool {self.name!r}: ticket {ticket} holds no slot")
        replica = self._replicas[lease.replica]
        replica.active -= 1
        self._waiters.released(ticket, now)
        self._finished[lease.tenant] = self._finished.get(lease.tenant, 0.0) + (
            now - lease.admitted_at
        )
        self._lengths.observe(now - lease.admitted_at)
        self._forecast = None
        if replica.retired and replica.active == 0:
            del self._replicas[replica.name]
        return self._assign(now)

    def relocate(self, ticket: int, now: float, exclude: Collection[str] = ()) -> Admit | None:
        """Move an admitted session to another eligible replica, not one in ``exclude``
        (failover before the first byte; the caller marks the failed replica unhealthy
        first if it was unreachable). It keeps its admission, so this is not barging.
        Returns None, lease unchanged, if no other replica has a free slot."""
        lease = self._leases.get(ticket)
        if lease is None:
            raise LookupError(f"pool {self.name!r}: ticket {ticket} holds no slot")
        current = self._replicas[lease.replica]
        self._forecast = None
        current.active -= 1  # so _pick never counts this session against another replica
        target = self._pick(exclude={current.name, *exclude})
        if target is None:
            current.active += 1
            return None
        if current.retired and current.active == 0:
            del self._replicas[current.name]
        target.active += 1
        lease.replica = target.name
        return Admit(ticket, target.name)

    def abandon(self, ticket: int, now: float) -> list[Admit]:
        """A waiter left (disconnected or cancelled). Unknown tickets are ignored so the
        caller may abandon unconditionally on every exit path."""
        self._waiters.remove(ticket)
        return self._assign(now)

    def expire(self, now: float) -> list[Reject]:
        """Refuse every waiter whose deadline has passed (``queue_timeout``)."""
        expired: list[Reject] = []
        if not any(w.deadline <= now for w in self._waiters.waiters()):
            return expired
        for position, ticket in enumerate(self.waiting(now), start=1):
            waiter = self._waiters.waiter(ticket)
            if waiter.deadline <= now:
                expired.append(
                    Reject(
                        ticket,
                        "queue_timeout",
                        self.retry_after("queue_timeout", position, now),
                        queue_position=position,
                        waited_s=now - waiter.arrived,
                    )
                )
        for reject in expired:
            self._waiters.remove(reject.ticket)
        return expired

    def drain(self, now: float) -> list[Reject]:
        """Stop admitting. Every waiter is refused with ``draining``; running sessions
        keep their slots until released."""
        self._draining = True
        rejects = []
        for pos, t in enumerate(self.waiting(now), start=1):
            w = self._waiters.waiter(t)
            rejects.append(
                Reject(
                    t,
                    "draining",
                    self.retry_after("draining", pos, now),
                    queue_position=pos,
                    waited_s=now - w.arrived,
                )
            )
        for reject in rejects:
            self._waiters.remove(reject.ticket)
        return rejects

    def undrain(self, now: float) -> list[Admit]:
        """Accept sessions again (a retired pool configured again); returns any waiters admitted at
        once."""
        self._draining = False
        return self._assign(now)

    def set_cap(self, replica: str, cap: int, now: float) -> list[Admit]:
        """Change a replica's cap live. Lowering never evicts running sessions."""
        if cap < 1:
            raise ValueError(f"replica {replica!r}: cap must be >= 1 (got {cap})")
        self._replica(replica).cap = cap
        self._forecast = None
        return self._assign(now)

    def set_healthy(self, replica: str, healthy: bool, now: float) -> list[Admit]:
        """Eject a replica (``healthy=False``: its health is re-checked every
        :attr:`recheck_interval_s` from ``now``) or restore it."""
        r = self._replica(replica)
        if r.healthy and not healthy:
            r.ejected_at = now
        elif healthy:
            r.ejected_at = None
        r.healthy = healthy
        self._forecast = None
        return self._assign(now)

    def set_guarded(self, replica: str, guarded: bool, now: float) -> list[Admit]:
        """Take a replica out of placement for the guard or give it back; returns the waiters
        admitted. Raises LookupError for an unknown replica."""
        self._replica(replica).guarded = guarded
        self._forecast = None
        return self._assign(now)

    def set_queue(self, queue: QueuePolicy, now: float) -> list[Reject]:
        """Change the queue policy live. Waiters beyond a lower ``max_depth`` (the
        newest) are refused with ``queue_full``; deadlines already given are kept."""
        self.queue = queue
        rejects: list[Reject] = []
        while len(self._waiters) > (queue.max_depth if queue.enabled else 0):
            position = len(self._waiters)
            ticket = self.waiting(now)[-1]
            waiter = self._waiters.remove(ticket)
            assert waiter is not None
            rejects.append(
                Reject(
                    ticket,
                    "queue_full",
                    self.retry_after("queue_full", position, now),
                    waited_s=now - waiter.arrived,
                )
            )
        return rejects

    def add_replica(self, spec: ReplicaSpec, now: float) -> list[Admit]:
        """Add a replica, or bring back a retired one with ``spec``'s cap; returns the waiters it
        admits. Raises ValueError if a live replica has that name."""
        existing = self._replicas.get(spec.name)
        if existing is not None and not existing.retired:
            raise ValueError(f"pool {self.name!r}: replica {spec.name!r} exists")
        if existing is not None:
            existing.retired = False
            existing.cap = spec.max_sessions
        else:
            self._replicas[spec.name] = _Replica(spec.name, spec.max_sessions)
        self._forecast = None
        return self._assign(now)

    def retire_replica(self, replica: str) -> None:
        """Take a replica out of placement. Its running sessions finish; it disappears
        once the last one is released."""
        r = self._replica(replica)
        self._forecast = None
        if r.active == 0:
            del self._replicas[replica]
        else:
            r.retired = True

    # -- queries ----------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    @property
    def active(self) -> int:
        return len(self._leases)

    def next_deadline(self) -> float | None:
        """The earliest waiter deadline, for the caller's timer."""
        return min((w.deadline for w in self._waiters.waiters()), default=None)

    def position(self, ticket: int, now: float | None = None) -> int | None:
        """1-based queue position of a waiter (its rank in the projected service
        order), or None if not waiting. ``now`` defaults to the last event's time."""
        at = self._last_now if now is None else now
        return self._waiters.position(ticket, at, self._lengths.mean)

    def waiting(self, now: float | None = None) -> list[int]:
        """Waiting tickets in projected service order (the head first)."""
        at = self._last_now if now is None else now
        return self._waiters.order(at, self._lengths.mean)

    def tenant_counts(self) -> dict[TenantSpec, tuple[int, int]]:
        """(active, queued) per tenant with either, for metrics."""
        counts: dict[TenantSpec, list[int]] = {}
        for lease in self._leases.values():
            counts.setdefault(lease.tenant, [0, 0])[0] += 1
        for w in self._waiters.waiters():
            counts.setdefault(w.tenant, [0, 0])[1] += 1
        return {k: (a, q) for k, (a, q) in counts.items()}

    def tenant_wait(self, name: str, now: float) -> float | None:
        """Expected seconds until one of key ``name``'s own running sessions in this pool
        ends (None if it runs none here): the Retry-After of a ``tenant_limit`` refusal
        for ``max_sessions``, which only its own sessions ending can lift."""
        ages = [now - lease.admitted_at for lease in self._leases.values()
                if lease.tenant.name == name]  # fmt: skip
        if not name or not ages:
            return None
        return self._lengths.forecast([(ages, 0)]).wait_s(1)

    def session_seconds(self, now: float) -> dict[TenantSpec, float]:
        """Slot-seconds each tenant's sessions have held in this pool: the finished ones
        plus the running ones up to ``now`` (never decreases for a tenant)."""
        out = dict(self._finished)
        for lease in self._leases.values():
            out[lease.tenant] = out.get(lease.tenant, 0.0) + now - lease.admitted_at
        return out

    def set_reserves(self, reserves: Sequence[Reserve], now: float) -> list[Admit]:
        """Change the pool's reserves live; never evicts."""
        self.reserves = tuple(reserves)
        return self._assign(now)

    def free_slots(self) -> int:
        """Free slots on replicas that take sessions now (healthy, unguarded, live)."""
        return sum(r.cap - r.active for r in self._replicas.values() if r.eligible)

    def lease_replica(self, ticket: int) -> str | None:
        """The replica ``ticket`` holds a slot on (None if it holds none)."""
        lease = self._leases.get(ticket)
        return lease.replica if lease else None

    def replica_names(self) -> list[str]:
        """Every replica, retired ones still running sessions included."""
        return list(self._replicas)

    def estimate_wait(self, position: int, now: float) -> float:
        """Expected seconds from ``now`` until a waiter at ``position`` (1 = head) is
        handed a slot (no jitter, not rounded): when the ``position``-th usable slot
        frees, judged by the ages of the sessions running on healthy, non-retired
        replicas and the observed session lengths (:class:`SlotForecast`). While
        nothing changes, one forecast serves for :data:`FORECAST_REUSE_S`."""
        forecast = self._forecast
        elapsed = now - self._forecast_at
        if forecast is None or not 0.0 <= elapsed <= FORECAST_REUSE_S:
            forecast = self._forecast = self._forecast_now(now)
            self._forecast_at, elapsed = now, 0.0
        return max(0.0, forecast.wait_s(position) - elapsed)

    def _forecast_now(self, now: float) -> SlotForecast:
        replicas = self._replicas.values()
        free_now = sum(r.cap - r.active for r in replicas if r.eligible)
        groups: list[tuple[Sequence[float], int]]
        if all(r.live and r.active <= r.cap for r in replicas):  # the usual case: one group
            groups = [([now - lease.admitted_at for lease in self._leases.values()], 0)]
        else:
            ages: dict[str, list[float]] = {r.name: [] for r in replicas if r.live}
            for lease in self._leases.values():
                bucket = ages.get(lease.replica)
                if bucket is not None:
                    bucket.append(now - lease.admitted_at)
            groups = [
                (running, max(0, self._replicas[name].active - self._replicas[name].cap))
                for name, running in ages.items()
            ]
        return self._lengths.forecast(groups, free_now)

    def retry_after(self, reason: str, position: int, now: float) -> float:
        """The ``Retry-After`` (whole seconds, jittered upward) for a client refused for
        ``reason`` that would stand at queue ``position``
        (:func:`~proxy.admission.retry_after.refusal_estimate_s`: ``no_healthy_replica``
        advises the next health re-check of an ejected replica, if
        :attr:`recheck_interval_s` is known; otherwise until the ``position``-th slot
        frees)."""
        ejected_for = (
            now - r.ejected_at
            for r in self._replicas.values()
            if not r.healthy and not r.retired and r.ejected_at is not None
        )
        estimate = refusal_estimate_s(
            reason, lambda: self.estimate_wait(position, now), ejected_for, self.recheck_interval_s
        )
        return retry_after_s(estimate, self._rng.random())

    def statistics(self) -> PoolStatistics:
        """A snapshot for metrics, ``/readyz`` and tests; ``session_estimate_s`` is the observed
        session-length mean."""
        return PoolStatistics(
            name=self.name,
            replicas=tuple(r.snapshot() for r in self._replicas.values()),
            queue_depth=len(self._waiters),
            max_depth=self.queue.max_depth,
            max_wait_s=self.queue.max_wait_s,
            draining=self._draining,
            session_estimate_s=self._lengths.mean,
        )

    def __repr__(self) -> str:
        reps = " ".join(
            f"{r.name}={r.active}/{r.cap}"
            + ("" if r.healthy else "!unhealthy")
            + ("!guarded" if r.guarded else "")
            + ("!retired" if r.retired else "")
            for r in self._replicas.values()
        )
        drain = " draining" if self._draining else ""
        return (
            f"<PoolCore {self.name} {reps} queue={len(self._waiters)}/{self.queue.max_depth}"
            f"{drain}>"
        )

    # -- internals --------------------------------------------------------------

    def _replica(self, name: str) -> _Replica:
        try:
            return self._replicas[name]
        except KeyError:
            raise LookupError(f"pool {self.name!r} has no replica {name!r}") from None

    def _pick(self, exclude: Collection[str] = ()) -> _Replica | None:
        best: _Replica | None = None
        best_key = (2.0, 0)
        for r in self._replicas.values():
            if r.eligible and r.name not in exclude:
                key = (r.active / r.cap, r.active)
                if key < best_key:
                    best, best_key = r, key
        return best

    def _admit(
        self, ticket: int, tenant: TenantSpec, replica: _Replica, arrived: float, now: float
    ) -> Admit:
        replica.active += 1
        self._leases[ticket] = _Lease(replica.name, now, tenant)
        self._waiters.admitted(ticket, tenant, now)
        self._forecast = None
        return Admit(ticket, replica.name, waited_s=now - arrived)

    def _may_take(self, priority: int) -> bool:
        """Whether a session of class ``priority`` may take a free slot now: the
        reserves of the classes above it hold (:func:`reserve_allows`), counted over
        the replicas that take sessions now."""
        if not self.reserves:
            return True
        usable = {n for n, r in self._replicas.items() if r.live and not r.guarded}
        capacity = sum(self._replicas[n].cap for n in usable)
        classes = [lease.tenant.priority for lease in self._leases.values()
                   if lease.replica in usable]  # fmt: skip

        def below(level: int) -> int:
            return sum(1 for c in classes if c < level)

        return reserve_allows(self.reserves, priority, capacity, len(usable), below)

    def _assign(self, now: float) -> list[Admit]:
        """Hand free slots to waiters, the one :class:`TenantQueue` serves next first.
        If that waiter may not take a slot (no replica, or reserves), no later one may:
        it is of the highest class waiting, and a reserve that blocks a class blocks
        every class below it too."""
        self._last_now = now
        admitted: list[Admit] = []
        if self._draining:
            return admitted
        while self._waiters:
            head = self._waiters.head(now, self._lengths.mean)
            assert head is not None
            if not self._may_take(head.tenant.priority):
                break
            replica = self._pick()
            if replica is None:
                break
            self._waiters.remove(head.ticket)
            admitted.append(self._admit(head.ticket, head.tenant, replica, head.arrived, now))
        return admitted

    def full_reason(self) -> str:
        """Why a pool with no slot for a newcomer is full: ``guard`` if a live replica
        has room the guard holds back, else ``pool_full``."""
        live = [r for r in self._replicas.values() if r.healthy and not r.retired]
        if any(r.guarded and r.active < r.cap for r in live):
            return "guard"
        return "pool_full"

    def _reject(
        self,
        ticket: int,
        reason: str,
        position: int | None,
        now: float,
        tenant: TenantSpec | None = None,
    ) -> Reject:
        """Refuse a newcomer; Retry-After from where ``tenant`` would have stood."""
        if tenant is None or not self._waiters:
            waiting_position = len(self._waiters) + 1
        else:
            waiting_position = self._waiters.position_of_new(tenant, now, self._lengths.mean)
        return Reject(
            ticket, reason, self.retry_after(reason, waiting_position, now), queue_position=position
        )
