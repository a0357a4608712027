"""The async gate under real asyncio with a fake clock: no test sleeps."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from proxy.admission import PoolCore, QueuePolicy, ReplicaSpec
from proxy.admission.gate import Gate
from proxy.admission.session_lease import Lease
from proxy.clock import FakeClock
from proxy.errors import CapacityRefused, DrainingRefused, FallbackHint, Refused
from proxy.metering.series import Metrics


async def settle() -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(10):
        await asyncio.sleep(0)


def make_gate(
    caps: tuple[int, ...] = (1,), depth: int = 3, wait: float = 5.0
) -> tuple[Gate, FakeClock, Metrics]:
    clock = FakeClock()
    metrics = Metrics()
    core = PoolCore(
        "tts",
        [ReplicaSpec(f"gpu{i}", c) for i, c in enumerate(caps)],
        QueuePolicy(depth, wait),
        session_estimate_s=10.0,
    )
    gate = Gate([core], clock=clock, metrics=metrics, fallbacks={"tts": FallbackHint(voice="lite")})
    return gate, clock, metrics


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_waiter_is_admitted_when_a_slot_is_released() -> None:
    gate, _, metrics = make_gate()
    first = await gate.acquire("tts")
    waiter = asyncio.create_task(gate.acquire("tts"))
    await settle()
    assert not waiter.done()
    assert gate.queued == 1
    first.release()
    second = await waiter
    assert second.replica == "gpu0"
    assert gate.active == 1 and gate.queued == 0
    second.release()
    assert gate.active == 0
    assert sample(metrics, "headroom_session_decisions_total", pool="tts", decision="queued") == 1
    assert sample(metrics, "headroom_session_decisions_total", pool="tts", decision="admitted") == 2
    assert sample(metrics, "headroom_queue_wait_seconds_count", pool="tts") == 1


async def test_waiters_are_admitted_in_arrival_order() -> None:
    gate, _, _ = make_gate(depth=5)
    holder = await gate.acquire("tts")
    order: list[int] = []

    async def wait(i: int) -> Lease:
        lease = await gate.acquire("tts")
        order.append(i)
        return lease

    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await settle()
    lease = holder
    for _ in range(3):
        lease.release()
        await settle()
        lease = next(t.result() for t in tasks if t.done() and not t.result().released)
    assert order == [0, 1, 2]
    lease.release()
    assert gate.active == 0


async def test_queue_timeout_refuses_on_the_fake_clock() -> None:
    gate, clock, metrics = make_gate(wait=5.0)
    holder = await gate.acquire("tts")
    waiter = asyncio.create_task(gate.acquire("tts"))
    await settle()
    clock.advance(4.9)
    await settle()
    assert not waiter.done()
    clock.advance(0.2)
    with pytest.raises(CapacityRefused) as info:
        await waiter
    refusal = info.value
    assert refusal.reason == "queue_timeout"
    assert refusal.queue_position == 1
    assert refusal.fallback == FallbackHint(voice="lite")
    assert 1 <= refusal.retry_after_s <= 60
    assert gate.queued == 0 and gate.active == 1
    holder.release()
    assert gate.active == 0
    assert (
        sample(metrics, "headroom_session_decisions_total", pool="tts",
               decision="rejected_queue_timeout") == 1
    )  # fmt: skip


async def test_cancelled_waiter_leaves_and_the_next_is_served() -> None:
    gate, _, metrics = make_gate()
    holder = await gate.acquire("tts")
    leaver = asyncio.create_task(gate.acquire("tts"))
    stayer = asyncio.create_task(gate.acquire("tts"))
    await settle()
    assert gate.queued == 2
    leaver.cancel()
    await settle()
    assert gate.queued == 1
    holder.release()
    lease = await stayer
    assert gate.active == 1
    lease.release()
    assert gate.active == 0 and gate.queued == 0
    assert leaver.cancelled()
    decisions = "headroom_session_decisions_total"
    assert sample(metrics, decisions, pool="tts", decision="abandoned") == 1


async def test_slot_handed_to_a_waiter_cancelled_in_the_same_instant_is_not_leaked() -> None:
    gate, _, _ = make_gate()
    holder = await gate.acquire("tts")
    leaver = asyncio.create_task(gate.acquire("tts"))
    await settle()
    leaver.cancel()  # not yet run: its future is cancelled, its ticket still queued
    holder.release()  # the core hands the slot to the cancelled waiter
    await settle()
    assert leaver.cancelled()
    assert gate.active == 0 and gate.queued == 0


async def test_waiter_cancelled_after_its_slot_was_granted_releases_it() -> None:
    gate, _, _ = make_gate()
    holder = await gate.acquire("tts")
    leaver = asyncio.create_task(gate.acquire("tts"))
    await settle()
    holder.release()  # the future now holds an Admit, the task has not resumed
    leaver.cancel()
    await settle()
    assert leaver.cancelled()
    assert gate.active == 0 and gate.queued == 0


async def test_full_queue_refuses_at_once() -> None:
    gate, _, _ = make_gate(depth=1)
    holder = await gate.acquire("tts")
    waiter = asyncio.create_task(gate.acquire("tts"))
    await settle()
    with pytest.raises(CapacityRefused) as info:
        await gate.acquire("tts")
    assert info.value.reason == "queue_full"
    assert info.value.http_status == 503
    waiter.cancel()
    await settle()
    holder.release()
    assert gate.active == 0


async def test_no_queue_refuses_pool_full_with_headers() -> None:
    gate, _, _ = make_gate(depth=0)
    holder = await gate.acquire("tts")
    with pytest.raises(Refused) as info:
        await gate.acquire("tts")
    refusal = info.value
    assert refusal.reason == "pool_full"
    headers = refusal.headers()
    assert headers["X-Headroom-Reason"] == "pool_full"
    assert int(headers["Retry-After"]) >= 1
    body = refusal.body()["error"]
    assert body["type"] == "capacity_exhausted" and body["code"] == "pool_full"
    assert body["fallback"] == {"voice": "lite", "pool": None, "url": None}
    assert body["queue_position"] is None
    holder.release()


async def test_drain_refuses_waiters_and_newcomers_but_keeps_running_sessions() -> None:
    gate, _, _ = make_gate()
    holder = await gate.acquire("tts")
    waiter = asyncio.create_task(gate.acquire("tts"))
    await settle()
    gate.drain()
    with pytest.raises(DrainingRefused):
        await waiter
    with pytest.raises(DrainingRefused):
        await gate.acquire("tts")
    assert gate.active == 1 and not holder.released
    holder.release()
    assert gate.active == 0


async def test_release_is_idempotent() -> None:
    gate, _, metrics = make_gate(caps=(2,))
    lease = await gate.acquire("tts")
    lease.release()
    lease.release()
    assert gate.active == 0
    assert sample(metrics, "headroom_session_duration_seconds_count", pool="tts") == 1


async def test_fail_over_moves_the_lease_and_ejects_the_replica() -> None:
    gate, _, _ = make_gate(caps=(1, 1))
    lease = await gate.acquire("tts")
    first = lease.replica
    assert await lease.fail_over()
    assert lease.replica != first
    stats = {r.name: r for r in gate.statistics()["tts"].replicas}
    assert not stats[first].healthy and stats[first].active == 0
    assert stats[lease.replica].active == 1
    assert not await lease.fail_over()  # nowhere left to go
    lease.release()
    assert gate.active == 0


async def test_all_replicas_unhealthy_refuses_no_healthy_replica() -> None:
    gate, _, _ = make_gate(caps=(1,))
    gate.set_healthy("tts", "gpu0", False)
    with pytest.raises(CapacityRefused) as info:
        await gate.acquire("tts")
    assert info.value.reason == "no_healthy_replica"


async def test_position_callbacks_report_entry_and_moves() -> None:
    gate, _, _ = make_gate(depth=5)
    holder = await gate.acquire("tts")
    seen: dict[int, list[int]] = {0: [], 1: []}
    tasks = [
        asyncio.create_task(
            gate.acquire("tts", on_position=lambda pos, eta, i=i: seen[i].append(pos))
        )
        for i in range(2)
    ]
    await settle()
    assert seen == {0: [1], 1: [2]}
    holder.release()
    await settle()
    assert seen == {0: [1], 1: [2, 1]}
    lease0 = tasks[0].result()
    lease0.release()
    (await tasks[1]).release()
    assert gate.active == 0


async def test_lowering_a_cap_never_evicts_and_raising_admits_waiters() -> None:
    gate, _, _ = make_gate(caps=(2,))
    a = await gate.acquire("tts")
    b = await gate.acquire("tts")
    gate.set_cap("tts", "gpu0", 1)
    assert gate.active == 2
    a.release()
    waiter = asyncio.create_task(gate.acquire("tts"))
    await settle()
    assert not waiter.done()  # 1 active, cap 1
    gate.set_cap("tts", "gpu0", 2)
    c = await waiter
    b.release()
    c.release()
    assert gate.active == 0


async def test_metrics_state_collector_reports_the_gate() -> None:
    gate, _, metrics = make_gate(caps=(3,))
    metrics.bind_state(gate.replica_gauges, gate.queue_depths)
    lease = await gate.acquire("tts")
    text = generate_latest(metrics.registry).decode()
    assert 'headroom_sessions_active{pool="tts",replica="gpu0"} 1.0' in text
    assert 'headroom_session_slots{pool="tts",replica="gpu0"} 3.0' in text
    assert 'headroom_queue_depth{pool="tts"} 0.0' in text
    lease.release()
    assert "gpu0=0/3" in repr(gate)
