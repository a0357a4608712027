"""Gang admission: one reservation holding a slot in every stage of a voice agent.

``POST /v1/headroom/reservations {"pools": ["asr-main", "tts-main"], "hold_s": 5}``
takes one slot in each named pool, or none (docs/voice-agents.md):

* **All or nothing, without deadlock.** The pools are taken one after another in a
  canonical order (sorted by name), each *without queueing*: a pool with no free slot
  the key's class may take, or with a waiter of that class or a higher one in its queue
  (no barging), refuses at once. If any stage refuses, the slots already taken are
  released in the same step and the caller gets that stage's refusal (status,
  ``Retry-After``, reason, fallback; the body's ``error.stage`` and the
  ``X-Headroom-Stage`` header name the stage). Since nobody ever waits while holding a
  slot, two reservations cannot wait on each other.
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
* **Backends.** Each gate keeps its reservations in its own store
  (:meth:`~proxy.admission.interface.AdmissionGate.reservation_store`). In process
  (``backend: memory``, :mod:`proxy.admission.local_reservations`) everything is this
  gateway's, and a gateway shutting down releases every unclaimed slot. On Redis a
  reservation lives in Redis and any gateway or worker can claim it
  (:mod:`proxy.admission.shared_reservations`).

A token is a bearer secret: it is never logged, and Redis stores only its SHA-256.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter

from proxy.admission import TenantSpec
from proxy.admission.auth import TenantQuotas, tenant_spec
from proxy.admission.interface import AdmissionGate, Reservation, ReservationStore, Unclaimable
from proxy.admission.reservation_requests import (
    MAX_POOLS,
    QUERY_PARAMETER,
    RESERVATION_HEADER,
    BadReservation,
    key_of,
    parse_request,
    reservation_token,
)
from proxy.admission.session_lease import Lease
from proxy.clock import Clock
from proxy.errors import PolicyViolation, Refused
from proxy.settings import ApiKeySettings, ReservationSettings

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
    "reservation_token",
]

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


def _tenant(key: ApiKeySettings | None) -> TenantSpec | None:
    return tenant_spec(key) if key else None


class Reservations:
    """Every live reservation of one gateway, in the store its gate keeps them in
    (:meth:`~proxy.admission.interface.AdmissionGate.reservation_store`). ``quotas``:
    the gateway's per-key session counts (in process; reserved slots count there until
    claimed); ``limits``: the ``reservations`` settings in force (read at each
    reservation: live on reload)."""

    def __init__(
        self,
        gate: AdmissionGate,
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
        self._store: ReservationStore = gate.reservation_store(clock, self._slot, quotas)

    async def reserve(
        self, pools: Sequence[str], hold_s: float, key: ApiKeySettings | None = None
    ) -> Reservation:
        """Take one slot in every pool, or none: raises the refusing stage's
        :class:`Refused` (its ``pool`` names the stage). ``key``: the API key the token
        is bound to (claims and DELETE must present the same key); its class and
        ``max_sessions`` apply to the slots."""
        order = sorted(pools)
        try:
            reservation = await self._store.reserve(
                secrets.token_urlsafe(24), order, hold_s, key, _tenant(key),
                self.limits().max_per_key,
            )  # fmt: skip
        except Refused as exc:
            self._count("refused")
            if self.metrics is not None:
                self.metrics.refusals.labels(exc.pool, exc.reason).inc()
            raise
        self._count("granted")
        return reservation

    async def claim(self, token: str, pool: str, key: ApiKeySettings | None) -> Lease:
        """The reserved slot of ``pool`` for a stage connection, which then owns it
        (releases it when it ends). Raises a :class:`ReservationRefused`."""
        try:
            return await self._store.claim(token, pool, key, _tenant(key))
        except Unclaimable as err:
            raise self._unclaimable(err.code, err.detail, pool) from None

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
        return await self._store.release(token, key)

    def close(self) -> None:
        """Gateway shutdown: release every unclaimed slot held here (on Redis the
        reservations stay claimable on the other gateways until their deadline)."""
        self._store.close()

    def get(self, token: str) -> Reservation | None:
        """A live in-process reservation (None on Redis: they live there)."""
        return self._store.get(token)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.reservations.labels(outcome).inc()

    def count_invalid(self) -> None:
        """Count a reservation request refused before any slot was sought (a
        :class:`~proxy.errors.PolicyViolation`): ``outcome=invalid``."""
        self._count("invalid")

    def _slot(self, pool: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.slots.labels(pool, outcome).inc()
