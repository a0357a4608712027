"""Mid-stream faults still fire when the simulator sits behind a real Headroom proxy.

Headroom appends ``X-Forwarded-For``; uvicorn's proxy-header rewrite used to turn the
sim's ``scope["client"]`` into that address, so ``drop_after_chunks`` found no
connection to abort and every soak through Headroom ended its streams cleanly.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from proxy.sim import Faults, running_cluster
from proxy.sim.audio import synthesize
from tests.conftest import proxy_settings
from tests.sim.conftest import ASR, FAST_TTS
from tests.sim.helpers import b64

#: Fail instead of hanging when a fault never fires (generous: a loaded 2-core host).
HANG_GUARD_S = 20.0
TEXT = "One, two, three, four, five, six, seven, eight, nine, ten."


def _routes() -> list[dict[str, str]]:
    return [
        {"path": "/v1/audio/speech", "pool": "main", "protocol": "openai-speech-http"},
        {"path": "/v1/audio/speech/stream", "pool": "main", "protocol": "vllm-omni-speech-ws"},
        {"path": "/v1/realtime", "pool": "main", "protocol": "vllm-realtime"},
    ]


@contextmanager
def unhandled_loop_errors() -> Iterator[list[dict[str, Any]]]:
    """Collect what the loop's exception handler sees (e.g. "Task exception was never
    retrieved", reported when such a task is garbage-collected)."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        yield seen
    finally:
        gc.collect()
        loop.set_exception_handler(previous)


async def _collect(ws: ClientConnection, into: list[str | bytes]) -> None:
    while True:
        into.append(await ws.recv())


async def _commit_again(ws: ClientConnection) -> None:
    # A hang guard, not a timing assertion: before the fix the sim kept the connection
    # and sent nothing more ...
    await asyncio.wait_for(ws.recv(), HANG_GUARD_S)
    # ... and a second commit replaced the failed generation task, whose exception
    # nobody retrieved.
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    await asyncio.wait_for(ws.recv(), HANG_GUARD_S)


async def test_http_drop_aborts_the_upstream_connection_behind_headroom(start_proxy: Any) -> None:
    async with running_cluster(FAST_TTS, faults=Faults(drop_after_chunks=2)) as cluster:
        proxy = await start_proxy(proxy_settings([("gpu0", cluster.urls[0], 2)], _routes()))
        body = {"input": TEXT, "stream_format": "audio", "response_format": "pcm"}
        received = bytearray()
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client:
            # Once Headroom aborts the client on a mid-stream failure this raises; either
            # way the audio is cut short.
            try:
                async with client.stream("POST", "/v1/audio/speech", json=body) as response:
                    assert response.status_code == 200
                    async for chunk in response.aiter_raw():
                        received += chunk
            except httpx.RemoteProtocolError:
                pass
        full = synthesize(TEXT, 24000)
        assert 0 < len(received) < len(full)
        assert full.startswith(bytes(received))
        # The sim cut TCP (not a clean, short body): Headroom saw an upstream failure.
        errors = proxy.metric(
            "headroom_upstream_errors_total", pool="main", replica="gpu0", kind="midstream"
        )
        assert errors == 1


async def test_raw_audio_error_fault_cuts_the_stream_behind_headroom(start_proxy: Any) -> None:
    async with running_cluster(FAST_TTS, faults=Faults(error_after_chunks=1)) as cluster:
        proxy = await start_proxy(proxy_settings([("gpu0", cluster.urls[0], 2)], _routes()))
        body = {"input": TEXT, "stream_format": "audio", "response_format": "pcm"}
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client:
            try:
                async with client.stream("POST", "/v1/audio/speech", json=body) as response:
                    async for _ in response.aiter_raw():
                        pass
            except httpx.RemoteProtocolError:
                pass
        errors = proxy.metric(
            "headroom_upstream_errors_total", pool="main", replica="gpu0", kind="midstream"
        )
        assert errors == 1


async def test_speech_websocket_drop_reaches_the_client_as_an_upstream_failure(
    start_proxy: Any,
) -> None:
    async with running_cluster(FAST_TTS, faults=Faults(drop_after_chunks=2)) as cluster:
        proxy = await start_proxy(proxy_settings([("gpu0", cluster.urls[0], 2)], _routes()))
        async with connect(proxy.ws_url + "/v1/audio/speech/stream") as ws:
            await ws.send(
                json.dumps(
                    {"type": "session.config", "response_format": "pcm", "stream_audio": True}
                )
            )
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            frames: list[str | bytes] = []
            with pytest.raises(ConnectionClosed) as info:
                await _collect(ws, frames)
    assert [type(f) for f in frames] == [str, bytes, bytes]
    assert info.value.rcvd is not None
    assert info.value.rcvd.code == 1014  # Headroom: the upstream failed (not a clean 1000)


async def test_realtime_drop_behind_headroom_leaves_no_unretrieved_task(start_proxy: Any) -> None:
    with unhandled_loop_errors() as loop_errors:
        async with running_cluster(ASR, faults=Faults(drop_after_chunks=1)) as cluster:
            proxy = await start_proxy(proxy_settings([("gpu0", cluster.urls[0], 2)], _routes()))
            async with connect(proxy.ws_url + "/v1/realtime") as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                await ws.send(json.dumps({"type": "session.update"}))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                pcm = synthesize(TEXT, 16000)
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm)}))
                assert json.loads(await ws.recv())["type"] == "transcription.delta"
                with pytest.raises(ConnectionClosed) as info:
                    await _commit_again(ws)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1014
            assert cluster.gpus[0].runner.open_streams == 0
    assert loop_errors == []
