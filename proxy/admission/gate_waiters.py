"""The in-process gate's waiters: the sessions in each pool's queue and its deadlines.

:class:`GateWaiters` is a part of :class:`proxy.admission.gate.Gate` (held as
``Gate.waiters``): it hands the pure core's decisions to the sessions waiting for
them -- a waiter's future resolved with its :class:`~proxy.admission.Admit` or
:class:`~proxy.admission.Reject`, a slot granted to a waiter cancelled in the same
instant released again at once, the waiters told their new positions, the pool's next
queue deadline armed on the injected :class:`~proxy.clock.Clock`. The decisions and
queue waits are counted in the series both gates record
(:class:`~proxy.admission.gate_common.GateCounts`). :class:`LocalPool` is what the gate
keeps of one pool around its :class:`~proxy.admission.PoolCore`; :class:`LocalWaiter`
is one session in its queue.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proxy.admission import Admit, PoolCore, Reject, TenantSpec
from proxy.errors import FallbackHint, Refused, refusal_for

if TYPE_CHECKING:
    from proxy.admission.gate_common import GateCounts
    from proxy.admission.session_lease import PositionCallback
    from proxy.clock import Clock, TimerHandle

__all__ = ["GateWaiters", "LocalPool", "LocalWaiter"]


@dataclass(eq=False)
class LocalWaiter:
    """One session in a pool's queue: the future its outcome is handed over in."""

    future: asyncio.Future[Admit | Reject]
    on_position: PositionCallback | None
    position: int
    tenant: TenantSpec | None = None


@dataclass(eq=False)
class LocalPool:
    """What the gate keeps of one pool around its core: the fallback hint, the waiters
    and when each entered the queue, and the timer of the next queue deadline."""

    core: PoolCore
    fallback: FallbackHint | None
    waiters: dict[int, LocalWaiter] = field(default_factory=dict)
    timer: TimerHandle | None = None
    timer_at: float | None = None
    enqueued_at: dict[int, float] = field(default_factory=dict)


class GateWaiters:
    """Hands each pool core's decisions to its waiting sessions (module docstring)."""

    def __init__(self, clock: Clock, counts: GateCounts) -> None:
        self.clock = clock
        self.counts = counts

    def refusal(self, p: LocalPool, reject: Reject) -> Refused:
        """The :class:`~proxy.errors.Refused` a waiter of ``p`` raises for ``reject``, with the
        pool's fallback hint."""
        return refusal_for(
            reject.reason,
            retry_after_s=reject.retry_after_s,
            pool=p.core.name,
            queue_position=reject.queue_position,
            fallback=p.fallback,
        )

    def leave(self, p: LocalPool, ticket: int) -> None:
        """The waiter's task ended without taking its outcome (cancelled)."""
        waiter = p.waiters.pop(ticket, None)
        pool = p.core.name
        if waiter is None:
            return
        if waiter.future.done() and not waiter.future.cancelled():
            outcome = waiter.future.result()
            if isinstance(outcome, Admit):
                # The slot was handed over in the same instant the client left.
                self.counts.decision(pool, "abandoned", waiter.tenant)
                self.dispatch(p, p.core.release(ticket, self.clock.now()))
            return
        self._observe_wait(p, ticket, waiter.tenant)
        self.counts.decision(pool, "abandoned", waiter.tenant)
        self.dispatch(p, p.core.abandon(ticket, self.clock.now()))

    def _observe_wait(self, p: LocalPool, ticket: int, tenant: TenantSpec | None) -> None:
        enqueued = p.enqueued_at.pop(ticket, None)
        if enqueued is not None:
            self.counts.queue_wait(p.core.name, self.clock.now() - enqueued, tenant)

    def resolve(self, p: LocalPool, outcome: Admit | Reject) -> None:
        """Hand ``outcome`` to its waiter (or release a slot nobody will take)."""
        pool = p.core.name
        waiter = p.waiters.get(outcome.ticket)
        tenant = waiter.tenant if waiter is not None else None
        self._observe_wait(p, outcome.ticket, tenant)
        if waiter is not None and not waiter.future.done():
            if isinstance(outcome, Admit):
                self.counts.decision(pool, "admitted", tenant)
            else:
                self.counts.decision(pool, f"rejected_{outcome.reason}", tenant)
            # The entry stays until the waiter's task takes the outcome (or, if it is
            # cancelled first, hands an Admit back in leave).
            waiter.future.set_result(outcome)
            return
        # Nobody will take this outcome (the waiter was cancelled in this instant).
        p.waiters.pop(outcome.ticket, None)
        if isinstance(outcome, Admit):
            self.counts.decision(pool, "abandoned", tenant)
            self.dispatch(p, p.core.release(outcome.ticket, self.clock.now()))

    def dispatch(self, p: LocalPool, admits: list[Admit]) -> None:
        """Hand out ``admits``, re-arm the deadline and tell the waiters their places."""
        for admit in admits:
            self.resolve(p, admit)
        self.arm_timer(p)
        self.notify_positions(p)

    def notify_positions(self, p: LocalPool) -> None:
        """Call each waiter's ``on_position(position, eta_s)`` whose place in the projected service
        order changed; nothing when no waiter listens."""
        if not any(w.on_position for w in p.waiters.values()):
            return
        now = self.clock.now()
        for position, ticket in enumerate(p.core.waiting(now), start=1):
            waiter = p.waiters.get(ticket)
            if waiter is not None and waiter.position != position:
                waiter.position = position
                if waiter.on_position is not None:
                    waiter.on_position(position, p.core.estimate_wait(position, now))

    def arm_timer(self, p: LocalPool) -> None:
        """Arm the pool's next queue deadline (if it changed)."""
        deadline = p.core.next_deadline()
        if deadline == p.timer_at:
            return
        if p.timer is not None:
            p.timer.cancel()
            p.timer = None
        p.timer_at = deadline
        if deadline is not None:
            p.timer = self.clock.call_at(deadline, lambda: self._on_deadline(p, deadline))

    def _on_deadline(self, p: LocalPool, deadline: float) -> None:
        p.timer = None
        p.timer_at = None
        # An event loop may fire a timer up to one clock tick early.
        for reject in p.core.expire(max(self.clock.now(), deadline)):
            self.resolve(p, reject)
        self.arm_timer(p)
        self.notify_positions(p)
