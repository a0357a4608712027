"""Gang reservations through a real gateway (issue 19): config/voice-agent.yaml with its
replicas at a real upstream; ASR over a WebSocket route, TTS over an HTTP route."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.process.gateway import Gateway
from tests.integration.test_operations import running_gateway
from tests.integration.test_pipelines import voice_agent_config
from tests.integration.test_ws_relay import hello, upstream, wait_until

__all__ = ["upstream"]

RESERVE = "/v1/headroom/reservations"


def config(url: str) -> dict[str, Any]:
    data = voice_agent_config(url)  # ASR 4 slots a GPU, TTS 1 (2 GPUs each), no queue
    data["routes"] = [
        {"path": "/asr", "pool": "asr-main", "protocol": "passthrough-ws",
         "upstream_path": "/ws/echo"},
        {"path": "/tts", "pool": "tts-main", "protocol": "passthrough-http",
         "upstream_path": "/speak"},
    ]  # fmt: skip
    return data


async def reserve(client: httpx.AsyncClient, gateway: Gateway, **body: Any) -> httpx.Response:
    return await client.post(f"http://127.0.0.1:{gateway.port}{RESERVE}", json=body)


async def test_a_reservation_admits_asr_over_ws_and_tts_over_http(
    upstream: Any, tmp_path: Path
) -> None:
    server, _ = upstream
    path = tmp_path / "voice-agent.yaml"
    path.write_text(yaml.safe_dump(config(server.http_url)))
    async with running_gateway(path) as gateway, httpx.AsyncClient() as client:
        base = f"127.0.0.1:{gateway.port}"
        gate = gateway.runtime.gate
        granted = [await reserve(client, gateway, pools=["asr-main", "tts-main"], hold_s=5)
                   for _ in range(2)]  # fmt: skip
        assert [r.status_code for r in granted] == [201, 201]
        tokens = [r.json()["token"] for r in granted]
        assert granted[0].headers["location"] == f"{RESERVE}/{tokens[0]}"
        # The TTS stage is full (2 of 2, both reserved): a third call is told at once,
        # naming the stage, holding nothing.
        refused = await reserve(client, gateway, pools=["asr-main", "tts-main"], hold_s=5)
        assert refused.status_code == 503
        assert refused.headers["x-headroom-reason"] == "pool_full"
        assert refused.headers["x-headroom-stage"] == "tts-main"
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["stage"] == "tts-main" and error["code"] == "pool_full"
        assert gate.active == 4  # 2 ASR + 2 TTS, all reserved
        # Without a token TTS refuses; with one it uses the reserved slot.
        plain = await client.post(f"http://{base}/tts", content=b"hi")
        assert plain.status_code == 503
        # ASR over a WebSocket (header), TTS over HTTP (query parameter): both stripped.
        header = {"X-Headroom-Reservation": tokens[0]}
        async with connect(f"ws://{base}/asr?lang=en", compression=None,
                           additional_headers=header) as asr:  # fmt: skip
            seen = await hello(asr)
            assert "x-headroom-reservation" not in seen["headers"]
            assert seen["query"] == "lang=en"
            assert gate.active == 4  # the reserved slot, not a new one
            tts = await client.post(f"http://{base}/tts?headroom_reservation={tokens[0]}&v=1",
                                    content=b"hello")  # fmt: skip
            assert tts.status_code == 200
            echoed = tts.json()
            assert echoed["query"] == "v=1" and "headroom_reservation" not in echoed["query"]
            # The HTTP stage connection ended: its slot is free; ASR still holds its own.
            await wait_until(lambda: gate.active == 3)
            # A slot is used once: the same token again is refused, not admitted.
            again = await client.post(f"http://{base}/tts",
                                      headers={"X-Headroom-Reservation": tokens[0]})  # fmt: skip
            assert again.status_code == 409
            assert again.json()["error"]["code"] == "reservation_expired"
            with pytest.raises(InvalidStatus) as info:
                await connect(f"ws://{base}/asr", compression=None,
                              additional_headers={"X-Headroom-Reservation": "bogus"})  # fmt: skip
            assert info.value.response.status_code == 409
            assert json.loads(info.value.response.body)["error"]["code"] == "reservation_unknown"
            # The second call gives up: DELETE releases both of its unused slots.
            gone = await client.delete(f"http://{base}{RESERVE}/{tokens[1]}")
            assert gone.status_code == 200 and gone.json()["released"] == ["asr-main", "tts-main"]
            assert gate.active == 1
        await wait_until(lambda: gate.active == 0)  # the ASR connection ended
        missing = await client.delete(f"http://{base}{RESERVE}/never-issued")
        assert missing.status_code == 404
        bad = await reserve(client, gateway, pools=["asr-main", "nope"])
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_reservation"
        text = (await client.get(f"http://127.0.0.1:{gateway.admin_port}/metrics")).text
        assert 'headroom_reservations_total{outcome="granted"} 2.0' in text
        assert 'headroom_reservation_refusals_total{pool="tts-main",reason="pool_full"} 1.0' in text
        assert 'headroom_reservation_slots_total{outcome="used",pool="asr-main"} 1.0' in text
