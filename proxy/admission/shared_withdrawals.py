"""Withdrawing what a refused session's Redis call may still take.

When Redis does not answer an acquire (or a reservation's hold) in time, the gateway
refuses the session with ``backend_unavailable``; but the script may already sit in the
server's socket buffer and run when the server answers again (a ``DEBUG SLEEP``, a
stopped process, a slow fork), taking a slot for a client that is gone. A
:class:`Withdrawals` keeps each such id until Redis has run ``withdraw.lua`` for it:
that gives back whatever the call took and marks the id gone, so a call that runs
after the withdrawal takes nothing. One task drains the ids in the order they came,
retrying while Redis does not answer; ids still pending when the gate stops lapse with
the lease TTL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from proxy.admission.redis_backend import BackendUnavailable

__all__ = ["Withdrawals"]

log = logging.getLogger("headroom.shared_gate")

#: Backoff between attempts while Redis does not answer: first, and ceiling (seconds).
_FIRST_DELAY_S, _MAX_DELAY_S = 0.05, 1.0


class Withdrawals:
    """Ids whose acquire or hold this gateway gave up on, withdrawn in Redis in order
    (module docstring). ``withdraw(pool, id)`` runs withdraw.lua (raises
    :class:`BackendUnavailable` when Redis does not answer; :class:`LookupError` when
    the pool is no longer configured); ``spawn`` runs the draining task as one of the
    gate's background tasks; ``stopped`` tells when the gate has stopped."""

    def __init__(
        self,
        withdraw: Callable[[str, str], Awaitable[str]],
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
        stopped: Callable[[], bool],
    ) -> None:
        self._withdraw = withdraw
        self._spawn = spawn
        self._stopped = stopped
        #: id -> pool, in the order they were given up on.
        self._pending: dict[str, str] = {}
        self._draining = False

    @property
    def pending(self) -> int:
        """Ids not yet withdrawn in Redis."""
        return len(self._pending)

    def add(self, pool: str, lease_id: str) -> None:
        """Withdraw ``lease_id`` of ``pool`` as soon as Redis answers."""
        if self._stopped():
            return
        self._pending[lease_id] = pool
        if not self._draining:
            self._draining = True
            self._spawn(self._drain())

    async def _drain(self) -> None:
        delay = _FIRST_DELAY_S
        try:
            while self._pending and not self._stopped():
                lease_id, pool = next(iter(self._pending.items()))
                try:
                    await self._withdraw(pool, lease_id)
                except BackendUnavailable:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _MAX_DELAY_S)
                    continue
                except LookupError:
                    log.info("withdrawal of %s dropped: pool %s is gone", lease_id, pool)
                self._pending.pop(lease_id, None)
                delay = _FIRST_DELAY_S
        finally:
            self._draining = False
