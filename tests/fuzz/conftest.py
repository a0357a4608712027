"""Fuzzing: hypothesis properties over every parser that reads untrusted bytes, and
malformed traffic against a live proxy.

Campaign size: each property runs ``scaled(n)`` examples, ``n`` as written in the test;
``HEADROOM_SLOW=1`` multiplies by 10, ``HEADROOM_FUZZ_SCALE=F`` by ``F`` (e.g. 100 for an
overnight run). ``docs/reliability.md`` lists the targets and sizes.

The live stack (:func:`live`) is what ``headroom serve`` runs -- :class:`proxy.process.gateway.
Gateway`, with its uvicorn options (frame limits) -- in front of a simulated GPU, on
127.0.0.1 port 0, with short limits so a stuck example ends quickly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest_asyncio
from hypothesis import HealthCheck, settings

from proxy.process.gateway import Gateway
from proxy.runtime import Runtime
from proxy.settings import settings_from_mapping
from proxy.sim import Timeouts, get_preset, running_cluster
from proxy.sim.cluster import Cluster

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from wsraw import OP_TEXT, frame, handshake_request, read_frames, read_head  # noqa: E402

__all__ = ["FUZZ", "Live", "fuzz_settings", "normal_session", "scaled"]


def _scale() -> float:
    explicit = os.environ.get("HEADROOM_FUZZ_SCALE")
    if explicit:
        return max(0.01, float(explicit))
    return 10.0 if os.environ.get("HEADROOM_SLOW") == "1" else 1.0


def scaled(n: int) -> int:
    """The number of examples for a property written with ``n``."""
    return max(1, int(n * _scale()))


#: Every fuzz property: no deadline (the machines are loaded), no health check that
#: would fail a slow or filtered strategy.
FUZZ = settings(
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)


def fuzz_settings(n: int) -> settings:
    return settings(FUZZ, max_examples=scaled(n))


#: A fast TTS GPU (short chunks) so sessions in the live stack last a fraction of a second.
FAST_TTS = replace(get_preset("h200-voxtral-tts-4b"), name="fuzz-fast-tts", chunk_tokens=5)
MAX_MESSAGE = 64 * 1024  # Headroom's limit (1008); uvicorn's own is twice that (1009)

ROUTES = {
    "speech": "/v1/audio/speech/stream",
    "realtime": "/v1/realtime",
    "passthrough": "/raw/realtime",
    "http": "/v1/audio/speech",
}


@dataclass
class Live:
    gateway: Gateway
    runtime: Runtime
    cluster: Cluster
    port: int

    @property
    def active(self) -> int:
        return int(self.runtime.gate.active)

    async def settled(self, timeout: float = 20.0) -> None:
        """Wait (bounded) until no session holds a slot or waits."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.runtime.gate.active or self.runtime.gate.queued:
            if loop.time() > end:
                raise AssertionError(f"slots still held: {self.runtime.gate!r}")
            await asyncio.sleep(0.01)


def live_settings(upstream: str) -> Any:
    route = {"pool": "main"}
    return settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "log_level": "warning",
            "limits": {
                "max_message_bytes": MAX_MESSAGE,
                "max_http_body_bytes": 64 * 1024,
                "handshake_timeout_s": 2,
                "upstream_connect_timeout_s": 1,
                "idle_timeout_s": 1,
                "ping_interval_s": 0,
                "client_write_timeout_s": 2,
            },
            "pools": [{
                "name": "main",
                "replicas": [{"name": "gpu0", "url": upstream, "max_sessions": 4}],
                "queue": {"max_depth": 4, "max_wait_s": 2},
            }],
            "routes": [
                {"path": ROUTES["speech"], "protocol": "vllm-omni-speech-ws", **route},
                {"path": ROUTES["realtime"], "protocol": "vllm-realtime", **route},
                {"path": ROUTES["passthrough"], "protocol": "passthrough-ws",
                 "upstream_path": "/v1/realtime", **route},
                {"path": ROUTES["http"], "protocol": "openai-speech-http", **route},
            ],
        },
        env={},
    )  # fmt: skip


@contextlib.asynccontextmanager
async def live_stack() -> AsyncIterator[Live]:
    """The stack; on exit, no slot may be held and nobody may be queued."""
    quick = Timeouts(speech_config_s=0.5, speech_idle_s=1.0)
    async with running_cluster(FAST_TTS, gpus=1, timeouts=quick) as cluster:
        runtime = Runtime(live_settings(cluster.urls[0]))
        gateway = Gateway(runtime.settings, runtime)
        serving = asyncio.ensure_future(gateway.serve(install_signals=False))
        try:
            while not gateway.started:
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.01)
            stack = Live(gateway, runtime, cluster, gateway.port)
            yield stack
            await stack.settled()
        finally:
            gateway.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
    assert runtime.gate.active == 0, f"leaked slots: {runtime.gate!r}"
    assert runtime.gate.queued == 0, f"queue not empty: {runtime.gate!r}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live() -> AsyncIterator[Live]:
    """One stack per test module (its tests run on the module's event loop: mark the
    module ``pytest.mark.asyncio(loop_scope="module")``). Each test must leave it as it
    found it -- every test here ends by waiting for the slots to come back."""
    async with live_stack() as stack:
        yield stack


async def normal_session(port: int) -> None:
    """A well-behaved realtime session through the proxy: it must still work."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(handshake_request(ROUTES["realtime"]))
        await writer.drain()
        head = await asyncio.wait_for(read_head(reader), 20)
        assert head is not None and head.status == 101, head
        update = json.dumps({"type": "session.update"}).encode()
        writer.write(frame(OP_TEXT, update))
        await writer.drain()
        got = await read_frames(reader, head.rest, timeout=20, until_text="session.created")
        assert got.frames and b"session.created" in got.frames[0][1], got
        writer.write(frame(0x8, b"\x03\xe8"))  # close 1000
        await writer.drain()
        closed = await read_frames(reader, got.rest, timeout=20)
        assert closed.code in (1000, None), closed
    finally:
        writer.close()
