"""The WebSocket relay.

Order of a session: the client's handshake arrives -> the gate decides (while queued,
the handshake is simply held: transparent to the client) -> connect to the chosen
replica at the ws(s) form of its URL with the same path and query (failing over to
another replica before any byte flows) -> accept the client with the subprotocol the
upstream chose -> relay frames both ways as they arrive (text stays text, binary
stays binary, message boundaries kept, nothing re-buffered) -> propagate close codes
and reasons both ways -> release the slot when either side ends.

Close codes sent to the client: the upstream's own code when it closed cleanly (e.g.
4001), 1014 when the upstream failed or could not be reached, 1008 for limits (message
size, idle, session length), 1013 for ``refusal: close`` refusals, 1012 on drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    PayloadTooBig,
)
from websockets.protocol import State
from websockets.typing import Subprotocol

from proxy.errors import (
    HeadroomError,
    MessageTooLarge,
    Refused,
    UpstreamConnectError,
)
from proxy.gate import Lease, Waiting
from proxy.refusal import close_reason, error_event, http_error, truncate_reason
from proxy.relay.headers import forwarded_request_headers
from proxy.relay.session import SessionRecord, new_session_id

if TYPE_CHECKING:
    from proxy.runtime import Runtime
    from proxy.settings import RouteSettings

__all__ = ["relay_websocket"]

log = logging.getLogger("headroom.relay.ws")

Scope = dict[str, Any]
Receive = Any
Send = Any

#: Codes a peer may put in a close frame (RFC 6455 7.4); others are mapped.
_SENDABLE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})


def _sendable(code: int | None, default: int = 1000) -> int:
    if code is None:
        return default
    if code in _SENDABLE or 3000 <= code <= 4999:
        return code
    return default


class _Closing(Exception):
    """Ends a relay with a close code for the client (limits, timeouts, drain)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


async def _await_disconnect(receive: Receive) -> dict[str, Any]:
    """Before accept the client can only go away; wait for that."""
    while True:
        message: dict[str, Any] = await receive()
        if message["type"] == "websocket.disconnect":
            return message


async def _admit(
    rt: Runtime, route: RouteSettings, receive: Receive, record: SessionRecord
) -> Lease | None:
    """A lease, None if the client left while queued; raises Refused."""
    entry = rt.gate.enter(route.pool)
    if isinstance(entry, Lease):
        return entry
    return await _wait_in_queue(entry, receive, record)


