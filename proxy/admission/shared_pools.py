"""Changing the pools live, for the shared gate.

:class:`SharedPoolChanges` is the job of :class:`proxy.admission.shared_gate.SharedGate`
that changes this gateway's configuration view while it runs: a pool created or
changed (caps, queue policy, fallback, reserves; a replica dropped is retired, its
running sessions never cut), a pool retired, a replica's health and guard flag, the
health re-check interval, the health and fence listeners, and the drain. Each change
takes effect for new admissions on every gateway at once: it renews the pool now
(:mod:`proxy.admission.shared_renewal`), which hands freed capacity to waiters and
publishes guard flags; waiters refused by a drain or a retired pool hear
``draining``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from proxy.admission import QueuePolicy, Reject, ReplicaSpec, Reserve
from proxy.admission.interface import FenceCallback
from proxy.admission.shared_renewal import SharedRenewal
from proxy.admission.shared_state import PoolState, ReplicaState
from proxy.admission.shared_wakeups import SharedWakeups
from proxy.errors import FallbackHint

__all__ = ["SharedPoolChanges"]

log = logging.getLogger("headroom.shared_gate")


class SharedPoolChanges(SharedRenewal, SharedWakeups):
    """The shared gate's live pool, health and guard changes and its drain (module
    docstring)."""

    def drain(self) -> None:
        self.draining = True
        for p in self._pools.values():
            self._refuse_waiters(p, "draining")

    def _refuse_waiters(self, p: PoolState, reason: str) -> None:
        for waiter in list(p.waiters.values()):
            if waiter.queued and not waiter.future.done():
                waiter.future.set_result(
                    Reject(
                        0, reason, self._estimate(p, 1), waited_s=self.clock.now() - waiter.arrived
                    )
                )

    def set_healthy(self, pool: str, replica: str, healthy: bool) -> None:
        r = self._pool(pool).replicas.get(replica)
        if r is not None and r.healthy != healthy:
            log.warning("replica %s/%s is now %s", pool, replica,
                        "healthy" if healthy else "unhealthy")  # fmt: skip
            r.healthy = healthy
            if healthy:
                self._ejected_at.pop((pool, replica), None)
            else:
                self._ejected_at[(pool, replica)] = self.clock.now()
            self._poke(pool)
            for listener in self._healthy_listeners:
                listener(pool, replica, healthy)

    def set_guarded(self, pool: str, replica: str, guarded: bool) -> None:
        r = self._pool(pool).replicas.get(replica)
        if r is not None and r.guarded != guarded:
            r.guarded = guarded
            self._poke(pool)

    def set_cap(self, pool: str, replica: str, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"replica {replica!r}: cap must be >= 1 (got {cap})")
        self._pool(pool).replicas[replica].cap = cap
        self._poke(pool)

    def apply_pool(
        self,
        name: str,
        replicas: Sequence[ReplicaSpec],
        queue: QueuePolicy,
        fallback: FallbackHint | None,
        *,
        session_estimate_s: float = 20.0,
        reserves: Sequence[Reserve] | None = None,
    ) -> None:
        """Create a pool or change one live. Caps and reserves (None: unchanged) take
        effect for new admissions on every gateway at once (each gateway's calls carry
        its own view and reserves); running sessions are never cut."""
        if reserves is None:
            reserves = self._reserves.get(name, ())
        self._reserves[name] = tuple(reserves)
        self.backend.configure_pool(name, session_estimate_s=session_estimate_s, reserves=reserves)
        p = self._pools.get(name)
        if p is None:
            self._pools[name] = PoolState(
                name, {r.name: ReplicaState(r.max_sessions) for r in replicas}, queue, fallback,
                session_estimate_s,
            )  # fmt: skip
            if self._loops:
                self._loops.append(asyncio.ensure_future(self._wake_loop(name)))
            return
        p.fallback = fallback
        p.queue = queue
        if not self.draining:
            p.draining = False
        wanted = {r.name: r.max_sessions for r in replicas}
        for r_name, r in p.replicas.items():
            r.retired = r_name not in wanted
        for r_name, cap in wanted.items():
            existing = p.replicas.get(r_name)
            if existing is None:
                p.replicas[r_name] = ReplicaState(cap)
            else:
                existing.cap = cap
        self._poke(name)

    def retire_pool(self, name: str) -> None:
        p = self._pool(name)
        p.draining = True
        self._refuse_waiters(p, "draining")

    def on_health_change(self, listener: Callable[[str, str, bool], None]) -> None:
        self._healthy_listeners.append(listener)

    def set_recheck_interval(self, interval_s: float | None) -> None:
        """How often an ejected replica is re-checked (``health.recheck_interval_s``):
        a ``no_healthy_replica`` refusal advises retrying around the next re-check."""
        self._recheck_interval_s = interval_s

    def on_fence(self, listener: FenceCallback) -> None:
        self._fence_listeners.append(listener)

    def _poke(self, pool: str) -> None:
        """Renew now: hands freed capacity to waiters and publishes guard flags."""
        if self._loops:
            self._spawn(self._renew_pool(pool))
