"""The admission rules, on both backends: the same decisions and reasons whether the
state lives in this process (memory) or in Redis shared by gateways (redis)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.errors import CapacityRefused, DrainingRefused, Refused
from proxy.gate import Lease, Waiting
from tests.shared_admission.conftest import Backend, eventually


async def refused(gate: object, pool: str = "tts") -> Refused:
    with pytest.raises(Refused) as info:
        await gate.acquire(pool)  # type: ignore[attr-defined]
    return info.value


async def test_admits_up_to_each_cap_least_loaded_first_then_refuses(backend: Backend) -> None:
    gate = await backend.gate(caps=(2, 1), depth=0)
    leases = [await gate.acquire("tts") for _ in range(3)]
    assert [lease.replica for lease in leases] == ["gpu0", "gpu1", "gpu0"]
    refusal = await refused(gate)
    assert isinstance(refusal, CapacityRefused)
    assert refusal.reason == "pool_full" and refusal.http_status == 503
    assert refusal.headers()["X-Headroom-Reason"] == "pool_full"
    assert refusal.fallback is not None and refusal.fallback.voice == "lite"
    for lease in leases:
        lease.release()
    assert gate.active == 0
    await backend.settle()  # the shared gate releases in Redis in the background
    assert (await gate.acquire("tts")).replica == "gpu0"


async def test_release_is_idempotent_and_frees_one_slot(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=0)
    lease = await gate.acquire("tts")
    lease.release()
    lease.release()
    await backend.settle()
    again = await gate.acquire("tts")
    assert (await refused(gate)).reason == "pool_full"
    again.release()


async def test_waiters_are_admitted_in_arrival_order(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=5)
    holder = await gate.acquire("tts")
    order: list[int] = []

    async def wait(i: int) -> Lease:
        lease: Lease = await gate.acquire("tts")
        order.append(i)
        return lease

    tasks = []
    for i in range(3):  # one at a time, so arrival order is defined
        tasks.append(asyncio.create_task(wait(i)))
        await eventually(lambda n=i: gate.queued == n + 1, "queued")
    lease = holder
    for served in range(3):
        lease.release()
        await eventually(lambda n=served: len(order) == n + 1, "next waiter admitted")
        lease = tasks[order[-1]].result()
    assert order == [0, 1, 2]
    lease.release()


async def test_a_full_queue_refuses_with_queue_full(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=1)
    holder = await gate.acquire("tts")
    waiter = asyncio.create_task(gate.acquire("tts"))
    await eventually(lambda: gate.queued == 1, "queued")
    assert (await refused(gate)).reason == "queue_full"
    holder.release()
    (await waiter).release()


async def test_a_waiter_past_its_deadline_is_refused_queue_timeout(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=2, wait=5.0)
    holder = await gate.acquire("tts")
    waiter = asyncio.create_task(gate.acquire("tts"))
    await eventually(lambda: gate.queued == 1, "queued")
    backend.clock.advance(5.0)
    with pytest.raises(CapacityRefused) as info:
        await asyncio.wait_for(waiter, 5)
    assert info.value.reason == "queue_timeout"
    assert gate.queued == 0
    holder.release()
    await backend.settle()
    (await gate.acquire("tts")).release()  # the slot went to nobody stale


async def test_a_cancelled_waiter_leaves_and_the_next_is_served(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=3)
    holder = await gate.acquire("tts")
    first = asyncio.create_task(gate.acquire("tts"))
    await eventually(lambda: gate.queued == 1, "first queued")
    second = asyncio.create_task(gate.acquire("tts"))
    await eventually(lambda: gate.queued == 2, "second queued")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    holder.release()
    lease = await asyncio.wait_for(second, 5)
    assert lease.replica == "gpu0"
    lease.release()
    await backend.settle()
    assert gate.active == 0 and gate.queued == 0


async def test_draining_refuses_newcomers_and_waiters_but_keeps_running_sessions(
    backend: Backend,
) -> None:
    gate = await backend.gate(caps=(1,), depth=3)
    holder = await gate.acquire("tts")
    waiter = asyncio.create_task(gate.acquire("tts"))
    await eventually(lambda: gate.queued == 1, "queued")
    gate.drain()
    with pytest.raises(DrainingRefused):
        await asyncio.wait_for(waiter, 5)
    assert (await refused(gate)).reason == "draining"
    assert gate.active == 1 and not holder.released
    idle = asyncio.create_task(gate.wait_idle())
    await backend.settle()
    assert not idle.done()
    holder.release()
    await asyncio.wait_for(idle, 5)


async def test_guarded_and_unhealthy_replicas_take_nothing_new(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=0)
    gate.set_guarded("tts", "gpu0", True)
    assert (await refused(gate)).reason == "guard"
    gate.set_guarded("tts", "gpu0", False)
    await backend.settle()
    gate.set_healthy("tts", "gpu0", False)
    assert (await refused(gate)).reason == "no_healthy_replica"
    gate.set_healthy("tts", "gpu0", True)
    (await gate.acquire("tts")).release()


async def test_a_lowered_cap_never_evicts_and_a_raised_cap_serves_the_queue(
    backend: Backend,
) -> None:
    gate = await backend.gate(caps=(2,), depth=3)
    a, b = await gate.acquire("tts"), await gate.acquire("tts")
    gate.set_cap("tts", "gpu0", 1)
    assert gate.active == 2 and not a.released
    a.release()
    await backend.settle()
    entry = await gate.admit("tts")
    assert isinstance(entry, Waiting)  # one held, cap 1: full
    waiting = asyncio.create_task(entry.wait())
    gate.set_cap("tts", "gpu0", 3)
    lease = await asyncio.wait_for(waiting, 5)
    lease.release()
    b.release()


async def test_queue_feedback_reports_the_position_on_entry(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=3)
    holder = await gate.acquire("tts")
    seen: list[tuple[int, float]] = []
    entry = await gate.admit("tts", on_position=lambda pos, eta: seen.append((pos, eta)))
    assert isinstance(entry, Waiting) and entry.position == 1
    assert seen and seen[0][0] == 1 and seen[0][1] > 0
    task = asyncio.create_task(entry.wait())
    holder.release()
    (await asyncio.wait_for(task, 5)).release()
