"""The admission series every gate records: decisions and time in the queue.

Both gates (:class:`proxy.admission.gate.Gate` and the shared gate's
:class:`~proxy.admission.shared_state.SharedGateState`) and the runtime's per-key
``max_sessions`` refusal record here, so ``headroom_session_decisions_total`` and
``headroom_queue_wait_seconds`` mean the same under either ``admission.backend``; a
session with an API key is also counted in the per-key ``headroom_tenant_*`` series
(one without a key is not). The families are :class:`proxy.metering.series.Metrics`'s; the
shared gate's own series are :class:`~proxy.admission.shared_state.SharedAdmissionMetrics`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.admission.tenants import TenantSpec
    from proxy.metering.series import Metrics

__all__ = ["count_decision", "observe_queue_wait"]


def count_decision(
    metrics: Metrics | None, pool: str, decision: str, tenant: TenantSpec | None
) -> None:
    """Count an admission decision, and per key for a session with one (both gates)."""
    if metrics is not None:
        metrics.child(metrics.decisions, pool, decision).inc()
        if tenant is not None and tenant.name:
            labels = (pool, tenant.name, str(tenant.priority), decision)
            metrics.tenant_decisions.labels(*labels).inc()


def observe_queue_wait(
    metrics: Metrics | None, pool: str, waited: float, tenant: TenantSpec | None
) -> None:
    """Observe a waiter's time in the queue, and per key for one with a key (both gates)."""
    if metrics is not None:
        metrics.child(metrics.queue_wait, pool).observe(waited)
        if tenant is not None and tenant.name:
            labels = (pool, tenant.name, str(tenant.priority))
            metrics.tenant_queue_wait.labels(*labels).observe(waited)
