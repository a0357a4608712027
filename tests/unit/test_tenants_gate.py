"""Tenants through the async gate (fake clock), the settings, and a real gateway on real
sockets: reserves, shedding (503 preempted_in_queue), max_queued (429 tenant_limit),
per-key positions and the headroom_tenant_* series (issue 18)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.admission import PoolCore, QueuePolicy, ReplicaSpec, Reserve, TenantSpec
from proxy.admission.gate import Gate
from proxy.admission.session_lease import Lease
from proxy.clock import FakeClock
from proxy.errors import ConfigError, Refused, TenantLimitRefused
from proxy.metering.series import Metrics
from proxy.settings import Settings, settings_from_mapping
from tests.conftest import Proxy
from tests.integration.test_ws_relay import hello, upstream, wait_until

__all__ = ["upstream"]

GOLD = TenantSpec("gold", priority=1, weight=1.0)
TEAM = TenantSpec("team", priority=0, weight=1.0, max_queued=2)
BATCH = TenantSpec("batch", priority=-1)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def make_gate(
    caps: tuple[int, ...] = (2,), depth: int = 2, reserves: tuple[Reserve, ...] = ()
) -> tuple[Gate, FakeClock, Metrics]:
    clock = FakeClock()
    metrics = Metrics()
    core = PoolCore(
        "tts",
        [ReplicaSpec(f"gpu{i}", c) for i, c in enumerate(caps)],
        QueuePolicy(depth, 30.0),
        session_estimate_s=10.0,
        reserves=reserves,
    )
    gate = Gate([core], clock=clock, metrics=metrics)  # (binds its tenant gauges)
    return gate, clock, metrics


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_shed_waiter_is_refused_preempted_and_counted_per_tenant() -> None:
    gate, clock, metrics = make_gate(caps=(1,), depth=1)
    holder = gate.enter("tts", tenant=TEAM)
    assert isinstance(holder, Lease)
    shed = asyncio.create_task(gate.acquire("tts", tenant=BATCH))
    await settle()
    clock.advance(2.0)
    gold = asyncio.create_task(gate.acquire("tts", tenant=GOLD))
    await settle()
    with pytest.raises(Refused) as info:
        await shed
    assert info.value.reason == "preempted_in_queue" and info.value.http_status == 503
    assert info.value.retry_after_s >= 1
    holder.release()
    lease = await gold
    assert lease.tenant == GOLD
    clock.advance(5.0)
    lease.release()
    labels = {"pool": "tts", "tenant": "batch", "priority": "-1"}
    assert sample(metrics, "headroom_tenant_decisions_total", **labels,
                  decision="rejected_preempted_in_queue") == 1  # fmt: skip
    assert sample(metrics, "headroom_tenant_queue_wait_seconds_sum", **labels) == 2.0
    gold_labels = {"pool": "tts", "tenant": "gold", "priority": "1"}
    assert sample(metrics, "headroom_tenant_session_seconds_total", **gold_labels) == 5.0
    assert sample(metrics, "headroom_tenant_decisions_total", **gold_labels,
                  decision="admitted") == 1  # fmt: skip
    # 2 s held by team so far, running: counted up to the scrape
    team = {"pool": "tts", "tenant": "team", "priority": "0"}
    assert sample(metrics, "headroom_tenant_session_seconds_total", **team) == 2.0


async def test_tenant_gauges_and_positions_per_key() -> None:
    gate, _, _ = make_gate(caps=(1,), depth=5)
    holder = gate.enter("tts", tenant=TEAM)
    assert isinstance(holder, Lease)
    seen: dict[str, list[int]] = {"team": [], "gold": []}
    team_waiters = [
        asyncio.create_task(
            gate.acquire("tts", tenant=TEAM, on_position=lambda p, _e: seen["team"].append(p))
        )
        for _ in range(2)
    ]
    await settle()
    with pytest.raises(TenantLimitRefused):  # max_queued 2
        gate.enter("tts", tenant=TEAM)
    gold = asyncio.create_task(
        gate.acquire("tts", tenant=GOLD, on_position=lambda p, _e: seen["gold"].append(p))
    )
    await settle()
    assert seen["gold"] == [1]  # a higher class goes ahead of the queue
    assert seen["team"] == [1, 2, 2, 3]  # both moved back one place
    gauges = {(g.tenant, g.priority): (g.active, g.queued) for g in gate.tenant_gauges()}
    assert gauges == {("team", 0): (1, 2), ("gold", 1): (0, 1)}
    holder.release()
    (await gold).release()
    for task in team_waiters:
        (await task).release()
    assert gate.active == 0


async def test_the_tenant_is_the_one_passed() -> None:
    """The tenant is a value the caller passes; without one the session has no key."""
    gate, _, _ = make_gate(caps=(2,), depth=1)
    lease = gate.enter("tts", tenant=GOLD)
    keyless = gate.enter("tts")
    assert isinstance(lease, Lease) and lease.tenant == GOLD
    assert isinstance(keyless, Lease) and keyless.tenant is None
    lease.release()
    keyless.release()


async def test_reserves_change_on_reload() -> None:
    gate, _, _ = make_gate(caps=(2,), depth=2)
    first = gate.enter("tts", tenant=TEAM)
    assert isinstance(first, Lease)
    gate.apply_pool("tts", [ReplicaSpec("gpu0", 2)], QueuePolicy(2, 30.0), None,
                    reserves=(Reserve(1, slots=1),))  # fmt: skip
    waiting = asyncio.create_task(gate.acquire("tts", tenant=TEAM))
    await settle()
    assert gate.queued == 1  # the last slot is kept for class 1
    gate.apply_pool("tts", [ReplicaSpec("gpu0", 2)], QueuePolicy(2, 30.0), None)
    second = await waiting
    first.release()
    second.release()


# -- settings ------------------------------------------------------------------------------


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def mapping(url: str = "http://127.0.0.1:9", **pool: Any) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "metrics": {"client_port": True},  # scraped on the client listener here
        "pools": [
            {"name": "main", "replicas": [{"name": "gpu0", "url": url, "max_sessions": 2}],
             "queue": {"max_depth": 1, "max_wait_s": 30}, **pool},
        ],
        "routes": [{"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}],
        "auth": {"keys": [
            {"name": "gold", "sha256": sha("key-gold"), "priority": 1, "weight": 2},
            {"name": "batch", "sha256": sha("key-batch"), "priority": -1, "max_queued": 1},
            {"name": "plain", "sha256": sha("key-plain")},
        ]},
    }  # fmt: skip


def test_settings_accept_tenant_fields_and_reserves() -> None:
    s = settings_from_mapping(mapping(reserve=[{"priority": 1, "slots": 1}]), env={})
    assert s.pools[0].reserve[0].slots == 1
    assert s.auth is not None
    gold, batch, plain = s.auth.keys
    assert (gold.priority, gold.weight, batch.max_queued) == (1, 2.0, 1)
    assert not plain.schedules and gold.schedules


@pytest.mark.parametrize(
    ("reserve", "where"),
    [
        ([{"priority": 1}], "pools[0].reserve[0]"),
        ([{"priority": 1, "slots": 1, "per_replica": 1}], "pools[0].reserve[0]"),
        ([{"priority": 1, "slots": 2}], "pools[0].reserve"),
        (
            [{"priority": 1, "slots": 1}, {"priority": 1, "slots": 1}],
            "pools[0].reserve[1].priority",
        ),
        ([{"priority": 1, "per_replica": 2}], "pools[0].reserve"),
    ],
)
def test_bad_reserves_are_refused_naming_the_field(reserve: Any, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(mapping(reserve=reserve), env={})
    assert any(path.startswith(where) for path, _ in info.value.problems), info.value.problems


def test_redis_backend_takes_tenant_fields_and_reserves() -> None:
    """The shared backend applies the tenant rules (tests/shared_admission/test_tenants.py),
    so the fields are no longer refused with it; keys without them load as before."""
    data = mapping(reserve=[{"priority": 1, "slots": 1}])
    data["admission"] = {"backend": "redis"}
    s = settings_from_mapping(data, env={})
    assert s.pools[0].reserve[0].slots == 1
    assert s.auth is not None
    gold, batch, _ = s.auth.keys
    assert (gold.priority, gold.weight, batch.priority, batch.max_queued) == (1, 2.0, -1, 1)
    plain = mapping()
    plain["admission"] = {"backend": "redis"}
    plain["auth"]["keys"] = [plain["auth"]["keys"][2]]
    settings_from_mapping(plain, env={})  # keys without the fields: as today


# -- a real gateway -------------------------------------------------------------------------


TENANT_METRICS = {
    "headroom_tenant_sessions_active": "gauge",
    "headroom_tenant_queued": "gauge",
    "headroom_tenant_session_seconds": "counter",
    "headroom_tenant_decisions": "counter",
    "headroom_tenant_queue_wait_seconds": "histogram",
}


def gateway_settings(url: str) -> Settings:
    return settings_from_mapping(mapping(url, reserve=[{"priority": 1, "slots": 1}]), env={})


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def dial(url: str, key: str) -> Any:
    return await connect(url, additional_headers=bearer(key), compression=None)


async def test_gateway_reserve_shedding_and_tenant_series(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(gateway_settings(server.http_url))
    url = proxy.ws_url + "/ws"
    batch = await connect(url, additional_headers=bearer("key-batch"), compression=None)
    await hello(batch)
    # the pool's last slot is kept for class 1: a second batch session waits
    queued = asyncio.create_task(dial(url, "key-batch"))
    await wait_until(lambda: proxy.gate.queued == 1)
    with pytest.raises(InvalidStatus) as limit:  # batch's max_queued is 1
        await connect(url, additional_headers=bearer("key-batch"), compression=None)
    assert limit.value.response.status_code == 429
    assert limit.value.response.headers["X-Headroom-Reason"] == "tenant_limit"
    gold = await connect(url, additional_headers=bearer("key-gold"), compression=None)
    await hello(gold)  # admitted at once into the reserve
    # the pool is full, the queue (depth 1) holds the batch waiter: gold needs its place
    gold2 = asyncio.create_task(dial(url, "key-gold"))
    with pytest.raises(InvalidStatus) as shed:
        await queued
    response = shed.value.response
    assert response.status_code == 503
    assert response.headers["X-Headroom-Reason"] == "preempted_in_queue"
    assert int(response.headers["Retry-After"]) >= 1
    assert json.loads(response.body)["error"]["code"] == "preempted_in_queue"
    await wait_until(lambda: proxy.gate.queued == 1)
    await batch.close()
    second_gold = await gold2
    await hello(second_gold)
    async with httpx.AsyncClient() as client:
        text = (await client.get(proxy.http_url + "/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in TENANT_METRICS.items():
        assert families[name].type == kind, name
        for sample in families[name].samples:
            assert set(sample.labels) - {"le", "decision"} == {"pool", "tenant", "priority"}
            assert sample.labels["tenant"] in {"gold", "batch", "plain"}
    active = families["headroom_tenant_sessions_active"].samples
    assert {s.labels["tenant"]: s.value for s in active} == {"gold": 2.0, "batch": 0.0}
    for ws in (gold, second_gold):
        await ws.close()
    await wait_until(lambda: proxy.gate.active == 0)
    assert proxy.metric("headroom_tenant_decisions_total", pool="main", tenant="batch",
                        priority="-1", decision="rejected_preempted_in_queue") == 1  # fmt: skip
    assert proxy.metric("headroom_tenant_decisions_total", pool="main", tenant="batch",
                        priority="-1", decision="rejected_tenant_limit") == 1  # fmt: skip
    assert proxy.metric("headroom_tenant_decisions_total", pool="main", tenant="gold",
                        priority="1", decision="admitted") == 2  # fmt: skip
    assert proxy.metric("headroom_tenant_session_seconds_total", pool="main", tenant="gold",
                        priority="1") > 0  # fmt: skip


async def test_tenant_gauges_sum_a_keys_sessions_across_a_reloaded_spec() -> None:
    """After a reload changes a key's weight, its running sessions hold the old spec and
    new ones the new: the gauges count both under the key's one (name, class)."""
    gate, _, _ = make_gate(caps=(3,), depth=1)
    before = gate.enter("tts", tenant=TenantSpec("team", priority=0, weight=1.0))
    after = gate.enter("tts", tenant=TenantSpec("team", priority=0, weight=2.0))
    assert isinstance(before, Lease) and isinstance(after, Lease)
    gauges = {(g.tenant, g.priority): (g.active, g.queued) for g in gate.tenant_gauges()}
    assert gauges == {("team", 0): (2, 0)}
    before.release()
    after.release()
