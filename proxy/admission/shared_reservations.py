"""Gang reservations on the shared (Redis) backend: a reservation any gateway or worker
can claim (docs/voice-agents.md, "Admission backends and gateways").

A reservation lives in Redis (``reservations.lua``, under the tenants' hash tag), named
by the SHA-256 of its token, never the token itself. Its unclaimed slots are leases of
no gateway: each is granted by ``hold.lua`` with the expiry of the reservation's deadline
(``hold_s`` on Redis's clock) and renewed by nobody, so the reservation outlives the
gateway that issued it and its slots lapse on their own at the deadline.

* **Reserve** (any gateway): ``open`` checks the key's live reservations
  (``reservations.max_per_key``) and, for a key with ``max_sessions``, counts every slot
  in the key's quota set (tenants.lua's), all in one step; then each pool, in name
  order, grants one slot now or refuses (``hold.lua``: the decision of a plain session
  of the key's class, never a queue place). A refusal gives back every slot taken and
  the reservation (``abort``).
* **Claim** (any gateway): ``claim`` takes the pool's slot out of the reservation
  atomically (a second claim finds it gone: ``already in use``) and moves its quota
  entry to the session; the claiming gateway then confirms the lease in the pool
  (``leave.lua`` extends a granted lease by one TTL and never grants anything) and adopts
  it (:meth:`~proxy.admission.shared_sessions.SharedSessions.adopt`): from then on it
  is that gateway's lease, renewed and fenced with its sessions, released when the
  session ends. A lease that lapsed meanwhile refuses the claim (``expired``).
* **Release and expiry**: ``release`` takes every unclaimed slot out at once (DELETE, or
  the issuing gateway's timer at ``hold_s``) and the caller gives them back in their
  pools. A key other than the reservation's gets the same answer as an unknown token.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from proxy.admission.interface import Reservation, SlotCallback, Unclaimable
from proxy.admission.redis_backend import BackendUnavailable
from proxy.admission.tenants import TenantSpec
from proxy.clock import Clock, TimerHandle
from proxy.errors import Refused, TenantLimitRefused, refusal_for

if TYPE_CHECKING:
    from proxy.admission.session_lease import Lease
    from proxy.admission.shared_gate import SharedGate
    from proxy.settings import ApiKeySettings

__all__ = ["KEEP_S", "SharedReservations", "Unclaimable", "token_digest"]

log = logging.getLogger("headroom.reservations")

#: How long an ended reservation is remembered past its deadline (a late claim then
#: hears "expired" rather than "unknown").
KEEP_S = 600.0


def token_digest(token: str) -> str:
    """What Redis knows a reservation by: the SHA-256 of its token (hex)."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


