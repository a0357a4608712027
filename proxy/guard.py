"""The guard: stop admitting to a replica whose listeners are already near a stall.

A static cap is measured once; a GPU's real ceiling moves (longer texts grow the KV
cache, a noisy neighbour, thermal throttling). The guard watches each replica's
rolling worst-1% per-chunk delivery ratio (:class:`~proxy.signals.ReplicaSignals`) and,
when it falls below ``threshold`` (default 1.2x realtime) with at least
``min_samples`` chunks in the window, holds new admissions to that replica -- even
below its cap -- until the ratio has stayed at or above ``threshold + hysteresis`` for
``hold_s`` seconds (or the window has emptied: no audio is flowing, so nothing is at
risk). It never raises a replica above its configured cap: it only takes the replica
out of placement.

The two thresholds and the hold time make it a Schmitt trigger: a ratio hovering
around the threshold trips it once and it stays tripped, instead of admitting and
refusing on alternate evaluations.

Pure: no clock reads, no asyncio. Modes (``guard.mode``): ``off`` (not evaluated),
``observe`` (state exported as ``headroom_replica_guarded`` and logged, admissions
unaffected), ``enforce`` (the gate stops placing sessions on a guarded replica).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GuardPolicy", "ReplicaGuard"]


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    threshold: float = 1.2
    hysteresis: float = 0.1
    hold_s: float = 10.0
    min_samples: int = 50

    def __post_init__(self) -> None:
        if self.threshold <= 0 or self.hysteresis < 0 or self.hold_s < 0:
            raise ValueError("guard: threshold > 0, hysteresis >= 0, hold_s >= 0")
        if self.min_samples < 1:
            raise ValueError("guard: min_samples >= 1")

    @property
    def recover_at(self) -> float:
        return self.threshold + self.hysteresis


class ReplicaGuard:
    """The guard state of one replica."""

    __slots__ = ("_healthy_since", "guarded", "last_ratio", "policy", "since", "transitions")

    def __init__(self, policy: GuardPolicy) -> None:
        self.policy = policy
        self.guarded = False
        self.since: float | None = None
        self.transitions = 0
        self.last_ratio: float | None = None
        self._healthy_since: float | None = None

    def update(self, now: float, worst_ratio: float | None, samples: int) -> bool:
        """Evaluate at ``now``; returns True if the state changed (see :attr:`guarded`)."""
        policy = self.policy
        self.last_ratio = worst_ratio
        if not self.guarded:
            tail_too_slow = (
                worst_ratio is not None
                and samples >= policy.min_samples
                and worst_ratio < policy.threshold
            )
            return self._set(True, now) if tail_too_slow else False
        recovered = worst_ratio is None or worst_ratio >= policy.recover_at
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
        state = "guarded" if self.guarded else "open"
        return f"<ReplicaGuard {state} ratio={self.last_ratio} transitions={self.transitions}>"
