"""What both gates share: their decision counts, the wait for idle, the acquire and
take-now steps built on ``admit``, and a waiter's wait for its outcome.

The in-process :class:`~proxy.admission.gate.Gate` and the shared
:class:`~proxy.admission.shared_gate.SharedGate` each hold a :class:`GateCounts` and an
:class:`IdleWaiters`, and answer ``acquire``/``take_now`` with :func:`acquire` and
:func:`take_now`, so these rules exist once:

* ``headroom_session_decisions_total`` and ``headroom_queue_wait_seconds`` mean the same
  under either ``admission.backend`` (:func:`count_decision`, :func:`observe_queue_wait`;
  the runtime's per-key ``max_sessions`` refusal counts here too); a session with an
  API key is also counted in the per-key ``headroom_tenant_*`` series (one without a
  key is not). The families are :class:`proxy.metering.series.Metrics`'s.
* ``wait_idle`` returns once no session of the gateway holds a slot
  (:class:`IdleWaiters`: the gate tells it after every release).
* ``acquire`` is ``admit`` then, for a queue place, its wait; ``take_now`` is ``admit``
  with ``queue=False``, which gives a slot or raises.
* A waiter that stops waiting before it took its outcome (cancelled: its client went
  away) leaves the queue in the same step (:func:`await_outcome`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from proxy.admission.session_lease import Lease

if TYPE_CHECKING:
    from proxy.admission.decisions import Admit, Reject
    from proxy.admission.interface import AdmissionGate, TenantQuota
    from proxy.admission.session_lease import PositionCallback
    from proxy.admission.tenants import TenantSpec
    from proxy.metering.series import Metrics

__all__ = [
    "GateCounts",
    "IdleWaiters",
    "acquire",
    "await_outcome",
    "count_decision",
    "observe_queue_wait",
    "take_now",
]


def count_decision(
    metrics: Metrics | None, pool: str, decision: str, tenant: TenantSpec | None
) -> None:
    """Count an admission decision, and per key for a session with one."""
    if metrics is not None:
        metrics.child(metrics.decisions, pool, decision).inc()
        if tenant is not None and tenant.name:
            labels = (pool, tenant.name, str(tenant.priority), decision)
            metrics.tenant_decisions.labels(*labels).inc()


def observe_queue_wait(
    metrics: Metrics | None, pool: str, waited: float, tenant: TenantSpec | None
) -> None:
    """Observe a waiter's time in the queue, and per key for one with a key."""
    if metrics is not None:
        metrics.child(metrics.queue_wait, pool).observe(waited)
        if tenant is not None and tenant.name:
            labels = (pool, tenant.name, str(tenant.priority))
            metrics.tenant_queue_wait.labels(*labels).observe(waited)


class GateCounts:
    """A gate's admission series: decisions, queue waits and session lengths."""

    __slots__ = ("metrics",)

    def __init__(self, metrics: Metrics | None) -> None:
        self.metrics = metrics

    def decision(self, pool: str, decision: str, tenant: TenantSpec | None = None) -> None:
        """Count one admission decision (``admitted``, ``queued``, ``rejected_<reason>``,
        ``abandoned``), and per key for a session with a key."""
        count_decision(self.metrics, pool, decision, tenant)

    def queue_wait(self, pool: str, waited: float, tenant: TenantSpec | None) -> None:
        """Observe ``waited`` seconds spent in ``pool``'s queue (:func:`observe_queue_wait`)."""
        observe_queue_wait(self.metrics, pool, waited, tenant)

    def session(self, pool: str, duration_s: float) -> None:
        """A session released its slot after ``duration_s`` seconds."""
        if self.metrics is not None:
            self.metrics.child(self.metrics.session_duration, pool).observe(duration_s)


class IdleWaiters:
    """Callers of ``wait_idle``: released once ``active()`` (the sessions of this
    gateway holding a slot) is 0 after a release (:meth:`released`)."""

    __slots__ = ("_active", "_futures")

    def __init__(self, active: Callable[[], int]) -> None:
        self._active = active
        self._futures: list[asyncio.Future[None]] = []

    async def wait(self) -> None:
        """Return once no session holds a slot."""
        if self._active() == 0:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures.append(future)
        try:
            await future
        finally:
            if future in self._futures:
                self._futures.remove(future)

    def released(self) -> None:
        """A session released its slot: wake the waiters if none holds one now."""
        if self._futures and self._active() == 0:
            for future in self._futures:
                if not future.done():
                    future.set_result(None)


async def acquire(
    gate: AdmissionGate,
    pool: str,
    *,
    on_position: PositionCallback | None,
    tenant: TenantSpec | None,
    quota: TenantQuota | None,
) -> Lease:
    """``gate.admit``, then the queue place's wait if it gave one (``acquire``)."""
    entry = await gate.admit(pool, on_position=on_position, tenant=tenant, quota=quota)
    if isinstance(entry, Lease):
        return entry
    return await entry.wait()


async def take_now(gate: AdmissionGate, pool: str, tenant: TenantSpec | None) -> Lease:
    """``gate.admit`` with ``queue=False``: a slot or a refusal, never a queue place."""
    entry = await gate.admit(pool, queue=False, tenant=tenant)
    assert isinstance(entry, Lease)  # queue=False: a slot or a refusal
    return entry


async def await_outcome(
    future: asyncio.Future[Admit | Reject], leave: Callable[[], None]
) -> Admit | Reject:
    """A waiter's outcome; if the wait ends without it (cancelled), ``leave()`` first."""
    try:
        return await future
    except BaseException:
        leave()
        raise
