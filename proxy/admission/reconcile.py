"""Streams an engine runs that Headroom did not admit: counted, and (opt-in per pool)
taken off the replica's cap.

In a sidecar deployment the engine's own port often stays reachable (batch jobs, a
health checker that synthesises, a client that was never repointed), and a gateway
configured with another Redis counts only its own sessions. Headroom then believes a
replica is below its cap while the engine runs more streams than the cap allows.

Per replica, each engine scrape (:class:`~proxy.upstreams.Upstreams`) gives the
requests in the engine, ``vllm:num_requests_running + vllm:num_requests_waiting``; the
*unadmitted streams* are those minus the sessions Headroom holds there (the in-process
gate's count, or on the redis backend every gateway's from the last renewal), at least
0. Waiting requests count too: when the engine's batch is full, Headroom's own sessions
are the ones that wait, and the running ones are the streams it did not admit.

With ``engine_reconcile: true`` on the pool, a *sustained* difference (the smaller of
the last two scrapes that answered, so one scrape that caught a session between
Headroom's release and the engine's end is not counted) is treated as slots in use: the replica's
effective cap is ``max_sessions`` minus it, never above ``max_sessions`` and never below 1
(the gates take no cap of 0; a replica full of other streams still takes one session).
Like any lowered cap it never ends a running session: sessions above it finish, and
none is admitted there until the sessions held are below it. (It is not floored at the
sessions held: such a floor would let every session that ends be replaced while the
other streams still run.) It is applied through the gates' own ``set_cap``, so both
backends get it, and it lapses
``engine_reconcile_hold_s`` after the scrape that last confirmed it, so a scrape that
stops answering cannot hold a replica down. A scrape that finds fewer streams gives the
slots back at once. Capacity refusals of such a pool say so in their message
(:meth:`EngineReconciler.explain`); the reason code stays the same.

Each gateway reconciles on its own (they scrape the same engines and, on the redis
backend, see the same held counts), so no state is shared.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.admission import ReplicaSpec
from proxy.errors import Refused

if TYPE_CHECKING:
    from proxy.admission.interface import AdmissionGate
    from proxy.clock import Clock, TimerHandle
    from proxy.settings import Settings

__all__ = ["CAPACITY_REASONS", "EngineReconciler"]

log = logging.getLogger("headroom.reconcile")

#: Refusals that mean "no free slot": the ones a reconciled cap can cause.
CAPACITY_REASONS = frozenset({"pool_full", "queue_full", "queue_timeout"})


@dataclass(slots=True)
class _Replica:
    configured: int  #: max_sessions from the configuration
    enabled: bool = False
    hold_s: float = 30.0
    unadmitted: int | None = None  #: the last scrape's difference (None: no figures)
    last: int | None = None  #: the last difference measured (kept over a failed scrape)
    taken: int = 0  #: slots taken off the cap now
    timer: TimerHandle | None = None


class EngineReconciler:
    """Per replica: the unadmitted streams, and the cap they leave (module docstring)."""

    def __init__(self, gate: AdmissionGate, clock: Clock, settings: Settings) -> None:
        self._gate = gate
        self._clock = clock
        self._replicas: dict[tuple[str, str], _Replica] = {}
        self.configure(settings)

    # -- configuration ----------------------------------------------------------------

    def configure(self, settings: Settings) -> None:
        """Take a (reloaded) configuration: each replica's configured cap and its
        pool's ``engine_reconcile`` and hold time. A pool switched off gets its
        configured caps back at once; replicas that left are forgotten."""
        wanted = set()
        for pool in settings.pools:
            for r in pool.replicas:
                key = (pool.name, r.name)
                wanted.add(key)
                state = self._replicas.setdefault(key, _Replica(r.max_sessions))
                state.configured = r.max_sessions
                state.hold_s = pool.engine_reconcile_hold_s
                if state.enabled and not pool.engine_reconcile:
                    self._lapse(key, state)
                state.enabled = pool.engine_reconcile
        for key in set(self._replicas) - wanted:
            state = self._replicas.pop(key)
            if state.timer is not None:
                state.timer.cancel()

    def specs(self, pool: str, specs: list[ReplicaSpec]) -> list[ReplicaSpec]:
        """``specs`` (from the configuration) with each replica's effective cap, so a
        reload does not hand out slots the engine's other streams hold."""
        return [ReplicaSpec(s.name, self.cap(pool, s.name, s.max_sessions)) for s in specs]

    # -- figures ----------------------------------------------------------------------

    def cap(self, pool: str, replica: str, configured: int) -> int:
        """The effective cap of ``configured`` for the replica now."""
        state = self._replicas.get((pool, replica))
        if state is None or not state.enabled or state.taken <= 0:
            return configured
        return min(configured, max(1, configured - state.taken))

    def unadmitted(self, pool: str, replica: str) -> int | None:
        """The last scrape's unadmitted streams (None: no engine figures)."""
        state = self._replicas.get((pool, replica))
        return None if state is None else state.unadmitted

    def taken(self, pool: str, replica: str) -> int:
        """Slots the reconciliation takes off the replica's cap now."""
        state = self._replicas.get((pool, replica))
        return state.taken if state is not None and state.enabled else 0

    def observe(self, pool: str, replica: str, in_engine: float | None) -> None:
        """One scrape of the replica: ``in_engine`` requests (running + waiting), or
        None when the page failed or had no engine figures (the reduction then stays
        until its hold time ends, no longer). A figure that is not a finite number
        counts as none, with a warning."""
        key = (pool, replica)
        state = self._replicas.get(key)
        if state is None:
            return
        if in_engine is not None and not math.isfinite(in_engine):
            log.warning(
                "pool %s replica %s: the engine reports %s requests, not a finite number; "
                "taken as no figures", pool, replica, in_engine,
            )  # fmt: skip
            in_engine = None
        if in_engine is None:
            state.unadmitted = None
            return
        unadmitted = max(0, round(in_engine) - self._held(pool).get(replica, 0))
        previous, state.last = state.last, unadmitted
        state.unadmitted = unadmitted
        if not state.enabled:
            return
        sustained = min(unadmitted, previous) if previous is not None else 0
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        if sustained > 0:
            when = self._clock.now() + state.hold_s
            state.timer = self._clock.call_at(when, lambda: self._expire(key))
        if sustained != state.taken:
            log.warning(
                "pool %s replica %s: the engine runs %d stream(s) Headroom did not admit; "
                "%d slot(s) taken off its cap of %d", pool, replica, sustained, sustained,
                state.configured,
            )  # fmt: skip
        state.taken = sustained
        self._apply(key, state)

    def explain(self, refusal: Refused) -> Refused:
        """``refusal`` with a message that says so when the pool's caps are lowered for
        streams the engine runs that Headroom did not admit (same reason code)."""
        if refusal.reason not in CAPACITY_REASONS:
            return refusal
        taken = {
            replica: state.taken
            for (pool, replica), state in self._replicas.items()
            if pool == refusal.pool and state.enabled and state.taken > 0
        }
        if not taken:
            return refusal
        held = ", ".join(f"{n} on {r}" for r, n in sorted(taken.items()))
        message = (
            f"{refusal.message} The engine runs streams Headroom did not admit, which "
            f"hold slots Headroom counts as in use ({held})."
        )
        return type(refusal)(
            refusal.reason,
            retry_after_s=refusal.retry_after_s,
            pool=refusal.pool,
            queue_position=refusal.queue_position,
            fallback=refusal.fallback,
            message=message,
        )

    # -- internals --------------------------------------------------------------------

    def _held(self, pool: str) -> dict[str, int]:
        """Sessions Headroom holds per replica of ``pool``: the gate's count over every
        gateway that shares the pool (:meth:`AdmissionGate.held_per_replica`), or this
        gateway's own if that is more (the shared gate's count dates from its last
        renewal, so sessions admitted since are not in it yet)."""
        try:
            stats = self._gate.statistics()[pool]
        except KeyError:
            return {}
        held = {r.name: r.active for r in stats.replicas}
        for replica, n in self._gate.held_per_replica(pool).items():
            held[replica] = max(held.get(replica, 0), n)
        return held

    def _expire(self, key: tuple[str, str]) -> None:
        state = self._replicas.get(key)
        if state is None:
            return
        state.timer = None
        if state.taken > 0:
            log.warning(
                "pool %s replica %s: no engine scrape confirmed its %d unadmitted stream(s) "
                "within %g s; its cap is %d again", key[0], key[1], state.taken, state.hold_s,
                state.configured,
            )  # fmt: skip
        self._lapse(key, state)

    def _lapse(self, key: tuple[str, str], state: _Replica) -> None:
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        state.taken = 0
        state.last = None
        self._apply(key, state, force=True)

    def _apply(self, key: tuple[str, str], state: _Replica, *, force: bool = False) -> None:
        pool, replica = key
        try:
            current = {r.name: r.cap for r in self._gate.statistics()[pool].replicas}
        except KeyError:
            return
        if replica not in current:
            return
        cap = self.cap(pool, replica, state.configured) if state.enabled else state.configured
        if cap != current[replica] and (state.enabled or force):
            self._gate.set_cap(pool, replica, cap)
