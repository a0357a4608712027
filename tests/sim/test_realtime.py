"""``WS /v1/realtime`` over a real socket: ASR, errors, omni audio-out."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from proxy.sim.audio import synthesize
from proxy.sim.cluster import Cluster
from tests.sim.helpers import b64

ASR_MODEL = "mistralai/Voxtral-Mini-4B-Realtime-2602"
SPEECH_16K = synthesize("Please check the status of my order for today.", 16000)


async def send(ws: ClientConnection, **event: Any) -> None:
    await ws.send(json.dumps(event))


async def events_until(ws: ClientConnection, kind: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while True:
        event = json.loads(await ws.recv())
        out.append(event)
        if event["type"] == kind:
            return out


async def stream_audio(ws: ClientConnection, pcm: bytes, piece: int = 6400) -> None:
    """Append 200 ms pieces (faster than realtime; the engine still gates on them)."""
    for i in range(0, len(pcm), piece):
        await send(ws, type="input_audio_buffer.append", audio=b64(pcm[i : i + piece]))
        await asyncio.sleep(0.01)


async def test_transcription_session(asr: Cluster) -> None:
    async with connect(asr.ws_urls[0] + "/v1/realtime", compression=None) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created"
        assert created["id"].startswith("sess-")
        assert isinstance(created["created"], int)
        await send(ws, type="session.update", model=ASR_MODEL)
        await send(ws, type="input_audio_buffer.commit")
        await stream_audio(ws, SPEECH_16K)
        await send(ws, type="input_audio_buffer.commit", final=True)
        events = await events_until(ws, "transcription.done")
    deltas = [e["delta"] for e in events if e["type"] == "transcription.delta"]
    done = events[-1]
    assert len(deltas) >= 3
    assert "".join(deltas) == done["text"]
    assert len(done["text"].split()) >= 3
    tokens = len(SPEECH_16K) // 2 // 1280  # one token per 80 ms of audio
    assert done["usage"]["completion_tokens"] == tokens
    assert done["usage"]["total_tokens"] == done["usage"]["prompt_tokens"] + tokens


async def test_a_second_utterance_on_the_same_session(asr: Cluster) -> None:
    async with connect(asr.ws_urls[0] + "/v1/realtime", compression=None) as ws:
        await ws.recv()
        await send(ws, type="session.update", model=ASR_MODEL)
        texts = []
        for _ in range(2):
            await stream_audio(ws, SPEECH_16K[:32000])
            await send(ws, type="input_audio_buffer.commit", final=True)
            texts.append((await events_until(ws, "transcription.done"))[-1]["usage"])
        assert texts[0]["completion_tokens"] == texts[1]["completion_tokens"] == 12


@pytest.mark.parametrize(
    ("events", "code"),
    [
        (["{not json"], "invalid_json"),
        ([{"type": "response.create"}], "unknown_event"),
        ([{"type": "input_audio_buffer.commit"}], "model_not_validated"),
        ([{"type": "input_audio_buffer.append", "audio": "%%%"}], "invalid_audio"),
        ([{"type": "input_audio_buffer.append", "audio": ""}], "invalid_audio"),
        ([{"type": "input_audio_buffer.append"}], "invalid_event"),
        ([{"type": "session.update", "model": "nope"}], "model_not_found"),
        (
            [{"type": "session.update"}, {"type": "input_audio_buffer.commit", "final": "yes"}],
            "invalid_event",
        ),
    ],
)
async def test_errors_use_the_vllm_shape(
    asr: Cluster, events: list[str | dict[str, Any]], code: str
) -> None:
    async with connect(asr.ws_urls[0] + "/v1/realtime", compression=None) as ws:
        await ws.recv()
        for event in events:
            await ws.send(event if isinstance(event, str) else json.dumps(event))
        error = json.loads(await ws.recv())
        assert set(error) == {"type", "error", "code"}
        assert error["type"] == "error"
        assert error["code"] == code
        assert isinstance(error["error"], str)
        # The session survives a bad event.
        await send(ws, type="bogus")
        assert json.loads(await ws.recv())["code"] == "unknown_event"


async def test_binary_frames_end_the_session(asr: Cluster) -> None:
    async with connect(asr.ws_urls[0] + "/v1/realtime", compression=None) as ws:
        await ws.recv()
        await ws.send(SPEECH_16K[:3200])
        error = json.loads(await ws.recv())
        assert error["code"] == "invalid_event"
        with pytest.raises(ConnectionClosed):
            await ws.recv()


async def test_omni_audio_out_on_a_tts_gpu(tts: Cluster) -> None:
    async with connect(tts.ws_urls[0] + "/v1/realtime", compression=None) as ws:
        await ws.recv()
        await send(ws, type="session.update")
        await send(ws, type="input_audio_buffer.commit")
        await stream_audio(ws, SPEECH_16K[:48000])  # 1.5 s in
        await send(ws, type="input_audio_buffer.commit", final=True)
        events = await events_until(ws, "response.audio.done")
    audio_events = [e for e in events if e["type"] == "response.audio.delta"]
    assert len(audio_events) >= 3
    assert all(e["format"] == "pcm16" and e["sample_rate_hz"] == 24000 for e in audio_events)
    audio = b"".join(base64.b64decode(e["audio"]) for e in audio_events)
    # As much speech out as came in: one codec token (80 ms) per whole 80 ms of input.
    assert len(audio) == int(1.5 * 12.5) * 1920 * 2
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["transcription.done", "response.audio.done"]
    assert events[-1]["has_audio"] is True
