"""The tenant rules (issue 18), on both backends: the same decisions whether the queue
lives in this process (memory, PoolCore) or in Redis shared by gateways (redis, the Lua
scripts) -- class order, weighted share by session-seconds, FIFO within a key,
max_queued, reserves, shedding a sheddable waiter, keys without the fields as before,
and the headroom_tenant_* series. The redis backend runs on the test's clock
(``fake_time``) so session-seconds are the same on both."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest

from proxy.admission import QueuePolicy, ReplicaSpec, Reserve, TenantSpec
from proxy.admission.interface import TenantQuota
from proxy.admission.session_lease import Lease, Waiting
from proxy.admission.shared_gate import SharedGate
from proxy.client_request import ClientRequest
from proxy.errors import Refused, TenantLimitRefused
from proxy.runtime import Runtime
from proxy.settings import settings_from_mapping
from tests.shared_admission.conftest import Backend, eventually, seed_generation

GOLD = TenantSpec("gold", priority=1)
TEAM = TenantSpec("team", priority=0, weight=1.0, max_queued=2)
A = TenantSpec("a", priority=0, weight=1.0)
B = TenantSpec("b", priority=0, weight=3.0)
FREE = TenantSpec("free", priority=-1)
PLAIN = TenantSpec("plain")  # a key without the fields


class Queue:
    """Waiters entered one at a time (so arrival order is defined on both backends);
    records the order in which they are admitted."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate
        self.order: list[str] = []
        self.tasks: dict[str, asyncio.Task[Lease]] = {}

    async def add(self, label: str, tenant: TenantSpec | None) -> None:
        before = self.gate.queued

        async def run() -> Lease:
            lease: Lease = await self.gate.acquire("tts", tenant=tenant)
            self.order.append(label)
            return lease

        self.tasks[label] = asyncio.create_task(run())
        await eventually(lambda: self.gate.queued == before + 1, f"{label} queued")

    async def serve(self, lease: Lease, backend: Backend, hold_s: float = 0.0) -> Lease:
        """``lease`` ends after ``hold_s``: returns the lease of the waiter it went to."""
        served = len(self.order)
        backend.clock.advance(hold_s)
        lease.release()
        await eventually(lambda: len(self.order) == served + 1, "next waiter admitted")
        return self.tasks[self.order[-1]].result()

    async def serve_all(self, lease: Lease, backend: Backend, hold_s: float = 0.0) -> None:
        """``lease``, then each lease it goes to, ends after ``hold_s`` until every waiter
        has been admitted; the last one is released."""
        for _ in range(len(self.tasks) - len(self.order)):
            lease = await self.serve(lease, backend, hold_s)
        lease.release()


async def refused(gate: Any, tenant: TenantSpec | None) -> Refused:
    """The refusal of a newcomer that finds no place (it must not be queued)."""
    with pytest.raises(Refused) as info:
        await gate.admit("tts", tenant=tenant)
    return info.value


async def test_a_higher_class_is_served_first(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=5)
    holder = await gate.acquire("tts", tenant=TEAM)
    q = Queue(gate)
    await q.add("team", TEAM)
    await q.add("none", None)
    await q.add("gold", GOLD)
    await q.serve_all(holder, backend)
    assert q.order == ["gold", "team", "none"]


async def test_weights_share_slot_seconds_and_each_key_stays_fifo(backend: Backend) -> None:
    """One slot, sessions of 10 s: a key of weight 3 gets three sessions for each one of
    a key of weight 1 while both wait; each key's own waiters in arrival order."""
    gate = await backend.gate(caps=(1,), depth=12, wait=1000.0, fake_time=True)
    holder = await gate.acquire("tts")
    q = Queue(gate)
    for i in range(4):
        await q.add(f"a{i}", A)
        await q.add(f"b{i}", B)
    await q.serve_all(holder, backend, hold_s=10.0)
    # a0 first (a tie, it came first), then b three times for a's once while both wait
    assert q.order == ["a0", "b0", "b1", "b2", "a1", "b3", "a2", "a3"]


async def test_max_queued_refuses_tenant_limit_and_a_full_queue_queue_full(
    backend: Backend,
) -> None:
    gate = await backend.gate(caps=(1,), depth=3)
    holder = await gate.acquire("tts", tenant=TEAM)
    q = Queue(gate)
    await q.add("team0", TEAM)
    await q.add("team1", TEAM)
    refusal = await refused(gate, TEAM)  # max_queued 2
    assert isinstance(refusal, TenantLimitRefused)
    assert refusal.reason == "tenant_limit" and refusal.http_status == 429
    assert refusal.retry_after_s >= 1
    await q.add("plain", PLAIN)  # another key still queues
    refusal = await refused(gate, A)
    assert refusal.reason == "queue_full"
    await q.serve_all(holder, backend)
    assert q.order == ["team0", "team1", "plain"]


