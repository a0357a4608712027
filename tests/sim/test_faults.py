"""Every fault flag produces its fault, set programmatically, by CLI flags or live."""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import TypeVar, cast

import httpx
import pytest
from starlette.responses import Response
from starlette.websockets import WebSocket
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from proxy.sim import Faults, running_cluster
from proxy.sim.audio import synthesize
from proxy.sim.cluster import Cluster
from proxy.sim.common import unavailable_response
from proxy.sim.faults import add_fault_arguments, faults_from_args
from proxy.sim.gpu_app import REFUSAL_LOG_FILTER, refuse_handshake
from tests.sim.conftest import ASR, FAST_TTS
from tests.sim.helpers import b64, sse_events

TEXT = "One, two, three, four, five, six, seven, eight, nine, ten."
PCM_STREAM = {"type": "session.config", "response_format": "pcm", "stream_audio": True}


async def healthy(url: str) -> bool:
    async with httpx.AsyncClient(timeout=5) as client:
        try:
            return (await client.get(url + "/health")).status_code == 200
        except httpx.ConnectError:
            return False


async def speech_ws_frames(ws: ClientConnection, text: str = TEXT) -> AsyncIterator[str | bytes]:
    await ws.send(json.dumps(PCM_STREAM))
    await ws.send(json.dumps({"type": "input.text", "text": text}))
    await ws.send(json.dumps({"type": "input.done"}))
    while True:
        yield await ws.recv()


async def sse_deltas(url: str, body: dict[str, object]) -> tuple[list[float], list[dict]]:
    """Arrival times and events of a speech SSE stream."""
    times: list[float] = []
    events: list[dict] = []
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as client,
        client.stream("POST", "/v1/audio/speech", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                times.append(time.monotonic())
                events.append(json.loads(line[5:]))
    return times, events


T = TypeVar("T")


async def collect(source: AsyncIterable[T], into: list[T]) -> None:
    async for item in source:
        into.append(item)


# -- refuse -------------------------------------------------------------------------------


async def test_refused_connections_recover_when_cleared() -> None:
    async with running_cluster(FAST_TTS, faults=Faults(refuse_connections=True)) as cluster:
        assert not await healthy(cluster.urls[0])
        with pytest.raises(ConnectionRefusedError):
            await connect(cluster.ws_urls[0] + "/v1/realtime", open_timeout=5)
        assert cluster.gpus[0].listening is False
        await cluster.set_faults(Faults())
        assert await healthy(cluster.urls[0])


async def test_refuse_for_a_while_then_listen_again() -> None:
    faults = Faults(refuse_connections=True, refuse_for_s=0.3)
    async with running_cluster(FAST_TTS, faults=faults) as cluster:
        assert not await healthy(cluster.urls[0])
        for _ in range(200):
            if await healthy(cluster.urls[0]):
                break
            await asyncio.sleep(0.02)
        assert await healthy(cluster.urls[0])
        assert cluster.faults[0] == Faults()


async def test_admin_endpoint_flips_faults_live_and_open_sessions_continue() -> None:
    async with running_cluster(FAST_TTS, gpus=2) as cluster:
        gpu0, gpu1 = cluster.urls
        async with connect(cluster.ws_urls[0] + "/v1/audio/speech/stream") as ws:
            frames = speech_ws_frames(ws)
            assert json.loads(await anext(frames))["type"] == "audio.start"
            async with httpx.AsyncClient(timeout=5) as client:
                set_ = await client.post(gpu0 + "/sim/faults", json={"refuse_connections": True})
                assert set_.json()["refuse_connections"] is True
            assert not await healthy(gpu0)  # new connections are refused ...
            async for frame in frames:  # ... the open session runs to its end
                if isinstance(frame, str) and json.loads(frame)["type"] == "session.done":
                    break
        async with httpx.AsyncClient(timeout=5) as client:
            read = await client.get(gpu1 + "/sim/faults", params={"gpu": 0})
            assert read.json()["refuse_connections"] is True
            cleared = await client.delete(gpu1 + "/sim/faults", params={"gpu": 0})
            assert cleared.json() == Faults().as_json()
            assert await healthy(gpu0)
            bad = await client.post(gpu0 + "/sim/faults", json={"stall_s": "long"})
            assert bad.status_code == 400
            unknown = await client.post(gpu0 + "/sim/faults", json={"explode": True})
            assert "unknown fault field" in unknown.json()["error"]["message"]


# -- 503 and health --------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self.levels: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.levels.append(record.levelno)


async def test_handshake_503() -> None:
    records = _Records()
    # uvicorn's loggers do not propagate, and uvicorn resets their handlers when it
    # configures logging: listen on its own logger once the servers are up.
    logger = logging.getLogger("uvicorn.error")
    async with running_cluster(FAST_TTS, faults=Faults(handshake_503=True)) as cluster:
        logger.addHandler(records)
        try:
            await _refused_everywhere(cluster)
        finally:
            logger.removeHandler(records)
    # uvicorn's websockets-sansio before 0.55 logs every denied handshake at ERROR; a
    # deliberate 503 must not flood logs.
    assert not [m for m in records.messages if "handshake" in m]
    assert not [level for level in records.levels if level >= logging.ERROR]


async def test_refusal_mark_stays_in_its_connections_task() -> None:
    """What uvicorn logs after a deliberate refusal is dropped in that connection's task
    only: a record logged at the same time in another connection's task still passes."""
    refused, other = asyncio.Event(), asyncio.Event()
    passed: dict[str, bool] = {}

    class _Denied:
        async def send_denial_response(self, response: Response) -> None:
            assert response.status_code == 503

    def record() -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 0, "x", None, None)

    async def refusing() -> None:
        await refuse_handshake(cast(WebSocket, _Denied()), unavailable_response())
        refused.set()
        await other.wait()
        passed["refused"] = REFUSAL_LOG_FILTER.filter(record())

    async def failing() -> None:
        await refused.wait()
        passed["other"] = REFUSAL_LOG_FILTER.filter(record())
        other.set()

    await asyncio.gather(refusing(), failing())
    assert passed == {"refused": False, "other": True}
    assert REFUSAL_LOG_FILTER.filter(record())  # nor in the task that started them


