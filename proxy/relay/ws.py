"""The WebSocket relay: one client session from handshake to close.

Order: the client's handshake arrives -> the gate decides (while queued, the handshake
is simply held: transparent to the client) -> connect to the chosen replica at the
ws(s) form of its URL with the same path and query (failing over to another replica
before any byte flows) -> accept the client with the subprotocol the upstream chose ->
relay frames both ways (:mod:`proxy.relay.ws_pump`) -> release the slot when either
side ends.

Queue feedback (route ``queue_feedback: true``, opt-in): a client that must wait is
accepted at once and told ``{"type": "headroom.queue", "position": N, "eta_s": X}`` on
entry and whenever its position changes, then ``{"type": "headroom.admitted"}`` before
relaying starts. The trade-off: the handshake is answered before the upstream is
chosen, so the subprotocol cannot be negotiated with it -- Headroom accepts the
client's first offered subprotocol, and the upstream is asked for that one only.
Frames the client sends while waiting are held (bounded by the message size limit and
16 messages; beyond that, 1008) and relayed first, in order.

Close codes for the client: the upstream's own code when it closed cleanly (e.g.
4001), 1014 when the upstream failed or could not be reached, 1008 for limits, 1013 for
refusals in ``refusal: close`` mode (and after queue feedback), 1012 on drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, InvalidStatus
from websockets.protocol import State
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from proxy.admission import RETRY_AFTER_MIN_S
from proxy.clock import clock_timeout
from proxy.errors import (
    HeadroomError,
    MessageTooLarge,
    PolicyViolation,
    Refused,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    refusal_for,
)
from proxy.gate import Lease, Waiting
from proxy.refusal import close_reason, error_event, http_error
from proxy.relay.admit import FALLBACK_RESPONSE_HEADER, enter, upstream_query
from proxy.relay.failover import Failover, Unreachable, describe, open_tcp
from proxy.relay.headers import forwarded_request_headers
from proxy.relay.session import SessionRecord, new_session_id
from proxy.relay.splice import Splice
from proxy.relay.upstream_ws import UpstreamSocket, UpstreamStatus, open_upstream
from proxy.relay.uvicorn_ws import TakeOver
from proxy.relay.ws_pump import relay_frames

if TYPE_CHECKING:
    from proxy.runtime import Runtime
    from proxy.settings import RouteSettings

__all__ = ["relay_websocket"]

log = logging.getLogger("headroom.relay.ws")

Scope = dict[str, Any]
Receive = Any
Send = Any

_MAX_HELD_MESSAGES = 16


class _Client:
    """The client side of the handshake: accepted yet or not, and how to refuse."""

    __slots__ = ("accepted", "protocol", "route", "scope", "send")

    def __init__(self, scope: Scope, send: Send, route: RouteSettings) -> None:
        self.scope = scope
        self.send = send
        self.route = route
        self.protocol = route.inner_protocol or route.protocol
        self.accepted = False

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


async def _until_disconnect(
    receive: Receive, held: list[dict[str, Any]] | None, limit: int
) -> None:
    """Wait for the client to leave. Before accept only a disconnect can come; after an
    early accept (queue feedback) frames are held in ``held``, within bounds."""
    size = 0
    while True:
        message: dict[str, Any] = await receive()
        if message["type"] == "websocket.disconnect":
            return
        if held is not None and message["type"] == "websocket.receive":
            size += len(message.get("bytes") or b"") + len(message.get("text") or "")
            if size > limit or len(held) >= _MAX_HELD_MESSAGES:
                raise MessageTooLarge("too much data sent while waiting in the queue")
            held.append(message)


async def _wait(
    waiting: Waiting,
    receive: Receive,
    record: SessionRecord,
    held: list[dict[str, Any]] | None,
    limit: int,
) -> Lease | None:
    """Wait in the queue: a lease, None if the client left; raises Refused (or
    MessageTooLarge for a client that floods while waiting)."""
    record.decision = "queued"
    wait_task = asyncio.ensure_future(waiting.wait())
    gone_task = asyncio.ensure_future(_until_disconnect(receive, held, limit))
    try:
        await asyncio.wait({wait_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (wait_task, gone_task):
            if not task.done():
                task.cancel()
        # A cancelled wait leaves the queue (or hands a just-granted slot back).
        await asyncio.gather(wait_task, gone_task, return_exceptions=True)
    if gone_task.done() and not gone_task.cancelled():
        granted = wait_task.done() and not wait_task.cancelled() and not wait_task.exception()
        if granted:
            wait_task.result().release()
        gone_task.result()  # raises MessageTooLarge for a flood
        record.decision = "abandoned"
        return None
    return wait_task.result()  # a Lease, or raises Refused


async def _connect_upstream(
    rt: Runtime, route: RouteSettings, scope: Scope, lease: Lease, subprotocols: list[str],
    record: SessionRecord, *, lean: bool,
) -> ClientConnection | UpstreamSocket:  # fmt: skip
    """Connect to the lease's replica, failing over before any byte flows, each replica
    at most once (:mod:`proxy.relay.failover`); only an unreachable replica is ejected.
    ``lean``: the splice's own handshake (:mod:`proxy.relay.upstream_ws`), otherwise a
    websockets client connection for the ASGI relay. The caller bounds the time."""
    limits = rt.settings.limits
    headers = forwarded_request_headers(
        scope["headers"],
        client_host=(scope.get("client") or (None,))[0],
        scheme=scope.get("scheme", "ws"),
        websocket=True,
        keep_authorization=rt.settings.auth is None,
        trusted_proxies=rt.settings.forwarded.trusted_proxies,
    )
    user_agent = next((v for k, v in headers if k == "user-agent"), None)
    headers = [(k, v) for k, v in headers if k != "user-agent"]

    async def handshake(url: str, sock: socket.socket) -> ClientConnection | UpstreamSocket:
        if lean:
            return await open_upstream(
                url, sock, headers=headers, subprotocols=subprotocols, user_agent=user_agent
            )
        return await connect(
            url,
            sock=sock,
            additional_headers=headers,
            subprotocols=[Subprotocol(p) for p in subprotocols] or None,
            user_agent_header=user_agent,
            compression=None,
            proxy=None,
            open_timeout=None,  # the caller's deadline
            ping_interval=limits.ping_interval_s or None,
            ping_timeout=limits.ping_timeout_s or None,
            close_timeout=5,
            max_size=limits.max_message_bytes,
            max_queue=16,
            write_limit=64 * 1024,
        )

    path = route.upstream_path or scope["path"]
    query = upstream_query(scope, auth=rt.settings.auth is not None)
    failover = Failover(lease)
    while True:
        url = rt.ws_url(lease.pool, lease.replica) + path + (f"?{query}" if query else "")
        uri = parse_uri(url)
        eject = False
        try:
            sock = await open_tcp(
                uri.host, uri.port, clock=rt.clock, timeout=limits.upstream_connect_timeout_s
            )
        except Unreachable as exc:
            kind, eject = "connect", True
            reason = f"cannot reach upstream {lease.replica}: {exc}"
        else:
            try:
                return await handshake(url, sock)
            except (InvalidStatus, UpstreamStatus) as exc:
                status = (
                    exc.status if isinstance(exc, UpstreamStatus) else exc.response.status_code
                )  # fmt: skip
                kind = "handshake"
                reason = f"upstream {lease.replica} answered the handshake with HTTP {status}"
                if status < 500:
                    # The upstream refused this request (auth, path, headers...): the
                    # request's problem, not the replica's, and the same elsewhere.
                    rt.upstream_error(lease.pool, lease.replica, kind)
                    log.warning("%s; not failing over (the request was refused)", reason)
                    raise UpstreamConnectError(reason, replica=lease.replica, kind=kind) from exc
            except (OSError, InvalidHandshake) as exc:
                kind = "handshake"
                reason = f"upstream {lease.replica} failed the handshake: {describe(exc)}"
        rt.upstream_error(lease.pool, lease.replica, kind)
        failed = lease.replica
        if not await failover.next(eject=eject):
            log.warning("%s; no other replica to try", reason)
            raise UpstreamConnectError(reason, replica=failed, kind=kind)
        log.warning("%s; failing over to %s", reason, lease.replica)
        record.replica = lease.replica


async def _connect_while_present(
    rt: Runtime, route: RouteSettings, scope: Scope, receive: Receive, lease: Lease,
    subprotocols: list[str], record: SessionRecord, held: list[dict[str, Any]] | None,
    *, lean: bool,
) -> ClientConnection | UpstreamSocket | None:  # fmt: skip
    """:func:`_connect_upstream` within one deadline for every attempt together
    (``limits.handshake_timeout_s``, on the injected clock), raced against the client:
    None if the client left first (the connect is abandoned at once). A drain stops it
    too (:class:`~proxy.errors.DrainingRefused`). Raises UpstreamConnectError,
    UpstreamConnectTimeout, or MessageTooLarge (a client flooding an early accept)."""
    limits = rt.settings.limits
    deadline_s = limits.handshake_timeout_s

    async def bounded() -> ClientConnection | UpstreamSocket:
        try:
            async with clock_timeout(rt.clock, deadline_s):
                return await _connect_upstream(
                    rt, route, scope, lease, subprotocols, record, lean=lean
                )
        except TimeoutError:
            # Not a replica failure: the replica accepted the connection, and a request
            # it will not answer (e.g. an oversized header) would fail everywhere.
            reason = (
                f"upstream {lease.replica} did not complete the WebSocket handshake "
                f"within {deadline_s:g} s (TimeoutError)"
            )
            rt.upstream_error(lease.pool, lease.replica, "timeout")
            log.warning("%s; the replica stays in service", reason)
            raise UpstreamConnectTimeout(reason, replica=lease.replica, kind="timeout") from None

    connecting = asyncio.ensure_future(bounded())
    gone = asyncio.ensure_future(
        _until_disconnect(receive, held, limits.max_message_bytes if held is not None else 0)
    )
    drained: list[tuple[int, str]] = []

    def stop(code: int, reason: str) -> None:
        drained.append((code, reason))
        connecting.cancel()

    rt.register_session(stop)
    try:
        await asyncio.wait({connecting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        rt.unregister_session(stop)
        for task in (connecting, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(connecting, gone, return_exceptions=True)
        left = gone.done() and not gone.cancelled()
        if left or asyncio.current_task().cancelling():  # type: ignore[union-attr]
            _discard(connecting)
    if left:
        gone.result()  # raises MessageTooLarge for a flood
        return None
    if drained and connecting.cancelled():
        raise refusal_for(
            "draining", retry_after_s=RETRY_AFTER_MIN_S, pool=lease.pool,
            fallback=rt.gate.fallback(lease.pool),
        )  # fmt: skip
    return connecting.result()


def _discard(connecting: asyncio.Future[ClientConnection | UpstreamSocket]) -> None:
    """Drop an upstream connection that was made for nobody."""
    if connecting.cancelled() or connecting.exception() is not None:
        return
    upstream = connecting.result()
    if isinstance(upstream, UpstreamSocket):
        upstream.abort()
    else:
        upstream.transport.abort()


async def _splice(
    rt: Runtime, route: RouteSettings, lease: Lease, upstream: UpstreamSocket,
    take_over: TakeOver, headers: list[tuple[bytes, bytes]], record: SessionRecord,
    held: Sequence[dict[str, Any]] = (),
) -> None:  # fmt: skip
    """Accept the client and relay in protocol callbacks until both sockets close."""
    clock = rt.clock
    meter = rt.new_meter(lease.pool, lease.replica, record.admitted_at or clock.now())
    loop = upstream.handshake.head.get_loop()  # get_running_loop() costs a getpid()
    splice = Splice(rt, lease, rt.ws_adapter(route, meter), record, rt.settings.limits, loop)
    try:
        taken = take_over(
            upstream.subprotocol, headers, splice.client,
            lambda: splice.stop(1012, "server shutting down"), held,
        )  # fmt: skip
        if taken is None:  # the client left during the upstream handshake
            record.error = "client went away"
            splice.client_left(upstream.transport)
            return
        transport, early = taken
        rt.register_session(splice.stop)
        try:
            splice.start(transport, early, upstream.transport, upstream.take_leftover(),
                         upstream.lost)  # fmt: skip
            await splice.done
        except BaseException:
            splice.abort()
            raise
        finally:
            rt.unregister_session(splice.stop)
    finally:
        record.meter = meter.finish(clock.now()).as_log_fields()


async def relay_websocket(
    rt: Runtime, route: RouteSettings, scope: Scope, receive: Receive, send: Send
) -> None:
    """Serve one client WebSocket on ``route``. Never raises for client or upstream
    behaviour; every exit path releases the slot and logs one line."""
    connect_msg = await receive()
    if connect_msg["type"] != "websocket.connect":
        return
    clock = rt.clock
    record = SessionRecord(
        new_session_id(), route.path, route.pool, "ws", clock.now(), decision="admitted"
    )
    client = _Client(scope, send, route)
    offered: list[str] = list(scope.get("subprotocols") or [])
    lease: Lease | None = None
    upstream: ClientConnection | UpstreamSocket | None = None
    held: list[dict[str, Any]] | None = None
    tenant: str | None = None
    try:
        try:
            tenant = rt.authorize(scope, route.pool)
        except Refused as refusal:
            record.decision = f"rejected_{refusal.reason}"
            await client.refuse(refusal, record)
            return
        except PolicyViolation as err:
            record.decision = f"rejected_{err.code}"
            await client.refuse(err, record)
            return
        notes: asyncio.Queue[dict[str, Any]] | None = None
        if route.queue_feedback:
            notes = asyncio.Queue()

        def on_position(position: int, eta_s: float) -> None:
            assert notes is not None
            notes.put_nowait({"type": "headroom.queue", "position": position,
                              "eta_s": round(eta_s, 1)})  # fmt: skip

        try:
            feedback = on_position if route.queue_feedback else None
            entry, fallback_pool = await enter(rt, route, scope, feedback)
            if fallback_pool is not None:
                record.pool = fallback_pool
            if isinstance(entry, Waiting):
                if notes is not None:
                    offered = offered[:1]
                    await client.accept(offered[0] if offered else None, [])
                    held = []
                    notifier = asyncio.ensure_future(_notify(client, notes))
                    try:
                        lease = await _wait(entry, receive, record, held,
                                            rt.settings.limits.max_message_bytes)  # fmt: skip
                    finally:
                        notifier.cancel()
                        with contextlib.suppress(BaseException):
                            await notifier
                else:
                    lease = await _wait(entry, receive, record, None, 0)
            else:
                lease = entry
        except Refused as refusal:
            record.decision = f"rejected_{refusal.reason}"
            await client.refuse(refusal, record)
            return
        except MessageTooLarge as err:
            record.decision = "abandoned"
            await client.refuse(err, record)
            return
        except PolicyViolation as err:  # a reservation token without a slot here
            record.decision = f"rejected_{err.code}"
            await client.refuse(err, record)
            return
        if lease is None:
            return
        record.admitted_at = clock.now()
        record.queue_wait_s = lease.waited_s
        record.replica = lease.replica
        if record.decision == "queued":
            record.decision = "admitted_after_queue"
        take_over: TakeOver | None = (
            scope.get("extensions", {}).get("headroom.splice", {}).get("take_over")
        )
        try:
            upstream = await _connect_while_present(
                rt, route, scope, receive, lease, offered, record, held,
                lean=take_over is not None,
            )  # fmt: skip
        except UpstreamConnectError as err:
            timeout = isinstance(err, UpstreamConnectTimeout)
            record.decision = "upstream_timeout" if timeout else "upstream_unreachable"
            record.error = str(err)
            await client.refuse(err, record)
            return
        except Refused as refusal:  # drained while connecting
            record.decision = f"rejected_{refusal.reason}"
            record.error = "gateway draining during the upstream connect"
            await client.refuse(refusal, record)
            return
        except MessageTooLarge as err:  # flooded an early accept while connecting
            record.error = str(err)
            await client.refuse(err, record)
            return
        if upstream is None:
            record.error = "client went away during the upstream connect"
            record.client_close = 1006
            return
        headers = [(FALLBACK_RESPONSE_HEADER, fallback_pool.encode())] if fallback_pool else []
        if client.accepted:
            while notes is not None and not notes.empty():
                await client.text(notes.get_nowait())
            await client.text({"type": "headroom.admitted"})
        if isinstance(upstream, UpstreamSocket):
            assert take_over is not None
            await _splice(rt, route, lease, upstream, take_over, headers, record, held or ())
            upstream = None
            return
        if not client.accepted:
            await client.accept(upstream.subprotocol, headers)
        await relay_frames(rt, route, lease, upstream, receive, send, record, held or ())
    except asyncio.CancelledError:
        record.error = "cancelled"
        raise
    except OSError:
        # uvicorn's ClientDisconnected: the client left while we were answering it
        # (e.g. during the upstream handshake). Not an error of ours.
        record.error = "client went away"
        if record.client_close is None:
            record.client_close = 1006
    except Exception as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        log.exception("internal error in session %s", record.session)
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": 1011, "reason": "internal error"})
    finally:
        # only on cancellation or an internal error:
        if isinstance(upstream, UpstreamSocket):
            upstream.abort()
        elif upstream is not None and upstream.state is not State.CLOSED:
            upstream.transport.abort()
        if lease is not None:
            lease.release()
        rt.release_tenant(tenant)
        record.ended = clock.now()
        record.emit()


async def _notify(client: _Client, notes: asyncio.Queue[dict[str, Any]]) -> None:
    while True:
        await client.text(await notes.get())
