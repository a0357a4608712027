"""Wake-ups and queue deadlines, for the shared gate's waiters.

A slot freed on any gateway is handed to the head of the pool's Redis queue and its
waiter's id pushed on the pool's wake list; this gateway's wake loop (one per pool)
blocks on that list and takes a slot only once Redis confirms the lease is live
(``leave.lua`` of a granted waiter extends its lease and names the replica). A
waiter's queue deadline leaves the queue in Redis (a grant found then is taken); a
waiter shed by a higher class hears ``preempted_in_queue``. :class:`SharedWakeups`
is the shared gate's part that runs these; the waiters themselves are their pool's
(:class:`~proxy.admission.shared_state.PoolState`).
"""

from __future__ import annotations

import asyncio
import logging

from proxy.admission import Admit
from proxy.admission.redis_backend import BackendUnavailable
from proxy.admission.shared_state import WAKE_BLOCK_S, PoolState, WaiterState
from proxy.admission.shared_store import SharedStore

__all__ = ["SharedWakeups"]

log = logging.getLogger("headroom.shared_gate")


class SharedWakeups:
    """The shared gate's wake loops and queue deadlines (module docstring)."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store

    def on_deadline(self, pool: str, waiter_id: str) -> None:
        """The waiter's queue deadline passed: leave the queue in Redis. The refusal's
        Retry-After is judged now, as the in-process core judges it: as of the deadline, at
        the place it then holds -- behind this gateway's waiters still waiting ahead of
        it whose deadline is not earlier (those leave by their own deadlines)."""
        p = self.store.pools[pool]
        waiter = p.waiters.get(waiter_id)
        if waiter is None or waiter.future.done():
            return
        at = max(self.store.clock.now(), waiter.deadline)
        ahead = sum(
            1
            for w in p.waiters.values()
            if w.queued and not w.future.done() and w.position < waiter.position
            and w.deadline >= at
        )  # fmt: skip
        retry = self.store.retry_after(p, "queue_timeout", ahead + 1, at)
        self.store.spawn(self._expire(pool, waiter_id, retry))

    async def _expire(self, pool: str, waiter_id: str, retry: float) -> None:
        store = self.store
        p = store.pools[pool]
        waiter = p.waiters.get(waiter_id)
        if waiter is None or waiter.future.done():
            return
        try:
            kind, replica = await store.backend.leave(pool, waiter_id, p.view())
        except BackendUnavailable:
            kind, replica = "gone", None
        if waiter.future.done():
            return
        if kind == "granted" and replica is not None:
            waiter.future.set_result(Admit(0, replica, store.clock.now() - waiter.arrived))
        elif kind == "shed":  # its wake-up is on the way: the same outcome, now
            store.shed(p, waiter, waiter.position)
        else:
            store.reject_waiter(waiter, "queue_timeout", retry)

    async def loop(self, pool: str) -> None:
        """Take the wake-ups of ``pool``'s waiters until the gate closes."""
        store = self.store
        delay = 0.05
        while not store.closing:
            try:
                woken = await store.backend.wakeups(pool, WAKE_BLOCK_S)
            except BackendUnavailable:
                store.set_available(False)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            delay = 0.05
            p = store.pools.get(pool)
            for waiter_id, message in woken:  # the confirm says which replica
                waiter = p.waiters.get(waiter_id) if p is not None else None
                if message.startswith("!"):  # refused in the queue: '!<reason> <position>'
                    if p is not None and waiter is not None:
                        store.shed(p, waiter, int(message.rpartition(" ")[2] or 1))
                    continue
                if waiter is not None and not waiter.future.done():
                    store.spawn(self._confirm(pool, waiter_id, waiter))
                elif p is None or not self._taken(p, waiter_id, waiter):
                    store.spawn(store.release_remote(pool, waiter_id))  # nobody takes it

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
        store = self.store
        p = store.pools[pool]
        try:
            kind, replica = await store.backend.leave(pool, waiter_id, p.view())
        except BackendUnavailable:
            store.set_available(False)
            kind, replica = "unavailable", None
        if waiter.future.done() or p.waiters.get(waiter_id) is not waiter:
            return
        if kind == "granted" and replica is not None:
            waiter.future.set_result(Admit(0, replica, store.clock.now() - waiter.arrived))
            return
        if kind == "shed":
            store.shed(p, waiter, waiter.position)
            return
        if kind != "unavailable":
            log.warning("pool %s: the slot handed to %s lapsed before this gateway took it",
                        pool, waiter_id)  # fmt: skip
        store.reject_waiter(waiter, "backend_unavailable", 1.0)
