"""vLLM itself behind Headroom: streaming transcriptions (``/v1/audio/transcriptions``
with ``stream=true``) through an ``openai-transcription-sse`` route, driven with the
OpenAI SDK against vLLM's CPU build serving a tiny random-weight Whisper
(``python -m bench.vllm_engine`` installs and builds both; .ci/run runs it first).

One server serves the whole module. What the client receives through Headroom equals
what it receives straight from vLLM (every ``transcription.chunk`` event in order,
payloads without the per-run id and timestamp, ``[DONE]``) for the same greedy request;
Headroom's meter saw the engine's final transcript; at the cap a newcomer gets 503 with
Retry-After and the reason, and vLLM never sees it.
"""

from __future__ import annotations

import asyncio
import io
import math
import struct
import wave
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from bench.vllm_engine import VllmServer, ensure_model, vllm_server
from tests.real_engine.vllm_support import (
    gateway,
    metric_value,
    need_vllm,
    normalize_sse,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm_transcription"),
    pytest.mark.asyncio(loop_scope="module"),
]

ROUTES = [{"path": "/v1/audio/transcriptions", "protocol": "openai-transcription-sse"}]
FINALS = "headroom_asr_finalize_seconds_count"


def wav(seconds: float, rate: int = 16000) -> bytes:
    """A 440 Hz tone, 16-bit mono PCM in a WAV container."""
    frames = int(seconds * rate)
    pcm = struct.pack(f"<{frames}h", *(int(8000 * math.sin(2 * math.pi * 440 * i / rate))
                                       for i in range(frames)))  # fmt: skip
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return out.getvalue()


AUDIO = wav(2.0)
#: Two minutes: four 30 s windows, transcribed one after another.
LONG = wav(120.0)
#: Greedy with a fixed language: no language detection, the same tokens on both sides.
#: A random vocabulary decodes to empty text, which vLLM does not send: the running usage
#: makes every generated token an event.
REQUEST: dict[str, Any] = {
    "model": "whisper", "language": "en", "temperature": 0.0,
    "extra_body": {"stream_include_usage": True, "stream_continuous_usage_stats": True},
}  # fmt: skip
PROMPT_TOKENS = "vllm:prompt_tokens_total"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm() -> AsyncIterator[VllmServer]:
    engine = need_vllm()
    model = await asyncio.to_thread(ensure_model, engine, "whisper")
    async with vllm_server(engine, model, name="whisper", max_num_seqs=4,
                           max_model_len=448) as server:  # fmt: skip
        yield server


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def transcription_events(url: str) -> list[str]:
    """The raw SSE lines of one streamed transcription, through the SDK."""
    async with client(url) as sdk:
        request = sdk.audio.transcriptions.with_streaming_response.create(
            file=("tone.wav", AUDIO, "audio/wav"), stream=True, **REQUEST
        )
        async with request as response:
            assert response.status_code == 200
            return [line async for line in response.iter_lines()]


async def parsed_events(url: str) -> list[dict[str, Any]]:
    """The same request read as the SDK's stream events (ids and timestamps dropped)."""
    async with client(url) as sdk:
        stream = await sdk.audio.transcriptions.create(
            file=("tone.wav", AUDIO, "audio/wav"), stream=True, **REQUEST
        )
        return [event.model_dump(exclude={"id", "created"}) async for event in stream]


async def test_stream_through_headroom_equals_direct_and_the_final_is_metered(
    vllm: VllmServer,
) -> None:
    direct = normalize_sse(await transcription_events(vllm.url))
    direct_parsed = await parsed_events(vllm.url)
    async with gateway(vllm, ROUTES, cap=2) as url:
        before = await metric_value(url, FINALS)
        relayed = normalize_sse(await transcription_events(url))
        relayed_parsed = await parsed_events(url)
        finals = await wait_for(lambda: metric_value(url, FINALS),
                                lambda v: v >= before + 2)  # fmt: skip
    assert relayed == direct
    assert relayed[-1] == "data: [DONE]"
    chunks = [e for e in relayed if isinstance(e, dict)]
    assert chunks and all(e["object"] == "transcription.chunk" for e in chunks), relayed
    assert relayed_parsed == direct_parsed
    assert finals == before + 2  # one final transcript per session, as the engine sent it


async def engine_counts(url: str) -> tuple[float, float]:
    """vLLM's counts of requests finished and prompt tokens taken."""
    return (await metric_value(url, "vllm:request_success_total"),
            await metric_value(url, PROMPT_TOKENS))  # fmt: skip


def add(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return (a[0] + b[0], a[1] + b[1])


async def engine_idle(url: str) -> float:
    """Requests running or waiting at vLLM."""
    running = await metric_value(url, "vllm:num_requests_running")
    return running + await metric_value(url, "vllm:num_requests_waiting")


async def test_a_newcomer_at_the_cap_is_refused_and_never_reaches_vllm(
    vllm: VllmServer,
) -> None:
    # What the held transcription alone makes vLLM count, sent direct.
    before = await engine_counts(vllm.url)
    async with client(vllm.url) as sdk:
        stream = await sdk.audio.transcriptions.create(
            file=("long.wav", LONG, "audio/wav"), stream=True, **REQUEST
        )
        assert [event async for event in stream]
    idle = await wait_for(lambda: engine_idle(vllm.url), lambda v: v == 0)
    assert idle == 0
    after = await engine_counts(vllm.url)
    held_alone = tuple(a - b for a, b in zip(after, before, strict=True))
    before = after
    async with gateway(vllm, ROUTES, cap=1) as url, client(url) as sdk:
        # The held session: two minutes of audio, its first event read, the rest left
        # unread until the newcomer has its answer.
        held = await sdk.audio.transcriptions.create(
            file=("long.wav", LONG, "audio/wav"), stream=True, **REQUEST
        )
        try:
            await held.__anext__()
            with pytest.raises(openai.APIStatusError) as refused:
                await sdk.audio.transcriptions.create(
                    file=("tone.wav", wav(1.0), "audio/wav"), stream=True, **REQUEST
                )
            rest = [event.model_dump() async for event in held]
        finally:
            await held.close()
    response = refused.value.response
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert response.headers["x-headroom-reason"]
    assert rest[-1]["usage"]  # the held session ran to its end: the usage closes it
    # Once nothing runs or waits at vLLM, what reached it has been counted: the held
    # session's requests alone, as many as the same transcription makes sent direct.
    idle = await wait_for(lambda: engine_idle(vllm.url), lambda v: v == 0)
    assert idle == 0
    assert await engine_counts(vllm.url) == add(before, held_alone)
