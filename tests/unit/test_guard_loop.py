"""The guard loop (:class:`proxy.admission.guard.GuardLoop`) on a fake clock, against a real
in-process gate: it evaluates every replica once per interval while started and not
``off``, passes changes to the gate only in ``enforce``, and a reload keeps the guards'
state, drops removed replicas and hands guarded ones back when leaving ``enforce``."""

from __future__ import annotations

from proxy.admission.gate import Gate
from proxy.admission.guard import GUARD_INTERVAL_S, GuardLoop, GuardPolicy
from proxy.clock import FakeClock
from proxy.metering.rolling import ReplicaSignals
from proxy.runtime import build_gate
from tests.conftest import proxy_settings

POLICY = GuardPolicy(threshold=1.2, hysteresis=0.1, hold_s=5, min_samples=10)
REPLICAS = [("main", "gpu0"), ("main", "gpu1")]


def loop(mode: str) -> tuple[GuardLoop, Gate, dict[tuple[str, str], ReplicaSignals], FakeClock]:
    clock = FakeClock()
    settings = proxy_settings(
        [("gpu0", "http://127.0.0.1:9", 4), ("gpu1", "http://127.0.0.1:10", 4)],
        [{"path": "/s", "pool": "main", "protocol": "passthrough-ws"}],
    )
    gate = build_gate(settings, clock, None)
    signals = {key: ReplicaSignals(10.0) for key in REPLICAS}
    guard = GuardLoop(gate, clock, signals)
    guard.configure(POLICY, mode, REPLICAS)
    return guard, gate, signals, clock


def feed(signals: ReplicaSignals, clock: FakeClock, ratio: float, n: int = 30) -> None:
    for _ in range(n):
        signals.observe(clock.now(), ratio, 0.2)


def placeable(gate: Gate) -> dict[str, bool]:
    return {r.name: not r.guarded for r in gate.statistics()["main"].replicas}


def test_the_loop_evaluates_once_per_interval_on_the_clock_and_enforces() -> None:
    guard, gate, signals, clock = loop("enforce")
    feed(signals[("main", "gpu0")], clock, 0.9)
    assert clock.pending_timers == 0  # not started: nothing armed
    guard.start()
    assert clock.pending_timers == 1
    clock.advance(GUARD_INTERVAL_S - 0.01)
    assert not guard.guarded("main", "gpu0")
    clock.advance(0.01)
    assert guard.guarded("main", "gpu0") and not guard.guarded("main", "gpu1")
    assert placeable(gate) == {"gpu0": False, "gpu1": True}
    assert guard.guards[("main", "gpu0")].reasons == ("steady",)
    assert clock.pending_timers == 1  # re-armed
    # the bad samples age out of the 10 s window; after the 5 s hold it reopens
    clock.advance(16)
    assert not guard.guarded("main", "gpu0")
    assert placeable(gate) == {"gpu0": True, "gpu1": True}
    guard.stop()
    assert clock.pending_timers == 0


def test_observe_guards_without_telling_the_gate() -> None:
    guard, gate, signals, clock = loop("observe")
    feed(signals[("main", "gpu0")], clock, 0.9)
    guard.start()
    clock.advance(GUARD_INTERVAL_S)
    assert guard.guarded("main", "gpu0")
    assert placeable(gate) == {"gpu0": True, "gpu1": True}


def test_off_arms_no_timer_and_never_reports_guarded() -> None:
    guard, _, signals, clock = loop("off")
    feed(signals[("main", "gpu0")], clock, 0.5)
    guard.start()
    assert clock.pending_timers == 0
    guard.evaluate()  # even when asked directly
    assert not guard.guarded("main", "gpu0")


def test_a_reload_keeps_state_drops_removed_replicas_and_leaving_enforce_unguards() -> None:
    guard, gate, signals, clock = loop("enforce")
    feed(signals[("main", "gpu0")], clock, 0.9)
    guard.start()
    clock.advance(GUARD_INTERVAL_S)
    assert placeable(gate) == {"gpu0": False, "gpu1": True}
    kept = guard.guards[("main", "gpu0")]
    looser = GuardPolicy(threshold=1.0, hysteresis=0.1, hold_s=5, min_samples=10)
    guard.configure(looser, "enforce", REPLICAS)
    assert guard.guards[("main", "gpu0")] is kept and kept.policy is looser and kept.guarded
    guard.configure(looser, "observe", [("main", "gpu0")])
    assert list(guard.guards) == [("main", "gpu0")]
    assert guard.guarded("main", "gpu0")  # observed still
    assert placeable(gate) == {"gpu0": True, "gpu1": True}  # but placed again
    assert clock.pending_timers == 1  # one timer, not one per reload


def test_turning_the_guard_on_by_reload_starts_the_loop() -> None:
    guard, _, signals, clock = loop("off")
    guard.start()
    feed(signals[("main", "gpu0")], clock, 0.9)
    guard.configure(POLICY, "observe", REPLICAS)
    assert clock.pending_timers == 1
    clock.advance(GUARD_INTERVAL_S)
    assert guard.guarded("main", "gpu0")
