"""The shared gate's link to Redis: what every one of its parts works on.

:class:`SharedStore` holds the Redis backend
(:class:`~proxy.admission.redis_backend.RedisAdmission`), the clock, this gateway's
pools (:class:`~proxy.admission.shared_state.PoolState` by name), the gate's background
tasks and loops, whether Redis answered the last call (``/readyz``), the drain and
stop flags, and the decision series. Its calls are the ones several parts make: a
refusal and its Retry-After, the Redis release of a lease retried until it lands,
leaving the queue in Redis, withdrawing an id, refusing a waiter that was shed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from proxy.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, Reject, TenantSpec
from proxy.admission.gate_common import GateCounts
from proxy.admission.redis_backend import BackendUnavailable, RedisAdmission
from proxy.admission.shared_state import PoolState, SharedAdmissionMetrics, WaiterState
from proxy.errors import Refused, refusal_for

if TYPE_CHECKING:
    from proxy.clock import Clock
    from proxy.metering.series import Metrics

_T = TypeVar("_T")

__all__ = ["SharedStore"]

log = logging.getLogger("headroom.shared_gate")


class SharedStore:
    """The shared gate's Redis, clock, pools and background work (module docstring)."""

    def __init__(
        self, backend: RedisAdmission, clock: Clock, metrics: Metrics | None, lease_ttl_s: float
    ) -> None:
        self.backend = backend
        self.clock = clock
        self.lease_ttl_s = lease_ttl_s
        self.counts = GateCounts(metrics)
        #: The shared gate's own series (None without metrics).
        self.series = SharedAdmissionMetrics(metrics.registry) if metrics else None
        self.pools: dict[str, PoolState] = {}
        #: One-off background calls (releases, renewals asked for, withdrawals).
        self.tasks: set[asyncio.Task[Any]] = set()
        #: The renew loop and each pool's wake loop, while the gate runs.
        self.loops: list[asyncio.Task[None]] = []
        #: Seconds between health re-checks of an ejected replica (None: unknown).
        self.recheck_interval_s: float | None = None
        #: Whether the last call to Redis succeeded (``/readyz``).
        self.available = False
        #: Set by a drain: everything new is refused.
        self.draining = False
        #: Set by the gate's stop first: the background loops end at their next turn.
        self.closing = False
        self.stopped = False
        self._next = 0

    def pool(self, name: str) -> PoolState:
        """The state of pool ``name``; raises LookupError for an unknown pool."""
        try:
            return self.pools[name]
        except KeyError:
            raise LookupError(f"no pool named {name!r}") from None

    def new_id(self) -> str:
        """A fresh lease id of this gateway (``<gateway>:<n>``)."""
        self._next += 1
        return f"{self.backend.gateway_id}:{self._next}"

    def spawn(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Future[_T]:
        """Run ``coro`` as a background task the gate tracks (``quiesce`` waits for it, ``stop``
        gives it a last chance); returns the task."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def set_available(self, up: bool) -> None:
        """Record whether Redis answered the last call (``/readyz``,
        ``headroom_admission_backend_up``)."""
        self.available = up
        if self.series is not None:
            self.series.backend_up.labels("redis").set(1 if up else 0)

    def retry_after(
        self, p: PoolState, reason: str, position: int, at: float | None = None
    ) -> float:
        """``p``'s Retry-After for ``reason`` at queue ``position``, as of ``at`` (None:
        now)."""
        now = self.clock.now() if at is None else at
        return p.retry_after(reason, position, now, self.recheck_interval_s)

    def refuse(
        self, p: PoolState, reason: str, retry_after_s: float, tenant: TenantSpec | None = None
    ) -> Refused:
        """Count and build the refusal of a newcomer."""
        self.counts.decision(p.name, f"rejected_{reason}", tenant)
        retry = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, retry_after_s))
        return refusal_for(reason, retry_after_s=retry, pool=p.name, fallback=p.fallback)

    def refusal(self, p: PoolState, reject: Reject) -> Refused:
        """The refusal a waiter hears for ``reject``."""
        return refusal_for(
            reject.reason,
            retry_after_s=reject.retry_after_s,
            pool=p.name,
            queue_position=reject.queue_position,
            fallback=p.fallback,
        )

    def reject_waiter(self, waiter: WaiterState, reason: str, retry: float) -> None:
        """Resolve a waiter still waiting with a refusal for ``reason``."""
        if not waiter.future.done():
            waited = self.clock.now() - waiter.arrived
            waiter.future.set_result(Reject(0, reason, retry, waited_s=waited))

    def shed(self, p: PoolState, waiter: WaiterState, position: int) -> None:
        """A sheddable waiter displaced by a higher class: ``preempted_in_queue``, with
        a Retry-After from where it would stand if it queued again."""
        if not waiter.future.done():
            retry = self.retry_after(p, "preempted_in_queue", max(1, position))
            self.reject_waiter(waiter, "preempted_in_queue", retry)

    async def release_remote(self, pool: str, lease_id: str) -> None:
        """Release in Redis, retrying while Redis is unreachable; gives up once the
        lease has expired on its own (it then frees its slot anyway)."""
        give_up = self.clock.now() + self.lease_ttl_s
        delay = 0.05
        while True:
            try:
                await self.backend.release(pool, lease_id, self.pools[pool].view())
                self.set_available(True)
                return
            except BackendUnavailable:
                self.set_available(False)
                if self.stopped or self.clock.now() + delay > give_up:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def leave_remote(self, pool: str, waiter_id: str) -> None:
        """Leave the queue in Redis; a grant found there is released."""
        try:
            kind, _ = await self.backend.leave(pool, waiter_id, self.pools[pool].view())
        except BackendUnavailable:
            return  # its heartbeat stops: Redis drops it within the heartbeat TTL
        if kind == "granted":
            await self.release_remote(pool, waiter_id)

    async def withdraw_now(self, pool: str, lease_id: str) -> str:
        """withdraw.lua for ``lease_id`` (the call of
        :class:`~proxy.admission.shared_withdrawals.Withdrawals`); LookupError if ``pool``
        is no longer configured."""
        reply = await self.backend.withdraw(pool, lease_id, self.pool(pool).view())
        self.set_available(True)
        return reply
