"""Gang reservations on the in-process gate (``admission.backend: memory``): every
reservation is this gateway's, its unclaimed slots are leases of
:class:`proxy.admission.gate.Gate` held here (docs/voice-agents.md).

The pools are taken one after another in the order given, each *without queueing*
(:meth:`proxy.admission.gate.Gate.take_now`): a pool with no free slot the key's class may take,
with a waiter of that class or a higher one in its queue (no barging), or with a full
queue, refuses at once and the slots already taken are released in the same step.
Slots not claimed within ``hold_s`` (the injected clock) are released; a gateway
shutting down releases every unclaimed slot. The rules common to both stores (metrics,
refusal types) are :mod:`proxy.admission.reservations`'.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from proxy.admission.interface import Reservation, SlotCallback, Unclaimable
from proxy.errors import TenantLimitRefused

if TYPE_CHECKING:
    from proxy.admission.auth import TenantQuotas
    from proxy.admission.gate import Gate
    from proxy.admission.session_lease import Lease
    from proxy.admission.tenants import TenantSpec
    from proxy.clock import Clock
    from proxy.settings import ApiKeySettings

__all__ = ["LocalReservations"]

log = logging.getLogger("headroom.reservations")

#: Ended tokens remembered (to say "expired" rather than "unknown").
_TOMBSTONES = 10_000


class LocalReservations:
    """Every live reservation of one gateway on the in-process gate. ``quotas``: the
    gateway's per-key session counts (reserved slots count there until claimed)."""

    def __init__(
        self, gate: Gate, clock: Clock, on_slot: SlotCallback, quotas: TenantQuotas | None
    ) -> None:
        self.gate = gate
        self.clock = clock
        self._on_slot = on_slot
        self.quotas = quotas
        self._live: dict[str, Reservation] = {}
        #: token -> (why it ended, its key)
        self._ended: OrderedDict[str, tuple[str, str | None]] = OrderedDict()

    async def reserve(
        self, token: str, pools: Sequence[str], hold_s: float, key: ApiKeySettings | None,
        tenant: TenantSpec | None, max_live: int,
    ) -> Reservation:  # fmt: skip
        """Take one slot now in each of ``pools`` for the reservation ``token``, held ``hold_s``
        seconds, counted against ``key``'s quota. All or nothing: a refusal on any pool gives
        back what was taken and raises :class:`~proxy.errors.Refused` (``tenant_limit`` when
        ``key`` already holds ``max_live`` reservations)."""
        name = key.name if key is not None else None
        live = sum(1 for r in self._live.values() if r.key == name)
        if name is not None and live >= max_live:  # (without auth: no keys)
            raise TenantLimitRefused(
                "tenant_limit", retry_after_s=hold_s, pool=pools[0],
                message=f"this API key holds {live} reservations with unclaimed slots "
                "(reservations.max_per_key); claim or release one first.",
            )  # fmt: skip
        quota: dict[str, str | None] = {}
        taken: dict[str, Lease] = {}
        try:
            for pool in pools:
                if self.quotas is not None:
                    quota[pool] = self.quotas.reserve(key, pool, hold_s)
            for pool in pools:
                taken[pool] = await self.gate.take_now(pool, tenant)
        except BaseException:
            for lease in taken.values():
                lease.release()
            for counted in quota.values():
                self._quota_release(counted)
            raise
        now = self.clock.now()
        reservation = Reservation(token, name, tuple(pools), now + hold_s, taken, quota)
        reservation.timer = self.clock.call_at(now + hold_s, lambda: self._expire(token))
        self._live[token] = reservation
        return reservation

    async def claim(
        self, token: str, pool: str, key: ApiKeySettings | None, tenant: TenantSpec | None
    ) -> Lease:
        """Hand the reserved slot of ``pool`` to the session of ``key`` presenting ``token``. Raises
        :class:`~proxy.admission.interface.Unclaimable` (``unknown``, ``expired`` with why, or
        ``pool`` when the slot is used or was never reserved); a token of another key is
        ``unknown``."""
        name = key.name if key is not None else None
        reservation = self._live.get(token)
        if reservation is None or reservation.key != name:
            ended = self._ended.get(token) if reservation is None else None
            if ended is not None and ended[1] == name:
                raise Unclaimable("expired", ended[0])
            raise Unclaimable("unknown")
        taken = reservation.unused.pop(pool, None)
        if taken is None:
            raise Unclaimable("pool", "already in use" if pool in reservation.pools
                              else "not reserved")  # fmt: skip
        # The stage connection's own count (taken unenforced) replaces the slot's.
        self._quota_release(reservation.quota.pop(pool, None))
        self._on_slot(pool, "used")
        if not reservation.unused:
            self._end(reservation, "fully used")
        return taken

    async def release(self, token: str, key: ApiKeySettings | None) -> list[str] | None:
        """Give back the reservation's unused slots: the pools released, ``[]`` if it had already
        ended, None if ``key`` holds no such token."""
        name = key.name if key is not None else None
        reservation = self._live.get(token)
        if reservation is None or reservation.key != name:
            ended = self._ended.get(token) if reservation is None else None
            return [] if ended is not None and ended[1] == name else None
        return self._drop(reservation, "released", "released")

    def close(self) -> None:
        """Release every live reservation's unused slots (the gateway stops)."""
        for reservation in list(self._live.values()):
            self._drop(reservation, "closed", "released at shutdown")

    def get(self, token: str) -> Reservation | None:
        return self._live.get(token)

    def _expire(self, token: str) -> None:
        reservation = self._live.get(token)
        if reservation is not None:
            reservation.timer = None
            pools = self._drop(reservation, "expired_unused", "expired after its hold_s")
            log.info("reservation expired with unused slots in %s", ", ".join(pools))

    def _drop(self, reservation: Reservation, outcome: str, why: str) -> list[str]:
        pools = sorted(reservation.unused)
        for pool, lease in list(reservation.unused.items()):
            lease.release()
            self._on_slot(pool, outcome)
        reservation.unused.clear()
        for counted in reservation.quota.values():
            self._quota_release(counted)
        reservation.quota.clear()
        self._end(reservation, why)
        return pools

    def _end(self, reservation: Reservation, why: str) -> None:
        if reservation.timer is not None:
            reservation.timer.cancel()
            reservation.timer = None
        self._live.pop(reservation.token, None)
        self._ended[reservation.token] = (why, reservation.key)
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)

    def _quota_release(self, token: str | None) -> None:
        if self.quotas is not None:
            self.quotas.release(token)
