"""A session's own bound on its queue wait (``admit(max_wait_s=...)``, what a held
WebSocket handshake uses), on both backends: refused ``queue_timeout`` at its bound while
the pool's other waiters keep theirs."""

from __future__ import annotations

import asyncio

import pytest

from proxy.admission.session_lease import Waiting
from proxy.errors import CapacityRefused
from tests.shared_admission.conftest import Backend, eventually


async def test_a_waiters_own_bound_refuses_it_before_the_pools_deadline(
    backend: Backend,
) -> None:
    gate = await backend.gate(caps=(1,), depth=3, wait=10.0)
    holder = await gate.acquire("tts")
    plain = await gate.admit("tts")
    bounded = await gate.admit("tts", max_wait_s=4.0)
    assert isinstance(plain, Waiting) and isinstance(bounded, Waiting)
    plain_wait = asyncio.create_task(plain.wait())
    bounded_wait = asyncio.create_task(bounded.wait())
    await eventually(lambda: gate.queued == 2, "both queued")
    backend.clock.advance(4.0)
    with pytest.raises(CapacityRefused) as info:
        await asyncio.wait_for(bounded_wait, 5)
    refusal = info.value
    assert refusal.reason == "queue_timeout"
    assert refusal.headers()["X-Headroom-Reason"] == "queue_timeout"
    assert 1 <= int(refusal.headers()["Retry-After"]) <= 60
    assert gate.queued == 1 and not plain_wait.done()
    holder.release()
    lease = await asyncio.wait_for(plain_wait, 5)  # the pool's waiter kept its place
    lease.release()


async def test_a_bound_of_0_refuses_at_once_without_a_queue_place(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=3, wait=10.0)
    holder = await gate.acquire("tts")
    with pytest.raises(CapacityRefused) as info:
        await gate.admit("tts", max_wait_s=0.0)
    assert info.value.reason == "pool_full"
    assert gate.queued == 0
    holder.release()
