"""Changing the pools live, for the shared gate.

:class:`SharedPoolChanges` is the shared gate's part that changes this gateway's
configuration view while it runs: a pool created or changed (caps, queue policy,
fallback, reserves; a replica dropped is retired, its running sessions never cut), a
pool retired, a replica's health and guard flag, the health re-check interval, the
health listeners, and the drain. Each change takes effect for new admissions on every
gateway at once: it renews the pool now
(:class:`~proxy.admission.shared_renewal.SharedRenewal`), which hands freed capacity to
waiters and publishes guard flags; waiters refused by a drain or a retired pool hear
``draining``. The view itself is each pool's
(:class:`~proxy.admission.shared_state.PoolState`); this part owns the health
listeners.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence

from proxy.admission import QueuePolicy, ReplicaSpec, Reserve
from proxy.admission.shared_renewal import SharedRenewal
from proxy.admission.shared_state import PoolState, ReplicaState
from proxy.admission.shared_store import SharedStore
from proxy.admission.shared_wakeups import SharedWakeups
from proxy.errors import FallbackHint

__all__ = ["SharedPoolChanges"]

log = logging.getLogger("headroom.shared_gate")


class SharedPoolChanges:
    """The shared gate's live pool, health and guard changes and its drain (module
    docstring). ``seed`` seeds each pool's Retry-After jitter."""

    def __init__(
        self, store: SharedStore, renewal: SharedRenewal, wakeups: SharedWakeups, seed: int
    ) -> None:
        self.store = store
        self.renewal = renewal
        self.wakeups = wakeups
        self.seed = seed
        self.healthy_listeners: list[Callable[[str, str, bool], None]] = []

    def drain(self) -> None:
        """Refuse everything new and every queued waiter of this gateway with ``draining``; sessions
        holding slots run on."""
        self.store.draining = True
        for p in self.store.pools.values():
            self._refuse_waiters(p, "draining")

    def _refuse_waiters(self, p: PoolState, reason: str) -> None:
        for waiter in list(p.waiters.values()):
            if waiter.queued and not waiter.future.done():
                retry = self.store.retry_after(p, reason, max(1, waiter.position))
                self.store.reject_waiter(waiter, reason, retry)

    def set_healthy(self, pool: str, replica: str, healthy: bool) -> None:
        """Eject or restore a replica in this gateway's view (the view it sends with every script
        call), renew at once so freed capacity reaches waiters, and tell the health listeners.
        Unknown replicas are ignored; an unknown pool raises LookupError."""
        r = self.store.pool(pool).replicas.get(replica)
        if r is not None and r.healthy != healthy:
            log.warning("replica %s/%s is now %s", pool, replica,
                        "healthy" if healthy else "unhealthy")  # fmt: skip
            r.healthy = healthy
            r.ejected_at = None if healthy else self.store.clock.now()
            self._poke(pool)
            for listener in self.healthy_listeners:
                listener(pool, replica, healthy)

    def set_guarded(self, pool: str, replica: str, guarded: bool) -> None:
        """Hold or release a replica for this gateway's guard; the renewal it triggers publishes the
        flag to the other gateways."""
        r = self.store.pool(pool).replicas.get(replica)
        if r is not None and r.guarded != guarded:
            r.guarded = guarded
            self._poke(pool)

    def set_cap(self, pool: str, replica: str, cap: int) -> None:
        """Change a replica's cap in this gateway's view. Raises ValueError for a cap below 1,
        KeyError for an unknown replica."""
        if cap < 1:
            raise ValueError(f"replica {replica!r}: cap must be >= 1 (got {cap})")
        self.store.pool(pool).replicas[replica].cap = cap
        self._poke(pool)

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
        """Create a pool or change one live: the pool's whole configuration (reserves
        not given: none). Caps and reserves take effect for new admissions on every
        gateway at once (each gateway's calls carry its own view and reserves); running
        sessions are never cut."""
        store = self.store
        store.backend.configure_pool(name, session_estimate_s=session_estimate_s,
                                     reserves=reserves)  # fmt: skip
        p = store.pools.get(name)
        if p is None:
            store.pools[name] = PoolState(
                name, {r.name: ReplicaState(r.max_sessions) for r in replicas}, queue, fallback,
                session_estimate_s, tuple(reserves), random.Random(self.seed),
            )  # fmt: skip
            if store.loops:
                store.loops.append(asyncio.ensure_future(self.wakeups.loop(name)))
            return
        p.reserves = tuple(reserves)
        p.fallback = fallback
        p.queue = queue
        if not store.draining:
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
        """Refuse this gateway's waiters and newcomers on ``name`` with ``draining``; its running
        sessions finish."""
        p = self.store.pool(name)
        p.draining = True
        self._refuse_waiters(p, "draining")

    def on_health_change(self, listener: Callable[[str, str, bool], None]) -> None:
        """Call ``listener(pool, replica, healthy)`` after each change :meth:`set_healthy` makes."""
        self.healthy_listeners.append(listener)

    def set_recheck_interval(self, interval_s: float | None) -> None:
        """How often an ejected replica is re-checked (``health.recheck_interval_s``):
        a ``no_healthy_replica`` refusal advises retrying around the next re-check."""
        self.store.recheck_interval_s = interval_s

    def _poke(self, pool: str) -> None:
        """Renew now: hands freed capacity to waiters and publishes guard flags."""
        if self.store.loops:
            self.store.spawn(self.renewal.renew_pool(pool))
