"""What a caller of a gate holds: a session's :class:`Lease` or its :class:`Waiting`.

Both gates (:class:`proxy.admission.gate.Gate` and
:class:`proxy.admission.shared_gate.SharedGate`) answer ``admit`` with one of these:

* :class:`Lease` -- a held slot on one replica of a pool. :meth:`Lease.release` is
  idempotent, so a session releases on every exit path in a ``finally`` and the slot is
  freed exactly once; :meth:`Lease.fail_over` moves it to another replica before any
  byte was relayed.
* :class:`Waiting` -- a place in a pool's queue. Await :meth:`Waiting.wait` for the
  :class:`Lease` (or a :class:`~proxy.errors.Refused`); cancelling that await leaves the
  queue at once. :data:`PositionCallback` is told the place's position as it moves.

Neither knows its gate: a gate hands each one the callables it works through (a
lease's ``release`` and ``move``, a waiting place's ``wait``). The in-process gate hands
out these classes; the shared gate hands out their subclasses
(:class:`~proxy.admission.shared_state.SharedLease`, which adds the Redis lease id,
and :class:`~proxy.admission.shared_state.SharedWaiting`). This module is the session's side
of a slot; :mod:`proxy.admission.lease_keeper` is something else: the thread that renews
the shared gate's lease records in Redis while this process holds them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.admission.tenants import TenantSpec

__all__ = ["Lease", "MoveLease", "PositionCallback", "ReleaseLease", "Waiting"]

#: Called with (position, eta_s) when a waiter enters the queue and whenever its
#: position changes.
PositionCallback = Callable[[int, float], None]

#: Gives a lease's slot back (called once, by :meth:`Lease.release`).
ReleaseLease = Callable[["Lease"], None]

#: Moves a lease to another replica: (lease, eject, exclude) -> moved
#: (:meth:`Lease.fail_over`).
MoveLease = Callable[["Lease", bool, Collection[str]], Awaitable[bool]]


class Lease:
    """One admitted session's slot. Release it exactly once -- calling
    :meth:`release` again is a no-op, so call it on every exit path."""

    __slots__ = (
        "_move", "_release", "admitted_at", "pool", "released", "replica", "tenant", "ticket",
        "waited_s",
    )  # fmt: skip

    def __init__(
        self,
        pool: str,
        ticket: int,
        replica: str,
        *,
        waited_s: float,
        admitted_at: float,
        tenant: TenantSpec | None,
        release: ReleaseLease,
        move: MoveLease,
    ) -> None:
        self._release = release
        self._move = move
        self.tenant = tenant
        self.pool = pool
        self.ticket = ticket
        self.replica = replica
        self.waited_s = waited_s
        self.admitted_at = admitted_at
        self.released = False

    def release(self) -> None:
        """Give the slot back. Idempotent and synchronous (the shared gate's Redis release runs in
        the gate's background), so it is safe in ``finally`` and from a cancelled task."""
        if not self.released:
            self.released = True
            self._release(self)

    async def fail_over(self, *, eject: bool = True, exclude: Collection[str] = ()) -> bool:
        """Connecting to :attr:`replica` failed before any byte was relayed: move this
        lease to another replica with a free slot, not one in ``exclude``, ejecting
        this one first if ``eject`` (it was unreachable; a failure the request may have
        caused must not eject). Returns False (lease unchanged) if there is none.
        Awaitable because the shared gate's move is a round trip to Redis (False too
        when Redis did not answer); the in-process gate decides it at once."""
        return await self._move(self, eject, exclude)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Lease {self.pool}/{self.replica} ticket={self.ticket} {state}>"


class Waiting:
    """A session in a pool's queue. Await :meth:`wait` for its :class:`Lease` (or a
    :class:`~proxy.errors.Refused`); cancelling that await leaves the queue at once."""

    __slots__ = ("_wait", "eta_s", "pool", "position", "ticket")

    def __init__(
        self,
        pool: str,
        ticket: int,
        position: int,
        eta_s: float,
        wait: Callable[[], Awaitable[Lease]],
    ) -> None:
        self._wait = wait
        self.pool = pool
        self.ticket = ticket
        self.position = position
        self.eta_s = eta_s

    async def wait(self) -> Lease:
        """The lease once a slot is handed over; raises :class:`~proxy.errors.Refused`
        (``queue_timeout``, ``draining``, ...) if refused while waiting."""
        return await self._wait()

    def __repr__(self) -> str:
        return f"<Waiting {self.pool} ticket={self.ticket} entered at {self.position}>"
