"""Admission: which session gets a slot on which replica, which waits, which is refused.

The package owns the gateway's admission end to end. Its parts:

* the pure core of one pool (:mod:`~proxy.admission.pool_core`, :mod:`~proxy.admission.tenants`,
  :mod:`~proxy.admission.decisions`, :mod:`~proxy.admission.retry_after`): caps,
  placement, the queue (priority classes, fair share between tenants, reserves) and
  Retry-After, with no asyncio and no clock (``now`` is passed in);
* the interface the rest of the gateway holds (:mod:`~proxy.admission.interface`), what
  a session holds (:mod:`~proxy.admission.session_lease`) and what both gates share
  (:mod:`~proxy.admission.gate_common`);
* the in-process gate (:mod:`~proxy.admission.gate`, :mod:`~proxy.admission.gate_waiters`);
* the shared gate over Redis (:mod:`~proxy.admission.shared_gate` and its parts
  ``shared_*``; the Redis calls :mod:`~proxy.admission.redis_backend`,
  :mod:`~proxy.admission.redis_clients` and ``lua/``; the lease keeper
  :mod:`~proxy.admission.lease_keeper`, :mod:`~proxy.admission.keeper_process`);
* gang reservations (:mod:`~proxy.admission.reservations`,
  :mod:`~proxy.admission.reservation_requests`, :mod:`~proxy.admission.local_reservations`,
  :mod:`~proxy.admission.shared_reservations`);
* API keys and per-key quotas (:mod:`~proxy.admission.auth`), refusal responses
  (:mod:`~proxy.admission.refusal`), the delivery guard (:mod:`~proxy.admission.guard`) and
  the engine reconciler (:mod:`~proxy.admission.reconcile`).

This module re-exports the pure core's names.
"""

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
