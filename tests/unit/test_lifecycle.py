"""The session lifecycle (proxy.relay.lifecycle) without sockets: a scripted transport,
a real Gate over real PoolCores on a fake clock, real reservations. Nothing sleeps:
the client leaving, the upstream answering and the clock moving are explicit steps."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from proxy.admission import PoolCore, QueuePolicy, ReplicaSpec
from proxy.admission.auth import Authorization
from proxy.admission.gate import Gate
from proxy.admission.reservations import Reservations
from proxy.admission.session_lease import Lease
from proxy.client_request import ClientRequest
from proxy.clock import FakeClock
from proxy.errors import (
    DrainingRefused,
    FallbackHint,
    HeadroomError,
    MessageTooLarge,
    Refused,
    Unauthorized,
    UpstreamConnectError,
)
from proxy.metering.session_meter import RecordingReplicaSink, SessionMeter
from proxy.relay.failover import AttemptFailed, walk
from proxy.relay.lifecycle import Declined, SessionStop, race_client, run_session
from proxy.relay.services import StopSession
from proxy.relay.session_record import SessionRecord
from proxy.settings import RouteSettings, Settings
from tests.conftest import proxy_settings

POOL = "main"


async def settle() -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(20):
        await asyncio.sleep(0)


class Services:
    """The members of RelayServices the lifecycle and admission use, over a real gate.
    ``authorize`` hands out numbered tenant tokens (or raises ``refuse_key``)."""

    def __init__(self, caps: tuple[int, ...] = (1,), depth: int = 2, wait_s: float = 5.0):
        self.clock = FakeClock()
        replicas = [(f"gpu{i}", f"http://127.0.0.1:{9000 + i}", c) for i, c in enumerate(caps)]
        route = {"path": "/ws", "pool": POOL, "protocol": "passthrough-ws"}
        self.settings: Settings = proxy_settings(replicas, [route])
        core = PoolCore(
            POOL, [ReplicaSpec(n, c) for n, _, c in replicas], QueuePolicy(depth, wait_s),
            session_estimate_s=10.0,
        )  # fmt: skip
        self.gate = Gate([core], clock=self.clock, fallbacks={POOL: FallbackHint(voice="lite")})
        self.reservations = Reservations(self.gate, self.clock, None)
        self.refuse_key: HeadroomError | None = None
        self.tokens = 0
        self.released_tokens: list[str | None] = []
        self.sessions: list[StopSession] = []
        self.upstream_errors: list[tuple[str, str, str]] = []
        self.meters: list[tuple[str, str, float]] = []
        self.tracer = None  # tracing off (proxy.tracing)

    @property
    def route(self) -> RouteSettings:
        return self.settings.routes[0]

    def authorize(self, request: ClientRequest, pool: str) -> Authorization:
        if self.refuse_key is not None:
            raise self.refuse_key
        self.tokens += 1
        return Authorization(f"tenant-{self.tokens}")

    def release_tenant(self, token: str | None) -> None:
        self.released_tokens.append(token)

    def explain_refusal(self, refusal: Refused) -> Refused:
        return refusal  # no engine reconciliation here: the refusal as the gate made it

    def register_session(self, stop: StopSession, pool: str) -> None:
        self.sessions.append(stop)

    def unregister_session(self, stop: StopSession) -> None:
        self.sessions.remove(stop)

    def upstream_error(self, pool: str, replica: str, kind: str) -> None:
        self.upstream_errors.append((pool, replica, kind))

    def new_meter(
        self, pool: str, replica: str, admitted_at: float, arrived_at: float | None = None
    ) -> SessionMeter:
        self.meters.append((pool, replica, admitted_at))
        return SessionMeter(admitted_at, RecordingReplicaSink(), arrived_at=arrived_at)


class Transport:
    """A scripted client and upstream. The client leaves when :attr:`left` is set;
    :meth:`open` returns ``upstream`` once :attr:`answer` is set (at once if
    ``connect_at_once``), or runs ``attempt`` through the failover walk."""

    kind = "ws"
    log = logging.getLogger("test.lifecycle")
    on_position = None
    open_races_client = True

    def __init__(self, services: Services, *, connect_at_once: bool = True) -> None:
        self.services = services
        self.left = asyncio.Event()
        self.answer = asyncio.Event()
        if connect_at_once:
            self.answer.set()
        self.flood: HeadroomError | None = None
        self.prepare_raises: Exception | None = None
        self.relay_raises: Exception | None = None
        self.attempt: Callable[[Lease], Any] | None = None
        self.upstream = object()
        self.events: list[str] = []
        self.refusals: list[HeadroomError] = []
        self.discarded: list[object] = []
        self.relayed: list[tuple[Lease, object, str | None]] = []
        self.lease_held_while_relaying: bool | None = None
        #: While relaying: the session's entry in the live sessions, and the stop the
        #: relay attached to it (what drain reached).
        self.registered_while_relaying: bool | None = None
        self.relay_stops: list[tuple[int, str]] = []

    async def prepare(self, record: SessionRecord) -> None:
        self.events.append("prepare")
        if self.prepare_raises is not None:
            raise self.prepare_raises

    @asynccontextmanager
    async def queued(self) -> AsyncIterator[None]:
        self.events.append("queued")
        try:
            yield
        finally:
            self.events.append("dequeued")

    async def until_disconnect(self) -> None:
        await self.left.wait()
        if self.flood is not None:
            raise self.flood

    async def open(self, lease: Lease, record: SessionRecord) -> object:
        self.events.append(f"open {lease.replica}")
        if self.attempt is not None:
            attempt = self.attempt

            def moved(replica: str) -> None:
                record.replica = replica

            return await walk(
                lease, lambda: attempt(lease), count=self.services.upstream_error,
                moved=moved, log=self.log,
            )  # fmt: skip
        await self.answer.wait()
        return self.upstream

    def discard(self, upstream: object) -> None:
        self.discarded.append(upstream)

    async def relay(
        self, lease: Lease, upstream: object, fallback_pool: str | None, record: SessionRecord,
        meter: SessionMeter, stop: SessionStop,
    ) -> None:  # fmt: skip
        self.events.append("relay")
        self.lease_held_while_relaying = not lease.released
        self.registered_while_relaying = self.services.sessions == [stop]
        self.relayed.append((lease, upstream, fallback_pool))
        meter.event(record.admitted_at or 0.0)  # one metered event
        if self.relay_raises is not None:
            raise self.relay_raises
        stop.attach(lambda code, reason: self.relay_stops.append((code, reason)))

    async def refuse(self, err: HeadroomError, record: SessionRecord) -> None:
        self.refusals.append(err)
        record.client_close = err.close_code

    def client_gone(self, exc: Exception) -> bool:
        return isinstance(exc, OSError)

    async def internal_error(self) -> None:
        self.events.append("internal_error")


@pytest.fixture
def releases(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """How many times each lease's release() was called (by id)."""
    calls: Counter[int] = Counter()
    original = Lease.release

    def counting(self: Lease) -> None:
        calls[id(self)] += 1
        original(self)

    monkeypatch.setattr(Lease, "release", counting)
    return calls


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="headroom.session")
    return caplog