async def test_a_reserve_keeps_slots_for_a_higher_class(backend: Backend) -> None:
    gate = await backend.gate(caps=(2, 1), depth=3, reserves=(Reserve(1, slots=1),))
    low = [await gate.acquire("tts", tenant=A) for _ in range(2)]
    # A free slot, but class 0 sees a cap of 2: it queues.
    entry = await gate.admit("tts", tenant=A)
    assert isinstance(entry, Waiting)
    # The higher class takes the reserved slot at once, past the low waiter.
    gold = await gate.admit("tts", tenant=GOLD)
    assert isinstance(gold, Lease)
    # A second gold finds every slot taken: it queues ahead of the low waiter.
    second = await gate.admit("tts", tenant=GOLD)
    assert isinstance(second, Waiting) and second.position == 1
    waiting_gold = asyncio.create_task(second.wait())
    waiting_low = asyncio.create_task(entry.wait())
    low[0].release()
    lease = await asyncio.wait_for(waiting_gold, 5)  # the freed slot: to the gold waiter
    assert not waiting_low.done()
    gold.release()  # the reserve's slot is free again: class 0 still holds 1 + may take 1
    late = await asyncio.wait_for(waiting_low, 5)
    for held in (late, lease, low[1]):
        held.release()


async def test_a_sheddable_waiter_makes_room_for_a_higher_class(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=2)
    holder = await gate.acquire("tts", tenant=TEAM)
    q = Queue(gate)
    await q.add("team", TEAM)
    shed_task = asyncio.create_task(gate.acquire("tts", tenant=FREE))
    await eventually(lambda: gate.queued == 2, "free queued")
    newcomer = await gate.admit("tts", tenant=A)  # a full queue: the sheddable one goes
    assert isinstance(newcomer, Waiting)
    with pytest.raises(Refused) as info:
        await asyncio.wait_for(shed_task, 5)
    assert info.value.reason == "preempted_in_queue" and info.value.http_status == 503
    assert info.value.retry_after_s >= 1
    # Nobody sheddable is left: the next newcomer is refused, whatever its class.
    assert (await refused(gate, GOLD)).reason == "queue_full"
    # A sheddable newcomer never displaces anyone.
    assert (await refused(gate, FREE)).reason == "queue_full"
    lease = await q.serve(holder, backend)
    waiting = asyncio.create_task(newcomer.wait())
    lease.release()
    (await asyncio.wait_for(waiting, 5)).release()


async def test_keys_without_the_fields_share_one_fifo_as_before(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=5)
    holder = await gate.acquire("tts", tenant=PLAIN)
    q = Queue(gate)
    await q.add("plain0", PLAIN)
    await q.add("none0", None)
    await q.add("plain1", PLAIN)
    await q.add("none1", None)
    await q.serve_all(holder, backend)
    assert q.order == ["plain0", "none0", "plain1", "none1"]


async def test_tenant_series_count_decisions_and_session_seconds(backend: Backend) -> None:
    gate = await backend.gate(caps=(1,), depth=2, wait=100.0, fake_time=True)
    holder = await gate.acquire("tts", tenant=TEAM)
    q = Queue(gate)
    await q.add("gold", GOLD)
    backend.clock.advance(3.0)
    gauges = {(g.tenant, g.priority): (g.active, g.queued) for g in gate.tenant_gauges()}
    assert gauges == {("team", 0): (1, 0), ("gold", 1): (0, 1)}
    lease = await q.serve(holder, backend, hold_s=2.0)
    backend.clock.advance(4.0)
    lease.release()
    await backend.settle()
    registry = gate.metrics.registry

    def sample(name: str, tenant: str, priority: str, **extra: str) -> float:
        labels = {"pool": "tts", "tenant": tenant, "priority": priority, **extra}
        return registry.get_sample_value(name, labels) or 0.0

    assert sample("headroom_tenant_decisions_total", "gold", "1", decision="queued") == 1
    assert sample("headroom_tenant_decisions_total", "gold", "1", decision="admitted") == 1
    assert sample("headroom_tenant_queue_wait_seconds_sum", "gold", "1") == 5.0
    assert sample("headroom_tenant_session_seconds_total", "team", "0") == 5.0
    assert sample("headroom_tenant_session_seconds_total", "gold", "1") == 4.0
    assert sample("headroom_tenant_sessions_active", "gold", "1") == 0


