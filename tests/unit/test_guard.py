"""The guard's Schmitt trigger on a fake timeline."""

from __future__ import annotations

import random

import pytest

from proxy.admission.guard import GuardPolicy, ReplicaGuard
from proxy.metering.rolling import StartupSignals

POLICY = GuardPolicy(threshold=1.2, hysteresis=0.1, hold_s=10.0, min_samples=50)


def test_trips_below_threshold_with_enough_samples() -> None:
    guard = ReplicaGuard(POLICY)
    assert not guard.update(0.0, 1.19, samples=49)  # too few samples to judge
    assert not guard.guarded
    assert guard.update(1.0, 1.19, samples=50)
    assert guard.guarded and guard.since == 1.0


def test_recovers_only_above_hysteresis_after_the_hold() -> None:
    guard = ReplicaGuard(POLICY)
    guard.update(0.0, 1.0, 100)
    assert not guard.update(1.0, 1.29, 100)  # above threshold, below threshold+hysteresis
    assert not guard.update(2.0, 1.31, 100)  # healthy from t=2
    assert not guard.update(11.9, 1.31, 100)
    assert guard.guarded
    assert guard.update(12.0, 1.31, 100)  # held for 10 s
    assert not guard.guarded


def test_a_dip_during_the_hold_restarts_it() -> None:
    guard = ReplicaGuard(POLICY)
    guard.update(0.0, 1.0, 100)
    guard.update(1.0, 1.5, 100)
    guard.update(8.0, 1.25, 100)  # dip: not recovered
    guard.update(9.0, 1.5, 100)
    assert not guard.update(18.0, 1.5, 100)
    assert guard.update(19.0, 1.5, 100)


def test_an_empty_window_counts_as_recovered() -> None:
    guard = ReplicaGuard(POLICY)
    guard.update(0.0, 1.0, 100)
    guard.update(1.0, None, 0)
    assert guard.update(11.0, None, 0)


@pytest.mark.parametrize("seed", range(5))
def test_no_oscillation_for_a_replica_hovering_at_its_knee(seed: int) -> None:
    """A replica near its knee: the worst-1% ratio wanders 1.12..1.28 around the 1.2
    threshold, evaluated once a second for 10 minutes. The guard trips once and holds:
    it never flaps."""
    rng = random.Random(seed)
    guard = ReplicaGuard(POLICY)
    for t in range(600):
        guard.update(float(t), 1.2 + rng.uniform(-0.08, 0.08), samples=500)
    assert guard.transitions == 1
    assert guard.guarded


def test_recovery_after_load_drops_then_one_trip_per_overload() -> None:
    guard = ReplicaGuard(POLICY)
    timeline = [0.9] * 30 + [1.6] * 30 + [0.9] * 30 + [1.6] * 30
    states = []
    for t, ratio in enumerate(timeline):
        guard.update(float(t), ratio, samples=500)
        states.append(guard.guarded)
    assert guard.transitions == 4  # trip, recover, trip, recover
    assert states[0] and not states[59] and states[60] and not states[-1]


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="threshold"):
        GuardPolicy(threshold=0)
    with pytest.raises(ValueError, match="min_samples"):
        GuardPolicy(min_samples=0)


STARTUP = GuardPolicy(
    threshold=1.2, hysteresis=0.1, hold_s=10.0, min_samples=50,
    max_startup_stall_share=0.1, ttfa_p99_s=1.0, startup_min_streams=10,
)  # fmt: skip


def test_startup_signals_are_off_by_default() -> None:
    guard = ReplicaGuard(POLICY)
    bad = StartupSignals(seams=100, stalled=100, ttfas=100, ttfa_p99=30.0)
    assert not guard.update(0.0, 2.0, 500, bad)
    assert not guard.guarded


def test_first_seam_stalls_trip_the_guard_while_steady_chunks_look_fine() -> None:
    guard = ReplicaGuard(STARTUP)
    # Too few starts to judge, then at the limit (1 of 10 = 10 %): not past it.
    assert not guard.update(0.0, 2.0, 500, StartupSignals(seams=9, stalled=9))
    assert not guard.update(1.0, 2.0, 500, StartupSignals(seams=10, stalled=1))
    assert guard.update(2.0, 2.0, 500, StartupSignals(seams=10, stalled=2))
    assert guard.guarded and guard.reasons == ("startup_stalls",)
    # The stalls stay in the window: no release, however fine the ratio.
    assert not guard.update(30.0, 2.0, 500, StartupSignals(seams=10, stalled=2))
    # Guarded, nothing new starts: the starts age out, then the hold runs.
    assert not guard.update(31.0, 2.0, 500, StartupSignals(seams=0, stalled=0))
    assert not guard.update(40.9, 2.0, 500, StartupSignals())
    assert guard.update(41.0, 2.0, 500, StartupSignals())
    assert not guard.guarded


def test_ttfa_p99_above_the_limit_trips_the_guard() -> None:
    guard = ReplicaGuard(STARTUP)
    assert not guard.update(0.0, 2.0, 500, StartupSignals(ttfas=9, ttfa_p99=5.0))
    assert not guard.update(1.0, 2.0, 500, StartupSignals(ttfas=10, ttfa_p99=1.0))
    assert guard.update(2.0, None, 0, StartupSignals(ttfas=10, ttfa_p99=1.01))
    assert guard.reasons == ("ttfa",)
    guard.update(3.0, 2.0, 500, StartupSignals(ttfas=10, ttfa_p99=0.5))  # within: hold runs
    assert guard.update(13.0, 2.0, 500, StartupSignals(ttfas=10, ttfa_p99=0.5))


def test_every_breached_signal_is_named() -> None:
    guard = ReplicaGuard(STARTUP)
    both = StartupSignals(seams=20, stalled=20, ttfas=20, ttfa_p99=2.0)
    assert guard.update(0.0, 1.0, 500, both)
    assert guard.reasons == ("steady", "startup_stalls", "ttfa")


def test_startup_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="max_startup_stall_share"):
        GuardPolicy(max_startup_stall_share=1.0)
    with pytest.raises(ValueError, match="ttfa_p99_s"):
        GuardPolicy(ttfa_p99_s=0.0)
    with pytest.raises(ValueError, match="startup_min_streams"):
        GuardPolicy(startup_min_streams=0)