async def _wait_in_queue(
    waiting: Waiting, receive: Receive, record: SessionRecord
) -> Lease | None:
    record.decision = "queued"
    wait_task = asyncio.ensure_future(waiting.wait())
    gone_task = asyncio.ensure_future(_await_disconnect(receive))
    try:
        await asyncio.wait({wait_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (wait_task, gone_task):
            if not task.done():
                task.cancel()
        # The cancelled wait leaves the queue (or hands a just-granted slot back).
        await asyncio.gather(wait_task, gone_task, return_exceptions=True)
    if gone_task.done() and not gone_task.cancelled() and gone_task.exception() is None:
        record.decision = "abandoned"
        if wait_task.done() and not wait_task.cancelled() and wait_task.exception() is None:
            wait_task.result().release()
        return None
    return wait_task.result()  # a Lease, or raises Refused


async def _deny(
    send: Send, scope: Scope, route: RouteSettings, err: HeadroomError, record: SessionRecord
) -> None:
    """Refuse the handshake: an HTTP denial, or accept + error event + close."""
    denial = "websocket.http.response" in scope.get("extensions", {})
    if route.refusal == "http" and denial:
        status, headers, body = http_error(err)
        record.status = status
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    protocol = route.inner_protocol or route.protocol
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": error_event(protocol, err)})
    await send({"type": "websocket.close", "code": err.close_code, "reason": close_reason(err)})
    record.client_close = err.close_code


async def _connect_upstream(
    rt: Runtime, route: RouteSettings, scope: Scope, lease: Lease, record: SessionRecord
) -> ClientConnection:
    """Connect to the lease's replica, failing over to others before any byte flows."""
    limits = rt.settings.limits
    headers = forwarded_request_headers(
        scope["headers"],
        client_host=(scope.get("client") or (None,))[0],
        scheme=scope.get("scheme", "ws"),
        websocket=True,
    )
    user_agent = next((v for k, v in headers if k == "user-agent"), None)
    headers = [(k, v) for k, v in headers if k != "user-agent"]
    subprotocols = list(scope.get("subprotocols") or [])
    path = route.upstream_path or scope.get("raw_path", b"").decode("latin-1").split("?")[0]
    path = path or scope["path"]
    query = scope.get("query_string", b"").decode("latin-1")
    while True:
        url = rt.ws_url(lease.pool, lease.replica) + path + (f"?{query}" if query else "")
        try:
            return await connect(
                url,
                additional_headers=headers,
                subprotocols=[Subprotocol(p) for p in subprotocols] or None,
                user_agent_header=user_agent,
                compression=None,
                proxy=None,
                open_timeout=limits.handshake_timeout_s,
                ping_interval=limits.ping_interval_s or None,
                ping_timeout=limits.ping_timeout_s or None,
                close_timeout=5,
                max_size=limits.max_message_bytes,
                max_queue=16,
                write_limit=64 * 1024,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            kind = "handshake"
            reason = f"upstream {lease.replica} answered the handshake with HTTP {status}"
            if status < 500:
                # The upstream refused this client (auth, path...): not a replica fault.
                rt.upstream_error(lease.pool, lease.replica, kind)
                raise UpstreamConnectError(reason, replica=lease.replica, kind=kind) from exc
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            kind = "connect"
            reason = f"cannot reach upstream {lease.replica}: {exc or type(exc).__name__}"
        rt.upstream_error(lease.pool, lease.replica, kind)
        log.warning("%s; failing over", reason)
        failed = lease.replica
        if not lease.fail_over():
            raise UpstreamConnectError(reason, replica=failed, kind=kind)
        record.replica = lease.replica


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
    lease: Lease | None = None
    upstream: ClientConnection | None = None
    try:
        try:
            lease = await _admit(rt, route, receive, record)
        except Refused as refusal:
            record.decision = f"rejected_{refusal.reason}"
            await _deny(send, scope, route, refusal, record)
            return
        if lease is None:
            return
        record.admitted_at = clock.now()
        record.queue_wait_s = lease.waited_s
        record.replica = lease.replica
        if record.decision == "queued":
            record.decision = "admitted_after_queue"
        try:
            upstream = await _connect_upstream(rt, route, scope, lease, record)
        except UpstreamConnectError as err:
            record.decision = "upstream_unreachable"
            record.error = str(err)
            await _deny(send, scope, route, err, record)
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        await _relay(rt, route, lease, upstream, receive, send, record)
    except asyncio.CancelledError:
        record.error = "cancelled"
        raise
    except Exception as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        log.exception("internal error in session %s", record.session)
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": 1011, "reason": "internal error"})
    finally:
        if upstream is not None and upstream.state is not State.CLOSED:
            upstream.transport.abort()  # only on cancellation or an internal error
        if lease is not None:
            lease.release()
        record.ended = clock.now()
        record.emit()


class _Pump:
    """State shared by the two directions of one relay."""

    __slots__ = ("client_closed", "closing", "last_activity")

    def __init__(self, now: float) -> None:
        self.last_activity = now
        self.closing: _Closing | None = None
        self.client_closed: tuple[int, str] | None = None


async def _relay(
    rt: Runtime,
    route: RouteSettings,
    lease: Lease,
    upstream: ClientConnection,
    receive: Receive,
    send: Send,
    record: SessionRecord,
) -> None:
    clock = rt.clock
    limits = rt.settings.limits
    max_bytes = limits.max_message_bytes
    meter = rt.new_meter(lease.pool, lease.replica, record.admitted_at or clock.now())
    adapter = rt.ws_adapter(route, meter)
    state = _Pump(clock.now())
    timers: list[Any] = []

    def stop(code: int, reason: str) -> None:
        if state.closing is None:
            state.closing = _Closing(code, reason)
            client_task.cancel()
            rt.spawn(upstream.close(1000 if code != 1012 else 1001, reason))

    def check_idle() -> None:
        idle_s = limits.idle_timeout_s
        due = state.last_activity + idle_s
        if clock.now() >= due - 1e-6:
            stop(1008, "idle timeout")
        else:
            timers.append(clock.call_at(due, check_idle))

    async def client_to_upstream() -> None:
        while True:
            message = await receive()
            kind = message["type"]
            if kind == "websocket.receive":
                now = clock.now()
                state.last_activity = now
                text = message.get("text")
                if text is not None:
                    if len(text) > max_bytes // 4 and len(text.encode()) > max_bytes:
                        raise MessageTooLarge(f"message over {max_bytes} bytes")
                    record.frames_up += 1
                    record.bytes_up += len(text)
                    adapter.client_text(now, text)
                    await upstream.send(text)
                else:
                    data = message.get("bytes") or b""
                    if len(data) > max_bytes:
                        raise MessageTooLarge(f"message over {max_bytes} bytes")
                    record.frames_up += 1
                    record.bytes_up += len(data)
                    adapter.client_binary(now, data)
                    await upstream.send(data)
            elif kind == "websocket.disconnect":
                code = message.get("code", 1005)
                reason = message.get("reason") or ""
                state.client_closed = (code, reason)
                record.client_close = code
                await upstream.close(_sendable(code, 1001), truncate_reason(reason))
                return

    client_task = asyncio.ensure_future(client_to_upstream())
    rt.register_session(stop)
    if limits.idle_timeout_s:
        timers.append(clock.call_at(clock.now() + limits.idle_timeout_s, check_idle))
    if limits.max_session_s:
        timers.append(
            clock.call_at(clock.now() + limits.max_session_s,
                          lambda: stop(1008, "maximum session duration reached"))
        )  # fmt: skip
    client_task.add_done_callback(lambda t: _on_client_done(t, upstream, state, stop))
    try:
        try:
            async for message in upstream:
                now = clock.now()
                state.last_activity = now
                if isinstance(message, str):
                    adapter.upstream_text(now, message)
                    record.bytes_down += len(message)
                    record.frames_down += 1
                    await send({"type": "websocket.send", "text": message})
                else:
                    adapter.upstream_binary(now, message)
                    record.bytes_down += len(message)
                    record.frames_down += 1
                    await send({"type": "websocket.send", "bytes": message})
        except ConnectionClosed:
            pass
        except OSError:
            # uvicorn's ClientDisconnected: the client vanished while we were sending.
            if state.client_closed is None:
                state.client_closed = (1006, "")
                record.client_close = 1006
            with contextlib.suppress(Exception):
                await upstream.close(1001, "client went away")
        await _finish(rt, lease, upstream, send, state, record)
    finally:
        rt.unregister_session(stop)
        for timer in timers:
            timer.cancel()
        if not client_task.done():
            client_task.cancel()
        with contextlib.suppress(BaseException):
            await client_task
        summary = meter.finish(clock.now())
        record.meter = summary.as_log_fields()


def _on_client_done(
    task: asyncio.Future[None], upstream: ClientConnection, state: _Pump, stop: Any
) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is None:
        return
    if isinstance(exc, MessageTooLarge):
        stop(1008, str(exc))
    elif isinstance(exc, ConnectionClosed):
        pass  # upstream went away while we were sending; the upstream loop reports it
    else:
        log.error("client pump failed: %r", exc)
        stop(1011, "internal error")


async def _finish(
    rt: Runtime,
    lease: Lease,
    upstream: ClientConnection,
    send: Send,
    state: _Pump,
    record: SessionRecord,
) -> None:
    """Both directions are over: tell the client why, in one close frame."""
    rcvd = upstream.close_code
    record.upstream_close = rcvd
    if state.client_closed is not None:
        return  # the client ended it; nothing more to send
    if state.closing is not None:
        code, reason = state.closing.code, state.closing.reason
    elif isinstance(upstream.protocol.parser_exc, PayloadTooBig):
        rt.upstream_error(lease.pool, lease.replica, "protocol")
        code, reason = 1014, "upstream message too large"
    elif rcvd is None or rcvd == 1006:
        rt.upstream_error(lease.pool, lease.replica, "midstream")
        code, reason = 1014, "upstream connection lost"
    elif rcvd == 1005:
        code, reason = 1000, ""
    else:
        code, reason = _sendable(rcvd, 1011), upstream.close_reason or ""
        if code == 1011:
            rt.upstream_error(lease.pool, lease.replica, "upstream_internal_error")
    record.client_close = code
    with contextlib.suppress(Exception):
        await send({"type": "websocket.close", "code": code, "reason": truncate_reason(reason)})
