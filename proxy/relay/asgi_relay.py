"""The ASGI relay of one WebSocket session (after both handshakes): the path when the
server offers no take-over of the client's socket -- the app under another ASGI server,
or an upgrade uvicorn's own protocol took after a plain request on a kept-alive
connection (:mod:`proxy.relay.listener`).

Upstream -> client runs in the session's own task; client -> upstream in one extra
task. Messages are relayed as they arrive, text as text and binary as binary. This
module is a shell over the session's :class:`~proxy.relay.relay_core.RelayCore`, like the
splice: the core decides what is forwarded and metered, when a limit or timeout ends
the session and with which close codes; the shell feeds it the server's ASGI messages, the
websockets client connection's messages and closes, and its one timer, and maps the
core's actions onto those libraries' calls (they run the closing handshakes and the
keepalive pings themselves).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, PayloadTooBig

from proxy.admission.refusal import truncate_reason
from proxy.admission.session_lease import Lease
from proxy.relay.relay_core import RelayCore
from proxy.relay.session_actions import DropSocket, RelayClose, SendClose, Wake
from proxy.relay.session_record import SessionRecord
from proxy.relay.session_states import Side

if TYPE_CHECKING:
    from proxy.metering.session_meter import SessionMeter
    from proxy.relay.lifecycle import SessionStop
    from proxy.relay.services import RelayServices
    from proxy.settings import RouteSettings

__all__ = ["relay_frames"]

log = logging.getLogger("headroom.relay.ws")

Receive = Any
Send = Any


class _Shell:
    """Carries out the core's actions for the ASGI relay."""

    __slots__ = (
        "client_close", "client_task", "clock", "core", "main_task", "services", "stalled",
        "timer", "timer_at", "upstream", "upstream_close",
    )  # fmt: skip

    def __init__(
        self, services: RelayServices, core: RelayCore, upstream: ClientConnection
    ) -> None:
        self.services = services
        self.clock = services.clock
        self.core = core
        self.upstream = upstream
        self.client_close: tuple[int, str] | None = None  # sent once the upstream is done
        self.upstream_close: tuple[int, str] | None = None
        self.stalled = False  # the client stopped reading: give up on it
        self.main_task = asyncio.current_task()
        self.client_task: asyncio.Future[None] | None = None
        self.timer: Any = None
        self.timer_at = float("inf")

    def run(self) -> None:
        actions = self.core.actions
        if not actions:
            return
        batch = actions[:]
        actions.clear()
        for action in batch:
            if isinstance(action, (SendClose, RelayClose)):
                if action.side is Side.CLIENT:
                    self.client_close = (action.code, action.reason)
                    self._stop_reading_client()
                else:
                    self.upstream_close = (action.code, action.reason)
                    reason = truncate_reason(action.reason)
                    self.services.spawn(self.upstream.close(action.code, reason))
            elif isinstance(action, Wake):
                self.arm(action.at)
            elif isinstance(action, DropSocket):
                if action.side is Side.CLIENT:  # uvicorn closes the socket when we return
                    self.stalled = True
                    self._stop_reading_client()
                    if self.main_task is not None:
                        self.main_task.cancel()
                else:
                    self.upstream.transport.abort()
            # PauseReading/ResumeReading: awaiting the send is the back-pressure here;
            # CloseSocket, Ping, Done: uvicorn and websockets do these themselves.

    def _stop_reading_client(self) -> None:
        task = self.client_task
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def arm(self, when: float) -> None:
        if when == self.timer_at or when == float("inf"):
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = when
        self.timer = self.clock.call_at(when, self._tick)

    def _tick(self) -> None:
        self.timer = None
        self.timer_at = float("inf")
        due = self.core.tick(self.clock.now())
        self.run()
        self.arm(due)

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


