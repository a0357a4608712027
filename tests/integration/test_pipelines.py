"""A pipeline's limiting stage through a real gateway (issue 19): config/voice-agent.yaml
with its replicas pointed at a real upstream, sessions opened through the client listener,
the figures read from the admin listener's /metrics and /admin/status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from proxy.process.gateway import Gateway
from tests.integration.test_operations import running_gateway
from tests.integration.test_ws_relay import hello, upstream, wait_until

__all__ = ["upstream"]

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "voice-agent.yaml"


def voice_agent_config(url: str) -> dict[str, Any]:
    """The shipped example, on loopback ports 0, every replica at ``url``; ASR 4 slots a
    GPU, TTS 1, so two TTS sessions fill the TTS stage."""
    data: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    data["listen"] = {"host": "127.0.0.1", "port": 0}
    data["admin"] = {"host": "127.0.0.1", "port": 0}
    caps = {"asr-main": 4, "tts-main": 1}
    for pool in data["pools"]:
        for replica in pool["replicas"]:
            replica.update(url=url, max_sessions=caps[pool["name"]])
        pool["queue"] = {"max_depth": 0, "max_wait_s": 5}
    data["routes"] = [
        {"path": f"/{stage}", "pool": stage, "protocol": "passthrough-ws",
         "upstream_path": "/ws/echo"}
        for stage in ("asr-main", "tts-main")
    ]  # fmt: skip
    return data


async def scrape(gateway: Gateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{gateway.admin_port}/metrics")).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(("headroom_pool_", "headroom_pipeline_"))
    }


def limiting_from_metrics(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> str:
    stages = [
        dict(labels)["pool"]
        for (name, labels), value in samples.items()
        if name == "headroom_pipeline_limiting_stage" and value == 1
    ]
    assert len(stages) == 1, samples
    return stages[0]


async def status(gateway: Gateway) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{gateway.admin_port}/admin/status")
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


async def open_stage(gateway: Gateway, stage: str) -> ClientConnection:
    client = await connect(f"ws://127.0.0.1:{gateway.port}/{stage}", compression=None)
    await hello(client)
    return client


async def test_the_limiting_stage_flips_when_the_tts_pool_fills(
    upstream: Any, tmp_path: Path
) -> None:
    server, _ = upstream
    path = tmp_path / "voice-agent.yaml"
    path.write_text(yaml.safe_dump(voice_agent_config(server.http_url)))
    async with running_gateway(path) as gateway:
        sessions: list[ClientConnection] = []
        try:
            # Six calls' ASR sessions: 2 of 8 ASR slots left (0.25); TTS untouched (1.0).
            sessions += [await open_stage(gateway, "asr-main") for _ in range(6)]
            samples = await scrape(gateway)
            assert limiting_from_metrics(samples) == "asr-main"
            assert samples[("headroom_pool_slots_free", (("pool", "asr-main"),))] == 2
            assert samples[("headroom_pool_slots_usable", (("pool", "asr-main"),))] == 8
            assert samples[("headroom_pool_headroom_left_ratio", (("pool", "tts-main"),))] == 1
            body = await status(gateway)
            agent = body["pipelines"]["voice-agent"]
            assert agent["limiting_stage"] == "asr-main" and agent["left"] == 0.25
            assert [s["pool"] for s in agent["stages"]] == ["asr-main", "tts-main"]
            assert body["pools"]["asr-main"]["headroom"]["slots_free"] == 2

            # The TTS stage fills (2 of 2): it limits the pipeline now, with nothing left.
            sessions += [await open_stage(gateway, "tts-main") for _ in range(2)]
            with pytest.raises(InvalidStatus):
                await connect(f"ws://127.0.0.1:{gateway.port}/tts-main", compression=None)
            samples = await scrape(gateway)
            assert limiting_from_metrics(samples) == "tts-main"
            key = (("pipeline", "voice-agent"), ("pool", "tts-main"))
            assert samples[("headroom_pipeline_stage_headroom_left_ratio", key)] == 0
            assert samples[("headroom_pool_slots_free", (("pool", "tts-main"),))] == 0
            body = await status(gateway)
            agent = body["pipelines"]["voice-agent"]
            assert agent["limiting_stage"] == "tts-main" and agent["left"] == 0
            tts = next(s for s in agent["stages"] if s["pool"] == "tts-main")
            assert (tts["slots_usable"], tts["slots_free"]) == (2, 0)
            assert tts["delivery_ratio_worst_1pct"] is None  # no audio through an echo

            # Both TTS sessions end: ASR is the nearer stage again.
            for client in sessions[6:]:
                await client.close()
            await wait_until(lambda: gateway.runtime.gate.active == 6)
            assert limiting_from_metrics(await scrape(gateway)) == "asr-main"
        finally:
            for client in sessions:
                await client.close()
            await wait_until(lambda: gateway.runtime.gate.active == 0)
