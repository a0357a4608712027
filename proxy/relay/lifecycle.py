"""One relayed session from start to end, the same for WebSocket and HTTP.

The steps, in order (docs/architecture.md, "The path of one session"):

1. **authorize**: the client's key and its tenant quota (:meth:`RelayServices.authorize`),
   before anything else is held;
2. **prepare**: what the transport must have before admission (HTTP: the request
   body, bounded in size and time; WebSocket: nothing);
3. **admit**: the route's pool, its opt-in fallback pool, or a reserved slot
   (:func:`proxy.relay.admit.enter`);
4. **wait**: queued, raced against the client leaving -- a client that leaves is taken
   out of the queue at once, and a slot granted in that instant goes back;
5. **connect**: the upstream, failing over before any byte flows
   (:func:`proxy.relay.failover.walk`), raced against the client leaving and against
   drain (a draining gateway refuses the session, naming the fallback pool);
6. **relay**: the transport's own relay, with the session's meter and its entry in the
   gateway's live sessions (:class:`SessionStop`: drain, or a fence of its pool, ends
   it), both made here for either transport; the meter is finished here too;
7. **release and log**: the slot and the tenant token are released and one
   :class:`~proxy.relay.session_record.SessionRecord` line is logged, exactly once, on every
   exit path (a refusal, the client leaving, an upstream failure, cancellation, an
   internal error).

The refusal mapping lives here too: each step's failure becomes the record's
``decision`` (``rejected_<reason>``, ``rejected_<code>``, ``abandoned``,
``upstream_unreachable``, ``upstream_timeout``) and one refusal to the client, in the
transport's form (an HTTP error response, or a WebSocket denial / error event and close
code: docs/contracts.md). A connect failure is mapped once, for both transports: a
WebSocket's from :meth:`Transport.open`, an HTTP exchange's (which sends its request as
the first part of relaying) from :meth:`Transport.relay`.

What differs between transports is given by a :class:`Transport`: how to refuse the
client, how to notice it leave, what to do while it waits, how to open the upstream
and how to relay. The lifecycle is written against :class:`RelayServices`, never the
runtime.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol, TypeVar

from proxy.admission import RETRY_AFTER_MIN_S
from proxy.admission.session_lease import Lease, PositionCallback, Waiting
from proxy.errors import (
    HeadroomError,
    MessageTooLarge,
    PolicyViolation,
    Refused,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    refusal_for,
)
from proxy.relay.admit import enter
from proxy.relay.session_record import SessionRecord, new_session_id

if TYPE_CHECKING:
    from proxy.client_request import ClientRequest
    from proxy.metering.session_meter import SessionMeter
    from proxy.relay.services import RelayServices, StopSession
    from proxy.settings import RouteSettings

__all__ = ["Declined", "SessionStop", "Transport", "race_client", "run_session"]

T = TypeVar("T")
U = TypeVar("U")


class Declined(Exception):
    """Raised by a transport's step to end the session with ``decision``, answering the
    client with ``err`` (None: there is nobody to answer, e.g. it left)."""

    def __init__(self, decision: str, err: HeadroomError | None = None) -> None:
        super().__init__(decision)
        self.decision, self.err = decision, err


class SessionStop:
    """A relaying session's entry in the gateway's live sessions
    (:meth:`~proxy.relay.services.RelayServices.register_session`), registered by
    :func:`run_session` for the whole relay step: drain, or a fence of the session's
    pool, calls it, and it ends the relay through the stop the transport's relay gives
    it (:meth:`attach`) once it runs. A stop asked before that is kept and applied then,
    so a drain in the instant between the connect and the relay is not lost."""

    __slots__ = ("_asked", "_stop")

    def __init__(self) -> None:
        self._stop: StopSession | None = None
        self._asked: tuple[int, str] | None = None

    def __call__(self, code: int, reason: str) -> None:
        if self._stop is not None:
            self._stop(code, reason)
        elif self._asked is None:
            self._asked = (code, reason)

    def attach(self, stop: StopSession) -> None:
        """The relay runs: ``stop`` ends it (at once if a stop was already asked)."""
        self._stop = stop
        if self._asked is not None:
            stop(*self._asked)


class Transport(Protocol[U]):
    """The transport-specific half of a session; ``U`` is what :meth:`open` returns and
    :meth:`relay` uses."""

    #: The record's ``transport`` field ("ws", "http").
    kind: str
    #: Where an internal error of the session is logged.
    log: logging.Logger
    #: Called with (position, eta_s) while queued; None: the client is not told.
    on_position: PositionCallback | None
    #: True: :meth:`open` does I/O, raced against the client and drain. False: it only
    #: builds what :meth:`relay` uses, which opens the upstream itself.
    open_races_client: bool

    async def prepare(self, record: SessionRecord) -> None:
        """Before admission; raises :class:`Declined` to end the session."""

    def queued(self) -> AbstractAsyncContextManager[None]:
        """Entered while the session waits in the queue."""

    def until_disconnect(self) -> Awaitable[None]:
        """Done once the client has left. May raise (a client flooding while it waits:
        :class:`~proxy.errors.MessageTooLarge`). A future is watched as it is (the
        transport's own signal); a coroutine runs in a watcher task, cancelled when the
        race ends."""

    async def open(self, lease: Lease, record: SessionRecord) -> U:
        """The upstream connection for the lease (failing over); raises
        :class:`~proxy.errors.UpstreamConnectError`. Or, when :attr:`open_races_client`
        is False, only what :meth:`relay` uses."""

    def discard(self, upstream: U) -> None:
        """Drop what :meth:`open` made if the relay did not close it (cancellation,
        an internal error, or the client left during the connect)."""

    async def relay(
        self, lease: Lease, upstream: U, fallback_pool: str | None, record: SessionRecord,
        meter: SessionMeter, stop: SessionStop,
    ) -> None:  # fmt: skip
        """Relay until the session ends. ``meter``: the session's, for the transport's
        protocol adapter (the lifecycle finishes it); ``stop``: given the relay's own
        stop once it runs (:meth:`SessionStop.attach`). May raise
        :class:`~proxy.errors.UpstreamConnectError` before anything was relayed (a
        transport that connects as it relays)."""

    async def refuse(self, err: HeadroomError, record: SessionRecord) -> None:
        """Answer the client with ``err`` (sets ``record.status`` or ``client_close``)."""

    def client_gone(self, exc: Exception) -> bool:
        """Whether ``exc`` only means the client left while being answered."""

    async def internal_error(self) -> None:
        """An internal error ended the session (already logged): tell the client if
        possible. Must not raise."""


async def race_client(
    work: Awaitable[T],
    gone: Awaitable[None],
    *,
    leftover: Callable[[T], None],
    services: RelayServices | None = None,
    pool: str = "",
) -> T | None:
    """``work`` raced against ``gone`` (the client leaving): its result, or None if the
    client left first -- ``work`` is then cancelled at once, and a result it produced
    anyway (a slot granted, a connection made in the same instant) goes to
    ``leftover``, as it does when the caller itself is cancelled. ``gone``'s own error
    (a client flooding while it waits) is raised.

    With ``services``, a drain stops ``work`` too: raises the ``draining`` refusal for
    ``pool`` (naming its fallback).

    ``work`` runs in the caller's task (one task fewer per race than running it in its
    own): the client leaving, or a drain, cancels the caller's task and the
    cancellation is taken back here (``uncancel``), as ``asyncio.timeout`` does."""
    current = asyncio.current_task()
    assert current is not None
    # A future (a signal the transport keeps) is watched as it is; anything else runs
    # in a watcher task of ours, cancelled when the race ends.
    watcher: asyncio.Future[None]
    if isinstance(gone, asyncio.Future):
        watcher, owned = gone, False
    else:
        watcher, owned = asyncio.ensure_future(gone, loop=current.get_loop()), True
    cancelling = current.cancelling()
    #: Why this race cancelled the caller's task ("left", "drained"), if it did.
    why: list[str] = []
    racing = True

    def interrupt(reason: str) -> None:
        if racing and not why:
            why.append(reason)
            current.cancel()

    def on_gone(_: object) -> None:
        interrupt("left")

    def stop(code: int, reason: str) -> None:
        interrupt("drained")

    watcher.add_done_callback(on_gone)
    if services is not None:
        services.register_session(stop, pool)
    made = False
    result: T | None = None
    try:
        try:
            result = await work
            made = True
            if owned and not watcher.done():
                # the client may have left in this same instant: its watcher runs first
                await asyncio.sleep(0)
        finally:
            racing = False
            if services is not None:
                services.unregister_session(stop)
            watcher.remove_done_callback(on_gone)
            if owned and not watcher.done():
                watcher.cancel()
                await asyncio.wait((watcher,))
    except asyncio.CancelledError:
        if not why or current.uncancel() > cancelling:  # the caller's own cancellation
            if made:
                leftover(result)  # type: ignore[arg-type]
            raise
    else:
        if why:  # the work caught the cancellation itself and finished
            current.uncancel()
    if (watcher.done() and not watcher.cancelled()) or why == ["left"]:  # the client left
        if made:
            leftover(result)  # type: ignore[arg-type]
        if not watcher.cancelled():
            watcher.result()  # the client's flood, if that is how it "left"
        return None
    if not made:  # drained: the work was cancelled
        assert services is not None
        raise refusal_for(
            "draining", retry_after_s=RETRY_AFTER_MIN_S, pool=pool,
            fallback=services.gate.fallback(pool),
        )  # fmt: skip
    return result


def _release(lease: Lease) -> None:
    lease.release()


async def _connect_failed(
    transport: Transport[U], err: UpstreamConnectError, record: SessionRecord
) -> None:
    """No replica of the lease's pool took the session (proxy.relay.failover.walk)."""
    timeout = isinstance(err, UpstreamConnectTimeout)
    record.decision = "upstream_timeout" if timeout else "upstream_unreachable"
    record.error = str(err)
    await transport.refuse(err, record)


