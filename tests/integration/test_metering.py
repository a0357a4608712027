"""Metering through the proxy: known audio in each protocol's format, exact figures."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from proxy.metering.series import Metrics
from proxy.process.serving import RunningServer, running_server
from tests.conftest import Proxy, proxy_settings
from tests.integration.audio_engine import AudioEngine
from tests.integration.test_ws_relay import wait_until

ROUTES = [
    {"path": "/v1/audio/speech/stream", "pool": "main", "protocol": "vllm-omni-speech-ws"},
    {"path": "/v1/realtime", "pool": "main", "protocol": "vllm-realtime"},
    {"path": "/openai/realtime", "pool": "main", "protocol": "openai-realtime"},
    {"path": "/v1/asr", "pool": "main", "protocol": "vllm-realtime"},
    {"path": "/v1/audio/speech", "pool": "main", "protocol": "openai-speech-http"},
    {"path": "/v1/audio/transcriptions", "pool": "main", "protocol": "openai-transcription-sse"},
    {"path": "/bidi", "pool": "main", "protocol": "sagemaker-bidi",
     "inner_protocol": "vllm-omni-speech-ws", "upstream_path": "/v1/audio/speech/stream"},
]  # fmt: skip


@pytest.fixture
async def engine() -> AsyncIterator[RunningServer]:
    # Paced 20 ms apart so every chunk is its own arrival, even on a raw HTTP stream.
    async with running_server(AudioEngine(spacing_s=0.02)) as server:
        yield server


async def start(start_proxy: Any, server: RunningServer, **top: Any) -> Proxy:
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 4)], ROUTES, **top))
    return proxy


def delivered(proxy: Proxy) -> float:
    return proxy.metric("headroom_audio_delivered_seconds_total", pool="main", replica="gpu0")


def gaps(proxy: Proxy) -> float:
    return proxy.metric("headroom_chunk_gap_seconds_count", pool="main", replica="gpu0")


def engine_ttfa_sum(proxy: Proxy) -> float:
    return proxy.metric("headroom_time_to_first_audio_seconds_sum", pool="main")


def client_ttfa_sum(proxy: Proxy) -> float:
    return proxy.metric("headroom_client_time_to_first_audio_seconds_sum", pool="main")


async def run_ws(url: str, path: str) -> None:
    async with connect(url + path, compression=None) as ws:
        if path in ("/v1/audio/speech/stream", "/bidi"):
            await ws.send(json.dumps({"type": "session.config", "voice": "default"}))
            await ws.send(json.dumps({"type": "input.text", "text": "hi"}))
            await ws.send(json.dumps({"type": "input.done"}))
        if path == "/v1/asr":
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        async for _ in ws:
            pass


@pytest.mark.parametrize(
    "path", ["/v1/audio/speech/stream", "/v1/realtime", "/openai/realtime", "/bidi"]
)
async def test_ws_audio_protocols_meter_exactly_two_seconds(
    start_proxy: Any, engine: RunningServer, path: str
) -> None:
    proxy = await start(start_proxy, engine)
    await run_ws(proxy.ws_url, path)
    await wait_until(lambda: proxy.gate.active == 0)
    assert delivered(proxy) == pytest.approx(2.0, abs=1e-9)
    assert gaps(proxy) == 9
    assert proxy.metric("headroom_time_to_first_audio_seconds_count", pool="main") == 1
    assert proxy.metric("headroom_client_time_to_first_audio_seconds_count", pool="main") == 1
    assert client_ttfa_sum(proxy) >= engine_ttfa_sum(proxy) > 0.0
    assert proxy.metric("headroom_stream_gap_p99_seconds_count", pool="main") == 1


@pytest.mark.parametrize(
    ("body", "label"),
    [
        ({"stream": True, "stream_format": "sse", "response_format": "pcm"}, "sse"),
        ({"stream": True, "stream_format": "audio", "response_format": "pcm"}, "pcm"),
        ({"stream": True, "stream_format": "audio", "response_format": "wav"}, "wav"),
    ],
)
async def test_speech_http_meters_exactly_two_seconds(
    start_proxy: Any, engine: RunningServer, body: dict[str, Any], label: str
) -> None:
    proxy = await start(start_proxy, engine)
    request = {"model": "m", "input": "hi", "voice": "default", "sample_rate": 24000, **body}
    async with httpx.AsyncClient() as client:
        response = await client.post(proxy.http_url + "/v1/audio/speech", json=request)
    assert response.status_code == 200
    await wait_until(lambda: proxy.gate.active == 0)
    assert delivered(proxy) == pytest.approx(2.0, abs=1e-9), label
    # Ten chunks, 20 ms apart: ten arrivals, 9 gaps -- unless a loaded machine reads two
    # chunks of the byte stream in one go (one arrival, one gap fewer). The bytes, hence
    # the seconds, are exact either way.
    assert 1 <= gaps(proxy) <= 9, label
    assert proxy.metric("headroom_client_time_to_first_audio_seconds_count", pool="main") == 1
    assert client_ttfa_sum(proxy) >= engine_ttfa_sum(proxy) > 0.0


async def test_a_queued_requests_wait_is_in_the_clients_time_to_first_audio_only(
    start_proxy: Any, engine: RunningServer
) -> None:
    """An HTTP request queued behind a WebSocket session holding the only slot: its wait
    is in the client's time to first audio and not in the engine's."""
    settings = proxy_settings(
        [("gpu0", engine.http_url, 1)], ROUTES, queue={"max_depth": 1, "max_wait_s": 60}
    )
    proxy: Proxy = await start_proxy(settings)
    request = {"model": "m", "input": "hi", "stream": True, "stream_format": "audio",
               "response_format": "pcm"}  # fmt: skip
    async with connect(proxy.ws_url + "/v1/audio/speech/stream", compression=None) as ws:
        await wait_until(lambda: proxy.gate.active == 1)  # the engine waits for input.done
        async with httpx.AsyncClient(timeout=60) as client:
            post = asyncio.ensure_future(
                client.post(proxy.http_url + "/v1/audio/speech", json=request)
            )
            await wait_until(lambda: proxy.gate.queued == 1)
            await ws.send(json.dumps({"type": "input.text", "text": "hi"}))
            await ws.send(json.dumps({"type": "input.done"}))
            async for _ in ws:
                pass
            response = await post
    assert response.status_code == 200
    await wait_until(lambda: proxy.gate.active == 0)
    queued = proxy.metric("headroom_queue_wait_seconds_sum", pool="main")
    assert queued > 0.0
    assert proxy.metric("headroom_client_time_to_first_audio_seconds_count", pool="main") == 2
    # The client's figure runs from each session's arrival, the engine's from admission:
    # they differ by at least the queued request's wait.
    assert client_ttfa_sum(proxy) - engine_ttfa_sum(proxy) >= queued


async def one_body(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An upstream that answers speech requests in one body: 0.5 s of PCM, not streamed.
    24 kB: one write, one loopback segment, so the proxy reads it in one go however loaded
    the machine (96 kB could arrive in two reads, a gap apart)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"audio/pcm")]})  # fmt: skip
    await send({"type": "http.response.body", "body": bytes(24_000)})


async def test_a_non_streamed_response_counts_active_time(start_proxy: Any) -> None:
    """Audio delivered in one chunk has wall time behind it (admission to that chunk, its
    time to first audio), so the aggregate delivery ratio stays finite and honest; it
    used to add 2 s of audio and no active time."""
    async with running_server(one_body) as server:
        proxy = await start(start_proxy, server)
        async with httpx.AsyncClient() as client:
            request = {"model": "m", "input": "hi", "response_format": "pcm"}
            response = await client.post(proxy.http_url + "/v1/audio/speech", json=request)
        assert response.status_code == 200 and len(response.content) == 24_000
        await wait_until(lambda: proxy.gate.active == 0)
    active = proxy.metric("headroom_stream_active_seconds_total", pool="main", replica="gpu0")
    ttfa = proxy.metric("headroom_time_to_first_audio_seconds_sum", pool="main")
    assert delivered(proxy) == pytest.approx(0.5, abs=1e-9)
    assert gaps(proxy) == 0
    assert active > 0.0
    assert active == pytest.approx(ttfa, abs=1e-9)


async def test_asr_streams_meter_event_gaps_and_finalize(
    start_proxy: Any, engine: RunningServer
) -> None:
    proxy = await start(start_proxy, engine)
    await run_ws(proxy.ws_url, "/v1/asr")
    async with httpx.AsyncClient() as client:
        response = await client.post(
            proxy.http_url + "/v1/audio/transcriptions",
            files={"file": ("a.wav", b"RIFF....", "audio/wav")},
            data={"model": "m", "stream": "true"},
        )
    assert b"[DONE]" in response.content
    await wait_until(lambda: proxy.gate.active == 0)
    assert delivered(proxy) == 0
    assert gaps(proxy) == 18  # nine event gaps per stream
    assert proxy.metric("headroom_asr_finalize_seconds_count", pool="main") == 2


async def test_asr_finalize_is_exported_only_once_a_pool_answers_a_commit(
    start_proxy: Any, engine: RunningServer
) -> None:
    proxy = await start(start_proxy, engine)
    await run_ws(proxy.ws_url, "/v1/audio/speech/stream")  # speech only
    await wait_until(lambda: proxy.gate.active == 0)
    async with httpx.AsyncClient() as client:
        text = (await client.get(proxy.http_url + "/metrics")).text
    assert "headroom_asr_finalize_seconds_count" not in text
    await run_ws(proxy.ws_url, "/v1/asr")
    await wait_until(lambda: proxy.gate.active == 0)
    async with httpx.AsyncClient() as client:
        text = (await client.get(proxy.http_url + "/metrics")).text
    assert 'headroom_asr_finalize_seconds_count{pool="main"} 1.0' in text


async def test_upstream_pause_is_one_underrun_with_its_stall(start_proxy: Any) -> None:
    """Real pacing, wide margins: 5 chunks (1.0 s of audio) at once, a 1.5 s pause, then
    5 more. Playback starts 0.2 s after the first chunk and runs dry about 1.2 s in, so a
    listener hears about 0.3 s of silence: one underrun."""
    async with running_server(AudioEngine(pause_s=1.5)) as server:
        proxy = await start(start_proxy, server)
        await run_ws(proxy.ws_url, "/v1/audio/speech/stream")
        await wait_until(lambda: proxy.gate.active == 0)
    labels = {"pool": "main", "replica": "gpu0"}
    assert proxy.metric("headroom_playback_underruns_total", **labels) == 1
    stall = proxy.metric("headroom_playback_stall_seconds_total", **labels)
    assert 0.05 < stall < 0.9
    assert delivered(proxy) == pytest.approx(2.0, abs=1e-9)


async def test_faster_than_realtime_has_no_underrun(
    start_proxy: Any, engine: RunningServer
) -> None:
    proxy = await start(start_proxy, engine)
    await run_ws(proxy.ws_url, "/v1/audio/speech/stream")
    await wait_until(lambda: proxy.gate.active == 0)
    labels = {"pool": "main", "replica": "gpu0"}
    assert proxy.metric("headroom_playback_underruns_total", **labels) == 0
    assert proxy.metric("headroom_playback_stall_seconds_total", **labels) == 0


CONTRACT_METRICS = {
    "headroom_sessions_active": ("gauge", {"pool", "replica"}),
    "headroom_session_slots": ("gauge", {"pool", "replica"}),
    "headroom_queue_depth": ("gauge", {"pool"}),
    "headroom_queue_wait_seconds": ("histogram", {"pool"}),
    "headroom_session_decisions": ("counter", {"pool", "decision"}),
    "headroom_chunk_gap_seconds": ("histogram", {"pool", "replica"}),
    "headroom_chunk_delivery_ratio": ("histogram", {"pool", "replica"}),
    "headroom_stream_gap_p99_seconds": ("histogram", {"pool"}),
    "headroom_delivery_ratio_worst_1pct": ("gauge", {"pool", "replica"}),
    "headroom_delivery_ratio_p99": ("gauge", {"pool", "replica"}),  # deprecated alias
    "headroom_time_to_first_audio_seconds": ("histogram", {"pool"}),
    "headroom_client_time_to_first_audio_seconds": ("histogram", {"pool"}),
    "headroom_playback_underruns": ("counter", {"pool", "replica"}),
    "headroom_playback_stall_seconds": ("counter", {"pool", "replica"}),
    "headroom_audio_delivered_seconds": ("counter", {"pool", "replica"}),
    "headroom_stream_active_seconds": ("counter", {"pool", "replica"}),
    "headroom_session_duration_seconds": ("histogram", {"pool"}),
    "headroom_upstream_errors": ("counter", {"pool", "replica", "kind"}),
    "headroom_replica_healthy": ("gauge", {"pool", "replica"}),
    "headroom_replica_guarded": ("gauge", {"pool", "replica"}),
    "headroom_asr_finalize_seconds": ("histogram", {"pool"}),
    "headroom_pool_slots_usable": ("gauge", {"pool"}),
    "headroom_pool_slots_free": ("gauge", {"pool"}),
    "headroom_pool_delivery_ratio_worst_1pct": ("gauge", {"pool"}),
    "headroom_pool_delivery_margin_ratio": ("gauge", {"pool"}),
    "headroom_pool_headroom_left_ratio": ("gauge", {"pool"}),
    "headroom_pipeline_stage_headroom_left_ratio": ("gauge", {"pipeline", "pool"}),
    "headroom_pipeline_limiting_stage": ("gauge", {"pipeline", "pool"}),
    # Gang reservations (issue 19): registered with the gateway, samples once used.
    "headroom_reservations": ("counter", {"outcome"}),
    "headroom_reservation_refusals": ("counter", {"pool", "reason"}),
    "headroom_reservation_slots": ("counter", {"pool", "outcome"}),
    "headroom_reservation_claims_refused": ("counter", {"code"}),
}


async def test_metric_names_types_and_labels_match_the_design(
    start_proxy: Any, engine: RunningServer
) -> None:
    proxy = await start(start_proxy, engine, pipelines=[{"name": "agent", "stages": ["main"]}])
    await run_ws(proxy.ws_url, "/v1/audio/speech/stream")
    await run_ws(proxy.ws_url, "/v1/asr")
    async with httpx.AsyncClient() as client:
        text = (await client.get(proxy.http_url + "/metrics")).text
    await wait_until(lambda: proxy.gate.active == 0)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, labels) in CONTRACT_METRICS.items():
        assert name in families, name
        family = families[name]
        assert family.type == kind, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
    buckets = {
        float(s.labels["le"])
        for s in families["headroom_chunk_delivery_ratio"].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    }
    assert {1.0, 1.2} <= buckets
    gap_edges = {
        float(s.labels["le"])
        for s in families["headroom_chunk_gap_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    }
    assert min(gap_edges) == 0.005 and max(gap_edges) == 5.0
    assert {0.02, 0.04, 0.08, 0.2, 2.0} <= gap_edges  # the configured chunk durations


def test_custom_chunk_durations_become_gap_bucket_edges() -> None:
    metrics = Metrics(chunk_durations_s=[0.032, 0.48])
    metrics.replica_series("tts", "gpu0")  # a series, so the family has buckets to export
    for le in ("0.032", "0.48"):
        labels = {"pool": "tts", "replica": "gpu0", "le": le}
        assert metrics.registry.get_sample_value("headroom_chunk_gap_seconds_bucket", labels) == 0
