"""Gang admission: one reservation holding a slot in every stage of a voice agent.

``POST /v1/headroom/reservations {"pools": ["asr-main", "tts-main"], "hold_s": 5}``
takes one slot in each named pool, or none (docs/voice-agents.md):

* **All or nothing, without deadlock.** The pools are taken one after another in a
  canonical order (sorted by name), each *without queueing*: a pool with no free slot,
  or with anyone waiting in its queue (no barging), refuses at once. If any stage
  refuses, the slots already taken are released in the same step and the caller gets
  that stage's refusal (status, ``Retry-After``, reason, fallback; the body's
  ``error.stage`` and the ``X-Headroom-Stage`` header name the stage). Since nobody ever
  waits while holding a slot, two reservations cannot wait on each other.
* **Claims.** A stage connection presents the token (header ``X-Headroom-Reservation``
  or query parameter ``headroom_reservation``; both are stripped before forwarding) and
  uses its reserved slot instead of entering the pool's queue. The connection then owns
  the slot and releases it when it ends, on every exit path, like any lease. A token
  that does not hold an unused slot for that pool is refused (409, close 1008), never
  silently admitted the normal way: ``reservation_unknown`` (never issued by this
  gateway, or fully ended), ``reservation_expired`` (``hold_s`` passed before this stage
  connected, or the reservation was released), ``reservation_pool`` (no slot for this
  pool in it, or that slot is already in use).
* **Expiry and release.** Slots not claimed within ``hold_s`` (the injected clock) are
  released; ``DELETE /v1/headroom/reservations/{token}`` releases the unclaimed rest at
  once. Only the key that reserved may release: any other key hears 404, exactly as
  for a token never issued.
* **Every rule of a session.** A reserved slot is taken as a session of the key's class
  would be (the reserves kept for higher classes hold) and counts against the key's
  ``max_sessions`` from the reservation until its session ends; a claim takes over
  that count instead of adding one. ``hold_s`` is bounded (``reservations.max_hold_s``)
  and so are the reservations with unclaimed slots one key holds at once
  (``reservations.max_per_key``, with authentication on; past it 429
  ``tenant_limit``).
* **Backends.** In process (``backend: memory``) everything is this gateway's, and a
  gateway shutting down releases every unclaimed slot. On Redis a reservation lives in
  Redis and any gateway or worker can claim it
  (:mod:`proxy.admission.shared_reservations`).

A token is a bearer secret: it is never logged, and Redis stores only its SHA-256.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter

from proxy.admission import TenantSpec
from proxy.auth import TenantQuotas
from proxy.clock import Clock, TimerHandle
from proxy.errors import PolicyViolation, Refused, TenantLimitRefused, refusal_for
from proxy.gate import Gate, Lease, Waiting, count_decision
from proxy.reservation_requests import (
    MAX_POOLS,
    QUERY_PARAMETER,
    RESERVATION_HEADER,
    BadReservation,
    key_of,
    parse_request,
    presented_token,
)
from proxy.settings import ApiKeySettings, ReservationSettings
from proxy.shared_gate import ADMITTED_POOL, SharedGate

__all__ = [
    "MAX_POOLS",
    "QUERY_PARAMETER",
    "RESERVATION_HEADER",
    "BadReservation",
    "Reservation",
    "ReservationExpired",
    "ReservationPool",
    "ReservationRefused",
    "ReservationUnknown",
    "Reservations",
    "key_of",
    "parse_request",
    "presented_token",
]

log = logging.getLogger("headroom.reservations")

#: Ended tokens remembered (to say "expired" rather than "unknown").
_TOMBSTONES = 10_000
_DEFAULTS = ReservationSettings()


class ReservationRefused(PolicyViolation):
    """A stage connection presented a token that holds no unused slot for its pool:
    409, WebSocket close 1008. Not retryable with the same token: reserve again."""

    http_status: ClassVar[int] = 409


class ReservationUnknown(ReservationRefused):
    code: ClassVar[str] = "reservation_unknown"


class ReservationExpired(ReservationRefused):
    code: ClassVar[str] = "reservation_expired"


class ReservationPool(ReservationRefused):
    code: ClassVar[str] = "reservation_pool"


class ReservationMetrics:
    """The reservation series (README metrics table), on the gateway's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reservations = Counter(
            "headroom_reservations_total",
            "Gang reservation requests by outcome: granted (a slot in every stage), "
            "refused (a stage had no slot: nothing held), invalid (bad request or key).",
            ["outcome"], registry=registry,
        )  # fmt: skip
        self.refusals = Counter(
            "headroom_reservation_refusals_total",
            "Gang reservations refused, by the stage (pool) that refused and its reason.",
            ["pool", "reason"], registry=registry,
        )  # fmt: skip
        self.slots = Counter(
            "headroom_reservation_slots_total",
            "Reserved slots by how they left the reservation: used (claimed by a stage "
            "connection, counted where it connected), expired_unused (hold_s passed), "
            "released (DELETE), lost (its lease lapsed before the claim), closed "
            "(gateway shutdown, in process).",
            ["pool", "outcome"], registry=registry,
        )  # fmt: skip
        self.claims_refused = Counter(
            "headroom_reservation_claims_refused_total",
            "Stage connections refused because their reservation token held no unused "
            "slot for their pool, by code.",
            ["code"], registry=registry,
        )  # fmt: skip


