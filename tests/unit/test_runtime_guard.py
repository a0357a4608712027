"""The guard wired into the runtime and gate, on a fake clock (no sockets)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from proxy.clock import FakeClock
from proxy.errors import CapacityRefused
from proxy.runtime import Runtime
from tests.conftest import proxy_settings


def runtime(mode: str) -> tuple[Runtime, FakeClock]:
    clock = FakeClock()
    settings = proxy_settings(
        [("gpu0", "http://127.0.0.1:9", 4), ("gpu1", "http://127.0.0.1:10", 4)],
        [{"path": "/s", "pool": "main", "protocol": "passthrough-ws"}],
        guard={"mode": mode, "threshold": 1.2, "hysteresis": 0.1, "hold_s": 5,
               "min_samples": 10},
        meter={"window_s": 10},
    )  # fmt: skip
    return Runtime(settings, clock=clock), clock


def feed(rt: Runtime, clock: FakeClock, replica: str, ratio: float, n: int = 30) -> None:
    for _ in range(n):
        rt.signals[("main", replica)].observe(clock.now(), ratio, 0.2)


async def test_enforce_stops_placement_on_a_guarded_replica_then_refuses_guard() -> None:
    rt, clock = runtime("enforce")
    feed(rt, clock, "gpu0", 0.9)
    feed(rt, clock, "gpu1", 2.0)
    rt.evaluate_guards()
    assert rt.guarded("main", "gpu0") and not rt.guarded("main", "gpu1")
    leases = [await rt.gate.acquire("main") for _ in range(4)]
    assert {lease.replica for lease in leases} == {"gpu1"}  # gpu0 has 4 free slots, unused
    with pytest.raises(CapacityRefused) as info:
        await rt.gate.acquire("main")
    assert info.value.reason == "guard"
    for lease in leases:
        lease.release()
    # the bad samples age out of the 10 s window; after the 5 s hold it reopens
    clock.advance(12)
    rt.evaluate_guards()
    clock.advance(5)
    rt.evaluate_guards()
    assert not rt.guarded("main", "gpu0")
    lease = await rt.gate.acquire("main")
    lease.release()


async def test_observe_exports_but_does_not_hold_admissions() -> None:
    rt, clock = runtime("observe")
    feed(rt, clock, "gpu0", 0.9)
    feed(rt, clock, "gpu1", 0.9)
    rt.evaluate_guards()
    text = generate_latest(rt.metrics.registry).decode()
    assert 'headroom_replica_guarded{pool="main",replica="gpu0"} 1.0' in text
    assert 'headroom_delivery_ratio_worst_1pct{pool="main",replica="gpu0"}' in text
    leases = [await rt.gate.acquire("main") for _ in range(8)]  # all slots still usable
    for lease in leases:
        lease.release()


async def test_off_never_guards() -> None:
    rt, clock = runtime("off")
    feed(rt, clock, "gpu0", 0.5)
    rt.evaluate_guards()
    assert not rt.guarded("main", "gpu0")
