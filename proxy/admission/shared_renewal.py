"""Renewal and self-fencing, for the shared gate.

Every ``renew_interval_s`` one call per pool (renew.lua) renews this gateway's leases and
queue places, publishes its guard flags, and reads the pool-wide figures (sessions
held per replica, the queue's depth) and its waiters' positions. If a pool's last
successful renewal is older than ``lease_ttl_s - fence_margin_s`` on the monotonic
clock -- and the lease keeper (:mod:`proxy.admission.lease_keeper`) did not prove the
leases meanwhile from its own thread -- or Redis reports one of this gateway's leases
gone, the gateway ends its own sessions on that pool (``on_backend_loss: close``)
before other gateways can reuse those slots; ``keep`` only logs and counts.

:class:`SharedRenewal` is the shared gate's part that does this: it owns the fence
listeners, the keeper handle and the renewal settings; each pool's renewal state
(generation, last renewal, fence timer, pool-wide figures) is its
:class:`~proxy.admission.shared_state.PoolState`'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from proxy.admission.interface import FenceCallback
from proxy.admission.lease_keeper import Keeper
from proxy.admission.redis_backend import BackendUnavailable
from proxy.admission.shared_state import PoolState
from proxy.admission.shared_store import SharedStore
from proxy.admission.shared_tenants import SharedTenants

__all__ = ["SharedRenewal"]

#: How often, within one renewal interval, a pool whose renewal failed is tried again.
RETRIES_PER_INTERVAL = 4

log = logging.getLogger("headroom.shared_gate")


class SharedRenewal:
    """The shared gate's renewals and fencing (module docstring)."""

    def __init__(
        self,
        store: SharedStore,
        tenants: SharedTenants,
        *,
        keeper: Keeper | None,
        renew_interval_s: float,
        fence_margin_s: float,
        on_backend_loss: Literal["close", "keep"],
    ) -> None:
        self.store = store
        self.tenants = tenants
        #: Renews the leases while the event loop is late: a process of its own
        #: (:mod:`proxy.admission.keeper_process`), or a thread.
        self.keeper = keeper
        self.renew_interval_s = renew_interval_s
        self.fence_margin_s = fence_margin_s
        self.on_backend_loss = on_backend_loss
        self.fence_listeners: list[FenceCallback] = []

    async def loop(self) -> None:
        """Renew every ``renew_interval_s`` until the gate closes. A pool whose renewal
        failed is tried again every ``renew_interval_s / RETRIES_PER_INTERVAL`` until the
        next round, so a shard that comes back (its replica promoted) is renewed soon
        after, not one whole interval after the last failure."""
        loop = asyncio.get_running_loop()
        retry_s = self.renew_interval_s / RETRIES_PER_INTERVAL
        store = self.store
        while not store.closing:
            # Each round is one of the gate's tracked tasks, so ``quiesce`` waits for a
            # round in flight: its calls carry the configuration of when they were sent.
            failed = await store.spawn(self.renew())
            due = loop.time() + self.renew_interval_s
            while failed and not store.closing and loop.time() + retry_s < due:
                await asyncio.sleep(retry_s)
                retry = [n for n in failed if n in store.pools]
                failed = await store.spawn(self.renew_pools(retry, retry=True))
            await asyncio.sleep(max(0.0, due - loop.time()))

    async def renew(self) -> list[str]:
        """One renewal tick of every pool (the loop calls it every ``renew_interval_s``);
        returns the pools whose renewal failed."""
        failed = await self.renew_pools(list(self.store.pools))
        await self.tenants.renew()
        return failed

    async def renew_pools(self, names: list[str], *, retry: bool = False) -> list[str]:
        """Renew the pools ``names`` at once, each its own call (with a Redis Cluster, a
        shard that is slow or out of reach holds only its own pools' renewals); returns
        those whose renewal failed. A ``retry``'s failures are logged at DEBUG: the
        round's failure was logged."""
        done = await asyncio.gather(*(self.renew_pool(name, retry=retry) for name in names))
        return [name for name, ok in zip(names, done, strict=True) if not ok]

    async def renew_pool(self, name: str, *, retry: bool = False) -> bool:
        """One renewal of pool ``name`` in Redis: extends this gateway's leases, publishes its view
        and guard flags, reads the holdings and queue depth over every gateway, re-arms the
        fence, fences on lost leases and updates its waiters' places. A Redis failure marks the
        store unavailable and returns False (the fence deadline stands); True otherwise."""
        store = self.store
        p = store.pools[name]
        sent = store.clock.now()
        leases = [(lid, lease.replica) for lid, lease in p.leases.items()]
        waiters = [wid for wid, w in p.waiters.items() if w.queued and not w.future.done()]
        guards = [r for r, s in p.replicas.items() if s.guarded and not s.retired]
        try:
            result = await store.backend.tick(
                name, generation=p.generation, view=p.view(), leases=leases, waiters=waiters,
                guards=guards, guard_ttl_s=self.renew_interval_s * 3,
            )  # fmt: skip
        except BackendUnavailable as exc:
            store.set_available(False)
            log.log(logging.DEBUG if retry else logging.WARNING,
                    "renewal of pool %s failed: %s", name, exc)  # fmt: skip
            return False
        store.set_available(True)
        if p.generation and result.generation != p.generation:
            log.warning("pool %s: admission store lost its data (new generation); "
                        "re-asserted %d leases", name, len(leases) - len(result.lost))  # fmt: skip
        p.generation = result.generation
        p.blocked_until = store.clock.now() + result.blocked_s if result.blocked_s else 0.0
        if self.keeper is not None:
            self.keeper.set_generation(name, result.generation)
            self.keeper.ticked(name)
        p.held = result.held
        p.queue_depth = result.queue_depth
        if store.series is not None:
            for replica in p.replicas:
                store.series.held.labels(name, replica, "pool").set(p.held.get(replica, 0))
            store.series.queue_depth.labels(name, "pool").set(p.queue_depth)
        p.last_renewed = sent
        self.arm_fence(p)
        # Lost means lost while its session runs: a lease released while the call was in
        # flight (its release may have landed first) is not, nor is one whose session a
        # fence already told to close (found gone again until that session has ended).
        lost = [lid for lid in result.lost if lid in p.leases and not p.leases[lid].fenced]
        if lost:
            self._fence(p, f"{len(lost)} lease(s) expired in the admission store")
        for wid, state in zip(waiters, result.waiters, strict=True):
            waiter = p.waiters.get(wid)
            if waiter is None or waiter.future.done():
                continue
            if state == -2:  # shed; its wake-up may still be on the way
                store.shed(p, waiter, waiter.position)
            elif state < 0:
                store.reject_waiter(waiter, "backend_unavailable", 1.0)
            elif state > 0 and state != waiter.position:
                waiter.position = state
                if waiter.on_position is not None:
                    waiter.on_position(state, p.wait_s(state, store.clock.now()))
        return True

    def arm_fence(self, p: PoolState) -> None:
        """Arm ``p``'s fence at its last renewal plus ``lease_ttl_s - fence_margin_s``."""
        if p.fence_timer is not None:
            p.fence_timer.cancel()
            p.fence_timer = None
        if p.last_renewed is not None:
            deadline = p.last_renewed + self.store.lease_ttl_s - self.fence_margin_s
            p.fence_timer = self.store.clock.call_at(deadline, lambda: self._on_fence_deadline(p))

    def _on_fence_deadline(self, p: PoolState) -> None:
        p.fence_timer = None
        kept = self._kept_at(p)
        if kept is not None and (p.last_renewed is None or kept > p.last_renewed):
            # The keeper proved the leases while the loop was late: not a loss.
            p.last_renewed = kept
            self.arm_fence(p)
            return
        if any(not lease.fenced for lease in p.leases.values()):
            self._fence(p, "leases not renewed within lease_ttl_s - fence_margin_s")
        p.last_renewed = None  # until a renewal succeeds again

    def _kept_at(self, p: PoolState) -> float | None:
        """When, on this gate's clock, the keeper last proved every lease of ``p``."""
        if self.keeper is None:
            return None
        age = self.keeper.kept_age(p.name)
        return None if age is None else self.store.clock.now() - age

    def _fence(self, p: PoolState, why: str) -> None:
        """Once per set of lost leases: the listeners end every session of the pool
        this gateway runs now, so those leases are marked and never fence again; only a
        session admitted after this fence can trigger the next one."""
        count = len(p.leases)
        for lease in p.leases.values():
            lease.fenced = True
        if self.store.series is not None:
            self.store.series.lease_loss_closes.labels(p.name).inc()
        if self.on_backend_loss == "keep":
            log.error("pool %s: %s; on_backend_loss=keep: %d sessions keep running and the "
                      "replicas may exceed their caps", p.name, why, count)  # fmt: skip
            return
        log.error("pool %s: %s; closing this gateway's %d sessions (1012)", p.name, why, count)
        for listener in self.fence_listeners:
            listener(p.name, why)

    def grants_blocked_s(self) -> float:
        """Seconds until Redis grants slots again after it lost its data (a new
        generation, while surviving gateways re-assert their leases); 0 when not blocked."""
        now = self.store.clock.now()
        return max([0.0, *(p.blocked_until - now for p in self.store.pools.values())])
