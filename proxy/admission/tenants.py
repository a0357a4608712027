"""Which waiter gets a freed slot: priority classes, weighted fair share, reserves.

Pure, like :mod:`proxy.admission.pool_core` (no asyncio, no clock: every method takes
``now``). :class:`~proxy.admission.pool_core.PoolCore` keeps its waiters here and asks
:meth:`TenantQueue.head` whom to serve next; the rules are decided in this module and
nowhere else.

* **Class first.** A waiter of a higher ``priority`` is always served before one of a
  lower class. A negative class is *sheddable*: when the queue is full and a waiter of
  a higher class arrives, the newest waiter of the lowest sheddable class below it is
  refused at once (``preempted_in_queue``) to make room (:meth:`TenantQueue.victim`).
* **Fair share within a class.** Each *lane* (a key with a ``weight``; keys without one
  share one FIFO lane of their class, weight 1, which is exactly the old single FIFO) has
  a virtual time: the session-seconds its sessions held, divided by its weight. A running
  session counts ``max(age, expected length)`` (so a burst of slots freed in one instant
  is spread over lanes instead of all going to the lane that was behind), and is charged
  its real length when it ends. The lane with the least virtual time is served next;
  ties go to the earliest arrival. A lane that had nothing waiting is lifted, when its
  first waiter arrives, to the least virtual time of the lanes already waiting in its
  class, so idle time is not banked as credit.
* **FIFO within a lane.** A lane's waiters leave in arrival order.
* **Nobody starves.** Every waiter keeps the deadline the core gave it (served or refused
  ``queue_timeout`` by then).

The *position* a client is shown (queue feedback, Retry-After) is its rank in the
projected service order (:meth:`TenantQueue.order`): classes from the highest, and
within a class the lanes interleaved by virtual time, each waiter advancing its lane by
the expected session length over its weight (a stride schedule).

Reserves (:class:`Reserve`) are slots only sessions of a class at or above
``priority`` may take; the core applies them (:func:`reserve_allows`).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = [
    "ANONYMOUS",
    "Reserve",
    "TenantQueue",
    "TenantSpec",
    "reserve_allows",
    "reserved_above",
]

_K = TypeVar("_K", int, str)


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One caller's scheduling identity (from its key in ``auth.keys``).

    ``name`` is the key's configured name ("" without auth); ``weight`` None means the
    key shares its class's default FIFO lane; ``max_queued`` bounds its waiters in one
    pool's queue (429 ``tenant_limit`` past it)."""

    name: str = ""
    priority: int = 0
    weight: float | None = None
    max_queued: int | None = None

    def __post_init__(self) -> None:
        if self.weight is not None and not self.weight > 0:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0")
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError(f"tenant {self.name!r}: max_queued must be >= 0")

    @property
    def sheddable(self) -> bool:
        """A class below 0: its waiters may be refused (``preempted_in_queue``) to make room for a
        higher class."""
        return self.priority < 0

    @property
    def lane(self) -> tuple[int, str]:
        """The fair-share lane: (class, key name), or (class, "") for the shared one."""
        return (self.priority, self.name if self.weight is not None else "")


#: Every session without a key (auth off): class 0, the shared FIFO lane.
ANONYMOUS = TenantSpec()


@dataclass(frozen=True, slots=True)
class Reserve:
    """Slots only sessions of class ``priority`` or higher may take: ``slots`` over the
    pool plus ``per_replica`` on each usable replica."""

    priority: int
    slots: int = 0
    per_replica: int = 0

    def __post_init__(self) -> None:
        if self.slots < 0 or self.per_replica < 0:
            raise ValueError("reserve slots must be >= 0")

    def amount(self, usable_replicas: int) -> int:
        """The slots this reserve keeps on a pool with ``usable_replicas`` replicas taking
        sessions."""
        return self.slots + self.per_replica * usable_replicas


def reserved_above(reserves: Iterable[Reserve], priority: int, usable_replicas: int) -> int:
    """Slots kept from a session of class ``priority``: every reserve for a class above
    it. The sessions of that class and the classes below it hold at most the usable
    capacity minus this."""
    return sum(r.amount(usable_replicas) for r in reserves if r.priority > priority)


def reserve_allows(
    reserves: Sequence[Reserve],
    priority: int,
    capacity: int,
    usable_replicas: int,
    active_below: Callable[[int], int],
) -> bool:
    """Whether one more session of class ``priority`` keeps every reserve above it:
    for each reserved class ``P > priority``, the sessions of the classes below ``P``
    (``active_below(P)``) stay under ``capacity`` minus the reserves of ``P`` and above.
    The lower classes see a smaller pool; a reserve in use by its class does not shrink
    it further."""
    for level in sorted({r.priority for r in reserves if r.priority > priority}):
        kept = reserved_above(reserves, level - 1, usable_replicas)
        if active_below(level) >= capacity - kept:
            return False
    return True


