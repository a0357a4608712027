"""``WS /v1/audio/speech/stream`` over a real socket."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from proxy.sim.audio import synthesize
from proxy.sim.cluster import Cluster

PCM_STREAM = {"type": "session.config", "response_format": "pcm", "stream_audio": True}


def url(cluster: Cluster) -> str:
    return cluster.ws_urls[0] + "/v1/audio/speech/stream"


async def send(ws: ClientConnection, **message: Any) -> None:
    await ws.send(json.dumps(message))


async def until(ws: ClientConnection, kind: str) -> list[str | bytes]:
    """Every frame up to and including the first JSON event of type ``kind``."""
    frames: list[str | bytes] = []
    while True:
        frame = await ws.recv()
        frames.append(frame)
        if isinstance(frame, str) and json.loads(frame)["type"] == kind:
            return frames


async def drain(ws: ClientConnection) -> None:
    while True:
        await ws.recv()


async def closed_without_close_frame(ws: ClientConnection) -> bool:
    with pytest.raises(ConnectionClosed) as info:
        await drain(ws)
    return info.value.rcvd is None


async def test_streaming_utterances_on_one_connection(tts: Cluster) -> None:
    async with connect(url(tts), compression=None) as ws:
        await ws.send(json.dumps(PCM_STREAM | {"voice": "aiden"}))
        for index, text in enumerate(["Good morning to you.", "And a second one."]):
            await send(ws, type="input.text", text=text)
            await send(ws, type="input.done")
            frames = await until(ws, "session.done")
            events = [json.loads(f) for f in frames if isinstance(f, str)]
            audio = b"".join(f for f in frames if isinstance(f, bytes))
            assert [e["type"] for e in events] == ["audio.start", "audio.done", "session.done"]
            start, done, session = events
            assert start["utterance_index"] == index
            assert start["sentence_index"] == 0
            assert start["sentence_text"] == text
            assert start["format"] == "pcm"
            assert start["sample_rate"] == 24000
            assert start["channels"] == 1
            assert sum(isinstance(f, bytes) for f in frames) >= 2  # chunked as generated
            assert audio == synthesize(text, 24000, "aiden")
            assert done["total_bytes"] == len(audio)
            assert done["error"] is False
            assert session == {
                "type": "session.done",
                "utterance_index": index,
                "total_sentences": 1,
            }
        await send(ws, type="session.close")
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
        assert info.value.rcvd is not None
        assert info.value.rcvd.code == 1000


async def test_non_streaming_sentence_is_one_wav_frame(tts: Cluster) -> None:
    async with connect(url(tts), compression=None) as ws:
        await send(ws, type="session.config")  # defaults: wav, stream_audio false
        await send(ws, type="input.text", text="Just one frame.")
        await send(ws, type="input.done")
        frames = await until(ws, "session.done")
    binary = [f for f in frames if isinstance(f, bytes)]
    assert len(binary) == 1
    assert binary[0][:4] == b"RIFF"
    assert binary[0][44:] == synthesize("Just one frame.", 24000)
    assert json.loads(frames[0])["format"] == "wav"


async def test_sentence_splitting_sends_each_sentence(tts: Cluster) -> None:
    async with connect(url(tts), compression=None) as ws:
        await ws.send(json.dumps(PCM_STREAM | {"split_granularity": "sentence"}))
        await send(ws, type="input.text", text="First sentence. Second")
        first = await until(ws, "audio.done")  # generated before input.done
        await send(ws, type="input.text", text=" sentence!")
        await send(ws, type="input.done")
        rest = await until(ws, "session.done")
    starts = [json.loads(f) for f in first + rest if isinstance(f, str)]
    starts = [e for e in starts if e["type"] in ("audio.start", "session.done")]
    assert [(e["type"], e.get("sentence_index"), e.get("sentence_text")) for e in starts] == [
        ("audio.start", 0, "First sentence."),
        ("audio.start", 1, "Second sentence!"),
        ("session.done", None, None),
    ]
    assert starts[-1]["total_sentences"] == 2


@pytest.mark.parametrize(
    ("first", "message"),
    [
        ('{"type": "input.text", "text": "hi"}', "Expected session.config, got: input.text"),
        ("{not json", "Invalid JSON message"),
        ("[1, 2]", "WebSocket messages must be JSON objects"),
        (
            '{"type": "session.config", "response_format": "wav", "stream_audio": true}',
            "Invalid session config: WebSocket streaming audio",
        ),
        ('{"type": "session.config", "model": "other"}', "The model `other` does not exist."),
    ],
)
async def test_a_bad_first_message_ends_the_session(tts: Cluster, first: str, message: str) -> None:
    async with connect(url(tts), compression=None) as ws:
        await ws.send(first)
        error = json.loads(await ws.recv())
        assert error["type"] == "error"
        assert error["message"].startswith(message)
        # As vLLM-Omni: the handler returns, the server drops TCP without a close frame.
        assert await closed_without_close_frame(ws)


async def test_errors_after_config_keep_the_session(tts: Cluster) -> None:
    async with connect(url(tts), compression=None) as ws:
        await ws.send(json.dumps(PCM_STREAM))
        await ws.send("{oops")
        await send(ws, type="input.txt", text="typo")
        await send(ws, type="input.text", text=123)
        await send(ws, type="input.text", text="x" * (128 * 1024 + 1))
        await ws.send(b"\x00\x01")
        messages = [json.loads(await ws.recv())["message"] for _ in range(5)]
        assert messages == [
            "Invalid JSON message",
            "Unknown message type: input.txt",
            "input.text requires a string value",
            "input.text message too large",
            "Binary frames are not supported; send JSON text messages",
        ]
        await send(ws, type="input.text", text="Still here.")
        await send(ws, type="session.config", response_format="pcm")
        error = json.loads(await ws.recv())
        assert "utterance is in progress" in error["message"]
        await send(ws, type="input.done")
        frames = await until(ws, "session.done")
        assert b"".join(f for f in frames if isinstance(f, bytes)) == synthesize(
            "Still here.", 24000
        )


async def test_config_may_be_large_but_not_over_4_mib(tts: Cluster) -> None:
    async with connect(url(tts), compression=None, max_size=None) as ws:
        big_ref = "A" * (3 * 1024 * 1024)
        await ws.send(json.dumps(PCM_STREAM | {"ref_audio": big_ref}))
        await send(ws, type="input.text", text="Cloned.")
        await send(ws, type="input.done")
        assert isinstance((await until(ws, "session.done"))[-1], str)
        await ws.send(json.dumps(PCM_STREAM | {"ref_audio": "A" * (4 * 1024 * 1024)}))
        assert json.loads(await ws.recv())["message"] == "WebSocket message too large"


async def test_config_timeout(tts_quick: Cluster) -> None:
    async with connect(url(tts_quick), compression=None) as ws:
        error = json.loads(await ws.recv())  # nothing sent: the 0.3 s test limit expires
        assert error == {"type": "error", "message": "Timeout waiting for session.config"}
        assert await closed_without_close_frame(ws)


async def test_idle_timeout(tts_quick: Cluster) -> None:
    async with connect(url(tts_quick), compression=None) as ws:
        await ws.send(json.dumps(PCM_STREAM))
        error = json.loads(await ws.recv())
        assert error == {"type": "error", "message": "Idle timeout: no message received"}
        assert await closed_without_close_frame(ws)


async def test_speech_ws_on_an_asr_gpu_says_so(asr: Cluster) -> None:
    async with connect(url(asr), compression=None) as ws:
        error = json.loads(await ws.recv())
        assert "needs a TTS preset" in error["message"]


async def engine_idle(cluster: Cluster) -> bool:
    """Wait (bounded) for the GPU's engine to have nothing running or waiting."""
    engine = cluster.gpus[0].engine
    for _ in range(300):
        stats = engine.stats()
        if stats.running == stats.waiting == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_client_leaving_mid_stream_frees_the_engine_slot(tts: Cluster) -> None:
    text = " ".join(["A long sentence that keeps the engine busy for a while."] * 8)
    async with connect(url(tts), compression=None) as ws:
        await ws.send(json.dumps(PCM_STREAM))
        await send(ws, type="input.text", text=text)
        await send(ws, type="input.done")
        await ws.recv()  # audio.start
        assert isinstance(await ws.recv(), bytes)
        assert tts.gpus[0].engine.stats().running == 1
    assert await engine_idle(tts)
    async with (
        httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client,
        client.stream("POST", "/v1/audio/speech", json={"input": text, "stream": True}) as r,
    ):
        async for _ in r.aiter_lines():
            break
        assert tts.gpus[0].engine.stats().running == 1
    assert await engine_idle(tts)