def session_lines(logged: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in logged.records if r.name == "headroom.session"]  # type: ignore[attr-defined]


def start(services: Services, transport: Transport) -> asyncio.Task[SessionRecord]:
    scope: dict[str, Any] = {"headers": [], "query_string": b"", "path": "/ws"}
    request = ClientRequest.of(scope)
    return asyncio.ensure_future(run_session(services, services.route, request, transport))  # type: ignore[arg-type]


def only_lease(transport: Transport) -> Lease:
    ((lease, _, _),) = transport.relayed
    return lease


# -- the straight path ------------------------------------------------------------------


async def test_admitted_session_relays_then_releases_lease_and_token_once(
    releases: Counter[int], logged: pytest.LogCaptureFixture
) -> None:
    services = Services()
    transport = Transport(services)
    record = await start(services, transport)
    assert transport.events == ["prepare", "open gpu0", "relay"]
    lease = only_lease(transport)
    assert transport.lease_held_while_relaying is True
    assert lease.released and releases[id(lease)] == 1
    assert services.released_tokens == ["tenant-1"]
    assert services.gate.active == 0
    assert record.decision == "admitted" and record.replica == "gpu0"
    assert transport.discarded == [transport.upstream]  # offered back: the relay's to keep
    assert [line["decision"] for line in session_lines(logged)] == ["admitted"]


