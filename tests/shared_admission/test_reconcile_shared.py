"""Streams the engine runs that no gateway admitted, on the redis backend: each
gateway's reconciler subtracts every gateway's sessions (the shared gate's held count
from its renewals), not only its own, so two gateways together admit only into the
slots the other streams leave. Real redis-server; the gates' clock is a FakeClock."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from proxy.admission.reconcile import EngineReconciler
from proxy.errors import Refused
from proxy.settings import settings_from_mapping
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import Backend, seed_generation

SETTINGS = settings_from_mapping(
    {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "health": {"engine_metrics_interval_s": 5},
        "pools": [{"name": "tts", "engine_reconcile": True, "engine_reconcile_hold_s": 30,
                   "replicas": [{"name": "gpu0", "url": "http://127.0.0.1:9",
                                 "max_sessions": 4}]}],
        "routes": [{"path": "/ws", "pool": "tts", "protocol": "passthrough-ws"}],
    },
    env={},
)  # fmt: skip


@pytest.fixture
async def redis_backend() -> AsyncIterator[Backend]:
    server = RedisServer()
    await seed_generation(server.url)
    env = Backend("redis", server.url)
    try:
        yield env
    finally:
        for gate in env.made:
            await gate.stop()
        server.stop()


async def test_every_gateways_sessions_count_as_admitted(redis_backend: Backend) -> None:
    a = await redis_backend.gate(caps=(4,), depth=0)
    b = await redis_backend.gate(caps=(4,), depth=0)
    on_a = [await a.acquire("tts") for _ in range(2)]
    await a.renew()
    await b.renew()
    assert b.statistics()["tts"].replicas[0].active == 0  # b's own: none
    assert b.held_per_replica("tts") == {"gpu0": 2}
    reconcilers = [EngineReconciler(g, redis_backend.clock, SETTINGS) for g in (a, b)]
    # The engine runs a's 2 sessions and 1 stream nobody admitted, for two scrapes.
    for _ in range(2):
        for r in reconcilers:
            r.observe("tts", "gpu0", 3)
    assert [r.unadmitted("tts", "gpu0") for r in reconcilers] == [1, 1]
    assert [g.statistics()["tts"].replicas[0].cap for g in (a, b)] == [3, 3]
    on_b = await b.acquire("tts")  # the one slot left
    with pytest.raises(Refused) as info:
        await a.acquire("tts")
    assert info.value.reason == "pool_full"
    assert "(1 on gpu0)" in reconcilers[0].explain(info.value).message
    for lease in [*on_a, on_b]:
        lease.release()