class SharedReservations:
    """The gang reservations of one gateway on the shared gate."""

    def __init__(self, gate: SharedGate, clock: Clock, on_slot: SlotCallback) -> None:
        self.gate = gate
        self.clock = clock
        self._on_slot = on_slot
        #: Reservations issued here (digest -> key name, expiry timer): the timer ends
        #: them at ``hold_s`` and counts their unused slots.
        self._issued: dict[str, tuple[str, TimerHandle]] = {}

    async def reserve(
        self, token: str, pools: Sequence[str], hold_s: float, key: ApiKeySettings | None,
        tenant: TenantSpec | None, max_live: int,
    ) -> Reservation:  # fmt: skip
        """One slot in every pool (in the order given), or raises the refusing stage's
        :class:`Refused` holding nothing. ``max_live`` bounds ``key``'s reservations with
        unclaimed slots (without a key, authentication is off: no bound). Cancellation-safe."""
        gate = self.gate
        expires_at = self.clock.now() + hold_s
        digest = token_digest(token)
        name = key.name if key is not None else ""
        quota = key.max_sessions if key is not None else None
        ids = {pool: gate.new_id() for pool in pools}
        args: list[str | int] = [
            "open", digest, name, name if quota is not None else "", quota or 0,
            max_live if key is not None else 0,
            round(hold_s * 1000), round(KEEP_S * 1000),
        ]  # fmt: skip
        for pool in pools:
            args += [pool, ids[pool]]
        opening = asyncio.ensure_future(gate.backend.reservation(digest, name, args))
        try:
            opened = await asyncio.shield(opening)
        except BackendUnavailable as exc:
            log.warning("refusing a reservation: admission store unreachable (%s)", exc)
            self._abort(digest, name, ids, None)
            raise self._unavailable(pools[0]) from None
        except asyncio.CancelledError:
            self._abort(digest, name, ids, opening)  # once the open has landed
            raise
        if opened[0] == "live_limit":
            raise TenantLimitRefused(
                "tenant_limit", retry_after_s=hold_s, pool=pools[0],
                message=f"this API key holds {opened[1]} reservations with unclaimed slots "
                "(reservations.max_per_key); claim or release one first.",
            )  # fmt: skip
        if opened[0] == "tenant_limit":
            fits = int(opened[1])
            raise TenantLimitRefused(
                "tenant_limit", retry_after_s=hold_s, pool=pools[min(fits, len(pools) - 1)],
                message=f"this API key's max_sessions leaves room for {fits} more sessions "
                f"or reserved slots; this reservation needs {len(pools)}.",
            )  # fmt: skip
        for pool in pools:
            call = asyncio.ensure_future(gate.hold(pool, ids[pool], hold_s, tenant))
            try:
                await asyncio.shield(call)
            except BaseException:
                self._abort(digest, name, ids, call)
                raise
        timer = self.clock.call_at(self.clock.now() + hold_s, lambda: self._expire(digest))
        self._issued[digest] = (name, timer)
        return Reservation(token, key.name if key is not None else None, tuple(pools),
                           expires_at)  # fmt: skip

    def _abort(
        self, digest: str, name: str, ids: dict[str, str], pending: asyncio.Future[Any] | None
    ) -> None:
        self.gate.background(self._give_back(digest, name, ids, pending))

    async def _give_back(
        self, digest: str, name: str, ids: dict[str, str], pending: asyncio.Future[Any] | None
    ) -> None:
        """A reservation that never reached its client: its record, its quota entries
        and every slot it may hold (a slot whose grant is still on its way, once it
        lands) go back."""
        if pending is not None:
            await asyncio.wait({pending})
            if not pending.cancelled():
                pending.exception()  # retrieved: the caller has its answer
        try:
            await self.gate.backend.reservation(digest, name, ["abort", digest])
        except BackendUnavailable:
            pass  # the record and the quota entries lapse at the deadline
        for pool, lease_id in ids.items():
            self.gate.release_held(pool, lease_id)

    async def claim(
        self, token: str, pool: str, key: ApiKeySettings | None, tenant: TenantSpec | None
    ) -> Lease:
        """The reserved slot of ``pool``, now a lease of this gateway owned by the
        stage connection. Raises :class:`Unclaimable` or ``backend_unavailable``."""
        gate = self.gate
        digest = token_digest(token)
        name = key.name if key is not None else ""
        args: list[str | int] = ["claim", digest, name, pool, gate.backend.ttl_ms]
        try:
            got = await gate.backend.reservation(digest, name, args)
        except BackendUnavailable as exc:
            log.warning("refusing a reserved stage connection on %s: admission store "
                        "unreachable (%s)", pool, exc)  # fmt: skip
            raise self._unavailable(pool) from None
        if got[0] != "ok":
            raise Unclaimable(str(got[0]), str(got[1]) if len(got) > 1 else "")
        lease_id = str(got[1])
        quota = name if key is not None and key.max_sessions is not None else None
        lease = await gate.adopt(pool, lease_id, tenant, quota)
        if lease is None:
            self._on_slot(pool, "lost")
            raise Unclaimable("expired", "its slot lapsed before this stage connected")
        self._on_slot(pool, "used")
        return lease

    async def release(self, token: str, key: ApiKeySettings | None) -> list[str] | None:
        """DELETE: the pools whose unclaimed slots were released, [] if the reservation
        had ended, None if unknown or another key's."""
        return await self._end(token_digest(token), key.name if key else "", "released")

    async def _end(self, digest: str, name: str, outcome: str) -> list[str] | None:
        why = "expired after its hold_s" if outcome == "expired_unused" else outcome
        try:
            got = await self.gate.backend.reservation(digest, name, ["release", digest, name, why])
        except BackendUnavailable as exc:
            if outcome == "released":
                log.warning("reservation not released: admission store unreachable (%s)", exc)
                raise self._unavailable(self.gate.pools()[0]) from None
            return None  # its slots lapse at the deadline anyway
        issued = self._issued.pop(digest, None) if got[0] != "unknown" else None
        if issued is not None and outcome != "expired_unused":
            issued[1].cancel()
        if got[0] == "unknown":
            return None
        if got[0] == "ended":
            return []
        pools = []
        for pool, lease_id in zip(got[1::2], got[2::2], strict=True):
            self.gate.release_held(str(pool), str(lease_id))
            self._on_slot(str(pool), outcome)
            pools.append(str(pool))
        return sorted(pools)

    def _expire(self, digest: str) -> None:
        issued = self._issued.get(digest)
        if issued is not None:
            self.gate.background(self._expired(digest, issued[0]))

    async def _expired(self, digest: str, name: str) -> None:
        pools = await self._end(digest, name, "expired_unused")
        if pools:
            log.info("reservation expired with unused slots in %s", ", ".join(pools))

    def close(self) -> None:
        """Gateway shutdown: the reservations stay claimable on the other gateways and
        lapse at their deadlines; only this gateway's timers go."""
        for _, timer in self._issued.values():
            timer.cancel()
        self._issued.clear()

    def get(self, token: str) -> Reservation | None:
        """None: the reservations live in Redis, not in this process."""
        return None

    def _unavailable(self, pool: str) -> Refused:
        return refusal_for(
            "backend_unavailable", retry_after_s=1, pool=pool, fallback=self.gate.fallback(pool)
        )