async def test_reserves_change_on_reload(backend: Backend) -> None:
    gate = await backend.gate(caps=(2,), depth=2)
    first = await gate.acquire("tts", tenant=TEAM)
    replicas, queue = [ReplicaSpec("gpu0", 2)], QueuePolicy(2, 30.0)
    gate.apply_pool("tts", replicas, queue, None, reserves=(Reserve(1, slots=1),))
    await backend.settle()
    q = Queue(gate)
    await q.add("team", TEAM)  # the last slot is kept for class 1
    gate.apply_pool("tts", replicas, queue, None, reserves=())
    await eventually(lambda: q.order == ["team"], "admitted once the reserve is gone")
    q.tasks["team"].result().release()
    first.release()


async def test_runtime_sends_the_configured_reserves_and_reloads_them() -> None:
    """A redis-backend gateway takes tenant fields (no longer refused at start-up) and
    hands the pool's reserves to the shared gate, at start and on reload."""
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "admission": {"backend": "redis"},
        "pools": [{"name": "main", "queue": {"max_depth": 2, "max_wait_s": 30},
                   "replicas": [{"name": "gpu0", "url": "http://127.0.0.1:9",
                                 "max_sessions": 2}],
                   "reserve": [{"priority": 1, "slots": 1}]}],
        "routes": [{"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}],
        "auth": {"keys": [{"name": "gold", "sha256": "0" * 64, "priority": 1, "weight": 2},
                          {"name": "free", "sha256": "1" * 64, "priority": -1,
                           "max_queued": 1}]},
    }  # fmt: skip
    runtime = Runtime(settings_from_mapping(data, env={}))
    assert isinstance(runtime.gate, SharedGate)
    assert runtime.gate.reserves("main") == (Reserve(1, slots=1),)
    data["pools"][0]["reserve"] = [{"priority": 1, "per_replica": 1}]
    runtime.apply(settings_from_mapping(data, env={}))
    assert runtime.gate.reserves("main") == (Reserve(1, per_replica=1),)
    await runtime.gate.backend.close()


async def test_a_key_past_max_sessions_is_told_when_its_own_session_ends(
    backend: Backend,
) -> None:
    """Over every gateway (tenants.lua), a key past ``max_sessions`` is refused
    tenant_limit with a Retry-After from its own running session's expected end (10 s
    sessions, one just started), not the pool's free slot (which is free now)."""
    if backend.kind == "memory":
        pytest.skip("the in-process quota is Runtime.authorize's (tests/unit)")
    gate = await backend.gate(caps=(3,), depth=2)
    quota = TenantQuota("team", 1)
    held = await gate.acquire("tts", tenant=TEAM, quota=quota)
    backend.clock.advance(1.0)
    with pytest.raises(TenantLimitRefused) as info:
        await gate.acquire("tts", tenant=TEAM, quota=quota)
    assert info.value.reason == "tenant_limit"
    assert info.value.retry_after_s >= 5  # ~9 s left of the key's own session
    assert gate.tenant_wait("tts", "team") == pytest.approx(9.0, abs=3.0)
    assert gate.tenant_wait("tts", "gold") is None
    held.release()


async def test_runtime_tells_a_key_past_max_sessions_when_its_own_session_ends() -> None:
    """On the redis backend too, the gateway's own max_sessions check (Runtime.authorize,
    before the gate) gives a refused key the Retry-After of its own running session
    (20 s sessions, one 5 s old: about 15 s), not the pool's next free slot (free now,
    which would say 1-3 s)."""
    from proxy.clock import FakeClock
    from tests.redis_support import RedisServer

    server = RedisServer()
    try:
        await seed_generation(server.url, pool="main")
        data: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "admission": {"backend": "redis", "redis": {"url": server.url}},
            "pools": [{"name": "main", "session_estimate_s": 20,
                       "replicas": [{"name": "gpu0", "url": "http://127.0.0.1:9",
                                     "max_sessions": 3}]}],
            "routes": [{"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}],
            "auth": {"keys": [{"name": "team", "sha256": hashlib.sha256(b"k").hexdigest(),
                               "max_sessions": 1}]},
        }  # fmt: skip
        clock = FakeClock()
        runtime = Runtime(settings_from_mapping(data, env={}), clock=clock)
        assert isinstance(runtime.gate, SharedGate)
        await runtime.gate.start()
        try:
            scope = {"headers": [(b"authorization", b"Bearer k")], "query_string": b""}
            authorized = runtime.authorize(ClientRequest.of(scope), "main")
            lease = await runtime.gate.acquire(
                "main", tenant=authorized.tenant, quota=authorized.quota
            )
            clock.advance(5.0)
            with pytest.raises(TenantLimitRefused) as info:
                runtime.authorize(ClientRequest.of(scope), "main")
            assert info.value.reason == "tenant_limit"
            assert 15 <= info.value.retry_after_s <= 20
            lease.release()
            runtime.release_tenant(authorized.token)
        finally:
            await runtime.gate.stop()
    finally:
        server.stop()
