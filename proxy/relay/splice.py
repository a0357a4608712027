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
length, the write watchdog, pings and the close deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from typing import TYPE_CHECKING

from websockets.speedups import apply_mask

from proxy.refusal import truncate_reason
from proxy.relay.ws_pump import sendable_code

if TYPE_CHECKING:
    from proxy.clock import Clock, TimerHandle
    from proxy.gate import Lease
    from proxy.protocols.base import WsAdapter
    from proxy.relay.session import SessionRecord
    from proxy.runtime import Runtime
    from proxy.settings import LimitsSettings

__all__ = ["Splice", "close_frame", "frame"]

log = logging.getLogger("headroom.relay.ws")

_CONT, _TEXT, _BINARY, _CLOSE, _PING = 0, 1, 2, 8, 9

#: How long a closing handshake may take before both sockets are aborted.
CLOSE_TIMEOUT_S = 5.0


def frame(opcode: int, payload: bytes, *, masked: bool) -> bytes:
    """One final frame; client-to-server frames are masked (RFC 6455 5.3)."""
    n = len(payload)
    bit = 0x80 if masked else 0
    if n < 126:
        head = bytes((0x80 | opcode, bit | n))
    elif n < 65536:
        head = bytes((0x80 | opcode, bit | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, bit | 127)) + n.to_bytes(8, "big")
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + apply_mask(payload, key)


def close_frame(code: int, reason: str, *, masked: bool) -> bytes:
    return frame(_CLOSE, code.to_bytes(2, "big") + truncate_reason(reason).encode(), masked=masked)


def _close_fields(payload: bytes) -> tuple[int, str]:
    if len(payload) < 2:
        return 1005, ""
    return int.from_bytes(payload[:2], "big"), payload[2:].decode(errors="replace")


