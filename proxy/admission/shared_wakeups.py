"""Wake-ups and queue deadlines, for the shared gate's waiters.

A slot freed on any gateway is handed to the head of the pool's Redis queue and its
waiter's id pushed on the pool's wake list; this gateway's wake loop (one per pool)
blocks on that list and takes a slot only once Redis confirms the lease is live
(``leave.lua`` of a granted waiter extends its lease and names the replica). A
waiter's queue deadline leaves the queue in Redis (a grant found then is taken); a
waiter shed by a higher class hears ``preempted_in_queue``.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.admission import Admit, Reject
from proxy.admission.redis_backend import BackendUnavailable
from proxy.admission.shared_state import (
    WAKE_BLOCK_S,
    PoolState,
    SharedGateState,
    WaiterState,
)

__all__ = ["SharedWakeups"]

log = logging.getLogger("headroom.shared_gate")


class SharedWakeups(SharedGateState):
    """The shared gate's wake loop and queue deadlines (module docstring)."""

    def _on_deadline(self, pool: str, waiter_id: str) -> None:
        self._spawn(self._expire(pool, waiter_id))

    async def _expire(self, pool: str, waiter_id: str) -> None:
        p = self._pools[pool]
        waiter = p.waiters.get(waiter_id)
        if waiter is None or waiter.future.done():
            return
        try:
            kind, replica = await self.backend.leave(pool, waiter_id, p.view())
        except BackendUnavailable:
            kind, replica = "gone", None
        if waiter.future.done():
            return
        if kind == "granted" and replica is not None:
            waiter.future.set_result(Admit(0, replica, self.clock.now() - waiter.arrived))
        elif kind == "shed":  # its wake-up is on the way: the same outcome, now
            self._shed(p, waiter, waiter.position)
        else:
            waited = self.clock.now() - waiter.arrived
            waiter.future.set_result(
                Reject(0, "queue_timeout", self._estimate(p, 1), waited_s=waited)
            )

    async def _wake_loop(self, pool: str) -> None:
        delay = 0.05
        while not self._closing:
            try:
                woken = await self.backend.wakeups(pool, WAKE_BLOCK_S)
            except BackendUnavailable:
                self._set_available(False)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            delay = 0.05
            p = self._pools.get(pool)
            for waiter_id, message in woken:  # the confirm says which replica
                waiter = p.waiters.get(waiter_id) if p is not None else None
                if message.startswith("!"):  # refused in the queue: '!<reason> <position>'
                    if p is not None and waiter is not None:
                        self._shed(p, waiter, int(message.rpartition(" ")[2] or 1))
                    continue
                if waiter is not None and not waiter.future.done():
                    self._spawn(self._confirm(pool, waiter_id, waiter))
                elif p is None or not self._taken(p, waiter_id, waiter):
                    self._spawn(self._release_remote(pool, waiter_id))  # nobody takes it

    @staticmethod
    def _taken(p: PoolState, waiter_id: str, waiter: WaiterState | None) -> bool:
        """Whether the slot granted to ``waiter_id`` already reached its session by
        another way (its queue deadline's ``leave`` found the grant): the wake-up for
        it is then a duplicate, not a slot nobody takes."""
        if waiter_id in p.leases:
            return True
        future = waiter.future if waiter is not None else None
        return (future is not None and future.done() and not future.cancelled()
                and isinstance(future.result(), Admit))  # fmt: skip

    async def _confirm(self, pool: str, waiter_id: str, waiter: WaiterState) -> None:
        """Take a slot handed over through the wake list only once Redis confirms the
        lease is live (``leave`` of a granted waiter extends its lease and names the
        replica; it never grants anything): a gateway paused longer than the lease TTL
        finds grants in its wake list that lapsed and went to other sessions meanwhile.
        A lapsed grant refuses the waiter (``backend_unavailable``, as when a renewal
        finds its queue place gone). If the waiter was resolved meanwhile by another path
        (its queue deadline's ``leave`` found the grant and took it, a renewal refused
        it, its client left), that path owns the outcome and this one does nothing."""
        p = self._pools[pool]
        try:
            kind, replica = await self.backend.leave(pool, waiter_id, p.view())
        except BackendUnavailable:
            self._set_available(False)
            kind, replica = "unavailable", None
        if waiter.future.done() or p.waiters.get(waiter_id) is not waiter:
            return
        waited = self.clock.now() - waiter.arrived
        if kind == "granted" and replica is not None:
            waiter.future.set_result(Admit(0, replica, waited))
            return
        if kind == "shed":
            self._shed(p, waiter, waiter.position)
            return
        if kind != "unavailable":
            log.warning("pool %s: the slot handed to %s lapsed before this gateway took it",
                        pool, waiter_id)  # fmt: skip
        waiter.future.set_result(Reject(0, "backend_unavailable", 1.0, waited_s=waited))
