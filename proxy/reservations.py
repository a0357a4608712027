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
  once. A gateway shutting down releases every unclaimed slot.
* **Backends.** Works on the in-process gate and on the shared (Redis) gate. On Redis a
  reserved slot is a lease of the gateway that issued the token, renewed by it; the
  token is valid on that gateway only (clients must reach the same gateway: sticky
  routing). If that gateway loses its leases on a pool (fence), every reservation holding
  an unclaimed slot there is dropped whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter

from proxy.auth import authenticate
from proxy.clock import Clock, TimerHandle
from proxy.errors import PolicyViolation, Refused, refusal_for
from proxy.gate import Gate, Lease, Waiting, count_decision
from proxy.settings import AuthSettings
from proxy.shared_gate import ADMITTED_POOL, SharedGate

__all__ = [
    "MAX_HOLD_S",
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
    "presented_token",
]

log = logging.getLogger("headroom.reservations")

RESERVATION_HEADER = b"x-headroom-reservation"
QUERY_PARAMETER = "headroom_reservation"
#: The longest ``hold_s`` a client may ask for (slots held unused cost capacity).
MAX_HOLD_S = 60.0
DEFAULT_HOLD_S = 5.0
MAX_POOLS = 8
#: Ended tokens remembered (to say "expired" rather than "unknown").
_TOMBSTONES = 10_000


class BadReservation(PolicyViolation):
    """The reservation request itself is malformed (400)."""

    code: ClassVar[str] = "invalid_reservation"


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


def presented_token(scope: dict[str, Any]) -> str | None:
    """The reservation token of a stage connection (header first, then query)."""
    for name, value in scope["headers"]:
        if name.lower() == RESERVATION_HEADER:
            return value.decode("latin-1").strip() or None
    query: bytes = scope.get("query_string", b"")
    if QUERY_PARAMETER.encode() in query:
        from urllib.parse import parse_qsl

        for key, value in parse_qsl(query.decode("latin-1")):
            if key == QUERY_PARAMETER:
                return value.strip() or None
    return None


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
            "connection), expired_unused (hold_s passed), released (DELETE), lost "
            "(admission backend fence), closed (gateway shutdown).",
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
    #: Unclaimed slots, by pool.
    unused: dict[str, Lease] = field(default_factory=dict)
    timer: TimerHandle | None = None


