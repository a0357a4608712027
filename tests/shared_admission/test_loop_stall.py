"""A stalled event loop neither breaks the cap nor kills sessions: the lease keeper
renews this gateway's leases from its own thread (proxy/admission/lease_keeper.py).

The first tests put the whole world on fake clocks: Redis's time (``clock_ms``), the
keeper's, and gateway B's move together, while gateway A's loop clock stands still for
the stall and catches up after it, as a blocked loop's timers do. The last test blocks
a real event loop with ``time.sleep`` while the keeper's real thread runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis

from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.lease_keeper import LeaseKeeper
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import FakeClock, LoopClock
from proxy.errors import Refused
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation

TTL, RENEW, MARGIN = 4.0, 1.0, 1.0
POOL = [SharedPoolSpec("tts", (ReplicaSpec("gpu0", 2),), QueuePolicy(0, 1))]


@pytest.fixture
async def server() -> AsyncIterator[RedisServer]:
    s = RedisServer()
    await seed_generation(s.url)
    yield s
    s.stop()


def _gate(url: str, gateway: str, clock: FakeClock, world: FakeClock, keeper: bool) -> SharedGate:
    backend = RedisAdmission(url, gateway_id=gateway, lease_ttl_s=TTL, timeout_s=0.5,
                             clock_ms=lambda: round(world.now() * 1000))  # fmt: skip
    kept = None
    if keeper:
        renewer = backend.lease_renewer()
        kept = LeaseKeeper(renewer.keep, interval_s=RENEW, close=renewer.close,
                           monotonic=world.now)  # fmt: skip
    return SharedGate(POOL, backend=backend, clock=clock, lease_ttl_s=TTL,
                      renew_interval_s=RENEW, fence_margin_s=MARGIN, keeper=kept)  # fmt: skip


@pytest.mark.parametrize("keeper_runs", [True, False])
async def test_a_loop_stalled_for_two_ttls_keeps_its_leases_and_sessions(
    server: RedisServer, keeper_runs: bool
) -> None:
    world = FakeClock()
    loop_a = FakeClock(world.now())
    a = _gate(server.url, "gwa", loop_a, world, keeper=True)
    b = _gate(server.url, "gwb", world, world, keeper=False)
    fenced: list[str] = []
    a.on_fence(lambda pool, why: fenced.append(why))
    try:
        leases = [await a.acquire("tts"), await a.acquire("tts")]
        await a.renew()  # the loop's last tick before the stall
        assert a.keeper is not None
        # A's loop is blocked for two TTLs: its clock and timers stand still, its
        # ticks do not run; the keeper's thread renews every interval (or, in the
        # control run, does not run either).
        for _ in range(int(2 * TTL / RENEW)):
            world.advance(RENEW)
            if keeper_runs:
                a.keeper.keep_once()
        # Another gateway asks for the replica's slots at the end of the stall.
        if keeper_runs:
            with pytest.raises(Refused) as info:
                await b.acquire("tts")
            assert info.value.reason == "pool_full"
        else:
            stolen = await b.acquire("tts")  # the lapsed lease's slot: over the cap
        # A's loop runs again: its overdue timers fire, then its next tick.
        loop_a.advance(2 * TTL)
        await a.renew()
        if keeper_runs:
            assert fenced == []
            assert a.keeper.renewals >= 2 * TTL / RENEW - 1
        else:
            assert fenced, "a gateway whose leases lapsed must end its sessions"
            stolen.release()
        for lease in leases:
            lease.release()
    finally:
        await a.stop()
        await b.stop()


async def test_the_keeper_never_revives_a_lease_or_renews_a_released_one(
    server: RedisServer,
) -> None:
    world = FakeClock()
    a = _gate(server.url, "gwa", world, world, keeper=True)
    b = _gate(server.url, "gwb", world, world, keeper=False)
    try:
        assert a.keeper is not None
        first = await a.acquire("tts")
        second = await a.acquire("tts")
        await a.renew()
        second.release()
        await a.quiesce()
        assert a.keeper.holding("tts") == 1
        world.advance(TTL + 0.5)  # nothing renewed: both leases have lapsed in Redis
        a.keeper.keep_once()
        assert a.keeper.kept_age("tts") is None  # found gone: proves nothing
        # The lapsed slot is free for others: the keeper did not put the lease back.
        taken = await b.acquire("tts")
        taken.release()
        first.release()
    finally:
        await a.stop()
        await b.stop()


async def test_the_keeper_extends_nothing_in_a_new_data_generation(server: RedisServer) -> None:
    world = FakeClock()
    a = _gate(server.url, "gwa", world, world, keeper=True)
    try:
        assert a.keeper is not None
        lease = await a.acquire("tts")
        await a.renew()
        server.flush()  # Redis lost its data: the tick, not the keeper, re-asserts
        a.keeper.keep_once()
        assert a.keeper.kept_age("tts") is None
        assert a.keeper.renewals == 0
        lease.release()
    finally:
        await a.stop()


def _lease_expiries(url: str) -> list[float]:
    client = redis.Redis.from_url(url)
    try:
        now_s, now_us = client.time()
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        scores = client.zrange("headroom:{tts}:leases", 0, -1, withscores=True)
        return [score - now_ms for _, score in scores]
    finally:
        client.close()


@pytest.mark.slow
async def test_a_real_blocked_loop_keeps_its_leases(server: RedisServer) -> None:
    """The keeper's own thread keeps the leases while ``time.sleep`` blocks the event
    loop for two and a half TTLs, and the loop's fence does not fire afterwards."""
    ttl, renew, margin = 2.0, 0.5, 0.5
    backend = RedisAdmission(server.url, gateway_id="gwa", lease_ttl_s=ttl, timeout_s=0.5)
    renewer = backend.lease_renewer()
    keeper = LeaseKeeper(renewer.keep, interval_s=renew, close=renewer.close)
    gate = SharedGate(POOL, backend=backend, clock=LoopClock(), lease_ttl_s=ttl,
                      renew_interval_s=renew, fence_margin_s=margin, keeper=keeper)  # fmt: skip
    fenced: list[str] = []
    gate.on_fence(lambda pool, why: fenced.append(why))
    await gate.start()
    try:
        leases = [await gate.acquire("tts"), await gate.acquire("tts")]
        await gate.renew()
        time.sleep(2.5 * ttl)  # noqa: ASYNC251 -- the stall under test
        left = _lease_expiries(server.url)
        assert len(left) == 2 and all(ms > 0 for ms in left), left
        await asyncio.sleep(margin)  # the overdue fence timer and a tick run
        await gate.renew()
        assert fenced == []
        for lease in leases:
            lease.release()
    finally:
        await gate.stop()