class _Leg(asyncio.Protocol):
    """One socket of the session. It reads frames from its endpoint and forwards them
    into :attr:`peer`'s transport; state about *what it reads* lives here."""

    __slots__ = (
        "close_rcvd",
        "close_sent",
        "closed",
        "forwarding",
        "fparts",
        "fresh",
        "head",
        "is_client",
        "left",
        "mask",
        "msg_op",
        "msg_size",
        "parts",
        "passing",
        "peer",
        "pending",
        "ping_at",
        "session",
        "silent_since",
        "transport",
        "walking",
    )  # fmt: skip

    def __init__(self, session: Splice, *, is_client: bool, now: float) -> None:
        self.session = session
        self.is_client = is_client
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.peer: _Leg = None  # type: ignore[assignment]
        self.closed = False  # the socket is gone
        self.close_rcvd = False  # the endpoint sent a close frame
        self.close_sent = False  # a close frame was written to the endpoint
        self.forwarding = True  # new data frames are forwarded (off once closing)
        self.passing = True  # the frame in progress is forwarded
        self.head = b""  # an incomplete header (or control frame), withheld
        self.left = 0  # payload bytes of the frame in progress still to come
        self.mask = b""  # its masking key
        self.fparts: list[bytes] | None = None  # its payload, when the message is kept
        self.msg_op = 0  # opcode of the message in progress (text/binary)
        self.msg_size = 0
        self.parts: list[bytes] | None = None  # payloads of a fragmented message
        self.pending: list[bytes] = []  # frames for peer's transport at our next boundary
        self.walking = False  # inside data_received: writes to the peer wait for its flush
        self.fresh = False  # bytes arrived since the last keepalive sweep
        self.silent_since = 0.0  # loop time of the sweep that first found the leg silent
        self.ping_at: float | None = None  # a ping to this endpoint is unanswered since

    # -- transport callbacks -------------------------------------------------------------

    def pause_writing(self) -> None:
        self.session.paused(self, True)

    def resume_writing(self) -> None:
        self.session.paused(self, False)

    def eof_received(self) -> bool | None:
        return None  # close the socket; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.session.lost(self)

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    def at_boundary(self) -> bool:
        """The stream this leg forwards into its peer's socket is between frames."""
        return not self.left or not self.passing

    def inject(self, data: bytes) -> None:
        """Write a frame into the peer's socket at this leg's next frame boundary (now,
        if it is at one and not inside a read)."""
        if self.walking or not self.at_boundary():
            self.pending.append(data)
        else:
            self.peer.write(data)

    def _flush(self, data: bytes, start: int, end: int) -> None:
        """Forward ``data[start:end]``, then any injected frames."""
        peer = self.peer
        if start < end:
            peer.write(data if start == 0 and end == len(data) else data[start:end])
        if self.pending:
            for pending in self.pending:
                peer.write(pending)
            self.pending.clear()

    # -- the walk ------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self.walking = True
        try:
            self._walk(data)
        except Exception:
            log.exception("internal error in session %s", self.session.record.session)
            self.walking = False
            self.session.fail()
            return
        self.walking = False
        if self.pending and self.at_boundary():
            self._flush(b"", 0, 0)

    def _walk(self, data: bytes) -> None:  # the hot path, kept flat
        session = self.session
        now = session.clock.now()
        self.fresh = True
        peer = self.peer
        if self.head:
            data = self.head + data
            self.head = b""
        n = len(data)
        i = 0
        out = 0  # data[out:i] is still to be forwarded
        if self.left:
            take = self.left if self.left < n else n
            if self.fparts is not None:
                self.fparts.append(data[:take])
            if not self.passing:
                out = take
            self.left -= take
            i = take
            if not self.left and self.fparts is not None:
                self._frame_end(now)
        while i < n:
            if n - i < 2:
                break
            b0 = data[i]
            b1 = data[i + 1]
            length = b1 & 0x7F
            h = 2 if length < 126 else 4 if length == 126 else 10
            if b1 & 0x80:
                h += 4
            if n - i < h:
                break
            if length == 126:
                length = int.from_bytes(data[i + 2 : i + 4], "big")
            elif length == 127:
                length = int.from_bytes(data[i + 2 : i + 10], "big")
            opcode = b0 & 0x0F
            start = i + h
            if opcode >= 8:  # control frame: handled whole
                if length > 125 or not b0 & 0x80:
                    self._flush(data, out, i)
                    self.head = b""
                    session.protocol_error(self, "invalid control frame")
                    return
                if n - start < length:
                    break
                if opcode == _CLOSE:
                    self._flush(data, out, i)
                    payload = data[start : start + length]
                    if b1 & 0x80:
                        payload = apply_mask(payload, data[start - 4 : start])
                    i = out = start + length
                    session.close_received(self, payload, data[i - h - length : i])
                    continue
                i = start + length
                if not self.forwarding:
                    self._flush(data, out, i - h - length)
                    out = i
                continue
            # data frame
            if opcode:
                self.msg_op = opcode
                self.msg_size = length
                self.parts = None
            else:
                self.msg_size += length
            session.last_activity = now
            if self.msg_size > session.max_bytes or not self.forwarding:
                self._flush(data, out, i)
                if self.forwarding:
                    self.forwarding = False
                    session.too_large(self)
                self.passing = False
                end = start + length
                if end > n:
                    self.left = end - n
                    self.fparts = None
                    return
                i = out = end
                continue
            self.passing = True
            fin = b0 & 0x80
            keep = self.msg_op == _TEXT or not self.is_client
            end = start + length
            if end <= n:
                i = end
                if keep:
                    payload = data[start:end]
                    if b1 & 0x80:
                        payload = apply_mask(payload, data[start - 4 : start])
                    if fin and self.parts is None:
                        session.message(self, self.msg_op, payload, now, length)
                    else:
                        self._part(payload, fin, now)
                    if session.closing is not None:  # the message ended the session: held back
                        self._flush(data, out, start - h)
                        out = end
                elif fin:
                    session.message(self, self.msg_op, b"", now, self.msg_size)
                continue
            self.left = end - n
            if keep:
                self.fparts = [data[start:]]
                self.mask = data[start - 4 : start] if b1 & 0x80 else b""
                if not fin:
                    self.msg_op |= 0x100  # a fragment: more frames follow
            else:
                self.fparts = None
                if fin:
                    session.message(self, self.msg_op, b"", now, self.msg_size)
            i = n
            break
        if i < n:
            self.head = data[i:]
        if out < i:
            peer.write(data if out == 0 and i == n else data[out:i])

    def _frame_end(self, now: float) -> None:
        parts = self.fparts
        assert parts is not None
        self.fparts = None
        payload = parts[0] if len(parts) == 1 else b"".join(parts)
        if self.mask:
            payload = apply_mask(payload, self.mask)
        fin = not self.msg_op & 0x100
        self.msg_op &= 0xFF
        if fin and self.parts is None:
            self.session.message(self, self.msg_op, payload, now, len(payload))
        else:
            self._part(payload, bool(fin), now)

    def _part(self, payload: bytes, fin: int | bool, now: float) -> None:
        if self.parts is None:
            self.parts = []
        self.parts.append(payload)
        if fin:
            message = b"".join(self.parts)
            self.parts = None
            self.session.message(self, self.msg_op, message, now, len(message))


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
        self.client = _Leg(self, is_client=True, now=now)
        self.upstream = _Leg(self, is_client=False, now=now)
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

    def lost(self, leg: _Leg) -> None:
        """A socket is gone (closed by us or by the other end)."""
        client, upstream = self.client, self.upstream
        record = self.record
        if leg is upstream:
            self._resume(client)
            if not upstream.close_rcvd and self.closing is None and not self.client_closed:
                record.upstream_close = None
                self.rt.upstream_error(self.lease.pool, self.lease.replica, "midstream")
                self.closing = (1014, "upstream connection lost")
                if not client.close_sent and not client.closed:
                    client.close_sent = True
                    record.client_close = 1014
                    if not upstream.at_boundary():  # the client's stream stops mid-frame
                        client.closed = True
                        client.transport.abort()
                    else:
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
                if not client.at_boundary():
                    upstream.closed = True
                    upstream.transport.abort()
                else:
                    upstream.write(close_frame(1001, "client went away", masked=True))
            self._closing_started()
        self._settle()

    # -- frames --------------------------------------------------------------------------

    def message(self, leg: _Leg, opcode: int, payload: bytes, now: float, size: int) -> None:
        """A complete data message of ``size`` bytes (``payload`` empty when its content
        is not needed)."""
        record = self.record
        if leg.is_client:
            record.frames_up += 1
            record.bytes_up += size
            if opcode == _TEXT:
                try:
                    text = payload.decode()
                except UnicodeDecodeError:
                    self.stop(1007, "invalid UTF-8 in a text message")
                    return
                self.adapter.client_text(now, text)
            return
        record.frames_down += 1
        record.bytes_down += size
        if opcode == _BINARY:
            self.adapter.upstream_binary(now, payload)
            return
        try:
            text = payload.decode()
        except UnicodeDecodeError:
            self.rt.upstream_error(self.lease.pool, self.lease.replica, "protocol")
            self.stop(1014, "upstream sent invalid UTF-8", upstream_code=1007)
            return
        self.adapter.upstream_text(now, text)

    def too_large(self, leg: _Leg) -> None:
        if leg.is_client:
            self.record.error = "client message too large"
            self.stop(1008, f"message over {self.max_bytes} bytes")
        else:
            self.rt.upstream_error(self.lease.pool, self.lease.replica, "protocol")
            self.stop(1014, "upstream message too large", upstream_code=1009)

    def protocol_error(self, leg: _Leg, what: str) -> None:
        if leg.is_client:
            self.record.error = f"client protocol error: {what}"
            self.stop(1002, what)
        else:
            self.rt.upstream_error(self.lease.pool, self.lease.replica, "protocol")
            self.stop(1014, f"upstream protocol error: {what}", upstream_code=1002)

    def close_received(self, leg: _Leg, payload: bytes, raw: bytes) -> None:
        """A close frame from ``leg``'s endpoint (``raw``: the frame as it came)."""
        if leg.close_rcvd:
            return
        leg.close_rcvd = True
        leg.forwarding = False
        code, reason = _close_fields(payload)
        client, upstream = self.client, self.upstream
        record = self.record
        if leg is client and (len(payload) == 1 or (payload and sendable_code(code, -1) != code)):
            record.client_close = code
            self.stop(1002, "invalid close frame")
            return
        if leg is client and "\ufffd" in reason:
            try:
                payload[2:].decode()
            except UnicodeDecodeError:
                record.client_close = code
                self.stop(1007, "invalid UTF-8 in the close reason")
                return
        if leg is client:
            if self.closing is None and not client.close_sent:
                self.client_closed = True  # the client started it
                record.client_close = code
            if not upstream.close_sent and not upstream.closed:
                upstream.close_sent = True
                sendable = code == 1005 or sendable_code(code, -1) == code
                upstream.write(
                    raw if sendable else close_frame(sendable_code(code, 1001), reason, masked=True)
                )
        else:
            record.upstream_close = code
            if not client.close_sent and not client.closed:
                client.close_sent = True
                if self.client_closed:  # the upstream's answer to the client's close
                    client.write(raw)
                else:
                    if code == 1005:
                        code, reason, raw = 1000, "", close_frame(1000, "", masked=False)
                    elif sendable_code(code, -1) != code:
                        code, raw = 1011, close_frame(1011, reason, masked=False)
                    if code == 1011:
                        self.rt.upstream_error(
                            self.lease.pool, self.lease.replica, "upstream_internal_error"
                        )
                    record.client_close = code
                    client.write(raw)
        self._closing_started()
        self._settle()

    # -- flow control --------------------------------------------------------------------

    def paused(self, leg: _Leg, paused: bool) -> None:
        """``leg``'s socket buffer filled up (or drained): stop (resume) reading the
        other leg, so a slow reader slows its sender instead of growing our memory."""
        other = leg.peer
        if leg.is_client:
            self.send_since = self.clock.now() if paused else None
            if paused:
                self._arm(self.send_since + self.limits.client_write_timeout_s)  # type: ignore[operator]
        if other.closed:
            return
        if paused:
            other.transport.pause_reading()
        else:
            other.transport.resume_reading()

    def _resume(self, leg: _Leg) -> None:
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
                client.closed = True
                client.transport.abort()
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
        if not upstream.closed:
            upstream.closed = True
            upstream.transport.abort()
        if not client.closed:
            client.closed = True
            transport = client.transport
            if not client.close_sent and upstream.at_boundary():
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
            elif (
                now - leg.silent_since >= limits.ping_interval_s
                # written at the frame boundary of the stream into this leg
                and leg.peer.at_boundary()
                and not leg.peer.pending
            ):
                leg.ping_at = now
                leg.write(frame(_PING, os.urandom(4), masked=not leg.is_client))

    def _dead(self, leg: _Leg) -> None:
        """No answer to a keepalive ping: the endpoint (or the path to it) is gone."""
        if leg.is_client:
            self.record.error = "client keepalive timeout"
            self.record.client_close = 1006
            leg.close_sent = True
            self.stop(1011, "keepalive ping timeout")
        else:
            self.rt.upstream_error(self.lease.pool, self.lease.replica, "midstream")
            self.stop(1014, "upstream connection lost", upstream_code=1011)
        leg.closed = True
        leg.transport.abort()
        self.lost(leg)

    # -- drain and shutdown --------------------------------------------------------------

    def fail(self) -> None:
        """An internal error: 1011 for the client, then both sockets dropped."""
        self.record.error = "internal error"
        if not self.client.closed and not self.client.close_sent:
            self.client.close_sent = True
            self.record.client_close = 1011
            if self.upstream.at_boundary():
                self.client.write(close_frame(1011, "internal error", masked=False))
        self.abort()

    def abort(self) -> None:
        """Drop both sockets at once (cancellation, internal error)."""
        for leg in (self.client, self.upstream):
            if not leg.closed:
                leg.closed = True
                if leg.transport is not None:
                    leg.transport.abort()
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