async def test_the_lifecycle_meters_and_registers_the_relay_for_drain() -> None:
    """The relay step gets a meter made for the lease (finished into the record when
    the relay ends) and runs registered in the live sessions, an entry gone once the
    relay returns."""
    services = Services()
    transport = Transport(services)
    record = await start(services, transport)
    assert services.meters == [(POOL, "gpu0", record.admitted_at)]
    assert record.meter is not None and record.meter["events"] == 1
    assert transport.registered_while_relaying is True and services.sessions == []


async def test_a_stop_asked_before_the_relay_attaches_is_applied_when_it_does() -> None:
    stop = SessionStop()
    stop(1012, "server shutting down")
    stop(1001, "a second stop is not queued")
    stopped: list[tuple[int, str]] = []
    stop.attach(lambda code, reason: stopped.append((code, reason)))
    assert stopped == [(1012, "server shutting down")]
    stop(1012, "again")  # attached: straight through
    assert stopped[-1] == (1012, "again")


async def test_a_connect_failure_out_of_the_relay_is_refused_as_one_out_of_open() -> None:
    """A transport that connects as it relays (HTTP) raises the failover walk's
    UpstreamConnectError from relay: the same decision and one refusal."""
    services = Services()
    transport = Transport(services)
    err = UpstreamConnectError("cannot reach upstream gpu0", replica="gpu0", kind="connect")
    transport.relay_raises = err
    record = await start(services, transport)
    assert record.decision == "upstream_unreachable" and record.error == str(err)
    assert transport.refusals == [err] and "internal_error" not in transport.events
    assert record.meter is not None and services.sessions == []
    assert services.gate.active == 0


# -- refusals ---------------------------------------------------------------------------


async def test_key_refused_before_anything_is_held(logged: pytest.LogCaptureFixture) -> None:
    services = Services()
    services.refuse_key = Unauthorized("no key")
    transport = Transport(services)
    record = await start(services, transport)
    assert record.decision == "rejected_unauthorized"
    assert [type(e) for e in transport.refusals] == [Unauthorized]
    assert transport.events == []  # not even prepared
    assert services.released_tokens == [None]
    assert services.gate.active == 0
    assert len(session_lines(logged)) == 1


async def test_prepare_declines_with_its_own_decision() -> None:
    services = Services()
    transport = Transport(services)
    transport.prepare_raises = Declined("rejected_too_large", MessageTooLarge("body"))
    record = await start(services, transport)
    assert record.decision == "rejected_too_large"
    assert [type(e) for e in transport.refusals] == [MessageTooLarge]
    assert services.released_tokens == ["tenant-1"] and services.gate.active == 0

    transport = Transport(services)
    transport.prepare_raises = Declined("abandoned")  # nobody to answer
    record = await start(services, transport)
    assert record.decision == "abandoned" and transport.refusals == []


