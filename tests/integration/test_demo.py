"""``headroom demo``: the banner lists exactly the routes the demo gateway serves."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import re
import wave

import httpx
import pytest
from websockets.asyncio.client import connect

from proxy.demo import _banner, _run, add_arguments, demo_settings
from proxy.sim.presets import PRESETS, get_preset
from tests.integration.test_ws_relay import wait_until

ASR = next(name for name, preset in PRESETS.items() if preset.kind == "asr")
TTS = next(name for name, preset in PRESETS.items() if preset.kind == "tts")
ROUTE_LINE = re.compile(r"^  ((?:ws|http)://\S+)\s+(WebSocket|POST), (\S+)$", re.MULTILINE)


@pytest.mark.parametrize("name", [ASR, TTS])
def test_banner_lists_every_route_of_the_demo_settings(name: str) -> None:
    preset = get_preset(name)
    settings = demo_settings(
        preset, ["http://127.0.0.1:1"], 4, host="127.0.0.1", port=8080, queue_depth=8,
        queue_wait=10,
    )  # fmt: skip
    banner = _banner(preset, 4, 4, settings, "http://127.0.0.1:8080", ["http://127.0.0.1:1"])
    listed = [(url, how, protocol) for url, how, protocol in ROUTE_LINE.findall(banner)]
    expected = [
        (
            ("ws://127.0.0.1:8080" if r.is_websocket else "http://127.0.0.1:8080") + r.path,
            "WebSocket" if r.is_websocket else "POST",
            r.protocol,
        )
        for r in settings.routes
    ]
    assert listed == expected
    if preset.kind == "asr":
        assert "http://127.0.0.1:8080/v1/audio/transcriptions" in banner
        assert "curl -sN http://127.0.0.1:8080/v1/audio/transcriptions -F file=@" in banner


def _wav(seconds: float = 0.3, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"\0\0" * int(seconds * rate))
    return buffer.getvalue()


async def test_every_route_the_asr_demo_banner_lists_is_served() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--preset", ASR, "--gpus", "1", "--port", "0"])
    out = io.StringIO()
    demo = asyncio.ensure_future(_run(args, out))
    try:
        await wait_until(lambda: "Ctrl-C" in out.getvalue() or demo.done(), timeout=60)
        assert not demo.done(), out.getvalue()
        routes = ROUTE_LINE.findall(out.getvalue())
        assert {url.rsplit("/v1", 1)[1] for url, _, _ in routes} == {
            "/realtime",
            "/audio/transcriptions",
        }
        model = get_preset(ASR).model
        async with httpx.AsyncClient(timeout=30) as client:
            for url, how, _ in routes:
                if how == "WebSocket":
                    async with connect(url, compression=None) as ws:
                        assert ws.response is not None and ws.response.status_code == 101
                    continue
                response = await client.post(
                    url,
                    files={"file": ("speech.wav", _wav(), "audio/wav")},
                    data={"model": model, "stream": "true"},
                )
                assert response.status_code == 200, response.text
                assert response.headers["content-type"].startswith("text/event-stream")
                assert "[DONE]" in response.text
    finally:
        demo.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await demo
