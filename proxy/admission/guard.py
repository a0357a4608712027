"""The guard: stop admitting to a replica whose listeners are already near a stall.

A static cap is measured once; a GPU's real ceiling moves (longer texts grow the KV
cache, a noisy neighbour, thermal throttling). The guard watches each replica's
rolling worst-1% per-chunk delivery ratio (:class:`~proxy.metering.rolling.ReplicaSignals`) and,
when it falls below ``threshold`` (default :data:`~proxy.metering.rolling.DELIVERY_THRESHOLD`,
in multiples of realtime) with at least ``min_samples`` chunks in the window, holds new
admissions to that replica -- even below its cap -- until the ratio has stayed at or
above ``threshold + hysteresis`` for ``hold_s`` seconds (or the window has emptied: no
audio is flowing, so nothing is at risk). It never raises a replica above its
configured cap: it only takes the replica out of placement.

The two thresholds and the hold time make it a Schmitt trigger: a ratio hovering
around the threshold trips it once and it stays tripped, instead of admitting and
refusing on alternate evaluations.

**Start-up signals** (:class:`~proxy.metering.rolling.StartupSignals`, off unless configured): a
replica past its knee may keep its running streams' chunks on time while the streams it
admits next start badly -- their first seam stalls (the second chunk, a full-size one,
takes longer to make than the small first one lasts) or their first audio comes late
(an engine full at ``max_num_seqs`` queues newcomers instead of slowing everyone). With
at least ``startup_min_streams`` first seams in the window, more than
``max_startup_stall_share`` of them stalling trips the guard (``startup_stalls``); with
at least ``startup_min_streams`` sessions' first audio in the window, a TTFA p99 above
``ttfa_p99_s`` trips it (``ttfa``). Each is within its limit again (for release) when it
is at or below it or the window holds fewer than ``startup_min_streams`` samples of it:
while guarded, no new stream starts there, so old starts age out of the window and the
replica is tried again, as with an emptied ratio window. ``reasons`` names what tripped.

:class:`ReplicaGuard` is pure: no clock reads, no asyncio. :class:`GuardLoop` drives
every replica's guard once per :data:`GUARD_INTERVAL_S` on the injected clock
(:mod:`proxy.clock`) and tells the gate. Modes (``guard.mode``): ``off`` (not
evaluated), ``observe`` (state exported as ``headroom_replica_guarded`` and logged,
admissions unaffected), ``enforce`` (the gate stops placing sessions on a guarded
replica).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from proxy.clock import Clock, TimerHandle
from proxy.metering.rolling import DELIVERY_THRESHOLD, ReplicaSignals, StartupSignals

__all__ = ["GUARD_INTERVAL_S", "GuardLoop", "GuardPolicy", "GuardTarget", "ReplicaGuard"]

log = logging.getLogger("headroom.guard")

#: How often the guard evaluates every replica's rolling signals.
GUARD_INTERVAL_S = 1.0

_NO_STARTS = StartupSignals()


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    threshold: float = DELIVERY_THRESHOLD
    hysteresis: float = 0.1
    hold_s: float = 10.0
    min_samples: int = 50
    #: Trip when more than this share of first seams stalled (None: not watched).
    max_startup_stall_share: float | None = None
    #: Trip when TTFA p99 exceeds this many seconds (None: not watched).
    ttfa_p99_s: float | None = None
    #: First seams / first audios the window needs before either start-up rule judges.
    startup_min_streams: int = 10

    def __post_init__(self) -> None:
        if self.threshold <= 0 or self.hysteresis < 0 or self.hold_s < 0:
            raise ValueError("guard: threshold > 0, hysteresis >= 0, hold_s >= 0")
        if self.min_samples < 1 or self.startup_min_streams < 1:
            raise ValueError("guard: min_samples >= 1, startup_min_streams >= 1")
        share = self.max_startup_stall_share
        if share is not None and not 0.0 <= share < 1.0:
            raise ValueError("guard: max_startup_stall_share in [0, 1)")
        if self.ttfa_p99_s is not None and not self.ttfa_p99_s > 0:
            raise ValueError("guard: ttfa_p99_s > 0")

    def startup_breaches(self, startup: StartupSignals) -> list[str]:
        """The start-up rules ``startup`` breaks: ``startup_stalls``, ``ttfa``."""
        out = []
        share = self.max_startup_stall_share
        if (
            share is not None
            and startup.seams >= self.startup_min_streams
            and startup.stalled > share * startup.seams
        ):
            out.append("startup_stalls")
        p99 = startup.ttfa_p99
        if (
            self.ttfa_p99_s is not None
            and p99 is not None
            and startup.ttfas >= self.startup_min_streams
            and p99 > self.ttfa_p99_s
        ):
            out.append("ttfa")
        return out

    @property
    def recover_at(self) -> float:
        """The worst-1% ratio a guarded replica must hold (for ``hold_s``) to be released:
        ``threshold + hysteresis``."""
        return self.threshold + self.hysteresis


class ReplicaGuard:
    """The guard state of one replica."""

    __slots__ = (
        "_healthy_since",
        "guarded",
        "last_ratio",
        "last_startup",
        "policy",
        "reasons",
        "since",
        "transitions",
    )

    def __init__(self, policy: GuardPolicy) -> None:
        self.policy = policy
        self.guarded = False
        self.since: float | None = None
        self.transitions = 0
        self.last_ratio: float | None = None
        self.last_startup = _NO_STARTS
        #: What tripped the guard the last time it engaged: ``steady`` (the ratio),
        #: ``startup_stalls``, ``ttfa``.
        self.reasons: tuple[str, ...] = ()
        self._healthy_since: float | None = None

    def update(
        self,
        now: float,
        worst_ratio: float | None,
        samples: int,
        startup: StartupSignals = _NO_STARTS,
    ) -> bool:
        """Evaluate at ``now``; returns True if the state changed (see :attr:`guarded`)."""
        policy = self.policy
        self.last_ratio = worst_ratio
        self.last_startup = startup
        starts = policy.startup_breaches(startup)
        if not self.guarded:
            tail_too_slow = (
                worst_ratio is not None
                and samples >= policy.min_samples
                and worst_ratio < policy.threshold
            )
            if tail_too_slow or starts:
                self.reasons = (*(["steady"] if tail_too_slow else []), *starts)
                return self._set(True, now)
            return False
        recovered = (worst_ratio is None or worst_ratio >= policy.recover_at) and not starts
        if not recovered:
            self._healthy_since = None
            return False
        if self._healthy_since is None:
            self._healthy_since = now
        if now - self._healthy_since >= policy.hold_s:
            return self._set(False, now)
        return False

    def _set(self, guarded: bool, now: float) -> bool:
        self.guarded = guarded
        self.since = now
        self.transitions += 1
        self._healthy_since = None
        return True

    def __repr__(self) -> str:
        state = f"guarded {','.join(self.reasons)}" if self.guarded else "open"
        return f"<ReplicaGuard {state} ratio={self.last_ratio} transitions={self.transitions}>"


class GuardTarget(Protocol):
    """What :class:`GuardLoop` needs from the gate (in-process or shared)."""

    def set_guarded(self, pool: str, replica: str, guarded: bool) -> None: ...

    def pools(self) -> list[str]: ...


class GuardLoop:
    """Every replica's :class:`ReplicaGuard`, evaluated against its rolling signals
    every ``interval_s`` on ``clock`` while started and not ``off``; in ``enforce``
    mode each change is passed to the gate."""

    def __init__(
        self,
        gate: GuardTarget,
        clock: Clock,
        signals: Mapping[tuple[str, str], ReplicaSignals],
        *,
        interval_s: float = GUARD_INTERVAL_S,
    ) -> None:
        self._gate = gate
        self.clock = clock
        self._signals = signals
        self.interval_s = interval_s
        self.guards: dict[tuple[str, str], ReplicaGuard] = {}
        self.mode = "off"
        self.started = False
        self._timer: TimerHandle | None = None

    def configure(
        self, policy: GuardPolicy, mode: str, replicas: Iterable[tuple[str, str]]
    ) -> None:
        """Take a (reloaded) configuration: the policy (kept guards keep their state),
        the mode and the configured ``(pool, replica)`` pairs. Leaving ``enforce``
        hands every guarded replica back to placement."""
        keys = list(replicas)
        configured = set(keys)
        self.guards = {k: v for k, v in self.guards.items() if k in configured}
        for key in keys:
            guard = self.guards.get(key)
            if guard is None:
                self.guards[key] = ReplicaGuard(policy)
            else:
                guard.policy = policy
        if self.mode == "enforce" and mode != "enforce":
            pools = set(self._gate.pools())
            for pool, replica in self.guards:
                if pool in pools:
                    self._gate.set_guarded(pool, replica, False)
        self.mode = mode
        if self._timer is None:
            self._arm()

    def start(self) -> None:
        """Evaluate every ``interval_s`` from now on, unless the mode is ``off`` (calling it again
        is harmless)."""
        self.started = True
        if self._timer is None:
            self._arm()

    def stop(self) -> None:
        """Stop evaluating; guards keep their state, and guarded replicas stay guarded at
        the gate."""
        self.started = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def guarded(self, pool: str, replica: str) -> bool:
        """Whether the replica's guard is engaged (never in ``off`` mode)."""
        guard = self.guards.get((pool, replica))
        return guard is not None and guard.guarded and self.mode != "off"

    def _arm(self) -> None:
        if self.mode != "off" and self.started:
            self._timer = self.clock.call_at(self.clock.now() + self.interval_s, self.evaluate)

    def evaluate(self) -> None:
        """Feed every replica's rolling signals to its guard; apply changes (enforce)."""
        self._timer = None
        now = self.clock.now()
        mode = self.mode
        for (pool, replica), guard in self.guards.items():
            signals = self._signals[(pool, replica)]
            startup = signals.startup(now)
            if guard.update(now, signals.worst_ratio(now), signals.samples(now), startup):
                share, p99 = startup.stalled_share, startup.ttfa_p99
                log.warning(
                    "guard %s %s/%s (%s): worst-1%% delivery ratio %s (threshold %.2f), "
                    "first seams stalled %s of %d, TTFA p99 %s, mode %s",
                    "engaged on" if guard.guarded else "released",
                    pool, replica, ",".join(guard.reasons),
                    f"{guard.last_ratio:.2f}" if guard.last_ratio is not None else "n/a",
                    guard.policy.threshold,
                    f"{share:.0%}" if share is not None else "n/a", startup.seams,
                    f"{p99:.2f} s" if p99 is not None else "n/a", mode,
                )  # fmt: skip
                if mode == "enforce":
                    self._gate.set_guarded(pool, replica, guard.guarded)
        self._arm()
