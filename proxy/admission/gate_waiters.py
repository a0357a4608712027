"""The in-process gate's waiters: the sessions in each pool's queue and its deadlines.

:class:`GateWaiters` is the base of :class:`proxy.admission.gate.Gate`: the attributes
every step uses and the steps that hand the pure core's decisions to the sessions
waiting for them -- a waiter's future resolved with its :class:`~proxy.admission.Admit`
or :class:`~proxy.admission.Reject`, a slot granted to a waiter cancelled in the same
instant released again at once, the waiters told their new positions, the pool's next
queue deadline armed on the injected :class:`~proxy.clock.Clock`. The decisions and
queue waits are counted in the series both gates record
(:mod:`proxy.admission.gate_series`). :class:`LocalPool` is what the gate keeps of one
pool around its :class:`~proxy.admission.PoolCore`; :class:`LocalWaiter` is one session
in its queue.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proxy.admission import Admit, PoolCore, Reject, TenantSpec
from proxy.admission.gate_series import count_decision, observe_queue_wait
from proxy.errors import FallbackHint, Refused, refusal_for

if TYPE_CHECKING:
    from proxy.admission.session_lease import PositionCallback
    from proxy.clock import Clock, TimerHandle
    from proxy.metering.series import Metrics

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
    """The gate's attributes (set by :class:`proxy.admission.gate.Gate`'s constructor)
    and the steps that hand the core's decisions to the waiting sessions."""

    clock: Clock
    metrics: Metrics | None
    _pools: dict[str, LocalPool]

    def _pool(self, name: str) -> LocalPool:
        try:
            return self._pools[name]
        except KeyError:
            raise LookupError(f"no pool named {name!r}") from None

    def _count(self, pool: str, decision: str, tenant: TenantSpec | None = None) -> None:
        count_decision(self.metrics, pool, decision, tenant)

    def _refusal(self, pool: str, reject: Reject) -> Refused:
        return refusal_for(
            reject.reason,
            retry_after_s=reject.retry_after_s,
            pool=pool,
            queue_position=reject.queue_position,
            fallback=self._pools[pool].fallback,
        )

    def _leave(self, p: LocalPool, ticket: int) -> None:
        """The waiter's task ended without taking its outcome (cancelled)."""
        waiter = p.waiters.pop(ticket, None)
        pool = p.core.name
        if waiter is None:
            return
        if waiter.future.done() and not waiter.future.cancelled():
            outcome = waiter.future.result()
            if isinstance(outcome, Admit):
                # The slot was handed over in the same instant the client left.
                self._count(pool, "abandoned", waiter.tenant)
                self._dispatch(pool, p, p.core.release(ticket, self.clock.now()))
            return
        self._observe_wait(p, ticket, waiter.tenant)
        self._count(pool, "abandoned", waiter.tenant)
        self._dispatch(pool, p, p.core.abandon(ticket, self.clock.now()))

    def _observe_wait(self, p: LocalPool, ticket: int, tenant: TenantSpec | None) -> None:
        enqueued = p.enqueued_at.pop(ticket, None)
        if enqueued is not None:
            observe_queue_wait(self.metrics, p.core.name, self.clock.now() - enqueued, tenant)

    def _resolve(self, pool: str, p: LocalPool, outcome: Admit | Reject) -> None:
        waiter = p.waiters.get(outcome.ticket)
        tenant = waiter.tenant if waiter is not None else None
        self._observe_wait(p, outcome.ticket, tenant)
        if waiter is not None and not waiter.future.done():
            if isinstance(outcome, Admit):
                self._count(pool, "admitted", tenant)
            else:
                self._count(pool, f"rejected_{outcome.reason}", tenant)
            # The entry stays until the waiter's task takes the outcome (or, if it is
            # cancelled first, hands an Admit back in _leave).
            waiter.future.set_result(outcome)
            return
        # Nobody will take this outcome (the waiter was cancelled in this instant).
        p.waiters.pop(outcome.ticket, None)
        if isinstance(outcome, Admit):
            self._count(pool, "abandoned", tenant)
            self._dispatch(pool, p, p.core.release(outcome.ticket, self.clock.now()))

    def _dispatch(self, pool: str, p: LocalPool, admits: list[Admit]) -> None:
        for admit in admits:
            self._resolve(pool, p, admit)
        self._arm_timer(p)
        self._notify_positions(p)

    def _notify_positions(self, p: LocalPool) -> None:
        if not any(w.on_position for w in p.waiters.values()):
            return
        now = self.clock.now()
        for position, ticket in enumerate(p.core.waiting(now), start=1):
            waiter = p.waiters.get(ticket)
            if waiter is not None and waiter.position != position:
                waiter.position = position
                if waiter.on_position is not None:
                    waiter.on_position(position, p.core.estimate_wait(position, now))

    def _arm_timer(self, p: LocalPool) -> None:
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
            self._resolve(p.core.name, p, reject)
        self._arm_timer(p)
        self._notify_positions(p)
