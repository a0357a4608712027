"""The relay hot path: one admitted WebSocket session spliced in protocol callbacks.

After both handshakes, the client's socket (taken over from uvicorn,
:mod:`proxy.relay.uvicorn_ws`) and the upstream's (:mod:`proxy.relay.upstream_ws`)
forward bytes to each other as they are read: a server frame is valid unchanged on the
client leg and a masked client frame on the upstream leg, so nothing is re-framed,
copied into message objects or handed to a task. Each leg walks the frame headers of
what it reads, incrementally, to:

- meter: every upstream message goes to the route's adapter (binary payloads as they
  stand; text is assembled and decoded; client text is unmasked for the adapters that
  read it);
- enforce limits: a message over ``max_message_bytes`` is not forwarded (client: 1008;
  upstream: 1014 and a ``protocol`` upstream error);
- run the closing handshake: close frames are read, their codes recorded and mapped as
  the ASGI relay does (the upstream's code when it is sendable, 1000 for none, 1011 for
  codes a peer may not send, 1014 when the upstream vanishes), and Headroom's own
  closes (limits, idle, session length, drain 1012) are written at a frame boundary;
- keep both legs alive: a leg silent for ``ping_interval_s`` gets a ping between
  frames, and is dead if nothing at all arrives within ``ping_timeout_s``. The answer
  reaches the other endpoint as an unsolicited pong, which RFC 6455 5.5.3 allows.

Back-pressure is end to end: a leg whose socket buffer is full pauses reading on the
other leg; a client that stops reading for ``client_write_timeout_s`` is dropped (1008
upstream-side, so its slot is freed). One timer per session covers idle, session
length, the write watchdog and the close deadline; one sweep a second per event loop
sends the pings (:class:`_Keepalive`). Frame parsing is in :mod:`proxy.relay.splice_leg`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from typing import TYPE_CHECKING

from proxy.relay.splice_leg import Leg
from proxy.relay.wsframes import (
    BINARY,
    PING,
    TEXT,
    client_code_for_upstream_close,
    close_fields,
    close_frame,
    frame,
    sendable_code,
)  # fmt: skip

if TYPE_CHECKING:
    from proxy.clock import Clock, TimerHandle
    from proxy.gate import Lease
    from proxy.protocols.base import WsAdapter
    from proxy.relay.session import SessionRecord
    from proxy.runtime import Runtime
    from proxy.settings import LimitsSettings

__all__ = ["Splice", "close_frame", "frame"]

log = logging.getLogger("headroom.relay.ws")

#: How long a closing handshake may take (then: upstream aborted, client socket closed).
CLOSE_TIMEOUT_S = 5.0


def _invalid_close(payload: bytes, code: int) -> tuple[int, str] | None:
    """Why a client's close frame is invalid (RFC 6455 5.5.1, 7.4), as our answer."""
    if len(payload) == 1 or (payload and sendable_code(code, -1) != code):
        return 1002, "invalid close frame"
    try:
        payload[2:].decode()
    except UnicodeDecodeError:
        return 1007, "invalid UTF-8 in the close reason"
    return None


class _Keepalive:
    """Pings for every spliced session on one event loop: one sweep a second instead
    of a timer per session and leg."""

    PERIOD_S = 1.0

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sessions: set[Splice] = set()
        self._handle: asyncio.TimerHandle | None = None

    def add(self, session: Splice) -> None:
        self.sessions.add(session)
        if self._handle is None:
            self._handle = self.loop.call_later(self.PERIOD_S, self._sweep)

    def discard(self, session: Splice) -> None:
        self.sessions.discard(session)

    def _sweep(self) -> None:
        self._handle = None
        now = self.loop.time()
        for session in list(self.sessions):
            try:
                session.keepalive(now)
            except Exception:
                log.exception("keepalive sweep failed for %r", session)
                session.fail()
        if self.sessions:
            self._handle = self.loop.call_later(self.PERIOD_S, self._sweep)


_keepalives: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Keepalive] = (
    weakref.WeakKeyDictionary()
)


def _keepalive_for(loop: asyncio.AbstractEventLoop) -> _Keepalive:
    keepalive = _keepalives.get(loop)
    if keepalive is None:
        keepalive = _keepalives[loop] = _Keepalive(loop)
    return keepalive


