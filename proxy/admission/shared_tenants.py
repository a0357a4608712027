"""Tenant quotas over every gateway, for the shared gate.

A key's ``max_sessions`` is counted in Redis (tenants.lua) before its session asks for
a slot, as :class:`proxy.admission.auth.TenantQuotas` counts it in process: one entry per lease
or waiter id, renewed with this gateway's leases, dropped (retried until it lands or
would have expired anyway) when the session ends. A lapse does not fence: a tenant
quota is fairness, not a GPU's cap. :class:`SharedTenants` is the shared gate's part
that keeps those entries (``held``: lease or waiter id -> key name).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from proxy.admission import TenantSpec
from proxy.admission.interface import TenantQuota
from proxy.admission.redis_backend import BackendUnavailable
from proxy.admission.retry_after import retry_after_s
from proxy.admission.shared_state import PoolState
from proxy.admission.shared_store import SharedStore
from proxy.errors import TenantLimitRefused

__all__ = ["SharedTenants"]

log = logging.getLogger("headroom.shared_gate")


class SharedTenants:
    """The shared gate's tenant quota entries in Redis (module docstring)."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        #: Tenant reservations held in Redis: lease or waiter id -> key name.
        self.held: dict[str, str] = {}

    async def reserve(
        self, p: PoolState, reservation_id: str, quota: TenantQuota, spec: TenantSpec | None
    ) -> None:
        """Count this session against ``quota`` in Redis (tenants.lua), before it asks
        for a slot, as :meth:`proxy.admission.auth.TenantQuotas.reserve` does in process. Raises
        TenantLimitRefused (429) past the quota, or ``backend_unavailable``."""
        store = self.store
        tenant, max_sessions = quota.name, quota.max_sessions
        call = asyncio.ensure_future(
            store.backend.reserve_tenant(tenant, reservation_id, max_sessions)
        )
        try:
            reserved = await asyncio.shield(call)
        except asyncio.CancelledError:
            self.held[reservation_id] = tenant
            store.spawn(self._give_back(reservation_id, call))
            raise
        except BackendUnavailable as exc:
            store.set_available(False)
            log.warning("refusing a session on %s: admission store unreachable (%s)", p.name,
                        exc)  # fmt: skip
            self.held[reservation_id] = tenant  # it may have landed: undo it
            self.drop(reservation_id)
            raise store.refuse(p, "backend_unavailable", 1) from None
        store.set_available(True)
        if not reserved:
            store.counts.decision(p.name, "rejected_tenant_limit", spec)
            raise TenantLimitRefused(
                "tenant_limit", retry_after_s=self._retry(p, tenant), pool=p.name
            )
        self.held[reservation_id] = tenant

    def adopt(self, reservation_id: str, tenant: str) -> None:
        """Count ``reservation_id`` as ``tenant``'s (a claimed reservation's entry)."""
        self.held[reservation_id] = tenant

    def _retry(self, p: PoolState, tenant: str) -> float:
        """A ``tenant_limit`` refusal's Retry-After: from the key's own sessions here,
        else from the pool's next slot."""
        own = p.tenant_wait(tenant, self.store.clock.now())
        if own is None:
            return self.store.retry_after(p, "tenant_limit", 1)
        return retry_after_s(own, p.rng.random())

    async def _give_back(self, reservation_id: str, call: asyncio.Future[Any]) -> None:
        with contextlib.suppress(BaseException):
            await call
        self.drop(reservation_id)

    def drop(self, reservation_id: str) -> None:
        """The session (lease or waiter) ``reservation_id`` is over: stop counting it."""
        tenant = self.held.pop(reservation_id, None)
        if tenant is not None:
            self.store.spawn(self._release_remote(tenant, reservation_id))

    async def _release_remote(self, tenant: str, reservation_id: str) -> None:
        """Like :meth:`SharedStore.release_remote`: retried while Redis is unreachable,
        until the reservation would have expired on its own."""
        store = self.store
        give_up = store.clock.now() + store.lease_ttl_s
        delay = 0.05
        while True:
            try:
                await store.backend.release_tenant(tenant, reservation_id)
                return
            except BackendUnavailable:
                if store.stopped or store.clock.now() + delay > give_up:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def renew(self) -> None:
        """Renew every tenant reservation this gateway holds (one round trip). A lapse
        does not fence: a tenant quota is fairness, not a GPU's cap; a reservation that
        expired meanwhile is re-added (the session is live)."""
        if not self.held:
            return
        try:
            await self.store.backend.renew_tenants([(t, rid) for rid, t in self.held.items()])
        except BackendUnavailable as exc:
            self.store.set_available(False)
            log.warning("renewal of tenant quotas failed: %s", exc)
