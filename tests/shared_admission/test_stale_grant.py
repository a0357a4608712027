"""A slot handed to a waiter through its gateway's wake list while that gateway was
paused longer than the lease TTL: the grant lapsed and the slot went to someone else.
When the gateway runs again it must not admit the waiter on the stale grant (the
replica would be over its cap); it confirms the lease with Redis first and, finding
it gone, refuses the waiter. Found by bench/chaos_shared.py (SIGSTOP
past the TTL put a fifth session on a replica capped at 4)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.session_lease import Lease
from proxy.admission.shared_gate import SharedGate, SharedLease, SharedPoolSpec, SharedWaiting
from proxy.clock import FakeClock
from proxy.errors import Refused
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation

TTL_S = 2.0


@pytest.fixture
async def server() -> AsyncIterator[RedisServer]:
    s = RedisServer()
    await seed_generation(s.url)
    yield s
    s.stop()


def make(url: str, name: str) -> SharedGate:
    return SharedGate(
        [SharedPoolSpec("tts", (ReplicaSpec("gpu0", 2),), QueuePolicy(4, 60))],
        backend=RedisAdmission(url, gateway_id=name, lease_ttl_s=TTL_S, timeout_s=0.5),
        clock=FakeClock(), lease_ttl_s=TTL_S, renew_interval_s=0.5, fence_margin_s=0.5,
    )  # fmt: skip


async def _lapsed(client: aioredis.Redis, lease_id: str) -> bool:
    """Whether the lease's expiry (Redis clock) has passed, or it is gone."""
    expiry = await client.zscore("headroom:{tts}:leases", lease_id)
    seconds, micros = await client.time()
    return expiry is None or seconds * 1000 + micros // 1000 > expiry


async def test_a_grant_that_lapsed_while_its_gateway_was_paused_is_not_used(
    server: RedisServer,
) -> None:
    paused, holder = make(server.url, "paused"), make(server.url, "holder")
    client = aioredis.from_url(server.url)
    tasks: list[asyncio.Task[Lease]] = []
    try:
        held = [await holder.admit("tts"), await holder.admit("tts")]
        assert all(isinstance(x, SharedLease) for x in held)
        # The paused gateway queues three waiters, then runs nothing (no renewal, no
        # wake-up consumed), as under SIGSTOP.
        waiters = [await paused.admit("tts") for _ in range(3)]
        assert all(isinstance(w, SharedWaiting) for w in waiters)
        tasks = [asyncio.ensure_future(w.wait()) for w in waiters]
        first = waiters[0]
        assert isinstance(first, SharedWaiting)
        held[0].release()  # a slot is handed to the first waiter...
        await holder.quiesce()
        await asyncio.sleep(TTL_S / 2)
        held[1].release()  # ...the other one to the second (its wake-up refreshes the list)
        await holder.quiesce()
        # The first lease nobody renews lapses; the next script call hands its slot to
        # the third waiter.
        for _ in range(1000):
            if await _lapsed(client, first.waiter_id):
                break
            await asyncio.sleep(0.01)
        await holder.renew()
        wake = paused.backend.wake_key("tts")
        assert await client.llen(wake) == 3
        # The paused gateway runs again and reads the wake-ups, the first one stale.
        paused.store.loops.append(asyncio.ensure_future(paused.wakeups.loop("tts")))
        for _ in range(1000):
            if await client.llen(wake) == 0:
                break
            await asyncio.sleep(0.005)
        await paused.quiesce()
        for _ in range(10):
            await asyncio.sleep(0)
        owners = {o.decode() for o in await client.hkeys("headroom:{tts}:owner")}
        admitted = [t.result() for t in tasks if t.done() and not t.exception()]
        assert len(admitted) <= 2, "three sessions on a replica capped at 2"
        assert all(isinstance(x, SharedLease) and x.lease_id in owners for x in admitted)
        assert tasks[0].done(), "the waiter of the lapsed grant is refused"
        assert isinstance(tasks[0].exception(), Refused), "admitted on a grant that had lapsed"
        for lease in admitted:
            lease.release()
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for gate in (paused, holder):
            with contextlib.suppress(Exception):
                await gate.stop()
        await client.aclose()


async def test_a_waiter_timing_out_does_not_take_a_grant_that_lapsed(server: RedisServer) -> None:
    """The queue deadline of a waiter whose gateway was paused: leaving the queue finds
    the slot handed to it, but that lease lapsed; the waiter is refused, not admitted."""
    paused, holder = make(server.url, "paused"), make(server.url, "holder")
    client = aioredis.from_url(server.url)
    tasks: list[asyncio.Task[Lease]] = []
    try:
        held = [await holder.admit("tts"), await holder.admit("tts")]
        entry = await paused.admit("tts")
        assert isinstance(entry, SharedWaiting)
        tasks = [asyncio.ensure_future(entry.wait())]
        held[0].release()  # handed to the paused gateway's waiter; nobody renews it
        await holder.quiesce()
        for _ in range(1000):
            if await _lapsed(client, entry.waiter_id):
                break
            await asyncio.sleep(0.01)
        assert isinstance(paused.clock, FakeClock)
        paused.clock.advance(61)  # past max_wait_s: the waiter leaves the queue
        await paused.quiesce()
        for _ in range(10):
            await asyncio.sleep(0)
        assert tasks[0].done()
        assert isinstance(tasks[0].exception(), Refused)
        assert paused.active == 0
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for gate in (paused, holder):
            with contextlib.suppress(Exception):
                await gate.stop()
        await client.aclose()


async def test_a_grant_taken_by_the_queue_deadline_is_not_given_back_by_the_wake_up(
    server: RedisServer,
) -> None:
    """Both ways a paused gateway learns of a grant run when it resumes: its waiter's
    queue deadline (``leave`` finds the grant and admits) and the wake-up. The wake-up's
    confirmation must not release the lease the deadline path just handed to the
    session (Redis would reuse the slot while the session runs)."""
    paused, holder = make(server.url, "paused"), make(server.url, "holder")
    client = aioredis.from_url(server.url)
    tasks: list[asyncio.Task[Lease]] = []
    try:
        held = [await holder.admit("tts"), await holder.admit("tts")]
        entry = await paused.admit("tts")
        assert isinstance(entry, SharedWaiting)
        tasks = [asyncio.ensure_future(entry.wait())]
        held[0].release()  # granted to the paused gateway's waiter (its wake list)
        await holder.quiesce()
        assert isinstance(paused.clock, FakeClock)
        paused.clock.advance(61)  # the deadline fires first: leave finds the grant
        for _ in range(1000):
            if tasks[0].done():
                break
            await asyncio.sleep(0.005)
        lease = tasks[0].result()
        assert isinstance(lease, SharedLease)
        paused.store.loops.append(asyncio.ensure_future(paused.wakeups.loop("tts")))  # then this
        wake = paused.backend.wake_key("tts")
        for _ in range(1000):
            if await client.llen(wake) == 0:
                break
            await asyncio.sleep(0.005)
        await paused.quiesce()
        owners = {o.decode() for o in await client.hkeys("headroom:{tts}:owner")}
        assert lease.lease_id in owners, "the running session's lease was released"
        lease.release()
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for gate in (paused, holder):
            with contextlib.suppress(Exception):
                await gate.stop()
        await client.aclose()
