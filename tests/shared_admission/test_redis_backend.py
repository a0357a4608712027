"""The Lua scripts against a real redis-server: every safety property of the shared
admission state, with several clients (gateways) on one server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from proxy.admission.redis_backend import BackendUnavailable, RedisAdmission, ReplicaView
from tests.redis_support import RedisServer, redis_server

__all__ = ["redis_server"]

VIEW = [ReplicaView("gpu0", 2), ReplicaView("gpu1", 3)]

Factory = Callable[..., Awaitable[RedisAdmission]]


async def seed_generation(url: str, pool: str = "tts", prefix: str = "headroom:") -> None:
    """Mark the data generation as long established, so grants are not blocked for one
    TTL as they are after a data loss (or on a brand-new Redis)."""
    client = aioredis.from_url(url)
    await client.hset(f"{prefix}{{{pool}}}:gen", mapping={"id": "seed", "since": 0})
    await client.aclose()


@pytest.fixture
async def gateways(redis_server: RedisServer) -> AsyncIterator[Factory]:
    made: list[RedisAdmission] = []

    async def make(name: str, **kwargs: float) -> RedisAdmission:
        backend = RedisAdmission(redis_server.url, gateway_id=name, **kwargs)  # type: ignore[arg-type]
        made.append(backend)
        return backend

    await seed_generation(redis_server.url)
    yield make
    for backend in made:
        await backend.close()


async def test_cap_is_never_exceeded_by_concurrent_acquires_from_several_gateways(
    gateways: Factory,
) -> None:
    clients = [await gateways(f"gw{i}") for i in range(4)]
    results = await asyncio.gather(
        *(c.acquire("tts", f"{c.gateway_id}:{n}", VIEW, 0) for n in range(50) for c in clients)
    )
    admitted = [r for r in results if r[0] == "admit"]
    assert len(admitted) == 5
    assert sorted(str(r[1]) for r in admitted).count("gpu0") == 2
    assert {r for r in results if r[0] != "admit"} == {("reject", "pool_full")}
    tick = await clients[0].tick("tts", generation="", view=VIEW, leases=[], waiters=[],
                                 guards=[], guard_ttl_s=1)  # fmt: skip
    assert tick.held == {"gpu0": 2, "gpu1": 3}


async def test_placement_is_least_loaded_first_like_the_pure_core(gateways: Factory) -> None:
    a = await gateways("a")
    view = [ReplicaView("gpu0", 2), ReplicaView("gpu1", 4)]
    placed = [(await a.acquire("tts", f"a:{n}", view, 0))[1] for n in range(6)]
    # PoolCore._pick: lowest active/cap, then fewest active, then configuration order
    assert placed == ["gpu0", "gpu1", "gpu1", "gpu0", "gpu1", "gpu1"]


async def test_release_is_idempotent_and_frees_exactly_one_slot(gateways: Factory) -> None:
    a = await gateways("a")
    view = [ReplicaView("gpu0", 1)]
    assert await a.acquire("tts", "a:1", view, 0) == ("admit", "gpu0")
    assert await a.release("tts", "a:1", view) is True
    assert await a.release("tts", "a:1", view) is False
    assert await a.acquire("tts", "a:2", view, 0) == ("admit", "gpu0")
    assert await a.acquire("tts", "a:3", view, 0) == ("reject", "pool_full")


async def test_an_unrenewed_lease_expires_and_its_slot_is_reclaimed(gateways: Factory) -> None:
    crashed = await gateways("crashed", lease_ttl_s=0.3)
    survivor = await gateways("survivor", lease_ttl_s=0.3)
    view = [ReplicaView("gpu0", 1)]
    assert await crashed.acquire("tts", "crashed:1", view, 0) == ("admit", "gpu0")
    assert await survivor.acquire("tts", "survivor:1", view, 0) == ("reject", "pool_full")
    await asyncio.sleep(0.35)
    assert await survivor.acquire("tts", "survivor:2", view, 0) == ("admit", "gpu0")
    # and the crashed gateway learns at its next tick that its lease is gone
    tick = await crashed.tick("tts", generation="seed", view=view, leases=[("crashed:1", "gpu0")],
                              waiters=[], guards=[], guard_ttl_s=1)  # fmt: skip
    assert tick.lost == ("crashed:1",)
    assert tick.held == {"gpu0": 1}


async def test_renewal_keeps_a_lease_alive_past_its_ttl(gateways: Factory) -> None:
    a = await gateways("a", lease_ttl_s=0.3)
    b = await gateways("b", lease_ttl_s=0.3)
    view = [ReplicaView("gpu0", 1)]
    assert await a.acquire("tts", "a:1", view, 0) == ("admit", "gpu0")
    for _ in range(4):
        await asyncio.sleep(0.1)
        tick = await a.tick("tts", generation="seed", view=view, leases=[("a:1", "gpu0")],
                            waiters=[], guards=[], guard_ttl_s=1)  # fmt: skip
        assert tick.lost == ()
    assert await b.acquire("tts", "b:1", view, 0) == ("reject", "pool_full")


async def test_fifo_order_holds_across_gateways_and_the_head_is_woken(gateways: Factory) -> None:
    a = await gateways("a")
    b = await gateways("b")
    view = [ReplicaView("gpu0", 1)]
    assert await a.acquire("tts", "a:0", view, 10) == ("admit", "gpu0")
    arrivals = ["b:1", "a:2", "b:3", "a:4"]
    for position, waiter in enumerate(arrivals, start=1):
        client = a if waiter.startswith("a") else b
        assert await client.acquire("tts", waiter, view, 10) == ("queued", position)
    # a newcomer while others wait is queued even when a slot frees in between: no barging
    served: list[str] = []
    holder = "a:0"
    for _ in arrivals:
        owner = a if holder.startswith("a") else b
        await owner.release("tts", holder, view)
        woken = await a.wakeups("tts", 0.01) + await b.wakeups("tts", 0.01)
        assert len(woken) == 1
        holder = woken[0][0]
        served.append(holder)
    assert served == arrivals


async def test_a_release_wakes_a_blocked_waiter_at_once(gateways: Factory) -> None:
    a = await gateways("a")
    b = await gateways("b")
    view = [ReplicaView("gpu0", 1)]
    await a.acquire("tts", "a:1", view, 5)
    assert await b.acquire("tts", "b:1", view, 5) == ("queued", 1)
    waiting = asyncio.create_task(b.wakeups("tts", 5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await a.release("tts", "a:1", view)
    assert await waiting == [("b:1", "gpu0")]


async def test_queue_is_bounded(gateways: Factory) -> None:
    a = await gateways("a")
    view = [ReplicaView("gpu0", 1)]
    await a.acquire("tts", "a:0", view, 2)
    assert (await a.acquire("tts", "a:1", view, 2))[0] == "queued"
    assert (await a.acquire("tts", "a:2", view, 2))[0] == "queued"
    assert await a.acquire("tts", "a:3", view, 2) == ("reject", "queue_full")


async def test_a_waiter_whose_gateway_stops_beating_leaves_the_queue(gateways: Factory) -> None:
    holder = await gateways("holder", heartbeat_ttl_s=0.3)
    vanished = await gateways("vanished", heartbeat_ttl_s=0.3)
    alive = await gateways("alive", heartbeat_ttl_s=0.3)
    view = [ReplicaView("gpu0", 1)]
    await holder.acquire("tts", "holder:1", view, 5)
    assert await vanished.acquire("tts", "vanished:1", view, 5) == ("queued", 1)
    assert await alive.acquire("tts", "alive:1", view, 5) == ("queued", 2)
    for _ in range(4):
        await asyncio.sleep(0.1)
        tick = await alive.tick("tts", generation="seed", view=view, leases=[],
                                waiters=["alive:1"], guards=[], guard_ttl_s=1)  # fmt: skip
    assert tick.waiters == (1,)  # the vanished waiter ahead of it is gone
    await holder.release("tts", "holder:1", view)
    assert await alive.wakeups("tts", 0.01) == [("alive:1", "gpu0")]
    assert await vanished.wakeups("tts", 0.01) == []


async def test_leave_takes_a_waiter_out_or_reports_a_slot_it_was_handed(
    gateways: Factory,
) -> None:
    a = await gateways("a")
    view = [ReplicaView("gpu0", 1)]
    await a.acquire("tts", "a:0", view, 5)
    await a.acquire("tts", "a:1", view, 5)
    await a.acquire("tts", "a:2", view, 5)
    assert await a.leave("tts", "a:1", view) == ("left", None)
    await a.release("tts", "a:0", view)  # hands the slot to a:2
    assert await a.leave("tts", "a:2", view) == ("granted", "gpu0")
    assert await a.release("tts", "a:2", view) is True
    assert await a.leave("tts", "a:9", view) == ("gone", None)


async def test_a_guard_engaged_on_one_gateway_guards_the_replica_for_all(
    gateways: Factory,
) -> None:
    a = await gateways("a")
    b = await gateways("b")
    view = [ReplicaView("gpu0", 2)]
    await a.tick("tts", generation="seed", view=[ReplicaView("gpu0", 2, guarded=True)],
                 leases=[], waiters=[], guards=["gpu0"], guard_ttl_s=5)  # fmt: skip
    assert await b.acquire("tts", "b:1", view, 0) == ("reject", "guard")


async def test_after_redis_loses_its_data_grants_wait_for_survivors_to_reassert(
    redis_server: RedisServer,
) -> None:
    await seed_generation(redis_server.url)
    survivor = RedisAdmission(redis_server.url, gateway_id="survivor", lease_ttl_s=0.6)
    newcomer = RedisAdmission(redis_server.url, gateway_id="newcomer", lease_ttl_s=0.6)
    view = [ReplicaView("gpu0", 1)]
    try:
        assert await survivor.acquire("tts", "survivor:1", view, 0) == ("admit", "gpu0")
        redis_server.restart()  # no persistence: every lease is gone
        kind, wait_ms = await newcomer.acquire("tts", "newcomer:1", view, 0)
        assert kind == "blocked" and 0 < int(wait_ms) <= 600
        tick = await survivor.tick("tts", generation="seed", view=view,
                                   leases=[("survivor:1", "gpu0")], waiters=[], guards=[],
                                   guard_ttl_s=1)  # fmt: skip
        assert tick.generation != "seed" and tick.lost == ()
        assert tick.held == {"gpu0": 1}
        deadline = time.monotonic() + 5
        while (reply := await newcomer.acquire("tts", "newcomer:2", view, 0))[0] == "blocked":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
            renewed = await survivor.tick("tts", generation=tick.generation, view=view,
                                          leases=[("survivor:1", "gpu0")], waiters=[],
                                          guards=[], guard_ttl_s=1)  # fmt: skip
            assert renewed.lost == ()
        assert reply == ("reject", "pool_full")  # the re-asserted lease holds the slot
    finally:
        await survivor.close()
        await newcomer.close()


async def test_a_lease_is_not_reasserted_once_the_block_is_over(
    redis_server: RedisServer,
) -> None:
    await seed_generation(redis_server.url)
    late = RedisAdmission(redis_server.url, gateway_id="late", lease_ttl_s=0.2)
    try:
        await late.acquire("tts", "late:1", [ReplicaView("gpu0", 1)], 0)
        redis_server.restart()
        await late.ping()
        await seed_generation(redis_server.url)  # another gateway's generation, long past
        tick = await late.tick("tts", generation="old", view=[ReplicaView("gpu0", 1)],
                               leases=[("late:1", "gpu0")], waiters=[], guards=[],
                               guard_ttl_s=1)  # fmt: skip
        assert tick.lost == ("late:1",)
        assert tick.held == {}
    finally:
        await late.close()


async def test_an_unreachable_redis_raises_backend_unavailable(redis_server: RedisServer) -> None:
    backend = RedisAdmission(redis_server.url, gateway_id="a", timeout_s=0.2)
    redis_server.stop()
    try:
        with pytest.raises(BackendUnavailable):
            await backend.acquire("tts", "a:1", [ReplicaView("gpu0", 1)], 0)
        with pytest.raises(BackendUnavailable):
            await backend.ping()
    finally:
        await backend.close()


# --- relocate: failover before the first byte (issue 15 item 5) ------------------------


async def _held(store: RedisAdmission, view: list[ReplicaView]) -> dict[str, int]:
    tick = await store.tick("tts", generation="", view=view, leases=[], waiters=[],
                            guards=[], guard_ttl_s=1)  # fmt: skip
    return tick.held


async def test_relocate_moves_the_lease_to_a_replica_with_a_free_slot(gateways: Factory) -> None:
    a = await gateways("a")
    view = [ReplicaView("gpu0", 1), ReplicaView("gpu1", 1), ReplicaView("gpu2", 1)]
    assert await a.acquire("tts", "a:1", view, 0) == ("admit", "gpu0")
    # gpu0 unreachable: ejected (out of the view), gpu1 tried before: gpu2 it is.
    rest = view[1:]
    assert await a.relocate("tts", "a:1", "gpu0", rest, exclude=["gpu1"]) == ("moved", "gpu2")
    assert await _held(a, view) == {"gpu0": 0, "gpu2": 1}
    # A retry after a lost reply gets the same answer, and moves nothing again.
    assert await a.relocate("tts", "a:1", "gpu0", rest, exclude=["gpu1"]) == ("moved", "gpu2")
    assert await _held(a, view) == {"gpu0": 0, "gpu2": 1}
    assert await a.release("tts", "a:1", view) is True
    assert await _held(a, view) == {"gpu0": 0, "gpu2": 0}


async def test_relocate_stays_when_every_other_replica_is_full_or_excluded(
    gateways: Factory,
) -> None:
    a, b = await gateways("a"), await gateways("b")
    view = [ReplicaView("gpu0", 1), ReplicaView("gpu1", 1)]
    assert await a.acquire("tts", "a:1", view, 0) == ("admit", "gpu0")
    assert await b.acquire("tts", "b:1", view, 0) == ("admit", "gpu1")  # another gateway's
    assert await a.relocate("tts", "a:1", "gpu0", view[1:]) == ("stay", "gpu0")
    assert await b.release("tts", "b:1", view) is True
    assert await a.relocate("tts", "a:1", "gpu0", view, exclude=["gpu1"]) == ("stay", "gpu0")
    assert await _held(a, view) == {"gpu0": 1, "gpu1": 0}
    assert await a.relocate("tts", "gone:9", "gpu0", view) == ("gone", None)


async def test_the_slot_a_relocated_lease_leaves_goes_to_the_head_waiter(
    gateways: Factory,
) -> None:
    """Not ejected (the failure may have been the request's): the slot it frees on the
    old replica is handed to the head waiter in the same script, never left idle. (A
    waiter and a free slot coexist here because a's live cap for gpu1 is 2, b's 1.)"""
    a, b = await gateways("a"), await gateways("b")
    view_a = [ReplicaView("gpu0", 1), ReplicaView("gpu1", 2)]
    view_b = [ReplicaView("gpu0", 1), ReplicaView("gpu1", 1)]
    assert await a.acquire("tts", "a:1", view_a, 4) == ("admit", "gpu0")
    assert await b.acquire("tts", "b:1", view_b, 4) == ("admit", "gpu1")
    assert await b.acquire("tts", "b:2", view_b, 4) == ("queued", 1)
    assert await a.relocate("tts", "a:1", "gpu0", view_a) == ("moved", "gpu1")
    assert await b.wakeups("tts", 1.0) == [("b:2", "gpu0")]
    assert await _held(a, view_a) == {"gpu0": 1, "gpu1": 2}


# --- tenant quotas over every gateway (issue 15 item 4) ---------------------------------


async def test_a_tenant_quota_holds_over_concurrent_reservations_from_several_gateways(
    gateways: Factory,
) -> None:
    clients = [await gateways(f"gw{i}") for i in range(4)]
    results = await asyncio.gather(
        *(c.reserve_tenant("acme", f"{c.gateway_id}:{n}", 3) for n in range(20) for c in clients)
    )
    assert results.count(True) == 3
    assert await clients[0].tenant_active("acme") == 3
    assert await clients[0].reserve_tenant("other", "gw0:99", 1) is True  # tenants apart


async def test_a_tenant_reservation_is_idempotent_and_released_once(gateways: Factory) -> None:
    a, b = await gateways("a"), await gateways("b")
    assert await a.reserve_tenant("acme", "a:1", 1) is True
    assert await a.reserve_tenant("acme", "a:1", 1) is True  # a retry: the same answer
    assert await b.reserve_tenant("acme", "b:1", 1) is False
    assert await a.release_tenant("acme", "a:1") is True
    assert await a.release_tenant("acme", "a:1") is False
    assert await b.reserve_tenant("acme", "b:1", 1) is True


async def test_tenant_reservations_nobody_renews_expire_and_renewals_reassert(
    gateways: Factory, redis_server: RedisServer
) -> None:
    a = await gateways("a", lease_ttl_s=1.0)
    b = await gateways("b", lease_ttl_s=1.0)
    assert await a.reserve_tenant("acme", "a:1", 2) is True
    assert await a.reserve_tenant("acme", "a:2", 2) is True
    assert await b.reserve_tenant("acme", "b:1", 2) is False
    # a keeps a:1 alive; a:2's gateway "crashed" (nobody renews it): a:2 lapses, a:1 not.
    for _ in range(200):
        assert await a.renew_tenants([("acme", "a:1")]) == 1
        if await a.tenant_active("acme") == 1:
            break
        await asyncio.sleep(0.05)
    assert await a.tenant_active("acme") == 1
    assert await b.reserve_tenant("acme", "b:1", 2) is True
    assert await b.release_tenant("acme", "b:1") is True
    # Redis loses everything: the next renewal puts the live reservation back.
    redis_server.restart()
    assert await a.renew_tenants([("acme", "a:1")]) == 1
    assert await a.tenant_active("acme") == 1
    # The tenant's key expires with its last reservation.
    client = aioredis.from_url(redis_server.url)
    assert 0 < await client.pttl(a.tenant_key("acme")) <= 1000
    await client.aclose()


async def test_relocate_is_idempotent_and_fails_closed_without_redis(
    gateways: Factory, redis_server: RedisServer
) -> None:
    """The failover move: a retry of the same move is the same move; nowhere to go
    leaves the lease where it is; BackendUnavailable when Redis does not answer."""
    a = await gateways("a")
    view = [ReplicaView("gpu0", 1), ReplicaView("gpu1", 1)]
    assert await a.acquire("tts", "a:1", view, 0) == ("admit", "gpu0")
    assert await a.relocate("tts", "a:1", "gpu0", view[1:]) == ("moved", "gpu1")
    assert await a.relocate("tts", "a:1", "gpu0", view[1:]) == ("moved", "gpu1")  # a retry
    assert await _held(a, view) == {"gpu0": 0, "gpu1": 1}
    stay = await a.relocate("tts", "a:1", "gpu1", view[:1], exclude=["gpu0"])
    assert stay == ("stay", "gpu1")
    redis_server.stop()
    with pytest.raises(BackendUnavailable):
        await a.relocate("tts", "a:1", "gpu1", view)
