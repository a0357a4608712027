"""What the shared gate answers when asked: its read side.

:class:`SharedViews` is the part of :class:`proxy.admission.shared_gate.SharedGate`
that reports without changing anything (it reads the gate's
:class:`~proxy.admission.shared_store.SharedStore` and keeps no state of its own):
the pools, their fallbacks and reserves, :meth:`~SharedViews.statistics` (this
gateway's own sessions per replica and its waiters), the sessions held per replica
over every gateway as of the last renewal, this gateway's name in Redis, its
sessions active and queued, and the per-replica, per-queue and per-tenant gauges the
scrape collectors (:mod:`proxy.metering.scrape`) read.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.admission import PoolStatistics, ReplicaStatistics, Reserve
from proxy.admission.shared_store import SharedStore
from proxy.errors import FallbackHint
from proxy.metering.scrape import ReplicaGauges, TenantGauges

__all__ = ["SharedViews"]


class SharedViews:
    """The shared gate's queries and gauges (module docstring)."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store

    def pools(self) -> list[str]:
        return list(self.store.pools)

    def fallback(self, pool: str) -> FallbackHint | None:
        return self.store.pool(pool).fallback

    def reserves(self, pool: str) -> tuple[Reserve, ...]:
        """The pool's reserves as this gateway sends them with every script call."""
        return self.store.pool(pool).reserves

    def statistics(self) -> dict[str, PoolStatistics]:
        """This gateway's view: its own sessions per replica (``active``) and waiters."""
        out = {}
        for name, p in self.store.pools.items():
            mine: dict[str, int] = {}
            for lease in p.leases.values():
                mine[lease.replica] = mine.get(lease.replica, 0) + 1
            out[name] = PoolStatistics(
                name=name,
                replicas=tuple(
                    ReplicaStatistics(
                        r_name, mine.get(r_name, 0), r.cap, r.healthy, r.guarded, r.retired
                    )
                    for r_name, r in p.replicas.items()
                ),
                queue_depth=p.queued(),
                max_depth=p.queue.max_depth,
                max_wait_s=p.queue.max_wait_s,
                draining=p.draining or self.store.draining,
                session_estimate_s=p.lengths.mean,
            )
        return out

    def held_per_replica(self, pool: str) -> dict[str, int]:
        """Sessions holding a slot per replica over every gateway, as of the last
        renewal."""
        return dict(self.store.pool(pool).held)

    @property
    def gateway_id(self) -> str:
        """This gateway's name in Redis (its lease and waiter ids start with it)."""
        return self.store.backend.gateway_id

    @property
    def active(self) -> int:
        """This gateway's sessions holding a slot, over every pool."""
        return sum(len(p.leases) for p in self.store.pools.values())

    @property
    def queued(self) -> int:
        """This gateway's sessions waiting in a queue, over every pool."""
        return sum(p.queued() for p in self.store.pools.values())

    def replica_gauges(
        self,
        ratio: Callable[[str, str], float | None] | None = None,
        guarded: Callable[[str, str], bool] | None = None,
    ) -> list[ReplicaGauges]:
        """Per replica, from :meth:`statistics` (this gateway's own sessions); ``ratio`` and
        ``guarded`` supply the rolling delivery ratio and the guard's state in observe mode."""
        out: list[ReplicaGauges] = []
        for name, stats in self.statistics().items():
            for r in stats.replicas:
                out.append(ReplicaGauges(
                    name, r.name, r.active, r.cap, r.healthy,
                    guarded(name, r.name) if guarded else r.guarded,
                    ratio(name, r.name) if ratio else None,
                ))  # fmt: skip
        return out

    def queue_depths(self) -> list[tuple[str, int]]:
        """``(pool, waiters)``: this gateway's own waiters in each pool's queue."""
        return [(name, p.queued()) for name, p in self.store.pools.items()]

    def tenant_gauges(self) -> list[TenantGauges]:
        """Per API key and pool, this gateway's part (sum over gateways): sessions
        active and queued, and session-seconds held (finished plus running so far), as
        :meth:`proxy.admission.gate.Gate.tenant_gauges` reports them in process."""
        out: list[TenantGauges] = []
        now = self.store.clock.now()
        for name, p in self.store.pools.items():
            counts: dict[tuple[str, int], list[int]] = {}
            held = dict(p.finished)
            for lease in p.leases.values():
                t = lease.tenant
                if t is not None and t.name:
                    key = (t.name, t.priority)
                    counts.setdefault(key, [0, 0])[0] += 1
                    held[key] = held.get(key, 0.0) + max(0.0, now - lease.admitted_at)
            for w in p.waiters.values():
                t = w.tenant
                if t is not None and t.name and w.queued and not w.future.done():
                    counts.setdefault((t.name, t.priority), [0, 0])[1] += 1
            for key in sorted(set(counts) | set(held)):
                active, queued = counts.get(key, [0, 0])
                out.append(TenantGauges(name, key[0], key[1], active, queued, held.get(key, 0.0)))
        return out

    def describe(self) -> str:
        """The gate's ``repr``: its name, drain, and each pool's leases and waiters."""
        store = self.store
        inner = ", ".join(
            f"{n} leases={len(p.leases)} waiters={p.queued()}" for n, p in store.pools.items()
        )
        state = " draining" if store.draining else ""
        return f"<SharedGate {store.backend.gateway_id}{state} [{inner}]>"
