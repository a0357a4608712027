"""The guard wired into the runtime, its meters and the gate, on a fake clock (no sockets);
the loop itself is tested in tests/unit/test_guard_loop.py."""

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
    rt.guard.evaluate()
    assert rt.guard.guarded("main", "gpu0") and not rt.guard.guarded("main", "gpu1")
    leases = [await rt.gate.acquire("main") for _ in range(4)]
    assert {lease.replica for lease in leases} == {"gpu1"}  # gpu0 has 4 free slots, unused
    with pytest.raises(CapacityRefused) as info:
        await rt.gate.acquire("main")
    assert info.value.reason == "guard"
    for lease in leases:
        lease.release()
    # the bad samples age out of the 10 s window; after the 5 s hold it reopens
    clock.advance(12)
    rt.guard.evaluate()
    clock.advance(5)
    rt.guard.evaluate()
    assert not rt.guard.guarded("main", "gpu0")
    lease = await rt.gate.acquire("main")
    lease.release()


async def test_observe_exports_but_does_not_hold_admissions() -> None:
    rt, clock = runtime("observe")
    feed(rt, clock, "gpu0", 0.9)
    feed(rt, clock, "gpu1", 0.9)
    rt.guard.evaluate()
    text = generate_latest(rt.metrics.registry).decode()
    assert 'headroom_replica_guarded{pool="main",replica="gpu0"} 1.0' in text
    assert 'headroom_delivery_ratio_worst_1pct{pool="main",replica="gpu0"}' in text
    leases = [await rt.gate.acquire("main") for _ in range(8)]  # all slots still usable
    for lease in leases:
        lease.release()


async def test_off_never_guards() -> None:
    rt, clock = runtime("off")
    feed(rt, clock, "gpu0", 0.5)
    rt.guard.evaluate()
    assert not rt.guard.guarded("main", "gpu0")


def startup_runtime(**guard: object) -> tuple[Runtime, FakeClock]:
    clock = FakeClock()
    settings = proxy_settings(
        [("gpu0", "http://127.0.0.1:9", 4), ("gpu1", "http://127.0.0.1:10", 4)],
        [{"path": "/s", "pool": "main", "protocol": "passthrough-ws"}],
        guard={"mode": "enforce", "min_samples": 10, "hold_s": 5, **guard},
        meter={"window_s": 10},
    )  # fmt: skip
    return Runtime(settings, clock=clock), clock


def start_streams(rt: Runtime, clock: FakeClock, replica: str, n: int, *, stall: bool) -> None:
    """``n`` metered streams on ``replica``: a 0.16 s first chunk after 0.1 s, then 2 s
    chunks every 1.2 s (steady ratio 1.67x); the first seam comes 0.5 s after the first
    chunk (a 0.2 s prebuffer runs dry at 0.36 s: a stall) or 0.3 s after it (in time)."""
    t0 = clock.now()
    for _ in range(n):
        meter = rt.new_meter("main", replica, t0)
        meter.audio(t0 + 0.1, 0.16)
        meter.audio(t0 + (0.6 if stall else 0.4), 2.0)
        for k in range(1, 4):
            meter.audio(t0 + 0.6 + 1.2 * k, 2.0)
        meter.finish(t0 + 5.0)


async def test_a_replica_whose_new_streams_stall_at_their_first_seam_is_guarded() -> None:
    rt, clock = startup_runtime(startup_stall_share=0.05, startup_min_streams=5)
    start_streams(rt, clock, "gpu0", 6, stall=True)
    start_streams(rt, clock, "gpu1", 6, stall=False)
    clock.advance(5.0)
    rt.guard.evaluate()
    ratio = rt.delivery_ratio_worst_1pct("main", "gpu0")
    assert ratio is not None and ratio > 1.5  # steady chunks look fine
    assert rt.guard.guarded("main", "gpu0") and not rt.guard.guarded("main", "gpu1")
    assert rt.guard.guards[("main", "gpu0")].reasons == ("startup_stalls",)
    leases = [await rt.gate.acquire("main") for _ in range(4)]
    assert {lease.replica for lease in leases} == {"gpu1"}
    for lease in leases:
        lease.release()


async def test_startup_stalls_do_not_guard_unless_configured() -> None:
    rt, clock = startup_runtime()
    start_streams(rt, clock, "gpu0", 20, stall=True)
    clock.advance(5.0)
    rt.guard.evaluate()
    assert not rt.guard.guarded("main", "gpu0")


async def test_a_replica_whose_ttfa_p99_exceeds_the_limit_is_guarded() -> None:
    rt, clock = startup_runtime(ttfa_p99_s=1.0, startup_min_streams=5)
    t0 = clock.now()
    for i in range(6):
        meter = rt.new_meter("main", "gpu0", t0)
        meter.audio(t0 + (3.0 if i == 5 else 0.2), 0.5)  # one late first audio: p99 3 s
        meter.finish(t0 + 4.0)
    clock.advance(4.0)
    rt.guard.evaluate()
    assert rt.guard.guarded("main", "gpu0")
    assert rt.guard.guards[("main", "gpu0")].reasons == ("ttfa",)