async def test_full_pool_without_queue_is_refused_and_holds_nothing(
    releases: Counter[int],
) -> None:
    services = Services(depth=0)
    first = Transport(services, connect_at_once=False)
    running = start(services, first)
    await settle()
    assert services.gate.active == 1
    second = Transport(services)
    record = await start(services, second)
    assert record.decision.startswith("rejected_")
    ((refusal,),) = [second.refusals]
    assert isinstance(refusal, Refused) and record.decision == f"rejected_{refusal.reason}"
    assert refusal.fallback is not None and refusal.fallback.voice == "lite"
    assert services.gate.active == 1
    first.answer.set()
    await running
    assert services.gate.active == 0 and sum(releases.values()) == 1


async def test_queue_timeout_is_a_refusal_and_leaves_the_queue() -> None:
    services = Services(wait_s=5.0)
    holder = Transport(services, connect_at_once=False)
    running = start(services, holder)
    await settle()
    waiter = Transport(services)
    queued = start(services, waiter)
    await settle()
    assert services.gate.queued == 1 and waiter.events == ["prepare", "queued"]
    services.clock.advance(5.0)
    record = await queued
    assert isinstance(waiter.refusals[0], Refused)
    assert record.decision == f"rejected_{waiter.refusals[0].reason}"
    assert waiter.events == ["prepare", "queued", "dequeued"]
    assert services.gate.queued == 0 and services.released_tokens == ["tenant-2"]
    holder.answer.set()
    await running


# -- the client leaving -----------------------------------------------------------------


async def test_client_leaving_while_queued_leaves_the_queue(
    logged: pytest.LogCaptureFixture,
) -> None:
    services = Services()
    holder = Transport(services, connect_at_once=False)
    running = start(services, holder)
    await settle()
    waiter = Transport(services)
    queued = start(services, waiter)
    await settle()
    assert services.gate.queued == 1
    waiter.left.set()
    record = await queued
    assert record.decision == "abandoned" and waiter.refusals == []
    assert services.gate.queued == 0
    assert "open gpu0" not in waiter.events
    holder.answer.set()
    await running
    assert services.gate.active == 0
    assert [line["decision"] for line in session_lines(logged)] == ["abandoned", "admitted"]


async def test_slot_granted_as_the_client_leaves_is_handed_back(
    releases: Counter[int],
) -> None:
    services = Services()
    held = await services.gate.admit(POOL)
    assert isinstance(held, Lease)
    waiter = Transport(services)
    queued = start(services, waiter)
    await settle()
    assert services.gate.queued == 1
    # In the same instant: the slot goes to the waiter, and the waiter leaves.
    held.release()
    waiter.left.set()
    record = await queued
    assert record.decision == "abandoned" and waiter.relayed == []
    assert services.gate.active == 0 and services.gate.queued == 0
    # two leases were granted (the one held here, the waiter's): each released once
    assert sorted(releases.values()) == [1, 1]
    assert services.released_tokens == ["tenant-1"]


async def test_a_client_flooding_while_queued_is_refused_as_abandoned() -> None:
    services = Services()
    holder = Transport(services, connect_at_once=False)
    running = start(services, holder)
    await settle()
    waiter = Transport(services)
    waiter.flood = MessageTooLarge("too much data sent while waiting in the queue")
    queued = start(services, waiter)
    await settle()
    waiter.left.set()
    record = await queued
    assert record.decision == "abandoned"
    assert [type(e) for e in waiter.refusals] == [MessageTooLarge]
    assert services.gate.queued == 0
    holder.answer.set()
    await running


async def test_client_leaving_while_connecting_abandons_the_connect(
    releases: Counter[int],
) -> None:
    services = Services()
    transport = Transport(services, connect_at_once=False)
    running = start(services, transport)
    await settle()
    assert services.gate.active == 1 and len(services.sessions) == 1
    transport.left.set()
    record = await running
    assert record.error == "client went away during the upstream connect"
    assert record.client_close == 1006 and record.decision == "admitted"
    assert transport.discarded == [] and transport.relayed == []  # nothing was made
    assert services.gate.active == 0 and sum(releases.values()) == 1
    assert services.sessions == []  # the connect's drain hook is gone


