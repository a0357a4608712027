"""The background health re-check of an ejected replica survives whatever the HTTP
stack raises, and restores the replica once it answers."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from proxy.runtime import Runtime
from tests.conftest import proxy_settings


class FlakyClient:
    """Answers /health with: an error from outside httpx's hierarchy (as seen under a
    connection reset), an httpx error, then 200."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def get(self, url: str, **_: Any) -> httpx.Response:
        self.calls.append(url)
        if len(self.calls) == 1:
            raise AttributeError("'NoneType' object has no attribute 'send'")
        if len(self.calls) == 2:
            raise httpx.ConnectError("refused")
        return httpx.Response(200)

    async def aclose(self) -> None: ...


async def test_recheck_outlives_unexpected_errors_and_restores_the_replica() -> None:
    settings = proxy_settings(
        [("gpu0", "http://127.0.0.1:9", 2)],
        [{"path": "/s", "pool": "main", "protocol": "passthrough-ws"}],
        health={"recheck_interval_s": 0.001},
    )
    rt = Runtime(settings)
    client = FlakyClient()
    rt._http = client  # type: ignore[assignment]
    rt.gate.set_healthy("main", "gpu0", False)
    assert rt.gate.statistics()["main"].healthy_replicas == 0
    await asyncio.wait_for(rt._recheck("main", "gpu0"), 10)
    assert client.calls == ["http://127.0.0.1:9/health"] * 3
    assert rt.gate.statistics()["main"].healthy_replicas == 1
