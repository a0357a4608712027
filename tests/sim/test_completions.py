"""``POST /v1/completions`` and ``/v1/chat/completions``: a TTS preset's codec tokens
streamed as text, one event per token, metered by Headroom's token-stream adapter."""

from __future__ import annotations

import httpx
import pytest

from proxy.metering.adapters import AudioFormat, http_adapter
from proxy.metering.session_meter import RecordingReplicaSink, SessionMeter
from proxy.sim.cluster import Cluster
from proxy.sim.completions_api import token_text
from tests.sim.helpers import sse_events

TEXT = "Hello there. This is the simulator speaking."


async def post(cluster: Cluster, path: str, **body: object) -> httpx.Response:
    async with httpx.AsyncClient(base_url=cluster.urls[0], timeout=30) as client:
        return await client.post(path, json=body)


async def test_a_streamed_completion_sends_one_event_per_token_then_usage_and_done(
    tts: Cluster,
) -> None:
    whole = await post(tts, "/v1/completions", prompt=TEXT)
    natural = whole.json()["usage"]["completion_tokens"]
    assert natural > 4 and whole.json()["choices"][0]["finish_reason"] == "stop"
    response = await post(
        tts, "/v1/completions", prompt=TEXT, stream=True, stream_options={"include_usage": True}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    tokens, final, usage_only = events[:-3], events[-3], events[-2]
    assert [e["choices"][0]["text"] for e in tokens] == [token_text(i) for i in range(natural)]
    assert all(e["object"] == "text_completion" for e in tokens)
    assert final["choices"][0]["finish_reason"] == "stop" and final["choices"][0]["text"] == ""
    assert final["usage"]["completion_tokens"] == natural
    assert usage_only["choices"] == [] and usage_only["usage"] == final["usage"]
    assert whole.json()["choices"][0]["text"] == "".join(token_text(i) for i in range(natural))


async def test_max_tokens_caps_and_ignore_eos_fixes_the_length(tts: Cluster) -> None:
    capped = sse_events((await post(tts, "/v1/completions", prompt=TEXT, max_tokens=3,
                                    stream=True)).text)  # fmt: skip
    assert len(capped) == 3 + 2 and capped[-2]["choices"][0]["finish_reason"] == "length"
    long = await post(tts, "/v1/completions", prompt="Hi.", max_tokens=60, ignore_eos=True)
    assert long.json()["usage"]["completion_tokens"] == 60


async def test_chat_completions_stream_the_same_tokens_as_deltas(tts: Cluster) -> None:
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": TEXT}]
    response = await post(tts, "/v1/chat/completions", messages=messages, stream=True)
    events = sse_events(response.text)
    deltas = [e["choices"][0]["delta"].get("content") for e in events[:-2]]
    assert deltas == [token_text(i) for i in range(len(deltas))] and len(deltas) > 4
    assert events[0]["object"] == "chat.completion.chunk"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"prompt": ""}, 400, "'prompt' must be a non-empty string"),
        ({"prompt": "x", "max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1"),
        ({"prompt": "x", "ignore_eos": True}, 400, "'ignore_eos' needs 'max_tokens'"),
        ({"prompt": "x", "stream": "yes"}, 400, "must be booleans"),
        ({"prompt": "x", "model": "other"}, 404, "does not exist"),
    ],
)
async def test_bad_requests_say_what_is_wrong(
    tts: Cluster, body: dict[str, object], status: int, says: str
) -> None:
    response = await post(tts, "/v1/completions", **body)
    assert response.status_code == status
    assert says in response.json()["error"]["message"]


async def test_an_asr_preset_has_no_completions(asr: Cluster) -> None:
    response = await post(asr, "/v1/completions", prompt="x")
    assert response.status_code == 404


async def test_headrooms_adapter_meters_the_stream_as_audio(tts: Cluster) -> None:
    rate = tts.gpus[0].preset.token_rate_hz
    sink = RecordingReplicaSink()
    meter = SessionMeter(0.0, sink)
    adapter = http_adapter("openai-completions-tokens", meter, AudioFormat(tokens_per_second=rate))
    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        body = {"prompt": TEXT, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            adapter.response_start(response.status_code, response.headers)
            async for part in response.aiter_raw():
                adapter.response_chunk(len(sink.chunks), part)
    summary = meter.finish(float(len(sink.chunks) + 1))
    tokens = adapter.tokens  # type: ignore[attr-defined]
    assert tokens > 4 and adapter.errors == 0
    assert summary.audio_seconds == pytest.approx(tokens / rate)
