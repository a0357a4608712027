"""The one admission interface the rest of the gateway holds.

:class:`AdmissionGate` is what the runtime, the relays, the health checks, the guard,
the engine reconciler, the gang reservations and the workers use of a gate. Two gates
implement it: :class:`proxy.admission.gate.Gate` (``admission.backend: memory``, every decision in
this process) and :class:`proxy.admission.shared_gate.SharedGate` (``redis``, every slot and queue
place decided in Redis over every gateway). What only one of them has to do is a
method both have: the in-process gate's :meth:`~AdmissionGate.start`,
:meth:`~AdmissionGate.stop` and :meth:`~AdmissionGate.quiesce` return at once, it never
fences (:meth:`~AdmissionGate.on_fence` keeps no listener), it is always
:attr:`~AdmissionGate.available` and its grants are never blocked.

:class:`ReservationStore` is where one gateway's gang reservations live; each gate
builds its own (:meth:`AdmissionGate.reservation_store`): in this process for the
in-process gate, in Redis for the shared one.

A session's tenant and quota are values passed to :meth:`AdmissionGate.admit`
(:class:`TenantQuota`); the pool it was admitted to is its lease's ``pool``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from proxy.admission.auth import TenantQuotas
    from proxy.admission.decisions import PoolStatistics, QueuePolicy, ReplicaSpec
    from proxy.admission.session_lease import Lease, PositionCallback, Waiting
    from proxy.admission.tenants import Reserve, TenantSpec
    from proxy.clock import Clock, TimerHandle
    from proxy.errors import FallbackHint
    from proxy.metering.scrape import ReplicaGauges, TenantGauges
    from proxy.settings import ApiKeySettings

__all__ = [
    "AdmissionGate",
    "FenceCallback",
    "Reservation",
    "ReservationStore",
    "SlotCallback",
    "TenantQuota",
    "Unclaimable",
]

#: Called with (pool, reason) when the gateway must end its sessions on ``pool``.
FenceCallback = Callable[[str, str], None]

#: Called with (pool, outcome) for each reserved slot that leaves a reservation.
SlotCallback = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """An API key's ``max_sessions``: the shared gate counts a session against it over
    every gateway (this process's own part is :class:`proxy.admission.auth.TenantQuotas`)."""

    name: str
    max_sessions: int


class Unclaimable(Exception):
    """A claim that gets no slot: ``code`` is ``unknown``, ``expired`` or ``pool``."""

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


@dataclass(eq=False)
class Reservation:
    """One gang reservation as its store answers for it."""

    token: str
    key: str | None
    pools: tuple[str, ...]
    expires_at: float
    #: Unclaimed slots, by pool (in process; on Redis they are in Redis).
    unused: dict[str, Lease] = field(default_factory=dict)
    #: The key's quota count each unclaimed slot holds (in process), by pool.
    quota: dict[str, str | None] = field(default_factory=dict)
    timer: TimerHandle | None = None


class ReservationStore(Protocol):
    """One gateway's gang reservations (:mod:`proxy.admission.reservations` keeps the rules
    common to both stores: metrics, refusal types)."""

    async def reserve(
        self, token: str, pools: Sequence[str], hold_s: float, key: ApiKeySettings | None,
        tenant: TenantSpec | None, max_live: int,
    ) -> Reservation:  # fmt: skip
        """One slot in every pool (in the order given), or raises the refusing stage's
        :class:`~proxy.errors.Refused` holding nothing. ``max_live`` bounds ``key``'s
        reservations with unclaimed slots."""

    async def claim(
        self, token: str, pool: str, key: ApiKeySettings | None, tenant: TenantSpec | None
    ) -> Lease:
        """The reserved slot of ``pool``, now the caller's; raises :class:`Unclaimable`."""

    async def release(self, token: str, key: ApiKeySettings | None) -> list[str] | None:
        """Release the unclaimed slots: the pools released, [] if the reservation had
        already ended, None if unknown or another key's."""

    def close(self) -> None:
        """Gateway shutdown: give back what this gateway alone holds."""

    def get(self, token: str) -> Reservation | None:
        """A reservation this store holds in process (None for one kept elsewhere)."""


class AdmissionGate(Protocol):
    """Admission for every pool of one gateway (module docstring)."""

    #: Set by :meth:`drain`: everything new is refused.
    draining: bool

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start the gate's background work (renewals, wake-ups), if it has any."""

    async def stop(self) -> None:
        """Stop the background work and give back what can still be given back."""

    async def quiesce(self) -> None:
        """Wait for every call the gate started in the background to finish."""

    # -- admission ------------------------------------------------------------------

    async def admit(
        self,
        pool: str,
        *,
        on_position: PositionCallback | None = None,
        queue: bool = True,
        tenant: TenantSpec | None = None,
        quota: TenantQuota | None = None,
        max_wait_s: float | None = None,
    ) -> Lease | Waiting:
        """A :class:`~proxy.admission.session_lease.Lease` if admitted at once, a
        :class:`~proxy.admission.session_lease.Waiting` already in the queue, or raises
        :class:`~proxy.errors.Refused`. ``tenant``: the session's key's scheduling
        identity (None: no key); ``quota``: its ``max_sessions``, where the gate counts
        it; ``queue=False``: a slot now or a refusal; ``max_wait_s``: the session's own
        bound on its wait in the queue, used if shorter than the pool's ``max_wait_s``
        (0: as ``queue=False``), refused ``queue_timeout`` past it like any waiter."""

    async def acquire(
        self,
        pool: str,
        *,
        on_position: PositionCallback | None = None,
        tenant: TenantSpec | None = None,
        quota: TenantQuota | None = None,
    ) -> Lease:
        """:meth:`admit`, waiting in the queue if need be."""

    async def take_now(self, pool: str, tenant: TenantSpec | None) -> Lease:
        """One slot of ``pool`` now, never a queue place (a gang reservation's slot):
        the decision for a plain session of ``tenant``'s class; raises
        :class:`~proxy.errors.Refused`."""

    def drain(self) -> None:
        """Refuse everything new and every waiter with ``draining``."""

    async def wait_idle(self) -> None:
        """Return once no session of this gateway holds a slot."""

    # -- configuration, health, guard, fencing -----------------------------------------

    def apply_pool(
        self,
        name: str,
        replicas: Sequence[ReplicaSpec],
        queue: QueuePolicy,
        fallback: FallbackHint | None,
        *,
        session_estimate_s: float = 20.0,
        reserves: Sequence[Reserve] = (),
    ) -> None:
        """Create a pool or change one live; running sessions are never cut. The call
        states the pool's whole configuration, as a reload reads it: ``reserves`` not
        given means none (a reload that removed them clears them), never "unchanged"."""

    def retire_pool(self, name: str) -> None:
        """A pool left the configuration: refuse its waiters and newcomers."""

    def set_healthy(self, pool: str, replica: str, healthy: bool) -> None:
        """Eject a replica from placement (``healthy=False``) or restore it; tells the
        :meth:`on_health_change` listeners when the state changes."""

    def set_guarded(self, pool: str, replica: str, guarded: bool) -> None:
        """Hold new admissions to a replica for the delivery guard (``guarded=True``), or release
        it; running sessions are untouched."""

    def set_cap(self, pool: str, replica: str, cap: int) -> None:
        """Change a replica's cap live; lowering it never evicts a running session. Raises
        ValueError for a cap below 1."""

    def set_recheck_interval(self, interval_s: float) -> None:
        """How often an ejected replica is re-checked (``health.recheck_interval_s``)."""

    def on_health_change(self, listener: Callable[[str, str, bool], None]) -> None:
        """Call ``listener(pool, replica, healthy)`` each time :meth:`set_healthy` changes a
        replica's state."""

    def on_fence(self, listener: FenceCallback) -> None:
        """Call ``listener`` when this gateway must end its sessions on a pool because
        it can no longer prove their slots."""

    # -- queries ----------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the admission store answered its last call (``/readyz``)."""

    @property
    def gateway_id(self) -> str:
        """This gateway's name in the admission store."""

    @property
    def active(self) -> int:
        """Sessions of this gateway holding a slot."""

    @property
    def queued(self) -> int:
        """Sessions of this gateway waiting in a queue."""

    def grants_blocked_s(self) -> float:
        """Seconds until grants resume after the store lost its data; 0 when not."""

    def pools(self) -> list[str]:
        """Every pool configured since the gate was built, retired ones included."""

    def fallback(self, pool: str) -> FallbackHint | None:
        """The fallback hint refusals on ``pool`` carry (None: none configured)."""

    def reserves(self, pool: str) -> tuple[Reserve, ...]:
        """The reserves ``pool`` applies now (as the last :meth:`apply_pool` gave them)."""

    def estimate_wait(self, pool: str, position: int) -> float:
        """Expected seconds until a waiter at ``position`` (1 = head) gets a slot."""

    def tenant_wait(self, pool: str, name: str) -> float | None:
        """Expected seconds until one of key ``name``'s sessions in ``pool`` ends
        (None if it runs none here)."""

    def statistics(self) -> dict[str, PoolStatistics]:
        """This gateway's view of every pool."""

    def held_per_replica(self, pool: str) -> dict[str, int]:
        """Sessions holding a slot per replica of ``pool``, over every gateway that
        shares it (as of the last renewal, for the shared gate)."""

    def replica_gauges(
        self,
        ratio: Callable[[str, str], float | None] | None = None,
        guarded: Callable[[str, str], bool] | None = None,
    ) -> list[ReplicaGauges]:
        """One :class:`~proxy.metering.scrape.ReplicaGauges` per replica of every pool; ``ratio``
        and ``guarded`` supply what the gate does not know itself (the rolling delivery ratio;
        the guard's state in observe mode)."""

    def tenant_gauges(self) -> list[TenantGauges]:
        """Per API key and pool, this gateway's sessions active and queued and the session-seconds
        they held; sessions without a key are not counted."""

    def queue_depths(self) -> list[tuple[str, int]]:
        """``(pool, waiters)`` for every pool: this gateway's sessions waiting in its queue."""

    # -- gang reservations ------------------------------------------------------------

    def reservation_store(
        self, clock: Clock, on_slot: SlotCallback, quotas: TenantQuotas | None
    ) -> ReservationStore:
        """Where this gateway's gang reservations live; ``on_slot`` counts each slot
        that leaves one, ``quotas`` the per-key counts of this process."""
