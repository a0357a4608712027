"""``/metrics`` (vLLM names), ``/health``, ``/v1/models``, ``/sim/stats``."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
from websockets.asyncio.client import connect

from proxy.sim import running_cluster
from proxy.sim.cluster import Cluster
from tests.sim.conftest import FAST_TTS

LONG_TEXT = " ".join(["This sentence keeps the engine busy for a while."] * 2)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not exposed"
    return float(match.group(1))


async def test_metrics_follow_a_live_stream(tts: Cluster) -> None:
    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        idle = (await client.get("/metrics")).text
        assert metric(idle, "vllm:num_requests_running") == 0
        assert metric(idle, "vllm:websocket_connections_active") == 0
        async with connect(tts.ws_urls[0] + "/v1/audio/speech/stream", compression=None) as ws:
            config = {"type": "session.config", "response_format": "pcm", "stream_audio": True}
            await ws.send(json.dumps(config))
            await ws.send(json.dumps({"type": "input.text", "text": LONG_TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            assert json.loads(await ws.recv())["type"] == "audio.start"
            assert isinstance(await ws.recv(), bytes)
            busy = (await client.get("/metrics")).text
            while "session.done" not in str(await ws.recv()):
                pass
        assert metric(busy, "vllm:num_requests_running") == 1
        assert metric(busy, "vllm:num_requests_waiting") == 0
        assert 0 < metric(busy, "vllm:kv_cache_usage_perc") < 0.01
        assert metric(busy, "vllm:websocket_connections_active") == 1
        after = (await client.get("/metrics")).text
        assert metric(after, "vllm:num_requests_running") == 0
        assert metric(after, "vllm:time_to_first_token_seconds_count") == 1
        assert metric(after, "vllm:inter_token_latency_seconds_count") > 30
        assert metric(after, "vllm:e2e_request_latency_seconds_count") == 1
        assert metric(after, "vllm:generation_tokens_total") > 30
        assert metric(after, "vllm:websocket_connections_total") == 1
        assert "vllm:request_queue_time_seconds_bucket" in after
        assert 'model_name="mistralai/Voxtral-4B-TTS"' in after


async def test_waiting_requests_are_visible_when_the_batch_is_full() -> None:
    preset = FAST_TTS.with_overrides(max_num_seqs=1)
    async with (
        running_cluster(preset) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0], timeout=30) as client,
    ):
        body = {"input": LONG_TEXT, "response_format": "pcm", "stream": True}
        first = asyncio.create_task(client.post("/v1/audio/speech", json=body))
        second = asyncio.create_task(client.post("/v1/audio/speech", json=body))
        for _ in range(500):
            stats = (await client.get("/sim/stats")).json()
            if stats["waiting"]:
                break
            await asyncio.sleep(0.01)
        text = (await client.get("/metrics")).text
        await asyncio.gather(first, second)
    assert stats["running"] == 1
    assert stats["waiting"] == 1
    assert metric(text, "vllm:num_requests_waiting") == 1


async def test_health_models_and_stats(tts: Cluster) -> None:
    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        health = await client.get("/health")
        models = (await client.get("/v1/models")).json()
        stats = (await client.get("/sim/stats")).json()
        missing = await client.get("/sim/stats", params={"gpu": 7})
    assert health.status_code == 200
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["mistralai/Voxtral-4B-TTS"]
    assert stats["preset"] == "test-fast-tts"
    assert stats["url"] == tts.urls[0]
    assert stats["listening"] is True
    assert stats["faults"]["handshake_503"] is False
    assert missing.status_code == 404


async def test_cluster_urls_ports_and_engines() -> None:
    async with running_cluster(FAST_TTS, gpus=3) as cluster:
        ports = [int(url.rsplit(":", 1)[1]) for url in cluster.urls]
        assert len(set(ports)) == 3
        assert cluster.ws_urls[0] == "ws" + cluster.urls[0][4:]
        assert len(cluster.engines) == 3
        assert "x3" in repr(cluster)
        async with httpx.AsyncClient(timeout=30) as client:
            for url in cluster.urls:
                assert (await client.get(url + "/health")).status_code == 200


async def test_bypass_streams_run_in_the_engine_until_set_lower(tts: Cluster) -> None:
    async def in_engine(client: httpx.AsyncClient) -> int:
        text = (await client.get("/metrics")).text
        running = metric(text, "vllm:num_requests_running")
        return round(running + metric(text, "vllm:num_requests_waiting"))

    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        assert (await client.get("/sim/bypass")).json()["streams"] == 0
        answer = (await client.post("/sim/bypass", json={"streams": 3, "audio_s": 300})).json()
        assert answer == {"streams": 3, "audio_s": 300.0}
        for _ in range(500):  # the streams enter the engine on its next step
            if await in_engine(client) == 3:
                break
            await asyncio.sleep(0.01)
        assert await in_engine(client) == 3
        assert (await client.get("/sim/stats")).json()["bypass_streams"] == 3
        assert (await client.post("/sim/bypass", json={"streams": 1})).json()["streams"] == 1
        assert await in_engine(client) == 1  # the ended streams left the engine at once
        for bad in ({"streams": -1}, {"streams": "2"}, {"streams": 1, "audio_s": 0},
                    {"streams": 1, "other": 1}, [1]):  # fmt: skip
            response = await client.post("/sim/bypass", json=bad)
            assert response.status_code == 400, bad
        too_big = await client.post("/sim/bypass", content=b"{" + b" " * 5000 + b"}")
        assert too_big.status_code == 413
        assert (await client.delete("/sim/bypass")).json()["streams"] == 0
        assert await in_engine(client) == 0