class Reservations:
    """Every live reservation of one gateway."""

    def __init__(self, gate: Gate | SharedGate, clock: Clock, registry: CollectorRegistry | None):
        self.gate = gate
        self.clock = clock
        self.metrics = ReservationMetrics(registry) if registry is not None else None
        self._live: dict[str, Reservation] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        if isinstance(gate, SharedGate):
            gate.on_fence(self._on_fence)

    # -- reserve ------------------------------------------------------------------

    async def reserve(
        self, pools: Sequence[str], hold_s: float, key: str | None = None
    ) -> Reservation:
        """Take one slot in every pool, or none: raises the refusing stage's
        :class:`Refused` (its ``pool`` names the stage). ``key``: the API key name the
        token is bound to (claims and DELETE must present the same key)."""
        order = sorted(pools)
        taken: dict[str, Lease] = {}
        try:
            for pool in order:
                taken[pool] = await self._take(pool)
        except BaseException as exc:
            for lease in taken.values():
                lease.release()
            if isinstance(exc, Refused):
                self._count("refused")
                if self.metrics is not None:
                    self.metrics.refusals.labels(exc.pool, exc.reason).inc()
            raise
        token = secrets.token_urlsafe(24)
        now = self.clock.now()
        reservation = Reservation(token, key, tuple(order), now + hold_s, taken)
        reservation.timer = self.clock.call_at(now + hold_s, lambda: self._expire(token))
        self._live[token] = reservation
        self._count("granted")
        return reservation

    async def _take(self, pool: str) -> Lease:
        """One slot of ``pool`` now, never a place in its queue."""
        gate = self.gate
        if isinstance(gate, SharedGate):
            entry = await gate.admit(pool, queue=False)
            assert isinstance(entry, Lease)
            return entry
        core = gate.core(pool)
        stats = core.statistics()
        if (
            not stats.draining
            and stats.healthy_replicas > 0
            and (core.queue_depth > 0 or core.free_slots() == 0)
        ):
            raise self._full(gate, pool)
        entry = gate.enter(pool)  # admits at once, or refuses (draining, no replica)
        if isinstance(entry, Waiting):  # kept out by a reserve above this caller's class
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

    def claim(self, token: str, pool: str, key: str | None) -> Lease:
        """The reserved slot of ``pool`` for a stage connection, which then owns it
        (releases it when it ends). Raises a :class:`ReservationRefused`."""
        reservation = self._live.get(token)
        if reservation is None or reservation.key != key:
            ended = self._ended.get(token) if reservation is None else None
            if ended is not None:
                raise self._refuse(ReservationExpired(
                    f"reservation {ended}: reserve again"))  # fmt: skip
            raise self._refuse(ReservationUnknown(
                "no such reservation on this gateway (a reservation is held by the "
                "gateway that issued it; reach it again, or reserve again)"))  # fmt: skip
        lease = reservation.unused.pop(pool, None)
        if lease is None:
            what = "already in use" if pool in reservation.pools else "not reserved"
            raise self._refuse(ReservationPool(
                f"this reservation's slot for pool {pool!r} is {what}"))  # fmt: skip
        self._slot(pool, "used")
        if isinstance(self.gate, SharedGate):
            ADMITTED_POOL.set(pool)
        if not reservation.unused:
            self._end(reservation, "fully used")
        return lease

    def release(self, token: str, key: str | None) -> list[str] | None:
        """Release the unclaimed slots (DELETE): the pools released, [] if the
        reservation had already ended, None if unknown (or another key's)."""
        reservation = self._live.get(token)
        if reservation is None or reservation.key != key:
            return [] if reservation is None and token in self._ended else None
        released = self._drop(reservation, "released", "released")
        return released

    def close(self) -> None:
        """Gateway shutdown: release every unclaimed slot."""
        for reservation in list(self._live.values()):
            self._drop(reservation, "closed", "released at shutdown")

    def get(self, token: str) -> Reservation | None:
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

    def _on_fence(self, pool: str, why: str) -> None:
        for reservation in list(self._live.values()):
            if pool in reservation.unused:
                self._drop(reservation, "lost", f"lost with the leases of pool {pool}")

    def _drop(self, reservation: Reservation, outcome: str, why: str) -> list[str]:
        pools = sorted(reservation.unused)
        for pool, lease in list(reservation.unused.items()):
            lease.release()
            self._slot(pool, outcome)
        reservation.unused.clear()
        self._end(reservation, why)
        return pools

    def _end(self, reservation: Reservation, why: str) -> None:
        if reservation.timer is not None:
            reservation.timer.cancel()
            reservation.timer = None
        self._live.pop(reservation.token, None)
        self._ended[reservation.token] = why
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)

    def _refuse(self, err: ReservationRefused) -> ReservationRefused:
        if self.metrics is not None:
            self.metrics.claims_refused.labels(err.code).inc()
        return err

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


def parse_request(body: Any, known: Sequence[str]) -> tuple[list[str], float]:
    """(pools, hold_s) of a reservation request body; raises :class:`BadReservation`."""
    if not isinstance(body, dict):
        raise BadReservation('the body must be a JSON object: {"pools": [...], "hold_s": 5}')
    unknown_fields = set(body) - {"pools", "hold_s"}
    if unknown_fields:
        raise BadReservation(f"unknown field(s): {', '.join(sorted(unknown_fields))}")
    pools = body.get("pools")
    if not isinstance(pools, list) or not pools or not all(isinstance(p, str) for p in pools):
        raise BadReservation('"pools" must be a non-empty list of pool names')
    if len(pools) > MAX_POOLS:
        raise BadReservation(f'"pools" may name at most {MAX_POOLS} pools')
    if len(set(pools)) != len(pools):
        raise BadReservation('"pools" names a pool twice')
    missing = [p for p in pools if p not in known]
    if missing:
        raise BadReservation(f"no pool named {', '.join(map(repr, missing))}")
    hold = body.get("hold_s", DEFAULT_HOLD_S)
    if isinstance(hold, bool) or not isinstance(hold, int | float) or not 0 < hold <= MAX_HOLD_S:
        raise BadReservation(f'"hold_s" must be a number of seconds in (0, {MAX_HOLD_S:g}]')
    return list(pools), float(hold)


def key_of(auth: AuthSettings | None, scope: dict[str, Any], pools: Sequence[str]) -> str | None:
    """The caller's key name, checked for every pool (raises Unauthorized/Forbidden)."""
    name: str | None = None
    for pool in pools:
        key = authenticate(auth, scope, pool)
        name = key.name if key is not None else None
    return name
