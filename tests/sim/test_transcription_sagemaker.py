"""``POST /v1/audio/transcriptions`` and the SageMaker container contract."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.sim.audio import synthesize, wav_header
from proxy.sim.cluster import Cluster
from tests.sim.helpers import b64, sse_events

ASR_MODEL = "mistralai/Voxtral-Mini-4B-Realtime-2602"
PCM = synthesize("What is the weather like this morning?", 16000)
WAV = wav_header(16000, len(PCM)) + PCM


async def post(
    cluster: Cluster, data: dict[str, str], file: tuple[str, bytes, str] | None
) -> httpx.Response:
    # A multipart form either way: a file part, or a text part standing in for it.
    files: dict[str, tuple[str | None, bytes, str]] = (
        {"file": file} if file else {"language": (None, b"en", "text/plain")}
    )
    async with httpx.AsyncClient(base_url=cluster.urls[0], timeout=30) as client:
        return await client.post("/v1/audio/transcriptions", data=data, files=files)


async def test_streaming_transcription_sse(asr: Cluster) -> None:
    response = await post(
        asr,
        {"model": ASR_MODEL, "stream": "true", "stream_include_usage": "true"},
        ("clip.wav", WAV, "audio/wav"),
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert len(chunks) >= 3
    assert all(c["object"] == "transcription.chunk" and c["model"] == ASR_MODEL for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "stop"
    ]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert len(text.split()) >= 3
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == math.ceil(len(PCM) / 32000 * 12.5)


@pytest.mark.parametrize(
    ("fields", "file"),
    [({}, ("clip.wav", WAV, "audio/wav")), ({}, ("clip.pcm", PCM, "application/octet-stream"))],
)
async def test_non_streaming_json_for_wav_and_raw_pcm(
    asr: Cluster, fields: dict[str, str], file: tuple[str, bytes, str]
) -> None:
    response = await post(asr, fields, file)
    assert response.status_code == 200
    body = response.json()
    assert len(body["text"].split()) >= 3
    assert body["usage"]["seconds"] == pytest.approx(len(PCM) / 32000)


async def test_text_response_format(asr: Cluster) -> None:
    response = await post(asr, {"response_format": "text"}, ("clip.wav", WAV, "audio/wav"))
    assert response.headers["content-type"].startswith("text/plain")
    assert len(response.text.split()) >= 3


@pytest.mark.parametrize(
    ("fields", "file", "status", "fragment"),
    [
        ({}, None, 400, "'file'"),
        ({"model": "whisper"}, ("clip.wav", WAV, "audio/wav"), 404, "does not exist"),
        ({}, ("clip.mp3", b"ID3\x00\x00", "audio/mpeg"), 400, "unsupported audio format"),
        ({}, ("clip.wav", b"RIFF\x00\x00\x00\x00WAVE", "audio/wav"), 400, "fmt or data"),
        ({"response_format": "srt"}, ("clip.wav", WAV, "audio/wav"), 400, "srt"),
    ],
)
async def test_bad_uploads(
    asr: Cluster,
    fields: dict[str, str],
    file: tuple[str, bytes, str] | None,
    status: int,
    fragment: str,
) -> None:
    response = await post(asr, fields | {"prompt": "x"}, file)
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]


async def test_not_multipart_is_a_400(asr: Cluster) -> None:
    async with httpx.AsyncClient(base_url=asr.urls[0], timeout=30) as client:
        response = await client.post("/v1/audio/transcriptions", json={"file": "x"})
    assert response.status_code == 400
    assert "multipart" in response.json()["error"]["message"]


async def test_transcriptions_on_a_tts_gpu_are_not_found(tts: Cluster) -> None:
    response = await post(tts, {}, ("clip.wav", WAV, "audio/wav"))
    assert response.status_code == 404


async def test_ping(asr: Cluster) -> None:
    async with httpx.AsyncClient(base_url=asr.urls[0], timeout=30) as client:
        response = await client.get("/ping")
    assert response.status_code == 200


async def test_bidirectional_stream_runs_the_path_from_the_header(tts: Cluster) -> None:
    url = tts.ws_urls[0] + "/invocations-bidirectional-stream"
    headers = {"X-Amzn-SageMaker-Model-Invocation-Path": "v1/realtime"}
    async with connect(url, compression=None, additional_headers=headers) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        # SageMaker BINARY parts arrive as binary frames; the bridge reads them as text.
        await ws.send(json.dumps({"type": "session.update"}).encode())
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(PCM[:16000])}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}).encode())
        kinds = []
        while "response.audio.done" not in kinds:
            kinds.append(json.loads(await ws.recv())["type"])
        assert "response.audio.delta" in kinds


async def test_bidirectional_stream_defaults_to_the_speech_websocket(tts: Cluster) -> None:
    url = tts.ws_urls[0] + "/invocations-bidirectional-stream"
    async with connect(url, compression=None) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}).encode())
        await ws.send(json.dumps({"type": "input.text", "text": "Hi."}))
        await ws.send(json.dumps({"type": "input.done"}))
        frames = [""]
        while "session.done" not in frames[-1]:
            frame = await ws.recv()
            frames.append(frame if isinstance(frame, str) else "<audio>")
        frames.pop(0)
        assert frames[0].startswith('{"type":"audio.start"')
        assert "<audio>" in frames


async def test_bidirectional_stream_unknown_path_is_refused(tts: Cluster) -> None:
    url = tts.ws_urls[0] + "/invocations-bidirectional-stream"
    headers = {"X-Amzn-SageMaker-Model-Invocation-Path": "/v1/chat"}
    with pytest.raises(InvalidStatus) as info:
        async with connect(url, compression=None, additional_headers=headers):
            pass
    assert info.value.response.status_code == 404
    assert b"unknown invocation path" in info.value.response.body
