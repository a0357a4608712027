"""Tenant quotas over every gateway, for the shared gate.

A key's ``max_sessions`` is counted in Redis (tenants.lua) before its session asks for
a slot, as :class:`proxy.admission.auth.TenantQuotas` counts it in process: one entry per lease
or waiter id, renewed with this gateway's leases, dropped (retried until it lands or
would have expired anyway) when the session ends. A lapse does not fence: a tenant
quota is fairness, not a GPU's cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from proxy.admission import TenantSpec
from proxy.admission.interface import TenantQuota
from proxy.admission.redis_backend import BackendUnavailable
from proxy.admission.retry_after import SlotForecast, retry_after_s
from proxy.admission.shared_state import (
    PoolState,
    SharedGateState,
)
from proxy.errors import TenantLimitRefused

__all__ = ["SharedTenants"]

log = logging.getLogger("headroom.shared_gate")


class SharedTenants(SharedGateState):
    """The shared gate's tenant quotas (module docstring)."""

    async def _reserve_tenant(
        self, p: PoolState, reservation_id: str, quota: TenantQuota, spec: TenantSpec | None
    ) -> None:
        """Count this session against ``quota`` in Redis (tenants.lua), before it asks
        for a slot, as :meth:`proxy.admission.auth.TenantQuotas.reserve` does in process. Raises
        TenantLimitRefused (429) past the quota, or ``backend_unavailable``."""
        tenant, max_sessions = quota.name, quota.max_sessions
        call = asyncio.ensure_future(
            self.backend.reserve_tenant(tenant, reservation_id, max_sessions)
        )
        try:
            reserved = await asyncio.shield(call)
        except asyncio.CancelledError:
            self._tenants[reservation_id] = tenant
            self._spawn(self._give_back_tenant(reservation_id, call))
            raise
        except BackendUnavailable as exc:
            self._set_available(False)
            log.warning("refusing a session on %s: admission store unreachable (%s)", p.name,
                        exc)  # fmt: skip
            self._tenants[reservation_id] = tenant  # it may have landed: undo it
            self._drop_tenant(reservation_id)
            raise self._refuse(p, "backend_unavailable", 1) from None
        self._set_available(True)
        if not reserved:
            self._count(p.name, "rejected_tenant_limit", spec)
            raise TenantLimitRefused(
                "tenant_limit", retry_after_s=self._tenant_retry(p, tenant), pool=p.name
            )
        self._tenants[reservation_id] = tenant

    def tenant_wait(self, pool: str, name: str) -> float | None:
        """Expected seconds until one of key ``name``'s sessions this gateway runs in
        ``pool`` ends (None if it runs none here), as :meth:`PoolCore.tenant_wait`
        judges it in process: past ``max_sessions`` only the key's own sessions ending
        help, not the pool's next free slot. (Its sessions on other gateways are not
        seen here.)"""
        p = self._pool(pool)
        now = self.clock.now()
        ages = [now - lease.admitted_at for lease in p.leases.values()
                if lease.tenant is not None and lease.tenant.name == name]  # fmt: skip
        if not name or not ages:
            return None
        cv = p.lengths.cv if p.lengths is not None else 0.0
        return SlotForecast([(ages, 0)], mean_s=p.session_estimate_s, cv=cv).wait_s(1)

    def _tenant_retry(self, p: PoolState, tenant: str) -> float:
        """A ``tenant_limit`` refusal's Retry-After: from the key's own sessions here,
        else from the pool's next slot."""
        own = self.tenant_wait(p.name, tenant)
        if own is None:
            return self._estimate(p, 1)
        return retry_after_s(own, self._rng.random())

    async def _give_back(self, pool: str, waiter_id: str, call: asyncio.Future[Any]) -> None:
        """An acquire whose caller was cancelled: undo whatever it took, even if it
        runs after its answer was given up on (withdrawn)."""
        with contextlib.suppress(BaseException):
            await call
        self._drop_tenant(waiter_id)
        self.withdrawals.add(pool, waiter_id)

    async def _give_back_tenant(self, reservation_id: str, call: asyncio.Future[Any]) -> None:
        with contextlib.suppress(BaseException):
            await call
        self._drop_tenant(reservation_id)

    def _drop_tenant(self, reservation_id: str) -> None:
        """The session (lease or waiter) ``reservation_id`` is over: stop counting it."""
        tenant = self._tenants.pop(reservation_id, None)
        if tenant is not None:
            self._spawn(self._release_tenant_remote(tenant, reservation_id))

    async def _release_tenant_remote(self, tenant: str, reservation_id: str) -> None:
        """Like :meth:`_release_remote`: retried while Redis is unreachable, until the
        reservation would have expired on its own."""
        give_up = self.clock.now() + self.lease_ttl_s
        delay = 0.05
        while True:
            try:
                await self.backend.release_tenant(tenant, reservation_id)
                return
            except BackendUnavailable:
                if self._stopped or self.clock.now() + delay > give_up:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _renew_tenants(self) -> None:
        """Renew every tenant reservation this gateway holds (one round trip). A lapse
        does not fence: a tenant quota is fairness, not a GPU's cap; a reservation that
        expired meanwhile is re-added (the session is live)."""
        if not self._tenants:
            return
        try:
            await self.backend.renew_tenants([(t, rid) for rid, t in self._tenants.items()])
        except BackendUnavailable as exc:
            self._set_available(False)
            log.warning("renewal of tenant quotas failed: %s", exc)
