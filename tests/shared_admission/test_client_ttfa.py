"""Time to first audio, the client's and the engine's, through the session lifecycle on
both admission backends: a session that waits in the queue has its wait in the client's
figure (``headroom_client_time_to_first_audio_seconds``, ``client_ttfa_s``) and not in
the engine's (``headroom_time_to_first_audio_seconds``, ``ttfa_s``).

The test's FakeClock is the gate's and the relay's: time moves only at the explicit steps
below, so every figure is exact."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from proxy.admission.auth import NO_KEY, Authorization
from proxy.admission.session_lease import Lease
from proxy.client_request import ClientRequest
from proxy.errors import HeadroomError, Refused
from proxy.metering.rolling import ReplicaSignals
from proxy.metering.series import Metrics
from proxy.metering.session_meter import PrometheusReplicaSink, SessionMeter
from proxy.relay.lifecycle import SessionStop, run_session
from proxy.relay.services import StopSession
from proxy.relay.session_record import SessionRecord
from proxy.settings import Settings, settings_from_mapping
from tests.shared_admission.conftest import Backend, eventually

#: The gate's pool ("tts": the backend fixture's) and one HTTP speech route to it. Its
#: queue bound is the gate's own (``Backend.gate``'s ``wait``).
SETTINGS: Settings = settings_from_mapping(
    {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "pools": [{
            "name": "tts",
            "replicas": [{"name": "gpu0", "url": "http://127.0.0.1:9000", "max_sessions": 1}],
            "queue": {"max_depth": 2, "max_wait_s": 30},
        }],
        "routes": [{"path": "/v1/audio/speech", "pool": "tts", "protocol": "openai-speech-http"}],
    },
    env={},
)  # fmt: skip
ROUTE = SETTINGS.routes[0]


class Services:
    """The members of RelayServices the lifecycle and admission use, over the backend's
    gate and clock, metering into a real :class:`Metrics`."""

    def __init__(self, backend: Backend, gate: Any) -> None:
        self.clock = backend.clock
        self.settings = SETTINGS
        self.gate = gate
        self.reservations = None  # no reservation token in these requests
        self.tracer = None
        self.metrics = Metrics()
        self.sessions: list[StopSession] = []

    def authorize(self, request: ClientRequest, pool: str) -> Authorization:
        return NO_KEY

    def release_tenant(self, token: str | None) -> None:
        pass

    def explain_refusal(self, refusal: Refused) -> Refused:
        return refusal

    def register_session(self, stop: StopSession, pool: str) -> None:
        self.sessions.append(stop)

    def unregister_session(self, stop: StopSession) -> None:
        self.sessions.remove(stop)

    def new_meter(
        self, pool: str, replica: str, admitted_at: float, arrived_at: float | None = None
    ) -> SessionMeter:
        sink = PrometheusReplicaSink(self.metrics, pool, replica, ReplicaSignals())
        return SessionMeter(admitted_at, sink, arrived_at=arrived_at)

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, {"pool": "tts", **labels})
        return 0.0 if value is None else value


class Speaker:
    """A transport whose upstream answers ``first_audio_s`` after admission (on the
    clock) with one 0.2 s audio chunk, then holds the session until :attr:`done`."""

    kind = "http"
    log = logging.getLogger("test.client_ttfa")
    on_position = None
    open_races_client = False

    def __init__(self, services: Services, first_audio_s: float) -> None:
        self.services = services
        self.first_audio_s = first_audio_s
        self.relaying = asyncio.Event()
        self.done = asyncio.Event()
        self.refusals: list[HeadroomError] = []

    async def prepare(self, record: SessionRecord) -> None:
        pass

    @asynccontextmanager
    async def queued(self) -> AsyncIterator[None]:
        yield

    async def until_disconnect(self) -> None:
        await asyncio.Event().wait()  # this client never leaves

    async def open(self, lease: Lease, record: SessionRecord) -> object:
        return object()

    def discard(self, upstream: object) -> None:
        pass

    async def relay(
        self, lease: Lease, upstream: object, fallback_pool: str | None, record: SessionRecord,
        meter: SessionMeter, stop: SessionStop,
    ) -> None:  # fmt: skip
        clock = self.services.clock
        clock.advance(self.first_audio_s)
        meter.audio(clock.now(), 0.2)
        self.relaying.set()
        await self.done.wait()

    async def refuse(self, err: HeadroomError, record: SessionRecord) -> None:
        self.refusals.append(err)

    def client_gone(self, exc: Exception) -> bool:
        return False

    async def internal_error(self) -> None:
        pass


def start(services: Services, transport: Speaker) -> asyncio.Task[SessionRecord]:
    scope: dict[str, Any] = {"headers": [], "query_string": b"", "path": ROUTE.path}
    request = ClientRequest.of(scope)
    return asyncio.ensure_future(run_session(services, ROUTE, request, transport))  # type: ignore[arg-type]


async def relaying(transport: Speaker, session: asyncio.Task[SessionRecord]) -> None:
    """Until ``transport`` relays; fails (instead of hanging) if its session ends first."""
    signal = asyncio.ensure_future(transport.relaying.wait())
    await asyncio.wait({signal, session}, return_when=asyncio.FIRST_COMPLETED)
    if not signal.done():
        signal.cancel()
        raise AssertionError(f"the session ended before relaying: {session.result()!r}")


async def test_a_queued_sessions_wait_is_in_the_clients_time_to_first_audio_only(
    backend: Backend,
) -> None:
    gate = await backend.gate(caps=(1,), depth=2, wait=30.0, fake_time=True)
    services = Services(backend, gate)

    # The first session takes the only slot at once and hears audio 0.25 s later.
    holder = Speaker(services, first_audio_s=0.25)
    holding = start(services, holder)
    await relaying(holder, holding)
    # The second arrives now and queues behind it for 8.5 s, then hears audio 0.3 s
    # after its admission: 8.8 s after it arrived.
    waiter = Speaker(services, first_audio_s=0.3)
    waiting = start(services, waiter)
    await eventually(lambda: gate.queued == 1, "the second session queued")
    services.clock.advance(8.5)
    holder.done.set()
    held = await holding
    await relaying(waiter, waiting)
    waiter.done.set()
    queued = await waiting

    assert (held.decision, queued.decision) == ("admitted", "admitted_after_queue")
    assert queued.queue_wait_s == pytest.approx(8.5)
    # The session log lines: both figures, side by side.
    assert (held.meter["ttfa_s"], held.meter["client_ttfa_s"]) == (0.25, 0.25)
    assert (queued.meter["ttfa_s"], queued.meter["client_ttfa_s"]) == (0.3, 8.8)

    engine = "headroom_time_to_first_audio_seconds"
    client = "headroom_client_time_to_first_audio_seconds"
    assert services.sample(f"{engine}_count") == services.sample(f"{client}_count") == 2
    # The engine's part: admission to first audio, the queue left out.
    assert services.sample(f"{engine}_sum") == pytest.approx(0.25 + 0.3)
    assert services.sample(f"{engine}_bucket", le="0.3") == 2
    # The client's: arrival to first audio, the queue wait included.
    assert services.sample(f"{client}_sum") == pytest.approx(0.25 + 8.8)
    assert services.sample(f"{client}_bucket", le="0.3") == 1
    assert services.sample(f"{client}_bucket", le="7.5") == 1
    assert services.sample(f"{client}_bucket", le="10.0") == 2
    assert gate.active == 0 and gate.queued == 0
