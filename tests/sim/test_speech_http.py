"""``POST /v1/audio/speech`` over a real socket: SSE, raw streams, files, errors."""

from __future__ import annotations

import base64
import itertools
import json

import httpx
import pytest

from proxy.sim.audio import synthesize
from proxy.sim.cluster import Cluster
from tests.sim.helpers import speech_file, sse_events

TEXT = "Hello there. This is the simulator speaking."


async def test_sse_stream_delivers_deltas_then_done(tts: Cluster) -> None:
    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        response = await client.post(
            "/v1/audio/speech",
            json={"input": TEXT, "response_format": "pcm", "stream": True, "voice": "vivian"},
        )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "event: speech.audio.delta" in response.text
    events = sse_events(response.text)
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done"
    assert set(kinds[:-1]) == {"speech.audio.delta"}
    assert len(kinds) >= 4
    assert all(e["response_format"] == "pcm" for e in events[:-1])
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    # The stream is exactly the same speech as the file (deterministic, chunked only).
    assert audio == synthesize(TEXT, 24000, "vivian")
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == round(len(audio) / 2 / 24000 * 12.5 + 0.499)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


async def test_sse_wav_starts_with_a_streaming_riff_header(tts: Cluster) -> None:
    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        response = await client.post(
            "/v1/audio/speech", json={"input": "One two.", "stream_format": "sse"}
        )
    events = sse_events(response.text)
    first = base64.b64decode(events[0]["audio"])
    assert first[:4] == b"RIFF"
    assert first[8:16] == b"WAVEfmt "
    assert first[40:44] == b"\xff\xff\xff\xff"
    assert events[0]["response_format"] == "wav"


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
async def test_raw_audio_stream(tts: Cluster, fmt: str) -> None:
    chunks: list[bytes] = []
    async with (
        httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client,
        client.stream(
            "POST",
            "/v1/audio/speech",
            json={"input": TEXT, "response_format": fmt, "stream_format": "audio"},
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"] == f"audio/{fmt}"
        async for chunk in response.aiter_raw():
            chunks.append(chunk)
    body = b"".join(chunks)
    pcm = synthesize(TEXT, 24000)
    if fmt == "wav":
        assert body[:4] == b"RIFF"
        assert body[44:] == pcm
    else:
        assert body == pcm


async def test_non_streaming_wav_is_a_complete_file(tts: Cluster) -> None:
    wav = await speech_file(tts.urls[0], TEXT, "wav", sample_rate=16000)
    assert wav[:4] == b"RIFF"
    assert int.from_bytes(wav[4:8], "little") == len(wav) - 8
    assert int.from_bytes(wav[24:28], "little") == 16000
    assert int.from_bytes(wav[40:44], "little") == len(wav) - 44
    assert wav[44:] == synthesize(TEXT, 16000)


async def test_audio_is_audible_speech_rhythm(tts: Cluster) -> None:
    pcm = await speech_file(tts.urls[0], "Speech has rhythm, with pauses between words.")
    samples = memoryview(pcm).cast("h")
    frame = 24000 // 50  # 20 ms frames
    energies = [
        sum(abs(s) for s in samples[i : i + frame]) / frame
        for i in range(0, len(samples) - frame, frame)
    ]
    voiced = [e > 1000 for e in energies]
    assert 0.4 < sum(voiced) / len(voiced) < 0.95  # sound and silence alternate
    onsets = sum(1 for a, b in itertools.pairwise(voiced) if b and not a)
    assert onsets >= 7  # one per word at least
    crossings = sum(1 for a, b in itertools.pairwise(samples) if (a < 0) != (b < 0))
    pitch_like = crossings / (len(samples) / 24000) / 2
    assert 80 < pitch_like < 2000  # a voice's fundamental and formants, not noise
    assert max(samples) < 32767
    assert min(samples) > -32768


async def test_voices_differ_and_requests_are_deterministic(tts: Cluster) -> None:
    a = await speech_file(tts.urls[0], "Same words.", voice="vivian")
    b = await speech_file(tts.urls[0], "Same words.", voice="vivian")
    c = await speech_file(tts.urls[0], "Same words.", voice="ryan")
    assert a == b != c


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"input": ""}, 400, "'input'"),
        ({"input": "hi", "model": "no-such-model"}, 404, "does not exist"),
        (
            {"input": "hi", "stream": True, "response_format": "mp3"},
            400,
            "requires response_format",
        ),
        ({"input": "hi", "response_format": "mp3"}, 400, "not rendered by headroom sim"),
        ({"input": "hi", "stream": True, "speed": 1.5}, 400, "speed=1.0"),
        ({"input": "hi", "speed": 9}, 400, "speed"),
        ({"input": "hi", "sample_rate": 100}, 400, "sample_rate"),
    ],
)
async def test_bad_requests_get_vllm_error_bodies(
    tts: Cluster, body: dict[str, object], status: int, fragment: str
) -> None:
    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        response = await client.post("/v1/audio/speech", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"]
    assert error["code"] == status
    assert error["type"]


async def test_invalid_json_is_a_400(tts: Cluster) -> None:
    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        response = await client.post("/v1/audio/speech", content=b"{not json")
    assert response.status_code == 400
    assert json.loads(response.text)["error"]["message"] == "Invalid JSON body"


async def test_speech_on_an_asr_gpu_is_not_found(asr: Cluster) -> None:
    async with httpx.AsyncClient(base_url=asr.urls[0], timeout=30) as client:
        response = await client.post("/v1/audio/speech", json={"input": "hi"})
    assert response.status_code == 404
    assert "TTS preset" in response.json()["error"]["message"]