async def test_connection_made_as_the_client_leaves_is_discarded() -> None:
    services = Services()
    transport = Transport(services, connect_at_once=False)
    running = start(services, transport)
    await settle()
    transport.answer.set()
    transport.left.set()
    record = await running
    assert record.error == "client went away during the upstream connect"
    assert transport.discarded == [transport.upstream] and transport.relayed == []
    assert services.gate.active == 0


async def test_drain_while_connecting_refuses_naming_the_fallback() -> None:
    services = Services()
    transport = Transport(services, connect_at_once=False)
    running = start(services, transport)
    await settle()
    (stop,) = services.sessions
    stop(1012, "server shutting down")
    record = await running
    assert record.decision == "rejected_draining"
    assert record.error == "gateway draining during the upstream connect"
    (refusal,) = transport.refusals
    assert isinstance(refusal, DrainingRefused)
    assert refusal.fallback is not None and refusal.fallback.voice == "lite"
    assert services.gate.active == 0 and services.sessions == []


async def test_cancelled_while_queued_hands_a_just_granted_slot_back(
    releases: Counter[int],
) -> None:
    services = Services()
    holder = Transport(services, connect_at_once=False)
    running = start(services, holder)
    await settle()
    waiter = Transport(services)
    queued = start(services, waiter)
    await settle()
    holder.answer.set()
    await running  # the waiter's wait now holds a granted slot, not yet seen
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    await settle()
    assert services.gate.active == 0 and services.gate.queued == 0
    assert services.released_tokens == ["tenant-1", "tenant-2"]


# -- connecting -------------------------------------------------------------------------


async def test_failover_walks_each_replica_once_in_order_then_gives_up() -> None:
    services = Services(caps=(1, 1, 1))
    transport = Transport(services)
    tried: list[str] = []

    async def attempt(lease: Lease) -> object:
        tried.append(lease.replica)
        raise AttemptFailed(f"cannot reach {lease.replica}", kind="connect", eject=False)

    transport.attempt = attempt
    record = await start(services, transport)
    assert len(tried) == 3 and len(set(tried)) == 3 and tried[0] == "gpu0"
    assert record.replica == tried[-1]
    assert record.decision == "upstream_unreachable"
    (refusal,) = transport.refusals
    assert isinstance(refusal, UpstreamConnectError) and refusal.replica == tried[-1]
    assert services.upstream_errors == [(POOL, r, "connect") for r in tried]
    assert services.gate.active == 0


async def test_failover_stops_at_the_first_working_replica() -> None:
    services = Services(caps=(1, 1, 1))
    transport = Transport(services)
    tried: list[str] = []

    async def attempt(lease: Lease) -> object:
        tried.append(lease.replica)
        if len(tried) == 1:
            raise AttemptFailed("down", kind="connect", eject=True)
        return transport.upstream

    transport.attempt = attempt
    record = await start(services, transport)
    assert tried[0] == "gpu0" and len(tried) == 2
    assert record.replica == tried[1] and only_lease(transport).replica == tried[1]
    assert record.decision == "admitted"


async def test_a_final_failure_does_not_fail_over() -> None:
    services = Services(caps=(1, 1))
    transport = Transport(services)
    tried: list[str] = []

    async def attempt(lease: Lease) -> object:
        tried.append(lease.replica)
        raise AttemptFailed("HTTP 403", kind="handshake", final=True)

    transport.attempt = attempt
    record = await start(services, transport)
    assert tried == ["gpu0"] and record.decision == "upstream_unreachable"
    assert services.upstream_errors == [(POOL, "gpu0", "handshake")]


# -- errors -----------------------------------------------------------------------------