async def run_session(
    services: RelayServices, route: RouteSettings, request: ClientRequest, transport: Transport[U]
) -> SessionRecord:
    """Serve one session on ``route`` through ``transport``. Never raises for client or
    upstream behaviour (only cancellation); returns the record, already logged."""
    scope = request.scope
    clock = services.clock
    record = SessionRecord(
        new_session_id(), route.path, route.pool, transport.kind, clock.now(), decision="admitted"
    )
    peer = scope.get("client")
    if peer:
        record.client = peer[0]
    # Tracing (proxy.tracing): spans start and end at these step boundaries only.
    trace = services.tracer.start(scope, record) if services.tracer is not None else None
    lease: Lease | None = None
    upstream: U | None = None
    tenant: str | None = None
    try:
        try:
            if trace is not None:
                trace.begin("auth")
            authorized = services.authorize(request, route.pool)
            tenant = record.tenant = authorized.token
            await transport.prepare(record)
            if trace is not None:
                trace.end_step()
            entry, fallback_pool = await enter(
                services, route, request, transport.on_position, authorized=authorized
            )
            if fallback_pool is not None:
                record.pool = fallback_pool
            if isinstance(entry, Waiting):
                record.decision = "queued"
                if trace is not None:
                    trace.begin("queue_wait")
                async with transport.queued():
                    lease = await race_client(
                        entry.wait(), transport.until_disconnect(), leftover=_release
                    )
                if lease is None:
                    record.decision = "abandoned"
                    return record
                record.decision = "admitted_after_queue"
            else:
                lease = entry
        except Declined as declined:
            record.decision = declined.decision
            if declined.err is not None:
                await transport.refuse(declined.err, record)
            return record
        except Refused as refusal:
            record.decision = f"rejected_{refusal.reason}"
            await transport.refuse(services.explain_refusal(refusal), record)
            return record
        except MessageTooLarge as err:  # only a client flooding while queued, here
            record.decision = "abandoned"
            await transport.refuse(err, record)
            return record
        except PolicyViolation as err:  # the key, or a reservation without a slot here
            record.decision = f"rejected_{err.code}"
            await transport.refuse(err, record)
            return record
        admitted_at = record.admitted_at = clock.now()
        record.queue_wait_s = lease.waited_s
        record.replica = lease.replica
        if trace is not None:
            trace.begin("upstream_connect")
        try:
            if transport.open_races_client:
                upstream = await race_client(
                    transport.open(lease, record), transport.until_disconnect(),
                    leftover=transport.discard, services=services, pool=lease.pool,
                )  # fmt: skip
            else:
                upstream = await transport.open(lease, record)
        except UpstreamConnectError as err:
            await _connect_failed(transport, err, record)
            return record
        except Refused as refusal:  # drained while connecting
            record.decision = f"rejected_{refusal.reason}"
            record.error = "gateway draining during the upstream connect"
            await transport.refuse(refusal, record)
            return record
        except MessageTooLarge as err:  # a client flooding an early accept
            record.error = str(err)
            await transport.refuse(err, record)
            return record
        if upstream is None:
            record.error = "client went away during the upstream connect"
            record.client_close = 1006
            return record
        if trace is not None:
            trace.begin("stream")
        # The client's time to first audio runs from the session's start (its queue wait
        # included), the engine's from admission.
        meter = services.new_meter(lease.pool, lease.replica, admitted_at, record.started)
        stop = SessionStop()
        services.register_session(stop, lease.pool)
        try:
            await transport.relay(lease, upstream, fallback_pool, record, meter, stop)
        except UpstreamConnectError as err:  # a transport that connects as it relays
            await _connect_failed(transport, err, record)
        finally:
            services.unregister_session(stop)
            record.meter = meter.finish(clock.now()).as_log_fields()
    except asyncio.CancelledError:
        record.error = "cancelled"
        raise
    except Exception as exc:
        if transport.client_gone(exc):
            record.error = "client went away"
            if record.client_close is None:
                record.client_close = 1006
        else:
            record.error = f"{type(exc).__name__}: {exc}"
            transport.log.exception("internal error in session %s", record.session)
            await transport.internal_error()
    finally:
        if upstream is not None:
            transport.discard(upstream)
        if lease is not None:
            lease.release()
        services.release_tenant(tenant)
        record.ended = clock.now()
        if trace is not None:
            trace.finish(record)
        record.emit()
    return record