async def _refused_everywhere(cluster: Cluster) -> None:
    for path in (
        "/v1/audio/speech/stream",
        "/v1/realtime",
        "/invocations-bidirectional-stream",
    ):
        with pytest.raises(InvalidStatus) as info:
            await connect(cluster.ws_urls[0] + path)
        response = info.value.response
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
        assert json.loads(response.body)["error"]["code"] == 503
    async with httpx.AsyncClient(base_url=cluster.urls[0], timeout=5) as client:
        speech = await client.post("/v1/audio/speech", json={"input": "hi"})
        health = await client.get("/health")
    assert speech.status_code == 503
    assert speech.json()["error"]["type"] == "ServiceUnavailableError"
    assert health.status_code == 200  # the engine is alive; it just refuses work


async def test_unhealthy() -> None:
    async with (
        running_cluster(FAST_TTS, faults=Faults(unhealthy=True)) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0], timeout=5) as client,
    ):
        assert (await client.get("/health")).status_code == 503
        assert (await client.get("/ping")).status_code == 503


# -- mid-stream faults -------------------------------------------------------------------------


async def test_drop_after_chunks_on_the_speech_websocket() -> None:
    async with (
        running_cluster(FAST_TTS, faults=Faults(drop_after_chunks=2)) as cluster,
        connect(cluster.ws_urls[0] + "/v1/audio/speech/stream") as ws,
    ):
        received: list[str | bytes] = []
        with pytest.raises(ConnectionClosed) as info:
            await collect(speech_ws_frames(ws), received)
    assert info.value.rcvd is None  # no close frame: TCP was cut
    assert info.value.sent is None
    assert [type(f) for f in received] == [str, bytes, bytes]


async def test_drop_after_chunks_on_http_sse_and_raw_audio() -> None:
    async with running_cluster(FAST_TTS, faults=Faults(drop_after_chunks=3)) as cluster:
        with pytest.raises(httpx.RemoteProtocolError):
            await sse_deltas(cluster.urls[0], {"input": TEXT, "stream": True})
        received: list[bytes] = []
        body = {"input": TEXT, "stream_format": "audio", "response_format": "pcm"}
        async with (
            httpx.AsyncClient(base_url=cluster.urls[0], timeout=30) as client,
            client.stream("POST", "/v1/audio/speech", json=body) as response,
        ):
            with pytest.raises(httpx.RemoteProtocolError):
                await collect(response.aiter_raw(), received)
        full = synthesize(TEXT, 24000)
        assert 0 < len(b"".join(received)) < len(full)
        assert full.startswith(b"".join(received))


async def test_drop_on_realtime_and_on_a_whole_file() -> None:
    async with (
        running_cluster(ASR, faults=Faults(drop_after_chunks=1)) as cluster,
        connect(cluster.ws_urls[0] + "/v1/realtime") as ws,
    ):
        await ws.recv()
        await ws.send(json.dumps({"type": "session.update"}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        pcm = synthesize(TEXT, 16000)
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm)}))
        assert json.loads(await ws.recv())["type"] == "transcription.delta"
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
        assert info.value.rcvd is None
    async with (
        running_cluster(FAST_TTS, faults=Faults(drop_after_chunks=0)) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0], timeout=30) as client,
    ):
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await client.post("/v1/audio/speech", json={"input": "hi"})


