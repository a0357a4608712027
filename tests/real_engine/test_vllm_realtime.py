"""vLLM itself behind Headroom: realtime ASR on ``/v1/realtime`` (a WebSocket) through a
``vllm-realtime`` route, against vLLM's CPU build serving a tiny random-weight
Qwen3-ASR (``Qwen3ASRRealtimeGeneration``; ``python -m bench.vllm_engine`` installs and
builds both; .ci/run runs it first).

The client is a ``websockets`` client following vLLM's realtime example
(``examples/online_serving/openai_realtime_client.py`` in vLLM's repository) and its
events: ``session.created``, ``session.update``, the audio as
``input_audio_buffer.append`` events of 4 KiB of PCM16, ``input_audio_buffer.commit``
(vLLM starts transcribing), ``input_audio_buffer.commit`` with ``final: true``, then
``transcription.delta`` events up to ``transcription.done``. The audio is sent before the
first commit (the example sends it after): vLLM queues it, so the transcription starts
with all of it in hand whatever the relay's timing, and both sides get the same input.

One server serves the whole module. What the client receives through Headroom equals
what it receives straight from vLLM (every event in order, payloads without the
session's id and creation time, the close code); Headroom's meter saw the final
transcript; at the cap a newcomer is refused in the route's shape (503 with Retry-After
and the reason at the handshake, or the error event and close 1013 with ``refusal:
close``) and vLLM never works for it.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import websockets
from websockets.exceptions import InvalidStatus

from bench.vllm_engine import VllmServer, ensure_model, vllm_server
from tests.real_engine.test_vllm_transcription import wav
from tests.real_engine.vllm_support import gateway, metric_value, need_vllm, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm_realtime"),
    pytest.mark.asyncio(loop_scope="module"),
]

PCM = wav(3.0)[44:]  # the WAV's PCM16 samples, without its 44-byte header
FINALS = "headroom_asr_finalize_seconds_count"
#: Each event is read within this (a tiny model answers in well under a second).
EVENT_S = 120.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm() -> AsyncIterator[VllmServer]:
    engine = need_vllm()
    model = await asyncio.to_thread(ensure_model, engine, "qwen3asr")
    async with vllm_server(engine, model, name="asr", max_num_seqs=4,
                           max_model_len=4096) as server:  # fmt: skip
        yield server


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://", 1) + "/v1/realtime"


async def send_audio(ws: Any) -> None:
    """The audio, then the commit that starts the transcription and the final one."""
    for i in range(0, len(PCM), 4096):
        chunk = base64.b64encode(PCM[i : i + 4096]).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))


async def read_to_done(ws: Any) -> list[dict[str, Any]]:
    events = []
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), EVENT_S))
        events.append(event)
        if event["type"] in ("transcription.done", "error"):
            return events


async def open_session(ws: Any) -> dict[str, Any]:
    created = json.loads(await asyncio.wait_for(ws.recv(), EVENT_S))
    await ws.send(json.dumps({"type": "session.update", "model": "asr"}))
    return dict(created)


async def transcribe(url: str) -> tuple[list[dict[str, Any]], int | None]:
    """One realtime session: its events (without the session's id and creation time) and
    the close code."""
    async with websockets.connect(ws_url(url)) as ws:
        created = await open_session(ws)
        await send_audio(ws)
        events = [created, *await read_to_done(ws)]
    for event in events:
        event.pop("id", None)
        event.pop("created", None)
    return events, ws.close_code


async def test_session_through_headroom_equals_direct_and_the_final_is_metered(
    vllm: VllmServer,
) -> None:
    direct, direct_close = await transcribe(vllm.url)
    routes = [{"path": "/v1/realtime", "protocol": "vllm-realtime"}]
    async with gateway(vllm, routes, cap=2) as url:
        before = await metric_value(url, FINALS)
        relayed, relayed_close = await transcribe(url)
        finals = await wait_for(lambda: metric_value(url, FINALS), lambda v: v >= before + 1)
    assert relayed[0]["type"] == "session.created"
    assert relayed[-1]["type"] == "transcription.done", relayed[-1]
    assert any(e["type"] == "transcription.delta" for e in relayed)
    # vLLM merges deltas it sends late into one event, so the grouping differs run to
    # run; the session says the same through Headroom as direct: its first event, its
    # text, its final event and the kinds of event in it.
    assert said(relayed) == said(direct)
    assert relayed_close == direct_close == 1000
    assert finals == before + 1


def said(events: list[dict[str, Any]]) -> tuple[object, ...]:
    """What a transcription session says, apart from how its deltas are grouped."""
    deltas = "".join(e["delta"] for e in events if e["type"] == "transcription.delta")
    return events[0], deltas, events[-1], sorted({e["type"] for e in events})


async def engine_counts(url: str) -> tuple[float, float]:
    """vLLM's counts of requests finished and prompt tokens taken."""
    return (await metric_value(url, "vllm:request_success_total"),
            await metric_value(url, "vllm:prompt_tokens_total"))  # fmt: skip


async def engine_idle(url: str) -> float:
    running = await metric_value(url, "vllm:num_requests_running")
    return running + await metric_value(url, "vllm:num_requests_waiting")


@pytest.mark.parametrize("refusal", ["http", "close"])
async def test_a_newcomer_at_the_cap_is_refused_in_the_route_shape_and_vllm_never_works_for_it(
    vllm: VllmServer, refusal: str
) -> None:
    # What one session makes vLLM count, sent direct.
    before = await engine_counts(vllm.url)
    await transcribe(vllm.url)
    assert await wait_for(lambda: engine_idle(vllm.url), lambda v: v == 0) == 0
    after = await engine_counts(vllm.url)
    alone = tuple(a - b for a, b in zip(after, before, strict=True))
    routes = [{"path": "/v1/realtime", "protocol": "vllm-realtime", "refusal": refusal}]
    async with gateway(vllm, routes, cap=1) as url, websockets.connect(ws_url(url)) as held:
        await open_session(held)  # admitted, relayed, holding the only slot
        if refusal == "http":
            with pytest.raises(InvalidStatus) as refused:
                async with websockets.connect(ws_url(url)):
                    pass
            response = refused.value.response
            assert response.status_code == 503
            assert int(response.headers["Retry-After"]) >= 1
            assert response.headers["X-Headroom-Reason"]
        else:
            async with websockets.connect(ws_url(url)) as newcomer:
                event = json.loads(await asyncio.wait_for(newcomer.recv(), EVENT_S))
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(newcomer.recv(), EVENT_S)
            assert event["type"] == "error", event
            assert newcomer.close_code == 1013
        await send_audio(held)
        events = await read_to_done(held)
        assert events[-1]["type"] == "transcription.done", events[-1]
    # Once nothing runs or waits at vLLM, it has counted the held session's work alone.
    assert await wait_for(lambda: engine_idle(vllm.url), lambda v: v == 0) == 0
    counts = await engine_counts(vllm.url)
    assert tuple(c - a for c, a in zip(counts, after, strict=True)) == alone