@dataclass(eq=False)
class Reservation:
    token: str
    key: str | None
    pools: tuple[str, ...]
    expires_at: float
    #: Unclaimed slots, by pool (in process; on Redis they are in Redis).
    unused: dict[str, Lease] = field(default_factory=dict)
    #: The key's quota count each unclaimed slot holds (in process), by pool.
    quota: dict[str, str | None] = field(default_factory=dict)
    timer: TimerHandle | None = None


def _tenant(key: ApiKeySettings | None) -> TenantSpec | None:
    return TenantSpec(key.name, key.priority, key.weight, key.max_queued) if key else None


class Reservations:
    """Every live reservation of one gateway. ``quotas``: the gateway's per-key session
    counts (in process; reserved slots count there until claimed); ``limits``: the
    ``reservations`` settings in force (read at each reservation: live on reload)."""

    def __init__(
        self,
        gate: Gate | SharedGate,
        clock: Clock,
        registry: CollectorRegistry | None,
        *,
        quotas: TenantQuotas | None = None,
        limits: Callable[[], ReservationSettings] | None = None,
    ) -> None:
        self.gate = gate
        self.clock = clock
        self.metrics = ReservationMetrics(registry) if registry is not None else None
        self.quotas = quotas
        self.limits = limits or (lambda: _DEFAULTS)
        self._live: dict[str, Reservation] = {}
        #: token -> (why it ended, its key)
        self._ended: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._shared: Any = None
        if isinstance(gate, SharedGate):
            from proxy.admission.shared_reservations import SharedReservations

            self._shared = SharedReservations(gate, clock, self._slot)

    # -- reserve ------------------------------------------------------------------

    async def reserve(
        self, pools: Sequence[str], hold_s: float, key: ApiKeySettings | None = None
    ) -> Reservation:
        """Take one slot in every pool, or none: raises the refusing stage's
        :class:`Refused` (its ``pool`` names the stage). ``key``: the API key the token
        is bound to (claims and DELETE must present the same key); its class and
        ``max_sessions`` apply to the slots."""
        order = sorted(pools)
        name = key.name if key is not None else None
        limits = self.limits()
        now = self.clock.now()
        try:
            if self._shared is not None:
                token = secrets.token_urlsafe(24)
                await self._shared.reserve(
                    token, order, hold_s, key, _tenant(key), limits.max_per_key
                )
                reservation = Reservation(token, name, tuple(order), now + hold_s)
            else:
                reservation = await self._reserve_here(order, hold_s, key, limits)
        except Refused as exc:
            self._count("refused")
            if self.metrics is not None:
                self.metrics.refusals.labels(exc.pool, exc.reason).inc()
            raise
        self._count("granted")
        return reservation

    async def _reserve_here(
        self, order: list[str], hold_s: float, key: ApiKeySettings | None,
        limits: ReservationSettings,
    ) -> Reservation:  # fmt: skip
        name = key.name if key is not None else None
        live = sum(1 for r in self._live.values() if r.key == name)
        if name is not None and live >= limits.max_per_key:  # (without auth: no keys)
            raise TenantLimitRefused(
                "tenant_limit", retry_after_s=hold_s, pool=order[0],
                message=f"this API key holds {live} reservations with unclaimed slots "
                "(reservations.max_per_key); claim or release one first.",
            )  # fmt: skip
        quota: dict[str, str | None] = {}
        taken: dict[str, Lease] = {}
        try:
            for pool in order:
                if self.quotas is not None:
                    quota[pool] = self.quotas.reserve(key, pool, hold_s)
            for pool in order:
                taken[pool] = await self._take(pool, _tenant(key))
        except BaseException:
            for lease in taken.values():
                lease.release()
            for token in quota.values():
                self._quota_release(token)
            raise
        token = secrets.token_urlsafe(24)
        now = self.clock.now()
        reservation = Reservation(token, name, tuple(order), now + hold_s, taken, quota)
        reservation.timer = self.clock.call_at(now + hold_s, lambda: self._expire(token))
        self._live[token] = reservation
        return reservation

    async def _take(self, pool: str, tenant: TenantSpec | None = None) -> Lease:
        """One slot of ``pool`` now, never a place in its queue: the decision for a
        plain session of ``tenant``'s class (reserves, no barging past its class)."""
        gate = self.gate
        if isinstance(gate, SharedGate):
            entry = await gate.admit(pool, queue=False, tenant=tenant)
            assert isinstance(entry, Lease)
            return entry
        core = gate.core(pool)
        stats = core.statistics()
        full_queue = core.queue.enabled and core.queue_depth >= core.queue.max_depth
        if (
            not stats.draining
            and stats.healthy_replicas > 0
            and (full_queue or core.free_slots() == 0)
        ):
            raise self._full(gate, pool)
        entry = gate.enter(pool, tenant=tenant)  # admits at once, or refuses
        if isinstance(entry, Waiting):  # kept out by a waiter or a reserve above its class
            await _back_out(entry)
            raise self._full(gate, pool)
        return entry

    @staticmethod
    def _full(gate: Gate, pool: str) -> Refused:
        core = gate.core(pool)
        reason = core.full_reason()
        count_decision(gate.metrics, pool, f"rejected_{reason}", None)
        retry = core.retry_after(reason, core.queue_depth + 1, gate.clock.now())
        return refusal_for(reason, retry_after_s=retry, pool=pool, fallback=gate.fallback(pool))

    # -- claim, release, expiry -------------------------------------------------------

    async def claim(self, token: str, pool: str, key: ApiKeySettings | None) -> Lease:
        """The reserved slot of ``pool`` for a stage connection, which then owns it
        (releases it when it ends). Raises a :class:`ReservationRefused`."""
        if self._shared is not None:
            from proxy.admission.shared_reservations import Unclaimable

            try:
                lease: Lease = await self._shared.claim(token, pool, key, _tenant(key))
            except Unclaimable as err:
                raise self._unclaimable(err.code, err.detail, pool) from None
            return lease
        name = key.name if key is not None else None
        reservation = self._live.get(token)
        if reservation is None or reservation.key != name:
            ended = self._ended.get(token) if reservation is None else None
            if ended is not None and ended[1] == name:
                raise self._unclaimable("expired", ended[0], pool)
            raise self._unclaimable("unknown", "", pool)
        taken = reservation.unused.pop(pool, None)
        if taken is None:
            what = "already in use" if pool in reservation.pools else "not reserved"
            raise self._unclaimable("pool", what, pool)
        # The stage connection's own count (taken unenforced) replaces the slot's.
        self._quota_release(reservation.quota.pop(pool, None))
        self._slot(pool, "used")
        ADMITTED_POOL.set(pool)
        if not reservation.unused:
            self._end(reservation, "fully used")
        return taken

    def _unclaimable(self, code: str, detail: str, pool: str) -> ReservationRefused:
        err: ReservationRefused
        if code == "unknown":
            err = ReservationUnknown(
                "no such reservation (or not this key's): reserve again")  # fmt: skip
        elif code == "expired":
            err = ReservationExpired(f"reservation {detail}: reserve again")
        else:
            err = ReservationPool(f"this reservation's slot for pool {pool!r} is {detail}")
        if self.metrics is not None:
            self.metrics.claims_refused.labels(err.code).inc()
        return err

    async def release(self, token: str, key: ApiKeySettings | None) -> list[str] | None:
        """Release the unclaimed slots (DELETE): the pools released, [] if the
        reservation had already ended, None if unknown or another key's (the same
        answer: a key learns nothing about tokens that are not its own)."""
        if self._shared is not None:
            released: list[str] | None = await self._shared.release(token, key)
            return released
        name = key.name if key is not None else None
        reservation = self._live.get(token)
        if reservation is None or reservation.key != name:
            ended = self._ended.get(token) if reservation is None else None
            return [] if ended is not None and ended[1] == name else None
        return self._drop(reservation, "released", "released")

    def close(self) -> None:
        """Gateway shutdown: release every unclaimed slot held here (on Redis the
        reservations stay claimable on the other gateways until their deadline)."""
        if self._shared is not None:
            self._shared.close()
        for reservation in list(self._live.values()):
            self._drop(reservation, "closed", "released at shutdown")

    def get(self, token: str) -> Reservation | None:
        """A live in-process reservation (None on Redis: they live there)."""
        return self._live.get(token)

    @property
    def live(self) -> int:
        return len(self._live)

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
            self._slot(pool, outcome)
        reservation.unused.clear()
        for token in reservation.quota.values():
            self._quota_release(token)
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

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.reservations.labels(outcome).inc()

    def count_invalid(self) -> None:
        self._count("invalid")

    def _slot(self, pool: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.slots.labels(pool, outcome).inc()


async def _back_out(waiting: Waiting) -> None:
    """Leave a queue place taken by mistake (the in-process gate's only way out of a
    :class:`Waiting` is cancelling its wait); a slot granted meanwhile goes back."""
    task = asyncio.ensure_future(waiting.wait())
    await asyncio.sleep(0)  # let it start waiting, so the cancel leaves the queue
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        task.result().release()
    elif not task.cancelled():
        with contextlib.suppress(BaseException):
            task.result()