async def test_stall_after_chunks() -> None:
    faults = Faults(stall_after_chunks=2, stall_s=0.6)
    async with running_cluster(FAST_TTS, faults=faults) as cluster:
        times, events = await sse_deltas(cluster.urls[0], {"input": TEXT, "stream": True})
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert events[-1]["type"] == "speech.audio.done"  # the stream resumes and completes
    assert gaps[1] >= 0.55  # silence before chunk 3
    assert gaps[1] == max(gaps)


async def test_slow_start_adds_time_to_first_audio() -> None:
    async with running_cluster(FAST_TTS, faults=Faults(slow_start_s=0.6)) as cluster:
        started = time.monotonic()
        times, events = await sse_deltas(cluster.urls[0], {"input": "Hi.", "stream": True})
    assert times[0] - started >= 0.55
    assert events[-1]["type"] == "speech.audio.done"


async def test_error_after_chunks_on_each_protocol() -> None:
    async with running_cluster(FAST_TTS, faults=Faults(error_after_chunks=1)) as cluster:
        _, events = await sse_deltas(cluster.urls[0], {"input": TEXT, "stream": True})
        assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.error"]
        assert "simulated engine fault" in events[-1]["error"]["message"]
        async with connect(cluster.ws_urls[0] + "/v1/audio/speech/stream") as ws:
            seen: list[str | bytes] = []
            async for frame in speech_ws_frames(ws):
                seen.append(frame)
                if isinstance(frame, str) and '"session.done"' in frame:
                    break
        kinds = [json.loads(f)["type"] if isinstance(f, str) else "<audio>" for f in seen]
        assert kinds == ["audio.start", "<audio>", "error", "audio.done", "session.done"]
        error, done = json.loads(seen[2]), json.loads(seen[3])
        assert error["message"].startswith("Generation failed for utterance 0, sentence 0:")
        assert error["partial_audio"] is True
        assert done["error"] is True
    async with running_cluster(ASR, faults=Faults(error_after_chunks=1)) as cluster:
        async with connect(cluster.ws_urls[0] + "/v1/realtime") as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            pcm = base64.b64encode(synthesize(TEXT, 16000)).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm}))
            first, second = json.loads(await ws.recv()), json.loads(await ws.recv())
        assert first["type"] == "transcription.delta"
        assert second == {
            "type": "error",
            "error": "simulated engine fault (headroom sim --fault-error-after)",
            "code": "processing_error",
        }
        async with httpx.AsyncClient(base_url=cluster.urls[0], timeout=30) as client:
            wav = synthesize(TEXT, 16000)
            response = await client.post(
                "/v1/audio/transcriptions",
                data={"stream": "true"},
                files={"file": ("a.pcm", wav, "audio/pcm")},
            )
        events = sse_events(response.text)
        assert events[0]["object"] == "transcription.chunk"
        assert events[1]["error"]["code"] == 500
        assert events[2] == "[DONE]"


# -- configuration ------------------------------------------------------------------------------


def test_cli_flags_map_to_faults() -> None:
    parser = argparse.ArgumentParser()
    add_fault_arguments(parser)
    flags = (
        "--fault-refuse --fault-refuse-for 3 --fault-503 --fault-unhealthy --fault-drop-after 4 "
        "--fault-stall 2.5 --fault-stall-after 6 --fault-slow-start 0.5 --fault-error-after 7"
    )
    args = parser.parse_args(flags.split())
    assert faults_from_args(args) == Faults(
        refuse_connections=True,
        refuse_for_s=3.0,
        handshake_503=True,
        unhealthy=True,
        drop_after_chunks=4,
        stall_after_chunks=6,
        stall_s=2.5,
        slow_start_s=0.5,
        error_after_chunks=7,
    )
    assert faults_from_args(parser.parse_args([])) == Faults()


@pytest.mark.parametrize(
    "bad",
    [{"drop_after_chunks": -1}, {"stall_s": -2.0}, {"refuse_for_s": 0.0}],
)
def test_invalid_faults_are_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        Faults(**bad)  # type: ignore[arg-type]


def test_partial_updates_validate_types() -> None:
    faults = Faults().updated({"stall_s": 1, "drop_after_chunks": 3})
    assert faults == Faults(stall_s=1.0, drop_after_chunks=3)
    assert faults.updated({"drop_after_chunks": None}) == Faults(stall_s=1.0)
    with pytest.raises(ValueError, match="must be int"):
        faults.updated({"drop_after_chunks": True})


async def test_faults_per_gpu_in_a_cluster() -> None:
    async with running_cluster(FAST_TTS, gpus=2, faults={1: Faults(handshake_503=True)}) as cluster:
        assert cluster.faults == [Faults(), Faults(handshake_503=True)]
        async with httpx.AsyncClient(timeout=5) as client:
            ok = await client.post(cluster.urls[0] + "/v1/audio/speech", json={"input": "a"})
            refused = await client.post(cluster.urls[1] + "/v1/audio/speech", json={"input": "a"})
        assert (ok.status_code, refused.status_code) == (200, 503)
