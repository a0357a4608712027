"""Streams that bypass Headroom, end to end: a simulated GPU carries streams no gateway
admitted (``/sim/bypass``), Headroom scrapes the engine and, with ``engine_reconcile``,
admits only into the slots those streams leave.

The gateway runs on a fake clock: each engine scrape happens when the test calls
:meth:`~proxy.upstreams.Upstreams.scrape_once` (the scrape loop's first pass runs at
start-up, its next one only if the test advances the clock by its interval), and the
hold time lapses only when the test advances the clock past it. The simulated GPU runs
in real time; the test waits for the engine's own figures (events, not timings).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from proxy.clock import FakeClock
from proxy.settings import Settings, settings_from_mapping
from proxy.sim.cluster import running_cluster
from tests.integration.test_ws_relay import wait_until

PRESET = "h100-orpheus-3b"
CAP = 4
HOLD_S = 25.0
#: One sentence of about two minutes of speech: a session's request stays in the
#: engine for the whole test.
LONG_TEXT = " ".join(["steady"] * 300) + "."


def _settings(sim_url: str, *, reconcile: bool) -> Settings:
    return settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "health": {"engine_metrics_interval_s": 10},
            "pools": [{
                "name": "main",
                "replicas": [{"name": "gpu0", "url": sim_url, "max_sessions": CAP}],
                "queue": {"max_depth": 0, "max_wait_s": 10},
                "engine_reconcile": reconcile,
                "engine_reconcile_hold_s": HOLD_S,
            }],
            "routes": [{"path": "/v1/audio/speech/stream", "pool": "main",
                        "protocol": "vllm-omni-speech-ws"}],
        },
        env={},
    )  # fmt: skip


async def _in_engine(sim_url: str) -> int:
    async with httpx.AsyncClient() as client:
        stats = (await client.get(f"{sim_url}/sim/stats")).json()
    return int(stats["running"]) + int(stats["waiting"])


async def _wait_in_engine(sim_url: str, n: int, *, at_least: bool = False) -> None:
    """Until the engine holds exactly (or ``at_least``) ``n`` requests (its clock is
    real: a generous bound on a loaded machine; ordering, not timing, is asserted)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 60
    while (found := await _in_engine(sim_url)) != n and not (at_least and found >= n):
        if loop.time() > end:
            raise AssertionError(f"the engine holds {found} requests, not {n}")
        await asyncio.sleep(0.02)


async def _bypass(sim_url: str, streams: int) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{sim_url}/sim/bypass", json={"streams": streams})
    assert response.json()["streams"] == streams


async def _speak(url: str) -> ClientConnection:
    """An admitted session whose utterance keeps one request in the engine."""
    ws = await connect(url)
    await ws.send(json.dumps({"type": "session.config", "voice": "tara"}))
    await ws.send(json.dumps({"type": "input.text", "text": LONG_TEXT}))
    await ws.send(json.dumps({"type": "input.done"}))
    return ws


async def _refused(url: str) -> dict[str, Any]:
    with pytest.raises(InvalidStatus) as info:
        async with connect(url):
            pass
    response = info.value.response
    assert response.status_code == 503
    assert response.headers["X-Headroom-Reason"] == "pool_full"
    body: dict[str, Any] = json.loads(response.body)["error"]
    return body


async def test_bypass_streams_take_slots_only_with_engine_reconcile(start_proxy: Any) -> None:
    async with running_cluster(PRESET, gpus=1) as cluster:
        sim = cluster.urls[0]
        clock = FakeClock()
        proxy = await start_proxy(_settings(sim, reconcile=True), clock=clock)
        runtime, url = proxy.runtime, proxy.ws_url + "/v1/audio/speech/stream"

        def slots() -> float:
            return float(proxy.metric("headroom_session_slots", pool="main", replica="gpu0"))

        def unadmitted() -> float:
            return float(proxy.metric(
                "headroom_engine_unadmitted_streams", pool="main", replica="gpu0"
            ))  # fmt: skip

        await _bypass(sim, 2)
        await _wait_in_engine(sim, 2)
        await runtime.upstreams.scrape_once()
        # One scrape is not sustained: the metric shows the streams, the cap is whole.
        assert unadmitted() == 2 and slots() == CAP
        await runtime.upstreams.scrape_once()
        assert unadmitted() == 2 and slots() == CAP - 2

        sessions = [await _speak(url) for _ in range(CAP - 2)]
        await _wait_in_engine(sim, 4)
        refusal = await _refused(url)
        assert "streams Headroom did not admit" in refusal["message"]
        assert "(2 on gpu0)" in refusal["message"]
        # Headroom's own sessions now run in the engine too: the difference stays 2,
        # and the cap does not fall below the sessions held.
        await runtime.upstreams.scrape_once()
        assert unadmitted() == 2 and slots() == CAP - 2
        await _refused(url)

        # The bypass traffic ends: the next scrape gives the slots back.
        await _bypass(sim, 0)
        await _wait_in_engine(sim, CAP - 2)
        await runtime.upstreams.scrape_once()
        assert unadmitted() == 0 and slots() == CAP
        sessions += [await _speak(url) for _ in range(2)]
        assert (await _refused(url))["message"].startswith("All GPU slots")
        for ws in sessions:
            await ws.close()
        await wait_until(lambda: runtime.gate.active == 0)

        # A scrape that stops confirming: the reduction lapses after the hold time. (The
        # closed sessions' requests may still be finishing in the engine: they are
        # streams no session holds now, so they count too.)
        await _bypass(sim, 3)
        await _wait_in_engine(sim, 3, at_least=True)
        await runtime.upstreams.scrape_once()
        await runtime.upstreams.scrape_once()
        assert slots() == 1  # CAP - 3 or less, never below 1
        clock.advance(HOLD_S - 1)
        assert slots() == 1
        clock.advance(1)
        assert slots() == CAP
        await _bypass(sim, 0)


async def test_without_engine_reconcile_the_caps_ignore_bypass_streams(start_proxy: Any) -> None:
    async with running_cluster(PRESET, gpus=1) as cluster:
        sim = cluster.urls[0]
        proxy = await start_proxy(_settings(sim, reconcile=False), clock=FakeClock())
        runtime, url = proxy.runtime, proxy.ws_url + "/v1/audio/speech/stream"
        await _bypass(sim, 2)
        await _wait_in_engine(sim, 2)
        for _ in range(3):
            await runtime.upstreams.scrape_once()
        # The difference is shown, and nothing else changes.
        labels = {"pool": "main", "replica": "gpu0"}
        assert proxy.metric("headroom_engine_unadmitted_streams", **labels) == 2
        assert proxy.metric("headroom_session_slots", **labels) == CAP
        sessions = [await _speak(url) for _ in range(CAP)]
        refusal = await _refused(url)
        assert "did not admit" not in refusal["message"]
        for ws in sessions:
            await ws.close()
        await wait_until(lambda: runtime.gate.active == 0)
        await _bypass(sim, 0)
