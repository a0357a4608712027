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

The in-process gate hands out these classes; the shared gate hands out their
subclasses (:class:`~proxy.admission.shared_state.SharedLease`,
:class:`~proxy.admission.shared_state.SharedWaiting`). This module is the session's side
of a slot; :mod:`proxy.admission.lease_keeper` is something else: the thread that renews
the shared gate's lease records in Redis while this process holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.admission.decisions import Admit, Enqueue
    from proxy.admission.gate import Gate
    from proxy.admission.tenants import TenantSpec

__all__ = ["Lease", "PositionCallback", "Waiting"]

#: Called with (position, eta_s) when a waiter enters the queue and whenever its
#: position changes.
PositionCallback = Callable[[int, float], None]


class Lease:
    """One admitted session's slot. Release it exactly once -- calling
    :meth:`release` again is a no-op, so call it on every exit path."""

    __slots__ = (
        "_gate", "admitted_at", "pool", "released", "replica", "tenant", "ticket", "waited_s"
    )  # fmt: skip

    def __init__(
        self,
        gate: Gate,
        pool: str,
        admit: Admit,
        admitted_at: float,
        tenant: TenantSpec | None = None,
    ) -> None:
        self._gate = gate
        self.tenant = tenant
        self.pool = pool
        self.ticket = admit.ticket
        self.replica = admit.replica
        self.waited_s = admit.waited_s
        self.admitted_at = admitted_at
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate._release(self)

    async def fail_over(self, *, eject: bool = True, exclude: Collection[str] = ()) -> bool:
        """Connecting to :attr:`replica` failed before any byte was relayed: move this
        lease to another replica with a free slot, not one in ``exclude``, ejecting
        this one first if ``eject`` (it was unreachable; a failure the request may have
        caused must not eject). Returns False (lease unchanged) if there is none.
        Awaitable because the shared gate's move is a round trip to Redis; here it is
        decided at once."""
        return self._gate._fail_over(self, eject, exclude)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Lease {self.pool}/{self.replica} ticket={self.ticket} {state}>"


class Waiting:
    """A session in a pool's queue. Await :meth:`wait` for its :class:`Lease` (or a
    :class:`~proxy.errors.Refused`); cancelling that await leaves the queue at once."""

    __slots__ = ("_gate", "eta_s", "pool", "position", "ticket")

    def __init__(self, gate: Gate, pool: str, enqueue: Enqueue) -> None:
        self._gate = gate
        self.pool = pool
        self.ticket = enqueue.ticket
        self.position = enqueue.position
        self.eta_s = enqueue.eta_s

    async def wait(self) -> Lease:
        return await self._gate._wait(self.pool, self.ticket)

    def __repr__(self) -> str:
        return f"<Waiting {self.pool} ticket={self.ticket} entered at {self.position}>"
