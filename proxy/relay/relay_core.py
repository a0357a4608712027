"""The WebSocket session rules, once, with no I/O (sans-I/O, in the style of
python-websockets' ``protocol.py``).

One :class:`RelayCore` per relayed session owns both legs' states
(:class:`~proxy.relay.session_states.LegState`), the session's phase
(:class:`~proxy.relay.session_states.Phase`), the limits and their deadlines, the close-code
mapping, the metering calls and the back-pressure decisions. A shell feeds it events --
a data frame or message from a leg, a close frame, a lost connection, a full or drained
socket buffer, a drain request, the clock -- and then carries out the actions it queued
in :attr:`RelayCore.actions` (:mod:`proxy.relay.session_actions`: write a close frame,
forward the endpoint's own close, ping, close or drop a socket, pause or resume
reading, wake me at, done). Data frames are not actions: a shell forwards a frame when
:meth:`RelayCore.data_frame` says so (and keeps forwarding while
:attr:`~proxy.relay.session_states.LegStatus.accepting`), so the hot path allocates
nothing.

One shell drives it: the splice (:mod:`proxy.relay.splice`,
:mod:`proxy.relay.splice_leg`), protocol callbacks on both sockets, frame by frame.

The rules, each stated here only:

- **idle timeout**: no data frame either way for ``idle_timeout_s`` (a blocked send to
  the client does not count) -> 1008;
- **session length**: ``max_session_s`` after the start -> 1008;
- **write watchdog**: the client's socket buffer full for ``client_write_timeout_s``
  (it stopped reading) -> the client is dropped, 1000 for the upstream, slot freed;

(these three, with the close deadline, are :class:`~proxy.relay.deadlines.Deadlines`, which the HTTP
relay shares: :mod:`proxy.relay.http_exchange`);
- **size limit**: a message over ``max_message_bytes`` is not forwarded (client: 1008;
  upstream: 1014 for the client, 1009 for the upstream, an upstream ``protocol``
  error);
- **close mapping**: the upstream's close code reaches the client when a peer may send
  it, 1000 for none (1005), 1011 for the rest (counted as ``upstream_internal_error``);
  a vanished upstream gives 1014 (``midstream``); Headroom's closes give the upstream
  1000 (1001 on drain, i.e. a 1012 for the client);
- **closing handshake**: bounded by :data:`CLOSE_TIMEOUT_S`; then the upstream is
  dropped and the client's socket closed (and dropped if it never drains);
- **keepalive**: a leg silent for ``ping_interval_s`` is pinged, and dead without an
  answer within ``ping_timeout_s``;
- **back-pressure**: a full socket buffer pauses reading on the other leg.

Times are explicit ``now`` arguments (the session clock); keepalive liveness takes the
event loop's time as well, since it is about real sockets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from proxy.metering.adapters.speech_ws_audio import OmniSpeechWsAdapter
from proxy.relay.deadlines import Deadlines, Expiry
from proxy.relay.session_actions import (
    Action,
    CloseSocket,
    Done,
    DropSocket,
    PauseReading,
    Ping,
    RelayClose,
    ResumeReading,
    SendClose,
    Wake,
)  # fmt: skip
from proxy.relay.session_states import CLIENT, UPSTREAM, LegState, LegStatus, Phase
from proxy.relay.wsframes import (
    BINARY,
    INVALID_TEXT,
    client_code_for_upstream_close,
    close_error,
    close_fields,
    decode_text,
    sendable_code,
)  # fmt: skip

if TYPE_CHECKING:
    from proxy.metering.adapters.base import WsAdapter
    from proxy.relay.session_record import SessionRecord
    from proxy.settings import LimitsSettings

__all__ = ["CLOSE_TIMEOUT_S", "RelayCore"]

#: How long a closing handshake may take (then: upstream dropped, client socket closed).
CLOSE_TIMEOUT_S: Final = 5.0

_INF: Final = float("inf")

_CAN_SEND = (LegState.OPEN, LegState.CLOSE_RCVD)  # a close frame may still be written
_GOT_CLOSE = (LegState.CLOSE_RCVD, LegState.CLOSED)
_READS = (LegState.OPEN, LegState.CLOSE_SENT)  # data frames may still come from it
_PAUSE = (PauseReading(CLIENT), PauseReading(UPSTREAM))  # shared: the hot path allocates none
_RESUME = (ResumeReading(CLIENT), ResumeReading(UPSTREAM))
_DONE = Done()


class RelayCore(Deadlines):
    """One WebSocket session's rules. Feed it events; then carry out :attr:`actions`
    (in order) and clear them."""

    __slots__ = (
        "actions",
        "adapter",
        "binary_content",
        "client",
        "closing",
        "max_bytes",
        "phase",
        "record",
        "upstream",
        "upstream_error",
    )  # fmt: skip

    def __init__(
        self,
        limits: LimitsSettings,
        record: SessionRecord,
        adapter: WsAdapter,
        upstream_error: Callable[[str], None],
        now: float,
    ) -> None:
        super().__init__(limits, now)
        self.max_bytes = limits.max_message_bytes
        self.record = record
        # The concrete class first: compiled, a call to the speech adapter is native after
        # a type check, any other adapter a Python call (docs/performance.md).
        self.adapter: OmniSpeechWsAdapter | WsAdapter = adapter
        #: The adapter reads upstream binary content (:attr:`WsAdapter.reads_binary`): a
        #: relay passes it only then. Read again after each upstream text message.
        self.binary_content = adapter.reads_binary
        self.upstream_error = upstream_error  # counts an upstream error of a kind
        self.phase = Phase.RELAYING
        self.closing: tuple[int, str] | None = None  # Headroom ended it: code, reason
        self.client = LegStatus(CLIENT)
        self.upstream = LegStatus(UPSTREAM)
        self.actions: list[Action] = []

    # -- data ------------------------------------------------------------------------------

    def data_frame(self, leg: LegStatus, msg_size: int, now: float) -> bool:
        """A data frame from ``leg`` whose message is ``msg_size`` bytes so far: forward
        it? (No when the leg is closing, or -- the size limit -- when the message is
        too large, which ends the session.) A data frame either way is activity."""
        self.last_activity = now
        if not leg.accepting:
            return False
        if msg_size > self.max_bytes:
            self.too_large(leg, now)
            return False
        return True

    def message(self, leg: LegStatus, opcode: int, payload: bytes, now: float, size: int) -> None:
        """A complete data message of ``size`` bytes, as read from the wire (``payload``:
        its unmasked content, empty when the meter does not need it)."""
        if opcode == BINARY:
            self.binary(leg, payload, now, size)
            return
        text = decode_text(payload)
        if text is None:
            if leg is self.client:
                self.stop(*INVALID_TEXT, now)
            else:
                self.upstream_error("protocol")
                self.stop(1014, "upstream sent invalid UTF-8", now, upstream_code=1007)
            return
        self.text(leg, text, now, size)

    def text(self, leg: LegStatus, text: str, now: float, size: int) -> None:
        """A complete text message: counted and metered."""
        record = self.record
        if leg is self.client:
            record.frames_up += 1
            record.bytes_up += size
            self.adapter.client_text(now, text)
        else:
            record.frames_down += 1
            record.bytes_down += size
            adapter = self.adapter
            adapter.upstream_text(now, text)
            self.binary_content = adapter.reads_binary

    def binary(self, leg: LegStatus, data: bytes, now: float, size: int) -> None:
        """A complete binary message: counted; metered when it comes from the upstream
        (no protocol meters the client's binary messages, so the splice does not even
        unmask them)."""
        record = self.record
        if leg is self.client:
            record.frames_up += 1
            record.bytes_up += size
        else:
            record.frames_down += 1
            record.bytes_down += size
            self.adapter.upstream_binary(now, data, size)

    def too_large(self, leg: LegStatus, now: float) -> None:
        """``leg`` sent a message over the size limit (found by :meth:`data_frame`, or
        by a library enforcing the same limit)."""
        if not leg.accepting:
            return
        if leg is self.client:
            self.record.error = "client message too large"
            self.stop(1008, f"message over {self.max_bytes} bytes", now)
        else:
            self.upstream_error("protocol")
            self.stop(1014, "upstream message too large", now, upstream_code=1009)

    def protocol_error(self, leg: LegStatus, what: str, now: float) -> None:
        """``leg``'s endpoint broke RFC 6455: the connection is failed (7.1.7): our close
        frame is flushed and its socket closed, nothing more is read from it."""
        if leg is self.client:
            self.record.error = f"client protocol error: {what}"
            self.stop(1002, what, now)
        else:
            self.upstream_error("protocol")
            self.stop(1014, f"upstream protocol error: {what}", now, upstream_code=1002)
        self._gone(leg, CloseSocket(leg.side), now, got_close=True)

    # -- closing ---------------------------------------------------------------------------

    def stop(self, code: int, reason: str, now: float, upstream_code: int | None = None) -> None:
        """End the session from Headroom's side: ``code`` for the client, 1000 (1001 on
        drain, or ``upstream_code``) for the upstream; no more data either way."""
        if self.closing is not None or self.phase is Phase.DONE:
            return
        self.closing = (code, reason)
        self.phase = Phase.HEADROOM_CLOSING
        client, upstream = self.client, self.upstream
        if client.state in _CAN_SEND:
            self._sent(client)
            self.record.client_close = code
            self.actions.append(SendClose(CLIENT, code, reason))
        if upstream.state in _CAN_SEND:
            self._sent(upstream)
            if upstream_code is None:
                upstream_code = 1001 if code == 1012 else 1000
            self.actions.append(SendClose(UPSTREAM, upstream_code, reason))
        self._closing_started(now)
        self._settle(now)

    def close_frame(self, leg: LegStatus, payload: bytes, now: float) -> None:
        """A close frame from ``leg``'s endpoint, as read from the wire (unmasked)."""
        code, reason = close_fields(payload)
        invalid = close_error(payload) if leg is self.client else None
        self.close_received(leg, code, reason, now, invalid)

    def close_received(
        self, leg: LegStatus, code: int, reason: str, now: float,
        invalid: tuple[int, str] | None = None,
    ) -> None:  # fmt: skip
        """``leg``'s endpoint closed with ``code`` (1005: no code); ``invalid``: the
        answer to a client close frame that breaks RFC 6455 (it is not forwarded)."""
        if leg.state not in _READS:
            return
        self._rcvd(leg)
        client, upstream = self.client, self.upstream
        record = self.record
        if leg is client:
            if invalid is not None:
                record.client_close = code
                self.stop(*invalid, now)
                return
            if self.closing is None and leg.state is LegState.CLOSE_RCVD:
                self.phase = Phase.CLIENT_CLOSING  # the client started it
                record.client_close = code
            if upstream.state in _CAN_SEND:
                self._sent(upstream)
                self.actions.append(RelayClose(UPSTREAM, sendable_code(code, 1001), reason))
        else:
            record.upstream_close = code
            if self.phase is Phase.RELAYING:
                self.phase = Phase.UPSTREAM_CLOSING
            if client.state in _CAN_SEND:
                self._sent(client)
                if self.phase is Phase.CLIENT_CLOSING:  # the answer to the client's close
                    self.actions.append(RelayClose(CLIENT, code, reason))
                else:
                    mapped = client_code_for_upstream_close(code)
                    if mapped == 1011:
                        self.upstream_error("upstream_internal_error")
                    record.client_close = mapped
                    if mapped != code:
                        self.actions.append(
                            SendClose(CLIENT, mapped, reason if code != 1005 else "")
                        )
                    else:
                        self.actions.append(RelayClose(CLIENT, code, reason))
        self._closing_started(now)
        self._settle(now)

    def connection_lost(self, leg: LegStatus, now: float) -> None:
        """``leg``'s socket is gone (closed by the other end, or failed)."""
        if leg.state is not LegState.GONE:
            self._gone(leg, None, now)

    def _gone(
        self, leg: LegStatus, action: Action | None, now: float, got_close: bool = False
    ) -> None:
        """``leg``'s socket goes (``action``: how, if we close it)."""
        if leg.state is LegState.GONE:
            return
        got_close = got_close or leg.state in _GOT_CLOSE
        leg.state = LegState.GONE
        if action is not None:
            self.actions.append(action)
        client, upstream = self.client, self.upstream
        record = self.record
        if leg is upstream:
            if client.state is not LegState.GONE:
                self.actions.append(_RESUME[CLIENT])
            if not got_close and self.phase in (Phase.RELAYING, Phase.UPSTREAM_CLOSING):
                record.upstream_close = None
                self.upstream_error("midstream")
                self.closing = (1014, "upstream connection lost")
                self.phase = Phase.HEADROOM_CLOSING
                if client.state in _CAN_SEND:
                    self._sent(client)
                    record.client_close = 1014
                    self.actions.append(SendClose(CLIENT, 1014, "upstream connection lost"))
            if client.state in _CAN_SEND:
                # nothing more will come from upstream: finish the client's side now
                self._sent(client)
                self.actions.append(SendClose(CLIENT, 1000, ""))
        else:
            if upstream.state is not LegState.GONE:
                self.actions.append(_RESUME[UPSTREAM])
            if not got_close:
                if record.client_close is None:
                    record.client_close = 1006
                if self.phase in (Phase.RELAYING, Phase.UPSTREAM_CLOSING):
                    self.phase = Phase.CLIENT_CLOSING
            if upstream.state in _CAN_SEND:
                self._sent(upstream)
                self.actions.append(SendClose(UPSTREAM, 1001, "client went away"))
        self._closing_started(now)
        self._settle(now)

    def _sent(self, leg: LegStatus) -> None:
        leg.state = LegState.CLOSED if leg.state is LegState.CLOSE_RCVD else LegState.CLOSE_SENT

    def _rcvd(self, leg: LegStatus) -> None:
        leg.state = LegState.CLOSED if leg.state is LegState.CLOSE_SENT else LegState.CLOSE_RCVD

    def _closing_started(self, now: float) -> None:
        if self.close_deadline is None:
            self.close_deadline = now + CLOSE_TIMEOUT_S
            if self.earlier(self.close_deadline):
                self.actions.append(Wake(self.close_deadline))

    def _settle(self, now: float) -> None:
        """Close what is finished: the client's socket once close frames crossed both
        ways (the server closes TCP first); the session once both sockets are gone."""
        client, upstream = self.client, self.upstream
        closing = self.phase is not Phase.RELAYING
        client.accepting = client.state in _READS and self.closing is None
        upstream.accepting = upstream.state in _READS and self.closing is None
        if not closing:
            return
        if client.state is LegState.CLOSED:
            self._gone(client, CloseSocket(CLIENT), now)
            return
        if (
            client.state is LegState.GONE
            and upstream.state is LegState.GONE
            and self.phase is not Phase.DONE
        ):
            self.phase = Phase.DONE
            self.actions.append(_DONE)

    # -- flow control ----------------------------------------------------------------------

    def buffer_full(self, leg: LegStatus, now: float) -> None:
        """``leg``'s socket buffer filled up: stop reading the other leg, so a slow reader
        slows its sender instead of growing our memory; a client that stays so for
        ``client_write_timeout_s`` is dropped (:meth:`tick`)."""
        if leg is self.client:
            if self.sending(now):
                self.actions.append(Wake(self.wake_at))
            other = self.upstream
        else:
            other = self.client
        if other.state is not LegState.GONE:
            self.actions.append(_PAUSE[other.side])

    def buffer_drained(self, leg: LegStatus, now: float) -> None:
        if leg is self.client:
            self.sent(now)
            other = self.upstream
        else:
            other = self.client
        if other.state is not LegState.GONE:
            self.actions.append(_RESUME[other.side])

    # -- time ------------------------------------------------------------------------------

    def next_deadline(self) -> float:
        """When :meth:`tick` must run next (``inf``: never); the shell arms one timer."""
        if self.phase is Phase.DONE:
            self.wake_at = _INF
            return _INF
        return super().next_deadline()

    def tick(self, now: float) -> float:
        """Apply the deadline that is due at ``now``, if one is; return the next one."""
        if self.phase is Phase.DONE:
            return _INF
        expiry = self.expired(now)
        if expiry is Expiry.CLOSE:
            self._close_overdue(now)
        elif expiry is Expiry.CLIENT_WRITE:
            self.record.error = "client stopped reading"
            client = self.client
            self._sent(client)  # nothing more can be written to it
            self.record.client_close = 1008
            self.stop(1008, "client not reading", now)
            self._gone(client, DropSocket(CLIENT), now)
        elif expiry is Expiry.IDLE:
            self.stop(1008, "idle timeout", now)
        elif expiry is Expiry.MAX_SESSION:
            self.stop(1008, "maximum session duration reached", now)
        return self.next_deadline()

    def _close_overdue(self, now: float) -> None:
        """The closing handshake took too long. The upstream is dropped; the client's
        socket is closed gracefully -- what it has not read yet, close frame included,
        is still delivered (a slow reader is not cut short) -- and dropped after
        ``client_write_timeout_s`` if it never drains. The slot is freed now."""
        client, upstream = self.client, self.upstream
        if upstream.state is not LegState.GONE:
            upstream.state = LegState.GONE
            self.actions.append(DropSocket(UPSTREAM))
        if client.state is not LegState.GONE:
            if client.state in _CAN_SEND:
                self.actions.append(SendClose(CLIENT, 1000, ""))
            client.state = LegState.GONE
            self.actions.append(
                CloseSocket(CLIENT, abort_at=now + self.limits.client_write_timeout_s)
            )
        self._settle(now)

    def start_liveness(self, loop_now: float) -> None:
        """Keepalive starts: both legs count as silent since ``loop_now``."""
        self.client.silent_since = self.upstream.silent_since = loop_now

    def keepalive(self, loop_now: float, now: float) -> None:
        """One keepalive sweep at loop time ``loop_now`` (``now``: the session clock)."""
        if self.phase is not Phase.RELAYING:
            return
        limits = self.limits
        for leg in (self.client, self.upstream):
            if leg.state is LegState.GONE:
                continue
            if leg.fresh:
                leg.fresh = False
                leg.silent_since = loop_now
                leg.ping_at = None
            elif leg.ping_at is not None:
                if loop_now - leg.ping_at >= limits.ping_timeout_s:
                    self._dead(leg, now)
                    return
            elif loop_now - leg.silent_since >= limits.ping_interval_s:
                leg.ping_at = loop_now
                self.actions.append(Ping(leg.side))

    def _dead(self, leg: LegStatus, now: float) -> None:
        """No answer to a keepalive ping: the endpoint (or the path to it) is gone."""
        if leg is self.client:
            self.record.error = "client keepalive timeout"
            self.record.client_close = 1006
            self._sent(leg)  # nothing more can be written to it
            self.stop(1011, "keepalive ping timeout", now)
        else:
            self.upstream_error("midstream")
            self.stop(1014, "upstream connection lost", now, upstream_code=1011)
        self._gone(leg, DropSocket(leg.side), now)

    # -- failure ---------------------------------------------------------------------------

    def fail(self) -> None:
        """An internal error: 1011 for the client, then both sockets dropped."""
        self.record.error = "internal error"
        client = self.client
        if client.state in _CAN_SEND:
            self.record.client_close = 1011
            self.actions.append(SendClose(CLIENT, 1011, "internal error"))
            client.state = LegState.GONE
            self.actions.append(CloseSocket(CLIENT))  # flushes the close frame
        self.abort()

    def abort(self) -> None:
        """Drop both sockets at once (cancellation, internal error)."""
        for leg in (self.client, self.upstream):
            if leg.state is not LegState.GONE:
                leg.state = LegState.GONE
                self.actions.append(DropSocket(leg.side))
            leg.accepting = False
        if self.phase is not Phase.DONE:
            self.phase = Phase.DONE
            self.actions.append(_DONE)

    def __repr__(self) -> str:
        return (
            f"<RelayCore {self.phase.value} closing={self.closing} "
            f"client={self.client.state.value} upstream={self.upstream.state.value}>"
        )
