"""The frame pumps of one relayed WebSocket session (after both handshakes).

Upstream -> client runs in the session's own task; client -> upstream in one extra
task. Frames are relayed as they arrive, text as text and binary as binary, each
metered by the route protocol's adapter on the way down. Close codes travel both ways;
limits (message size, idle, session length, drain) end a session with a close code for
the client (:class:`Closing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, PayloadTooBig

from proxy.errors import MessageTooLarge
from proxy.gate import Lease
from proxy.refusal import truncate_reason
from proxy.relay.session import SessionRecord
from proxy.relay.wsframes import client_code_for_upstream_close, sendable_code

if TYPE_CHECKING:
    from proxy.runtime import Runtime
    from proxy.settings import RouteSettings

__all__ = ["relay_frames"]

log = logging.getLogger("headroom.relay.ws")

Receive = Any
Send = Any

class Closing(Exception):
    """Ends a relay with a close code for the client (limits, timeouts, drain)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _Pump:
    """State shared by the two directions of one relay."""

    __slots__ = ("client_closed", "closing", "last_activity", "send_since", "stalled")

    def __init__(self, now: float) -> None:
        self.last_activity = now
        self.closing: Closing | None = None
        self.client_closed: tuple[int, str] | None = None
        self.send_since: float | None = None  # a send to the client is blocked since
        self.stalled = False  # the client stopped reading: give up on it


async def relay_frames(
    rt: Runtime,
    route: RouteSettings,
    lease: Lease,
    upstream: ClientConnection,
    receive: Receive,
    send: Send,
    record: SessionRecord,
    pending: Sequence[dict[str, Any]] = (),
) -> None:
    """Relay until either side ends. ``pending``: client messages received before the
    upstream was connected (queue-feedback mode), sent upstream first, in order."""
    clock = rt.clock
    backlog = deque(pending)
    limits = rt.settings.limits
    max_bytes = limits.max_message_bytes
    meter = rt.new_meter(lease.pool, lease.replica, record.admitted_at or clock.now())
    adapter = rt.ws_adapter(route, meter)
    state = _Pump(clock.now())
    timers: list[Any] = []
    idle_timer: list[Any] = []
    writer_timer: list[Any] = []

    def stop(code: int, reason: str) -> None:
        if state.closing is None:
            state.closing = Closing(code, reason)
            client_task.cancel()
            rt.spawn(upstream.close(1000 if code != 1012 else 1001, reason))

    main_task = asyncio.current_task()
    write_timeout = limits.client_write_timeout_s

    def check_writer() -> None:
        """A client whose socket buffer stays full (it stopped reading) would hold its
        slot forever and pin the upstream: after ``client_write_timeout_s``, drop it."""
        since = state.send_since
        if since is not None and clock.now() - since >= write_timeout:
            state.stalled = True
            record.error = "client stopped reading"
            stop(1008, "client not reading")
            if main_task is not None:
                main_task.cancel()
        else:
            writer_timer[:] = [clock.call_at(clock.now() + write_timeout / 4, check_writer)]

    def check_idle() -> None:
        due = state.last_activity + limits.idle_timeout_s
        if clock.now() >= due - 1e-6:
            stop(1008, "idle timeout")
        else:
            idle_timer[:] = [clock.call_at(due, check_idle)]

    async def client_to_upstream() -> None:
        while True:
            message = backlog.popleft() if backlog else await receive()
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
                await upstream.close(sendable_code(code, 1001), truncate_reason(reason))
                return

    client_task = asyncio.ensure_future(client_to_upstream())
    rt.register_session(stop)
    if limits.idle_timeout_s:
        idle_timer.append(clock.call_at(clock.now() + limits.idle_timeout_s, check_idle))
    if limits.max_session_s:
        timers.append(
            clock.call_at(clock.now() + limits.max_session_s,
                          lambda: stop(1008, "maximum session duration reached"))
        )  # fmt: skip
    writer_timer.append(clock.call_at(clock.now() + write_timeout / 4, check_writer))
    client_task.add_done_callback(lambda t: _on_client_done(t, upstream, state, stop))
    try:
        try:
            async for message in upstream:
                now = clock.now()
                state.last_activity = now
                state.send_since = now
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
                state.send_since = None
        except ConnectionClosed:
            pass
        except asyncio.CancelledError:
            if not state.stalled or main_task is None or main_task.uncancel():
                raise
            return  # nothing more can be sent to this client; uvicorn closes the socket
        except OSError:
            # uvicorn's ClientDisconnected: the client vanished while we were sending.
            state.send_since = None  # that send is over: the write watchdog must not fire
            if state.client_closed is None:
                state.client_closed = (1006, "")
                record.client_close = 1006
            with contextlib.suppress(Exception):
                await upstream.close(1001, "client went away")
        await _finish(rt, lease, upstream, send, state, record)
    finally:
        rt.unregister_session(stop)
        for timer in timers + idle_timer + writer_timer:
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
    else:
        code = client_code_for_upstream_close(rcvd)
        reason = (upstream.close_reason or "") if rcvd != 1005 else ""
        if code == 1011:
            rt.upstream_error(lease.pool, lease.replica, "upstream_internal_error")
    record.client_close = code
    with contextlib.suppress(Exception):
        await send({"type": "websocket.close", "code": code, "reason": truncate_reason(reason)})