async def test_internal_error_in_the_relay_is_logged_and_releases(
    releases: Counter[int], logged: pytest.LogCaptureFixture
) -> None:
    services = Services()
    transport = Transport(services)
    transport.relay_raises = RuntimeError("boom")
    record = await start(services, transport)
    assert record.error == "RuntimeError: boom"
    assert transport.events[-1] == "internal_error"
    assert sum(releases.values()) == 1 and services.released_tokens == ["tenant-1"]
    assert len(session_lines(logged)) == 1


async def test_client_gone_while_answered_is_not_an_internal_error() -> None:
    services = Services()
    transport = Transport(services)
    transport.relay_raises = OSError("disconnected")
    record = await start(services, transport)
    assert record.error == "client went away" and record.client_close == 1006
    assert "internal_error" not in transport.events


async def test_race_client_returns_the_work_when_the_client_stays() -> None:
    left = asyncio.Event()
    leftovers: list[str] = []
    result = await race_client(asyncio.sleep(0, "done"), left.wait(), leftover=leftovers.append)
    assert result == "done" and leftovers == []


async def test_race_client_runs_the_work_in_the_callers_task() -> None:
    """One task fewer per race: only the client's watcher gets its own."""
    caller = asyncio.current_task()

    async def work() -> asyncio.Task[Any] | None:
        await asyncio.sleep(0)
        return asyncio.current_task()

    ran_in = await race_client(work(), asyncio.Event().wait(), leftover=lambda _: None)
    assert ran_in is caller
    assert caller is not None and caller.cancelling() == 0


@pytest.mark.parametrize("signal", ["coroutine", "future"])
async def test_race_client_takes_back_its_cancellation_when_the_client_leaves(
    signal: str,
) -> None:
    """The client leaving cancels the work through the caller's task; the caller is
    then not left cancelling (a later timeout in the session would misfire). The same
    whether the client's leaving is watched by a task of the race's (a coroutine) or is
    a future of the transport's, which the race watches as it is."""
    left = asyncio.Event()
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    started = asyncio.Event()
    cancelled_work: list[bool] = []

    async def work() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled_work.append(True)
            raise
        return "never"

    async def caller() -> tuple[str | None, int]:
        watched = left.wait() if signal == "coroutine" else gone
        result = await race_client(work(), watched, leftover=lambda _: None)
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0)  # no cancellation is pending either
        return result, task.cancelling()

    running = asyncio.ensure_future(caller())
    await started.wait()
    await settle()
    left.set()
    gone.set_result(None)
    assert await running == (None, 0)
    assert cancelled_work == [True]


async def test_race_client_passes_the_callers_own_cancellation_on() -> None:
    watching = asyncio.Event()
    watcher_cancelled: list[bool] = []

    async def gone() -> None:
        watching.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            watcher_cancelled.append(True)
            raise

    running = asyncio.ensure_future(
        race_client(asyncio.Event().wait(), gone(), leftover=lambda _: None)
    )
    await watching.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert watcher_cancelled == [True]


async def test_race_client_watches_a_future_as_it_is() -> None:
    """A transport's own disconnect future is watched without a task of ours: it is
    neither wrapped nor cancelled when the race ends (a later race reuses it), and the
    race costs no extra turn of the loop."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()
    tasks_before = len(asyncio.all_tasks())

    async def work() -> str:
        assert len(asyncio.all_tasks()) == tasks_before  # no watcher task
        return "done"

    assert await race_client(work(), gone, leftover=lambda _: None) == "done"
    assert not gone.done() and not gone.cancelled()
    assert await race_client(work(), gone, leftover=lambda _: None) == "done"


async def test_race_client_on_a_future_already_set_hands_the_result_back() -> None:
    """The client left in the instant the work finished: the result goes to
    ``leftover`` (a slot granted, a connection made) and the race returns None."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()
    leftovers: list[str] = []

    async def work() -> str:
        gone.set_result(None)  # the disconnect lands before the work's result is seen
        return "slot"

    assert await race_client(work(), gone, leftover=leftovers.append) is None
    assert leftovers == ["slot"]
