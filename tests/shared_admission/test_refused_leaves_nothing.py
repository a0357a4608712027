"""A session refused ``backend_unavailable`` leaves nothing behind in Redis.

A stalled Redis (``DEBUG SLEEP``, a stopped process, a slow disk) does not answer in
time, so the gateway refuses the session; but the acquire script is already in the
server's socket buffer and runs when the server wakes. The gateway withdraws the id
until Redis answers: whichever of the two runs first, no lease, queue place or tenant
count is left (a withdrawn id is refused by a late acquire or hold).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.redis_backend import RedisAdmission, ReplicaView
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import FakeClock
from proxy.errors import Refused
from proxy.metering.series import Metrics
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import eventually, seed_generation


@pytest.fixture
async def server() -> AsyncIterator[RedisServer]:
    s = RedisServer()
    await seed_generation(s.url)
    yield s
    s.stop()


def make(url: str, depth: int) -> SharedGate:
    return SharedGate(
        [SharedPoolSpec("tts", (ReplicaSpec("gpu0", 2),), QueuePolicy(depth, 5))],
        backend=RedisAdmission(url, gateway_id="gw", lease_ttl_s=30, timeout_s=0.2),
        clock=FakeClock(), metrics=Metrics(), lease_ttl_s=30, renew_interval_s=10,
    )  # fmt: skip


async def held(url: str) -> tuple[int, int, int]:
    """Leases, queue places and the replica's held count, as Redis has them."""
    client = aioredis.from_url(url)
    try:
        leases = await client.zcard("headroom:{tts}:leases")
        queued = await client.zcard("headroom:{tts}:queue")
        count = int(await client.hget("headroom:{tts}:held", "gpu0") or 0)
    finally:
        await client.aclose()
    return leases, queued, count


@pytest.mark.parametrize("depth", [0, 4])
async def test_sessions_refused_while_redis_is_stopped_take_no_lease(
    server: RedisServer, depth: int
) -> None:
    """Redis stopped (SIGSTOP) while three sessions arrive: each is refused
    ``backend_unavailable``; when Redis runs again their acquire scripts run too, and
    the gateway's withdrawals leave no lease and no queue place: the next two sessions
    are admitted at once."""
    gate = make(server.url, depth)
    await gate.start()
    # Warm: the scripts are loaded (a stale EVALSHA of an unknown script does nothing).
    warm = await gate.acquire("tts")
    warm.release()
    await gate.quiesce()
    assert server.process is not None
    pid = server.process.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            for _ in range(3):
                with pytest.raises(Refused) as info:
                    await gate.acquire("tts")
                assert info.value.reason == "backend_unavailable"
        finally:
            os.kill(pid, signal.SIGCONT)
        # Redis runs the three stale acquires and the withdrawals, in either order.
        await eventually(lambda: gate.withdrawals.pending == 0, "withdrawals landed")
        assert await held(server.url) == (0, 0, 0)
        first = await gate.acquire("tts")
        second = await gate.acquire("tts")
        assert {first.replica, second.replica} == {"gpu0"}
        first.release()
        second.release()
    finally:
        await gate.stop()


async def test_a_withdrawn_id_is_refused_by_a_late_acquire(server: RedisServer) -> None:
    """The withdrawal may land before the stale acquire does: the id is then refused
    when its acquire finally runs, so no slot is taken."""
    store = RedisAdmission(server.url, gateway_id="gw", lease_ttl_s=30)
    try:
        view = [ReplicaView("gpu0", 2)]
        assert await store.withdraw("tts", "gw:1", view) == "gone"
        kind, value = await store.acquire("tts", "gw:1", view, 4)
        assert (kind, value) == ("reject", "withdrawn")
        assert await held(server.url) == (0, 0, 0)
        # A withdrawal after the acquire gives the slot back.
        assert await store.acquire("tts", "gw:2", view, 4) == ("admit", "gpu0")
        assert await store.withdraw("tts", "gw:2", view) == "released"
        assert await held(server.url) == (0, 0, 0)
    finally:
        await store.close()
        await asyncio.sleep(0)
