"""The WebSocket relay: one client session from handshake to close.

Order: the client's handshake arrives -> the gate decides (while queued, the handshake
is simply held: transparent to the client, for at most the pool's
``queue.max_handshake_wait_s``, so that a refusal reaches the client before its own
handshake timeout does: :mod:`proxy.relay.admit`) -> connect to the chosen replica at
the ws(s) form of its URL with the same path and query (failing over to another replica
before any byte flows) -> accept the client with the subprotocol the upstream chose ->
relay frames both ways in the splice (:mod:`proxy.relay.splice`), over the socket
Headroom's client listener hands over (:mod:`proxy.relay.ws_server`) -> release the slot
when either side ends. A WebSocket scope without that take-over (the app under another
ASGI server) is refused before the gate is asked: WebSocket sessions are relayed only
through the client listener.

Queue feedback (route ``queue_feedback: true``, opt-in): a client that must wait is
accepted at once (so it may wait up to the pool's ``max_wait_s``) and told
``{"type": "headroom.queue", "position": N, "eta_s": X}`` on entry and whenever its
position changes, then ``{"type": "headroom.admitted"}`` before relaying starts. The
trade-off: the handshake is answered before the upstream is chosen, so the subprotocol
cannot be negotiated with it -- Headroom accepts the client's first offered
subprotocol, and the upstream is asked for that one only.
Frames the client sends while waiting are held (bounded by the message size limit and
16 messages; beyond that, 1008) and relayed first, in order. So are frames a client
sends before its handshake is answered (RFC 6455 says to wait; some do not), which the
server holds until the accept.

Close codes for the client: the upstream's own code when it closed cleanly (e.g.
4001), 1014 when the upstream failed or could not be reached, 1008 for limits, 1013 for
refusals in ``refusal: close`` mode (and after queue feedback), 1012 on drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any

from websockets.exceptions import InvalidHandshake

from proxy.admission.refusal import close_reason, error_event, http_error
from proxy.client_request import ClientRequest
from proxy.clock import clock_timeout
from proxy.errors import HeadroomError, MessageTooLarge, UpstreamConnectTimeout
from proxy.relay.admit import FALLBACK_RESPONSE_HEADER
from proxy.relay.failover import (
    AttemptFailed,
    Unreachable,
    describe,
    open_tcp,
    open_tcp_transport,
    walk,
)
from proxy.relay.headers import forwarded_request_headers
from proxy.relay.lifecycle import run_session
from proxy.relay.splice import Splice
from proxy.relay.upstream_handshake import (
    HandshakeProtocol,
    UpstreamSocket,
    UpstreamStatus,
    open_upstream,
    upgrade,
    upstream_uri,
)
from proxy.relay.ws_server import TakeOver

if TYPE_CHECKING:
    from proxy.admission.session_lease import Lease, PositionCallback
    from proxy.metering.session_meter import SessionMeter
    from proxy.relay.lifecycle import SessionStop
    from proxy.relay.services import RelayServices
    from proxy.relay.session_record import SessionRecord
    from proxy.settings import RouteSettings

__all__ = ["relay_websocket"]

log = logging.getLogger("headroom.relay.ws")

Scope = dict[str, Any]
Receive = Any
Send = Any
Upstream = UpstreamSocket

_MAX_HELD_MESSAGES = 16


async def relay_websocket(
    services: RelayServices, route: RouteSettings, scope: Scope, receive: Receive, send: Send
) -> None:
    """Serve one client WebSocket on ``route`` (:func:`proxy.relay.lifecycle.run_session`).
    Never raises for client or upstream behaviour; every exit path releases the slot
    and logs one line."""
    connect_msg = await receive()
    if connect_msg["type"] != "websocket.connect":
        return
    if _take_over(scope) is None:
        log.error(
            "refused a WebSocket session on %s: this server offers no take-over of the "
            "client's socket (WebSocket sessions are relayed through Headroom's client "
            "listener, proxy.relay.listener)", route.path,
        )  # fmt: skip
        await send({"type": "websocket.close", "code": 1011, "reason": "internal error"})
        return
    request = ClientRequest.of(scope)
    await run_session(services, route, request, _WebSocket(services, route, request, receive, send))


def _take_over(scope: Scope) -> TakeOver | None:
    """The client listener's take-over of the client's socket, from the scope's
    ``headroom.splice`` extension (:mod:`proxy.relay.ws_server`); None under any other
    server."""
    found: TakeOver | None = scope.get("extensions", {}).get("headroom.splice", {}).get("take_over")
    return found


class _WebSocket:
    """The WebSocket half of a session (:class:`proxy.relay.lifecycle.Transport`): the
    client's handshake (accepted yet or not, how to refuse it), queue feedback, the
    upstream handshake and the splice, over the socket Headroom's client listener hands
    over (:mod:`proxy.relay.ws_server`)."""

    kind: str = "ws"
    log: logging.Logger = log
    open_races_client: bool = True

    def __init__(
        self, services: RelayServices, route: RouteSettings, request: ClientRequest,
        receive: Receive, send: Send,
    ) -> None:  # fmt: skip
        self.services, self.route, self.request = services, route, request
        self.scope = scope = request.scope
        self.receive, self.send = receive, send
        self.protocol = route.stream_protocol
        self.accepted = False
        self.offered: list[str] = list(scope.get("subprotocols") or [])
        #: Frames the client sent while it waited after an early accept (queue
        #: feedback), relayed first (None: none came).
        self.held: list[dict[str, Any]] | None = None
        #: Queue notes not yet sent (queue feedback): made when the session first
        #: waits, dropped once it is admitted (an asyncio.Queue is about 3 KB).
        self.notes: asyncio.Queue[dict[str, Any]] | None = None
        self.on_position: PositionCallback | None = None
        if route.queue_feedback:
            self.on_position = self._on_position
        self.admitted = False
        self.take_over: TakeOver | None = _take_over(scope)
        self.spliced = False

    # -- the client ---------------------------------------------------------------------

    async def accept(self, subprotocol: str | None, headers: list[tuple[bytes, bytes]]) -> None:
        await self.send(
            {"type": "websocket.accept", "subprotocol": subprotocol, "headers": headers}
        )
        self.accepted = True

    async def text(self, payload: dict[str, Any]) -> None:
        await self.send({"type": "websocket.send", "text": json.dumps(payload)})

    async def refuse(self, err: HeadroomError, record: SessionRecord) -> None:
        """An HTTP denial if the handshake is still open and the route asks for it;
        otherwise one error event in the protocol's shape and a close frame."""
        denial = "websocket.http.response" in self.scope.get("extensions", {})
        if not self.accepted and self.route.refusal == "http" and denial:
            status, headers, body = http_error(err)
            record.status = status
            await self.send(
                {"type": "websocket.http.response.start", "status": status, "headers": headers}
            )
            await self.send({"type": "websocket.http.response.body", "body": body})
            return
        if not self.accepted:
            await self.accept(None, [])
        await self.send({"type": "websocket.send", "text": error_event(self.protocol, err)})
        await self.send(
            {"type": "websocket.close", "code": err.close_code, "reason": close_reason(err)}
        )
        record.client_close = err.close_code

    def until_disconnect(self) -> Awaitable[None]:
        """Wait for the client to leave. Before accept only a disconnect can come: when
        the server offers it, that is the connection's own ``gone`` future (no task and
        no ASGI receive, :meth:`proxy.relay.ws_server.ClientWebSocket.gone`). After an
        early accept (queue feedback) frames are held, within bounds (the message size
        limit and 16 messages; beyond that, MessageTooLarge)."""
        if not self.accepted:
            gone = self.scope.get("extensions", {}).get("headroom.splice", {}).get("gone")
            if gone is not None:
                future: asyncio.Future[None] = gone()
                return future
        return self._receive_until_disconnect()

    async def _receive_until_disconnect(self) -> None:
        held = self.held
        limit = self.services.settings.limits.max_message_bytes
        size = 0
        while True:
            message: dict[str, Any] = await self.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message["type"] == "websocket.receive":
                if held is None:  # sent before the handshake was answered
                    held = self.held = []
                size += len(message.get("bytes") or b"") + len(message.get("text") or "")
                if size > limit or len(held) >= _MAX_HELD_MESSAGES:
                    raise MessageTooLarge("too much data sent while waiting in the queue")
                held.append(message)

    def client_gone(self, exc: Exception) -> bool:
        # ClientDisconnected (proxy.relay.ws_server): the client left while we were
        # answering it (e.g. during the upstream handshake). Not an error of ours.
        return isinstance(exc, OSError)

    async def internal_error(self) -> None:
        with contextlib.suppress(Exception):
            await self.send({"type": "websocket.close", "code": 1011, "reason": "internal error"})

    # -- queue feedback -------------------------------------------------------------------

    async def prepare(self, record: SessionRecord) -> None:
        return None

    def _on_position(self, position: int, eta_s: float) -> None:
        if self.admitted:
            return
        if self.notes is None:
            self.notes = asyncio.Queue()
        self.notes.put_nowait({"type": "headroom.queue", "position": position,
                               "eta_s": round(eta_s, 1)})  # fmt: skip

    @contextlib.asynccontextmanager
    async def queued(self) -> AsyncIterator[None]:
        """With queue feedback, the client is accepted at once (with its first offered
        subprotocol, the only one the upstream will be asked for) and told its place."""
        if self.on_position is None:
            yield
            return
        self.offered = self.offered[:1]
        await self.accept(self.offered[0] if self.offered else None, [])
        self.held = []
        if self.notes is None:
            self.notes = asyncio.Queue()
        notifier = asyncio.ensure_future(self._notify(self.notes))
        try:
            yield
        finally:
            notifier.cancel()
            with contextlib.suppress(BaseException):
                await notifier

    async def _notify(self, notes: asyncio.Queue[dict[str, Any]]) -> None:
        while True:
            await self.text(await notes.get())

    # -- the upstream ---------------------------------------------------------------------

    async def open(self, lease: Lease, record: SessionRecord) -> Upstream:
        """The upstream WebSocket within one deadline for every attempt together
        (``limits.handshake_timeout_s``, on the injected clock), by the splice's own
        handshake (:mod:`proxy.relay.upstream_handshake`)."""
        services = self.services
        deadline_s = services.settings.limits.handshake_timeout_s
        try:
            async with clock_timeout(services.clock, deadline_s):
                return await self._connect(lease, record)
        except TimeoutError:
            # Not a replica failure: the replica accepted the connection, and a request
            # it will not answer (e.g. an oversized header) would fail everywhere.
            reason = (
                f"upstream {lease.replica} did not complete the WebSocket handshake "
                f"within {deadline_s:g} s (TimeoutError)"
            )
            services.upstream_error(lease.pool, lease.replica, "timeout")
            log.warning("%s; the replica stays in service", reason)
            raise UpstreamConnectTimeout(reason, replica=lease.replica, kind="timeout") from None

    async def _connect(self, lease: Lease, record: SessionRecord) -> Upstream:
        """Connect to the lease's replica, failing over before any byte flows, each
        replica at most once (:func:`proxy.relay.failover.walk`); only an unreachable
        replica is ejected, and a 4xx answer is the request's fault: no failover."""
        services, scope = self.services, self.scope
        settings = services.settings
        limits = settings.limits
        headers = forwarded_request_headers(
            scope["headers"],
            client_host=(scope.get("client") or (None,))[0],
            scheme=scope.get("scheme", "ws"),
            websocket=True,
            keep_authorization=settings.auth is None,
            trusted_proxies=settings.forwarded.trusted_proxies,
        )
        user_agent = next((v for k, v in headers if k == "user-agent"), None)
        headers = [(k, v) for k, v in headers if k != "user-agent"]
        subprotocols = self.offered

        path = self.route.upstream_path or scope["path"]
        query = self.request.upstream_query(auth=settings.auth is not None)
        target = path + (f"?{query}" if query else "")

        async def attempt() -> Upstream:
            replica = lease.replica
            url = services.ws_url(lease.pool, replica) + target
            uri = upstream_uri(url)  # parsed once per distinct URL
            opened: Awaitable[Upstream]  # the handshake, over the connection made
            try:
                if not uri.secure:  # the loop connects (no socket of ours)
                    loop = asyncio.get_running_loop()
                    transport, protocol = await open_tcp_transport(
                        uri.host, uri.port, lambda: HandshakeProtocol(loop), clock=services.clock,
                        timeout=limits.upstream_connect_timeout_s, loop=loop,
                    )  # fmt: skip
                    opened = upgrade(
                        url, transport, protocol,
                        headers=headers, subprotocols=subprotocols, user_agent=user_agent,
                    )  # fmt: skip
                else:
                    sock = await open_tcp(
                        uri.host, uri.port, clock=services.clock,
                        timeout=limits.upstream_connect_timeout_s,
                    )  # fmt: skip
                    opened = open_upstream(
                        url, sock,
                        headers=headers, subprotocols=subprotocols, user_agent=user_agent,
                    )  # fmt: skip
            except Unreachable as exc:
                reason = f"cannot reach upstream {replica}: {exc}"
                raise AttemptFailed(reason, kind="connect", eject=True) from exc
            try:
                return await opened
            except UpstreamStatus as exc:
                status = exc.status
                reason = f"upstream {replica} answered the handshake with HTTP {status}"
                # Below 500 the upstream refused this request (auth, path, headers...):
                # the request's problem, not the replica's, and the same elsewhere.
                raise AttemptFailed(reason, kind="handshake", final=status < 500) from exc
            except (OSError, InvalidHandshake) as exc:
                reason = f"upstream {replica} failed the handshake: {describe(exc)}"
                raise AttemptFailed(reason, kind="handshake") from exc

        def moved(replica: str) -> None:
            record.replica = replica

        return await walk(lease, attempt, count=services.upstream_error, moved=moved, log=log)

    def discard(self, upstream: Upstream) -> None:
        """Drop an upstream connection the relay did not close (made for a client that
        left, or left open by cancellation or an internal error)."""
        if not self.spliced:
            upstream.abort()

    # -- relaying -------------------------------------------------------------------------

    async def relay(
        self, lease: Lease, upstream: Upstream, fallback_pool: str | None, record: SessionRecord,
        meter: SessionMeter, stop: SessionStop,
    ) -> None:  # fmt: skip
        headers = [(FALLBACK_RESPONSE_HEADER, fallback_pool.encode())] if fallback_pool else []
        self.admitted = True
        if self.accepted:
            while self.notes is not None and not self.notes.empty():
                await self.text(self.notes.get_nowait())
            await self.text({"type": "headroom.admitted"})
        self.notes = None
        assert self.take_over is not None  # relay_websocket refuses a scope without it
        await self._splice(lease, upstream, self.take_over, headers, record, meter, stop)
        self.spliced = True

    async def _splice(
        self, lease: Lease, upstream: UpstreamSocket, take_over: TakeOver,
        headers: list[tuple[bytes, bytes]], record: SessionRecord, meter: SessionMeter,
        stop: SessionStop,
    ) -> None:  # fmt: skip
        """Accept the client and relay in protocol callbacks until both sockets close."""
        services = self.services
        loop = upstream.loop  # get_running_loop() costs a getpid()
        adapter = services.ws_adapter(self.route, meter)
        splice = Splice(services, lease, adapter, record, services.settings.limits, loop)
        taken = take_over(
            upstream.subprotocol, headers, splice.client,
            lambda: splice.stop(1012, "server shutting down"), self.held or (),
        )  # fmt: skip
        if taken is None:  # the client left during the upstream handshake
            record.error = "client went away"
            splice.client_left(upstream.transport)
            return
        transport, early = taken
        try:
            splice.start(transport, early, upstream.transport, *upstream.hand_over())
            stop.attach(splice.stop)
            await splice.done
        except BaseException:
            splice.abort()
            raise