@dataclass(slots=True)
class _Waiter:
    ticket: int
    tenant: TenantSpec
    arrived: float
    deadline: float
    seq: int


@dataclass(slots=True)
class _Lane:
    weight: float
    #: Finished session-seconds / weight, plus any lift.
    charge: float = 0.0
    queue: deque[int] = field(default_factory=deque)
    #: Running sessions: ticket -> admitted at.
    running: dict[int, float] = field(default_factory=dict)

    def vtime(self, now: float, expected_s: float) -> float:
        """The lane's virtual time at ``now``: its charge plus its running sessions' seconds (each
        counted at least ``expected_s``), divided by its weight."""
        held = sum(max(now - t, expected_s) for t in self.running.values())
        return self.charge + held / self.weight


class TenantQueue:
    """The waiters of one pool and the fair-share state of its lanes."""

    def __init__(self) -> None:
        self._waiters: dict[int, _Waiter] = {}
        self._lanes: dict[tuple[int, str], _Lane] = {}
        self._held: dict[int, tuple[int, str]] = {}
        self._seq = 0
        #: Waiters per class and per key name (O(1) checks on every arrival).
        self._per_class: Counter[int] = Counter()
        self._per_name: Counter[str] = Counter()

    # -- waiters ----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, ticket: int) -> bool:
        return ticket in self._waiters

    def __iter__(self) -> Iterator[int]:
        """Tickets in arrival order."""
        return iter(self._waiters)

    def waiter(self, ticket: int) -> _Waiter:
        """The waiter holding ``ticket``; raises KeyError if it is not waiting."""
        return self._waiters[ticket]

    def waiters(self) -> Iterable[_Waiter]:
        """Every waiter, in arrival order."""
        return self._waiters.values()

    def push(
        self, ticket: int, tenant: TenantSpec, arrived: float, deadline: float, expected_s: float
    ) -> None:
        """Queue ``ticket`` in ``tenant``'s lane until ``deadline``. A lane that was empty is first
        lifted to the least virtual time of the other waiting lanes of its class, so time spent
        idle banks no credit."""
        lane = self._lane(tenant)
        if not lane.queue:
            self._lift(tenant.lane, lane, arrived, expected_s)
        self._seq += 1
        self._waiters[ticket] = _Waiter(ticket, tenant, arrived, deadline, self._seq)
        lane.queue.append(ticket)
        self._per_class[tenant.priority] += 1
        self._per_name[tenant.name] += 1

    def remove(self, ticket: int) -> _Waiter | None:
        """Take ``ticket`` out of the queue; returns its waiter, or None if it was not waiting."""
        waiter = self._waiters.pop(ticket, None)
        if waiter is not None:
            lane = self._lanes[waiter.tenant.lane]
            if lane.queue[0] == ticket:
                lane.queue.popleft()
            else:
                lane.queue.remove(ticket)
            _decrement(self._per_class, waiter.tenant.priority)
            _decrement(self._per_name, waiter.tenant.name)
        return waiter

    def queued_by(self, name: str) -> int:
        """Waiters of key ``name`` in this queue (for its ``max_queued``)."""
        return self._per_name.get(name, 0)

    def waiting_at_or_above(self, priority: int) -> bool:
        """Whether any waiter is of class ``priority`` or higher."""
        return any(p >= priority for p in self._per_class)

    def head(self, now: float, expected_s: float) -> _Waiter | None:
        """The waiter to serve next: highest class, then least virtual time, then the
        earliest arrival."""
        best: _Waiter | None = None
        best_key: tuple[int, float, int] | None = None
        for key, lane in self._lanes.items():
            if not lane.queue:
                continue
            first = self._waiters[lane.queue[0]]
            rank = (-key[0], lane.vtime(now, expected_s), first.seq)
            if best_key is None or rank < best_key:
                best, best_key = first, rank
        return best

    def victim(self, priority: int) -> _Waiter | None:
        """The waiter a newcomer of class ``priority`` may displace from a full queue:
        the newest of the lowest sheddable class below ``priority``, if any."""
        found: _Waiter | None = None
        for w in self._waiters.values():
            p = w.tenant.priority
            if (
                p < 0
                and p < priority
                and (
                    found is None
                    or p < found.tenant.priority
                    or (p == found.tenant.priority and w.seq > found.seq)
                )
            ):
                found = w
        return found

    def order(self, now: float, expected_s: float, newcomer: TenantSpec | None = None) -> list[int]:
        """Every waiting ticket in projected service order (see the module docstring).
        With ``newcomer``, a phantom waiter of that tenant (ticket 0) is placed too, to
        tell a refused client where it would have stood."""
        queues: dict[tuple[int, str], list[int]] = {
            key: list(lane.queue) for key, lane in self._lanes.items() if lane.queue
        }
        vt = {key: self._lanes[key].vtime(now, expected_s) for key in queues}
        if newcomer is not None:
            key = newcomer.lane
            if key not in queues:
                queues[key] = []
                lane = self._lanes.get(key)
                own = lane.vtime(now, expected_s) if lane else 0.0
                vt[key] = max(own, self._floor(key, now, expected_s, own))
            queues[key].append(0)
        seq = {t: w.seq for t, w in self._waiters.items()}
        seq[0] = self._seq + 1
        out: list[int] = []
        for priority in sorted({k[0] for k in queues}, reverse=True):
            heap = [(vt[k], seq[q[0]], k) for k, q in queues.items() if k[0] == priority]
            heapq.heapify(heap)
            cursor = {k: 0 for _, _, k in heap}
            while heap:
                v, _, k = heapq.heappop(heap)
                q = queues[k]
                out.append(q[cursor[k]])
                cursor[k] += 1
                if cursor[k] < len(q):
                    weight = self._lanes[k].weight if k in self._lanes else _weight(newcomer)
                    heapq.heappush(heap, (v + expected_s / weight, seq[q[cursor[k]]], k))
        return out

    def position(self, ticket: int, now: float, expected_s: float) -> int | None:
        """1-based rank of a waiter in :meth:`order`, or None if not waiting."""
        waiter = self._waiters.get(ticket)
        if waiter is None:
            return None
        key = waiter.tenant.lane
        if not any(k[0] == key[0] and k != key and lane.queue for k, lane in self._lanes.items()):
            # the only lane waiting in its class: behind the higher classes, FIFO
            ahead = sum(n for p, n in self._per_class.items() if p > key[0])
            return ahead + self._lanes[key].queue.index(ticket) + 1
        return self.order(now, expected_s).index(ticket) + 1

    def position_of_new(self, tenant: TenantSpec, now: float, expected_s: float) -> int:
        """Where a newcomer of ``tenant`` would stand if it were queued now."""
        return self.order(now, expected_s, tenant).index(0) + 1

    # -- sessions ---------------------------------------------------------------

    def admitted(self, ticket: int, tenant: TenantSpec, now: float) -> None:
        """``ticket`` (of ``tenant``) took a slot at ``now``: its lane is charged for it."""
        self._lane(tenant).running[ticket] = now
        self._held[ticket] = tenant.lane

    def released(self, ticket: int, now: float) -> None:
        """The session ended: its lane is charged its real length."""
        lane = self._lanes[self._held.pop(ticket)]
        lane.charge += (now - lane.running.pop(ticket)) / lane.weight

    # -- internals --------------------------------------------------------------

    def _lane(self, tenant: TenantSpec) -> _Lane:
        key = tenant.lane
        lane = self._lanes.get(key)
        weight = _weight(tenant)
        if lane is None:
            lane = self._lanes[key] = _Lane(weight)
        elif lane.weight != weight:  # the key's weight changed (reload)
            lane.charge = lane.charge * lane.weight / weight
            lane.weight = weight
        return lane

    def _floor(self, key: tuple[int, str], now: float, expected_s: float, default: float) -> float:
        """The least virtual time of the other lanes waiting in ``key``'s class."""
        others = [
            lane.vtime(now, expected_s)
            for k, lane in self._lanes.items()
            if k[0] == key[0] and k != key and lane.queue
        ]
        return min(others, default=default)

    def _lift(self, key: tuple[int, str], lane: _Lane, now: float, expected_s: float) -> None:
        own = lane.vtime(now, expected_s)
        floor = self._floor(key, now, expected_s, own)
        if floor > own:
            lane.charge += floor - own


def _decrement(counts: Counter[_K], key: _K) -> None:
    """One fewer of ``key``; a count that reaches 0 is dropped (callers iterate keys)."""
    if counts[key] <= 1:
        del counts[key]
    else:
        counts[key] -= 1


def _weight(tenant: TenantSpec | None) -> float:
    return tenant.weight if tenant is not None and tenant.weight is not None else 1.0
