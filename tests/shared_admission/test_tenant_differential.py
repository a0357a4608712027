"""The tenant rules are decided twice -- in Python (:class:`~proxy.admission.pool_core.PoolCore`
with :class:`~proxy.admission.tenants.TenantQueue`) and in the Lua scripts of the shared
backend -- so the Lua port is checked against the Python, not trusted (issue 18).

Hypothesis draws one operation sequence (arrivals of keys of several classes and weights,
releases, waiters leaving, time passing, a replica's cap changing) and runs it on a
``PoolCore`` and on the scripts in a real redis-server, both on the same test clock (the
scripts take it in ARGV instead of Redis ``TIME``). After every step the decisions must
agree: admitted where, queued at which position, refused for which reason and from which
position (its Retry-After), which waiter a freed slot went to, which sheddable waiter was
refused ``preempted_in_queue``; and every waiter's position (the renewal tick's) must be
the core's."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.admission import (
    Admit,
    Enqueue,
    PoolCore,
    QueuePolicy,
    Reject,
    ReplicaSpec,
    Reserve,
    TenantSpec,
)
from proxy.admission.redis_backend import RedisAdmission, ReplicaView
from tests.hypothesis_profiles import examples
from tests.redis_support import RedisServer

POOL = "tts"
START_MS = 2_000_000_000  # past the seeded generation's block (since 0 + TTL)
TTL_S = 1_000_000.0  # nothing expires during a run: expiry is not PoolCore's business
ESTIMATE_S = 10.0

TENANTS: tuple[TenantSpec | None, ...] = (
    None,  # no key
    TenantSpec("plain"),  # a key without the fields: the shared FIFO lane of class 0
    TenantSpec("a", priority=0, weight=1.0),
    TenantSpec("b", priority=0, weight=2.5, max_queued=2),
    TenantSpec("gold", priority=2, max_queued=3),
    TenantSpec("silver", priority=1, weight=1.0),
    TenantSpec("free", priority=-1, max_queued=3),
    TenantSpec("batch", priority=-2, weight=0.5),
)

RESERVES: tuple[tuple[Reserve, ...], ...] = (
    (),
    (Reserve(2, slots=1),),
    (Reserve(1, per_replica=1), Reserve(2, slots=1)),
    (Reserve(0, slots=1),),
)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, len(TENANTS) - 1)),
        st.tuples(st.just("release"), st.integers(0, 20)),
        st.tuples(st.just("advance"), st.integers(1, 40_000)),
        st.tuples(st.just("abandon"), st.integers(0, 20)),
        st.tuples(st.just("cap"), st.integers(1, 3)),
    ),
    min_size=10,
    max_size=60,
)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer()
    yield s
    s.stop()


class Twin:
    """One PoolCore and the same pool in Redis, on one clock."""

    def __init__(self, url: str, prefix: str, reserves: tuple[Reserve, ...], depth: int) -> None:
        self.ms = START_MS
        self.caps = {"gpu0": 2, "gpu1": 1}
        self.core = PoolCore(
            POOL, [ReplicaSpec(n, c) for n, c in self.caps.items()],
            QueuePolicy(depth, TTL_S), session_estimate_s=ESTIMATE_S, reserves=reserves,
        )  # fmt: skip
        self.store = RedisAdmission(
            url, key_prefix=prefix, gateway_id="gw", lease_ttl_s=TTL_S, heartbeat_ttl_s=TTL_S,
            clock_ms=lambda: self.ms,
        )  # fmt: skip
        self.store.configure_pool(POOL, session_estimate_s=ESTIMATE_S, reserves=reserves)
        self.depth = depth
        self.client: Any = aioredis.from_url(url)

    @property
    def now(self) -> float:
        return self.ms / 1000  # the scripts' seconds: ms / 1000, the same double

    def view(self) -> list[ReplicaView]:
        return [ReplicaView(n, c) for n, c in self.caps.items()]

    def wid(self, ticket: int) -> str:
        return f"gw:{ticket}"

    async def woken(self) -> list[tuple[str, str]]:
        key = self.store.wake_key(POOL)
        items = await self.client.lrange(key, 0, -1)
        await self.client.delete(key)
        out = []
        for raw in items:
            waiter, _, message = raw.decode().partition(" ")
            out.append((waiter, message))
        return out

    async def close(self) -> None:
        await self.store.close()
        await self.client.aclose()


def granted(admits: list[Admit], twin: Twin) -> list[tuple[str, str]]:
    return [(twin.wid(a.ticket), a.replica) for a in admits]


async def step(twin: Twin, op: str, arg: int) -> None:
    core = twin.core
    if op == "advance":
        twin.ms += arg
        return
    if op == "arrive":
        spec = TENANTS[arg]
        now = twin.now
        queue = core._waiters  # where a refused newcomer would stand (its Retry-After)
        would_stand = (
            queue.position_of_new(spec or TenantSpec(), now, core._lengths.mean) if queue else 1
        )
        decision = core.arrive(now, spec)
        got = await twin.store.acquire_as(
            POOL, twin.wid(decision.ticket), twin.view(), twin.depth, spec
        )
        if isinstance(decision, Admit):
            assert (got.kind, got.value) == ("admit", decision.replica)
        elif isinstance(decision, Reject):
            assert (got.kind, got.value) == ("reject", decision.reason)
            assert got.position == would_stand
        else:
            assert isinstance(decision, Enqueue)
            assert (got.kind, got.value) == ("queued", decision.position)
        shed = [(twin.wid(r.ticket), r.reason) for r in getattr(decision, "displaced", ())]
        wakes = [(w, m.split(" ")[0]) for w, m in await twin.woken()]
        assert wakes == [(w, "!" + reason) for w, reason in shed]
        return
    if op == "release":
        tickets = sorted(t for t in core._leases)
        if not tickets:
            return
        ticket = tickets[arg % len(tickets)]
        admits = core.release(ticket, twin.now)
        assert await twin.store.release(POOL, twin.wid(ticket), twin.view())
        assert await twin.woken() == granted(admits, twin)
        return
    if op == "abandon":
        waiting = sorted(core._waiters)
        if not waiting:
            return
        ticket = waiting[arg % len(waiting)]
        admits = core.abandon(ticket, twin.now)
        kind, _ = await twin.store.leave(POOL, twin.wid(ticket), twin.view())
        assert kind == "left"
        assert await twin.woken() == granted(admits, twin)
        return
    assert op == "cap"
    twin.caps["gpu0"] = arg
    admits = core.set_cap("gpu0", arg, twin.now)
    await tick(twin)  # the renewal carries the new view and hands out freed slots
    assert await twin.woken() == granted(admits, twin)


async def tick(twin: Twin) -> dict[str, int]:
    waiting = [twin.wid(t) for t in sorted(twin.core._waiters)]
    result = await twin.store.tick(
        POOL, generation="seed", view=twin.view(), leases=[], waiters=waiting, guards=[],
        guard_ttl_s=1.0,
    )  # fmt: skip
    return dict(zip(waiting, result.waiters, strict=True))


async def check_positions(twin: Twin) -> None:
    positions = await tick(twin)
    assert await twin.woken() == []  # the core had handed out every slot it could
    expected = {twin.wid(t): twin.core.position(t, twin.now) for t in twin.core._waiters}
    assert positions == expected
    held = await twin.client.hgetall(twin.store.keys(POOL)[2])
    in_redis = {k.decode(): int(v) for k, v in held.items() if int(v)}
    in_core = {r.name: r.active for r in twin.core.statistics().replicas if r.active}
    assert in_redis == in_core


_prefixes = itertools.count()


@settings(
    max_examples=examples(120),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=ops, reserves=st.sampled_from(RESERVES), depth=st.sampled_from([0, 2, 4, 6]))
def test_lua_scripts_decide_as_pool_core(
    server: RedisServer, ops: list[tuple[str, int]], reserves: tuple[Reserve, ...], depth: int
) -> None:
    async def run() -> None:
        prefix = f"diff{next(_prefixes)}:"
        client = aioredis.from_url(server.url)
        await client.hset(f"{prefix}{{{POOL}}}:gen", mapping={"id": "seed", "since": 0})
        await client.aclose()
        twin = Twin(server.url, prefix, reserves, depth)
        try:
            for op, arg in ops:
                await step(twin, op, arg)
                await check_positions(twin)
        finally:
            await twin.close()

    asyncio.run(run())
