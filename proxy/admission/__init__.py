"""The pure admission core: caps, placement, the queue (priority classes, fair share
between tenants, reserves). Imports neither asyncio nor time; the clock is passed in as ``now``."""

from __future__ import annotations

from proxy.admission.decisions import (
    Admit,
    Decision,
    Enqueue,
    PoolStatistics,
    QueuePolicy,
    Reject,
    ReplicaSpec,
    ReplicaStatistics,
)
from proxy.admission.pool_core import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, PoolCore
from proxy.admission.tenants import ANONYMOUS, Reserve, TenantQueue, TenantSpec

__all__ = [
    "ANONYMOUS",
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "Admit",
    "Decision",
    "Enqueue",
    "PoolCore",
    "PoolStatistics",
    "QueuePolicy",
    "Reject",
    "ReplicaSpec",
    "ReplicaStatistics",
    "Reserve",
    "TenantQueue",
    "TenantSpec",
]