async def relay_frames(
    services: RelayServices,
    route: RouteSettings,
    lease: Lease,
    upstream: ClientConnection,
    receive: Receive,
    send: Send,
    record: SessionRecord,
    meter: SessionMeter,
    session_stop: SessionStop,
    pending: Sequence[dict[str, Any]] = (),
) -> None:
    """Relay until either side ends, metering into ``meter`` (the caller finishes it);
    drain ends the relay through ``session_stop``. ``pending``: client messages received
    before the upstream was connected (queue-feedback mode), sent upstream first, in
    order."""
    clock = services.clock
    backlog = deque(pending)
    pool, replica = lease.pool, lease.replica
    core = RelayCore(
        services.settings.limits, record, services.ws_adapter(route, meter),
        lambda kind: services.upstream_error(pool, replica, kind), clock.now(),
    )  # fmt: skip
    shell = _Shell(services, core, upstream)
    run = shell.run
    client, up = core.client, core.upstream

    def stop(code: int, reason: str) -> None:
        core.stop(code, reason, clock.now())
        run()

    async def client_to_upstream() -> None:
        while True:
            message = backlog.popleft() if backlog else await receive()
            kind = message["type"]
            if kind == "websocket.receive":
                now = clock.now()
                text = message.get("text")
                if text is not None:
                    size = len(text) if text.isascii() else len(text.encode())
                    if not core.data_frame(client, size, now):
                        run()
                        return
                    core.text(client, text, now, size)
                    await upstream.send(text)
                else:
                    data = message.get("bytes") or b""
                    if not core.data_frame(client, len(data), now):
                        run()
                        return
                    core.binary(client, data, now, len(data))
                    await upstream.send(data)
            elif kind == "websocket.disconnect":
                now = clock.now()
                core.close_received(
                    client, message.get("code", 1005), message.get("reason") or "", now
                )
                core.connection_lost(client, now)
                run()
                return

    client_task = shell.client_task = asyncio.ensure_future(client_to_upstream())
    shell.arm(core.next_deadline())
    client_task.add_done_callback(lambda t: _on_client_done(t, stop))
    session_stop.attach(stop)
    try:
        try:
            async for message in upstream:
                now = clock.now()
                size = len(message)
                if not core.data_frame(up, size, now):
                    run()
                    continue
                core.buffer_full(client, now)  # until the send returns: the write watchdog
                if isinstance(message, str):
                    core.text(up, message, now, size)
                    run()
                    await send({"type": "websocket.send", "text": message})
                else:
                    core.binary(up, message, now, size)
                    run()
                    await send({"type": "websocket.send", "bytes": message})
                core.buffer_drained(client, clock.now())
                run()
        except ConnectionClosed:
            pass
        except asyncio.CancelledError:
            main_task = shell.main_task
            if not shell.stalled or main_task is None or main_task.uncancel():
                raise
            return  # nothing more can be sent to this client; uvicorn closes the socket
        except OSError:
            # uvicorn's ClientDisconnected: the client vanished while we were sending.
            now = clock.now()
            core.buffer_drained(client, now)  # that send is over: the watchdog must not fire
            core.connection_lost(client, now)
            run()
            if shell.upstream_close is not None:
                code, reason = shell.upstream_close
                with contextlib.suppress(Exception):
                    await upstream.close(code, truncate_reason(reason))
        _upstream_ended(core, upstream, clock.now())
        run()
        if shell.client_close is not None:
            code, reason = shell.client_close
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": code,
                            "reason": truncate_reason(reason)})  # fmt: skip
    finally:
        shell.cancel_timer()
        if not client_task.done():
            client_task.cancel()
        with contextlib.suppress(BaseException):
            await client_task


def _upstream_ended(core: RelayCore, upstream: ClientConnection, now: float) -> None:
    """The upstream connection is closed: tell the core how."""
    rcvd = upstream.close_code
    up = core.upstream
    if isinstance(upstream.protocol.parser_exc, PayloadTooBig):
        core.too_large(up, now)
    elif rcvd is not None and rcvd != 1006:
        core.close_received(up, rcvd, upstream.close_reason or "", now)
    core.connection_lost(up, now)
    core.record.upstream_close = rcvd


def _on_client_done(task: asyncio.Future[None], stop: Callable[[int, str], None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is None or isinstance(exc, ConnectionClosed):
        return  # (upstream went away while we were sending: the upstream loop reports it)
    log.error("client pump failed: %r", exc)
    stop(1011, "internal error")