class Splice:
    """One spliced session: its two legs, limits, metering and closing handshake.
    :attr:`done` resolves once both sockets are closed."""

    def __init__(
        self,
        rt: Runtime,
        lease: Lease,
        adapter: WsAdapter,
        record: SessionRecord,
        limits: LimitsSettings,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.rt = rt
        self.lease = lease
        self.adapter = adapter
        self.record = record
        self.limits = limits
        self.clock: Clock = rt.clock
        now = self.clock.now()
        self.started = now
        self.max_bytes = limits.max_message_bytes
        self.last_activity = now
        self.client = Leg(self, is_client=True, now=now)
        self.upstream = Leg(self, is_client=False, now=now)
        self.client.peer = self.upstream
        self.upstream.peer = self.client
        self.closing: tuple[int, str] | None = None  # Headroom ended it: code, reason
        self.client_closed = False  # the client started the closing handshake
        self.close_deadline: float | None = None
        self.send_since: float | None = None  # the client's socket buffer is full since
        loop = loop or asyncio.get_running_loop()
        self.done: asyncio.Future[None] = loop.create_future()
        self._keepalive = _keepalive_for(loop) if limits.ping_interval_s else None
        self._timer: TimerHandle | None = None
        self._timer_at = float("inf")

    # -- life cycle ----------------------------------------------------------------------

    def start(
        self,
        client: asyncio.Transport,
        client_early: bytes,
        upstream: asyncio.Transport,
        upstream_early: bytes,
        upstream_lost: bool,
    ) -> None:
        """Both handshakes are done: wire the sockets and read what arrived early."""
        self.client.transport = client
        self.upstream.transport = upstream
        upstream.set_protocol(self.upstream)
        if upstream_early:
            self.upstream.data_received(upstream_early)
        if client_early and not self.client.closed:
            self.client.data_received(client_early)
        if upstream_lost:
            self.upstream.connection_lost(None)
        elif not self.upstream.closed:
            upstream.resume_reading()
        if self._keepalive is not None:
            now = self._keepalive.loop.time()
            self.client.silent_since = self.upstream.silent_since = now
            self._keepalive.add(self)
        self._arm(self._next_due())

    def stop(self, code: int, reason: str, upstream_code: int | None = None) -> None:
        """End the session from Headroom's side: ``code`` for the client, 1000 (1001 on
        drain, or ``upstream_code``) for the upstream; data stops at a frame boundary."""
        if self.closing is not None or self.done.done():
            return
        self.closing = (code, reason)
        client, upstream = self.client, self.upstream
        if not client.close_sent and not client.closed:
            client.close_sent = True
            self.record.client_close = code
            upstream.inject(close_frame(code, reason, masked=False))
        upstream.forwarding = False
        if not upstream.close_sent and not upstream.closed:
            upstream.close_sent = True
            if upstream_code is None:
                upstream_code = 1001 if code == 1012 else 1000
            client.inject(close_frame(upstream_code, reason, masked=True))
        client.forwarding = False
        self._closing_started()
        self._settle()

    def _closing_started(self) -> None:
        if self.close_deadline is None:
            self.close_deadline = self.clock.now() + CLOSE_TIMEOUT_S
            self._arm(self.close_deadline)

    def _settle(self) -> None:
        """Close what is finished: the client's socket once close frames crossed both
        ways (the server closes TCP first); then resolve :attr:`done`."""
        client, upstream = self.client, self.upstream
        if not client.closed and client.close_sent and client.close_rcvd:
            client.closed = True
            client.transport.close()
            self.lost(client)
            return
        if client.closed and upstream.closed and not self.done.done():
            if self._keepalive is not None:
                self._keepalive.discard(self)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.done.set_result(None)

    def lost(self, leg: Leg) -> None:
        """A socket is gone (closed by us or by the other end)."""
        client, upstream = self.client, self.upstream
        record = self.record
        if leg is upstream:
            self._resume(client)
            if not upstream.close_rcvd and self.closing is None and not self.client_closed:
                record.upstream_close = None
                self._upstream_error("midstream")
                self.closing = (1014, "upstream connection lost")
                if not client.close_sent and not client.closed:
                    client.close_sent = True
                    record.client_close = 1014
                    client.write(close_frame(1014, "upstream connection lost", masked=False))
            if not client.closed and not client.close_sent:
                # nothing more will come from upstream: finish the client's side now
                client.close_sent = True
                client.write(close_frame(1000, "", masked=False))
            self._closing_started()
        else:
            self._resume(upstream)
            if not client.close_rcvd:
                if record.client_close is None:
                    record.client_close = 1006
                if self.closing is None and not self.client_closed:
                    self.client_closed = True
            if not upstream.close_sent and not upstream.closed:
                upstream.close_sent = True
                upstream.write(close_frame(1001, "client went away", masked=True))
            self._closing_started()
        self._settle()

    # -- frames --------------------------------------------------------------------------

    def message(self, leg: Leg, opcode: int, payload: bytes, now: float, size: int) -> None:
        """A complete data message of ``size`` bytes (``payload`` empty when its content
        is not needed)."""
        record = self.record
        if leg.is_client:
            record.frames_up += 1
            record.bytes_up += size
            if opcode == TEXT:
                try:
                    text = payload.decode()
                except UnicodeDecodeError:
                    self.stop(1007, "invalid UTF-8 in a text message")
                    return
                self.adapter.client_text(now, text)
            return
        record.frames_down += 1
        record.bytes_down += size
        if opcode == BINARY:
            self.adapter.upstream_binary(now, payload)
            return
        try:
            text = payload.decode()
        except UnicodeDecodeError:
            self._upstream_error("protocol")
            self.stop(1014, "upstream sent invalid UTF-8", upstream_code=1007)
            return
        self.adapter.upstream_text(now, text)

    def _upstream_error(self, kind: str) -> None:
        self.rt.upstream_error(self.lease.pool, self.lease.replica, kind)

    def too_large(self, leg: Leg) -> None:
        if leg.is_client:
            self.record.error = "client message too large"
            self.stop(1008, f"message over {self.max_bytes} bytes")
        else:
            self._upstream_error("protocol")
            self.stop(1014, "upstream message too large", upstream_code=1009)

    def protocol_error(self, leg: Leg, what: str) -> None:
        """``leg``'s endpoint broke RFC 6455 (:func:`proxy.relay.splice_leg.violation`):
        the offending frame is not forwarded, and the connection is failed (7.1.7): our
        close frame is flushed and the socket closed, nothing more is read from it."""
        if leg.is_client:
            self.record.error = f"client protocol error: {what}"
            self.stop(1002, what)
        else:
            self._upstream_error("protocol")
            self.stop(1014, f"upstream protocol error: {what}", upstream_code=1002)
        if not leg.closed:
            leg.close_rcvd = True  # no close frame will be read from it: none is awaited
            leg.forwarding = False
            leg.closed = True
            leg.transport.close()
            self.lost(leg)

    def close_received(self, leg: Leg, payload: bytes, raw: bytes) -> None:
        """A close frame from ``leg``'s endpoint (``raw``: the frame as it came)."""
        if leg.close_rcvd:
            return
        leg.close_rcvd = True
        leg.forwarding = False
        code, reason = close_fields(payload)
        client, upstream = self.client, self.upstream
        record = self.record
        if leg is client:
            invalid = _invalid_close(payload, code)
            if invalid is not None:  # answered, not forwarded
                record.client_close = code
                self.stop(*invalid)
                return
            if self.closing is None and not client.close_sent:
                self.client_closed = True  # the client started it
                record.client_close = code
            if not upstream.close_sent and not upstream.closed:
                upstream.close_sent = True
                upstream.write(raw)
        else:
            record.upstream_close = code
            if not client.close_sent and not client.closed:
                client.close_sent = True
                if not self.client_closed:  # not the answer to the client's close: mapped
                    mapped = client_code_for_upstream_close(code)
                    if mapped != code:
                        raw = close_frame(mapped, reason if code != 1005 else "", masked=False)
                    if mapped == 1011:
                        self._upstream_error("upstream_internal_error")
                    record.client_close = mapped
                client.write(raw)
        self._closing_started()
        self._settle()

    # -- flow control --------------------------------------------------------------------

    def paused(self, leg: Leg, paused: bool) -> None:
        """``leg``'s socket buffer filled up (or drained): stop (resume) reading the
        other leg, so a slow reader slows its sender instead of growing our memory."""
        other = leg.peer
        if leg.is_client:
            self.send_since = None
            if paused:
                self.send_since = now = self.clock.now()
                self._arm(now + self.limits.client_write_timeout_s)
        if other.closed:
            return
        if paused:
            other.transport.pause_reading()
        else:
            other.transport.resume_reading()

    def _resume(self, leg: Leg) -> None:
        if not leg.closed and not leg.transport.is_reading():
            leg.transport.resume_reading()

    # -- the timer -----------------------------------------------------------------------

    def _next_due(self) -> float:
        limits = self.limits
        due = float("inf")
        if self.close_deadline is not None:
            return self.close_deadline
        if limits.idle_timeout_s:
            due = self.last_activity + limits.idle_timeout_s
        if limits.max_session_s:
            due = min(due, self.started + limits.max_session_s)
        if self.send_since is not None:
            due = min(due, self.send_since + limits.client_write_timeout_s)
        return due

    def _arm(self, when: float) -> None:
        if when >= self._timer_at or when == float("inf"):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self.clock.call_at(when, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        if self.done.done():
            return
        now = self.clock.now()
        limits = self.limits
        eps = 1e-6
        if self.close_deadline is not None:
            if now >= self.close_deadline - eps:
                self._close_overdue()
                return
        else:
            if self.send_since is not None and (
                now >= self.send_since + limits.client_write_timeout_s - eps
            ):
                self.record.error = "client stopped reading"
                client = self.client
                client.close_sent = True  # nothing more can be written to it
                self.record.client_close = 1008
                self.stop(1008, "client not reading")
                client.drop()
                self.lost(client)
                return
            if limits.idle_timeout_s and now >= self.last_activity + limits.idle_timeout_s - eps:
                self.stop(1008, "idle timeout")
                return
            if limits.max_session_s and now >= self.started + limits.max_session_s - eps:
                self.stop(1008, "maximum session duration reached")
                return
        self._arm(self._next_due())

    def _close_overdue(self) -> None:
        """The closing handshake took too long. The upstream is dropped; the client's
        socket is closed gracefully -- what it has not read yet, close frame included,
        is still delivered (a slow reader is not cut short) -- and dropped after
        ``client_write_timeout_s`` if it never drains. The slot is freed now."""
        client, upstream = self.client, self.upstream
        upstream.drop()
        if not client.closed:
            client.closed = True
            transport = client.transport
            if not client.close_sent:
                client.close_sent = True
                transport.write(close_frame(1000, "", masked=False))
            transport.close()
            self.clock.call_at(
                self.clock.now() + self.limits.client_write_timeout_s, transport.abort
            )
        self._settle()

    def keepalive(self, now: float) -> None:
        """One sweep of :class:`_Keepalive` (``now``: loop time, not the injected clock:
        liveness is about real sockets)."""
        if self.closing is not None or self.close_deadline is not None:
            return
        limits = self.limits
        for leg in (self.client, self.upstream):
            if leg.closed:
                continue
            if leg.fresh:
                leg.fresh = False
                leg.silent_since = now
                leg.ping_at = None
            elif leg.ping_at is not None:
                if now - leg.ping_at >= limits.ping_timeout_s:
                    self._dead(leg)
                    return
            elif now - leg.silent_since >= limits.ping_interval_s:
                leg.ping_at = now
                leg.write(frame(PING, os.urandom(4), masked=not leg.is_client))

    def _dead(self, leg: Leg) -> None:
        """No answer to a keepalive ping: the endpoint (or the path to it) is gone."""
        if leg.is_client:
            self.record.error = "client keepalive timeout"
            self.record.client_close = 1006
            leg.close_sent = True
            self.stop(1011, "keepalive ping timeout")
        else:
            self._upstream_error("midstream")
            self.stop(1014, "upstream connection lost", upstream_code=1011)
        leg.drop()
        self.lost(leg)

    # -- drain and shutdown --------------------------------------------------------------

    def fail(self) -> None:
        """An internal error: 1011 for the client, then both sockets dropped."""
        self.record.error = "internal error"
        if not self.client.closed and not self.client.close_sent:
            self.client.close_sent = True
            self.record.client_close = 1011
            self.client.write(close_frame(1011, "internal error", masked=False))
            self.client.closed = True
            self.client.transport.close()  # flushes the close frame
        self.abort()

    def abort(self) -> None:
        """Drop both sockets at once (cancellation, internal error)."""
        self.client.drop()
        self.upstream.drop()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._keepalive is not None:
            self._keepalive.discard(self)
        if not self.done.done():
            self.done.set_result(None)

    def __repr__(self) -> str:
        return (
            f"<Splice {self.record.session} replica={self.lease.replica} "
            f"closing={self.closing} client_closed={self.client_closed}>"
        )
