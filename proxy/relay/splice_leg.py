"""One leg of a spliced session (:mod:`proxy.relay.splice`): a socket whose frames are
walked and forwarded into the other leg's socket as they are read.

The walk reads frame headers incrementally across reads, with no payload copy except
for what the meter needs: text messages, and upstream binary messages when the session's
adapter reads their content (:attr:`proxy.metering.adapters.base.WsAdapter.reads_binary`; PCM is
metered by length). Control frames are
handled whole: close frames go to the session, pings and pongs pass through. Frames
injected by Headroom (its close frames, keepalive pings) are written at a frame
boundary of the forwarded stream, never inside a frame.

A frame that breaks RFC 6455 is refused, never forwarded; the rules, and the names of
what is refused, are :mod:`proxy.relay.wsframes`' (the walk tests a header with its
table and lengths, inline). The frames before it are forwarded; the session ends at once
(:meth:`proxy.relay.relay_core.RelayCore.protocol_error`: 1002 for a client, 1014 for the
client when its upstream is at fault).

Whether a data frame is forwarded (the size limit, a leg that is closing) and what a
complete message means (metering, text validity) are the core's decisions
(:meth:`~proxy.relay.relay_core.RelayCore.data_frame`,
:meth:`~proxy.relay.relay_core.RelayCore.message`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from proxy.relay.session_states import Side
from proxy.relay.wsframes import CLOSE, INVALID_FIRST_BYTE, TEXT, apply_mask, violation

if TYPE_CHECKING:
    from proxy.relay.session_states import LegStatus
    from proxy.relay.splice import Splice

__all__ = ["Leg"]

log = logging.getLogger("headroom.relay.ws")


class Leg(asyncio.Protocol):
    """One socket of the session. It reads frames from its endpoint and forwards them
    into :attr:`peer`'s transport; the frame walk's state lives here, the leg's place
    in the session (:class:`~proxy.relay.session_states.LegStatus`) in the session's core."""

    __slots__ = (
        "abort_at",
        "closed",
        "core",
        "fin",
        "gone",
        "head",
        "held",
        "hlen",
        "in_message",
        "is_client",
        "keep",
        "left",
        "mask",
        "msg_op",
        "msg_size",
        "parts",
        "peer",
        "pending",
        "session",
        "st",
        "transport",
        "walking",
    )  # fmt: skip
    # the session unties a finished leg with ``del`` (mypyc, proxy/speedups.py: a compiled
    # class's attributes may be deleted only if they are listed here)
    __deletable__ = ("peer", "session")

    def __init__(self, session: Splice, st: LegStatus) -> None:
        self.session = session
        self.core = session.core
        self.st = st
        self.is_client = st.side is Side.CLIENT
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.peer: Leg = None  # type: ignore[assignment]
        self.closed = False  # our transport is closed (an I/O fact; the state is st's)
        self.gone = False  # connection_lost came: the transport calls nothing more
        self.abort_at: float | None = None  # a deferred close drops the socket then
        self.head = b""  # an incomplete header (or control frame), withheld
        # A data frame still arriving is held, not forwarded, until it is complete: the
        # stream into the peer's socket is always between frames, so a close frame (1014
        # when this endpoint vanishes, Headroom's own closes) can always be written.
        self.held: list[bytes] | None = None
        self.left = 0  # bytes still to come of the frame in progress (held, or dropped)
        self.hlen = 0  # the held frame's header length
        self.fin = False  # its FIN bit
        self.keep = False  # its payload goes to the meter
        self.mask = b""  # its masking key
        self.msg_op = 0  # opcode of the message in progress (text/binary)
        self.msg_size = 0
        self.in_message = False  # a fragmented data message is in progress (RFC 6455 5.4)
        self.parts: list[bytes] | None = None  # payloads of a fragmented message
        # frames for peer's transport at our next boundary; None: then close its socket
        self.pending: list[bytes | None] = []
        self.walking = False  # inside data_received: writes to the peer wait for its flush

    @property
    def silent_since(self) -> float:
        return self.st.silent_since

    @property
    def ping_at(self) -> float | None:
        return self.st.ping_at

    # -- transport callbacks -------------------------------------------------------------

    def pause_writing(self) -> None:
        self.session.paused(self, True)

    def resume_writing(self) -> None:
        self.session.paused(self, False)

    def eof_received(self) -> bool | None:
        return None  # close the socket; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.gone:  # once per transport
            return
        self.gone = True
        session = self.session
        if not self.closed:
            self.closed = True
            session.lost(self)
        session.leg_gone()  # may untie this leg from the session

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    def close(self, abort_at: float | None) -> None:
        """Close the socket after what was written to it; drop it at ``abort_at``."""
        if not self.closed:
            self.closed = True
            transport = self.transport
            transport.close()
            if abort_at is not None:
                self.session.clock.call_at(abort_at, transport.abort)

    def drop(self) -> None:
        """Close the socket at once, unsent data discarded."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:  # None before the session starts
                self.transport.abort()

    def inject(self, data: bytes) -> None:
        """Write a frame into the peer's socket: now, or after what the read in progress
        forwards."""
        if self.walking:
            self.pending.append(data)
        else:
            self.peer.write(data)

    def _flush(self, data: bytes, start: int, end: int) -> None:
        """Forward ``data[start:end]``, then any injected frames (and a deferred close)."""
        peer = self.peer
        if start < end:
            peer.write(data if start == 0 and end == len(data) else data[start:end])
        if self.pending:
            for pending in self.pending:
                if pending is None:
                    peer.close(peer.abort_at)
                else:
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
        if self.pending:
            self._flush(b"", 0, 0)

    def _walk(self, data: bytes) -> None:  # the hot path, kept flat
        session = self.session
        core = self.core
        st = self.st
        now = session.clock.now()
        st.fresh = True
        peer = self.peer
        if self.head:
            data = self.head + data
            self.head = b""
        n = len(data)
        i = 0
        out = 0  # data[out:i] is still to be forwarded
        mask_bit = 0x80 if self.is_client else 0  # the masking its direction requires
        bad_first = INVALID_FIRST_BYTE
        if self.left:  # the rest of a frame: held (or dropped), never forwarded piecemeal
            take = self.left if self.left < n else n
            held = self.held
            if held is not None:
                held.append(data[:take] if take < n else data)
            out = i = take
            self.left -= take
            if not self.left and held is not None:
                self.held = None
                if st.accepting:
                    whole = b"".join(held)
                    payload = whole[self.hlen :] if self.keep else b""
                    if self.mask:
                        payload = apply_mask(payload, self.mask)
                    self._deliver(payload, self.fin, self.keep, now)  # may end the session
                    if st.accepting:
                        peer.write(whole)
        while i < n:
            if n - i < 2:
                break
            b0 = data[i]
            b1 = data[i + 1]
            opcode = b0 & 0x0F
            if bad_first[b0] or (b1 & 0x80) != mask_bit:
                self._refuse(data, out, i, b0, b1)
                return
            length = b1 & 0x7F
            h = 2 if length < 126 else 4 if length == 126 else 10
            if b1 & 0x80:
                h += 4
            if n - i < h:
                break
            if length == 126:
                length = data[i + 2] << 8 | data[i + 3]
            elif length == 127:
                length = int.from_bytes(data[i + 2 : i + 10], "big")
            start = i + h
            if opcode >= 8:  # control frame: handled whole
                if length > 125 or not b0 & 0x80:
                    self._refuse(data, out, i, b0, b1)
                    return
                if n - start < length:
                    break
                if opcode == CLOSE:
                    self._flush(data, out, i)
                    payload = data[start : start + length]
                    if b1 & 0x80:
                        payload = apply_mask(payload, data[start - 4 : start])
                    i = out = start + length
                    session.close_received(self, payload, data[i - h - length : i])
                    continue
                i = start + length
                if not st.accepting:
                    self._flush(data, out, i - h - length)
                    out = i
                continue
            # data frame
            if opcode:
                if self.in_message:
                    self._refuse(data, out, i, b0, b1)
                    return
                self.msg_op = opcode
                self.msg_size = length
                self.parts = None
                if not b0 & 0x80:
                    self.in_message = True
            else:
                if not self.in_message:
                    self._refuse(data, out, i, b0, b1)
                    return
                self.msg_size += length
                if b0 & 0x80:
                    self.in_message = False
            end = start + length
            if not core.data_frame(st, self.msg_size, now):  # closing, or too large
                if core.actions:
                    session.run()
                self._flush(data, out, i)
                if end > n:
                    self.left = end - n
                    return
                i = out = end
                continue
            fin = bool(b0 & 0x80)
            keep = self.msg_op == TEXT or (not self.is_client and core.binary_content)
            mask = data[start - 4 : start] if b1 & 0x80 else b""
            if end > n:  # completed by later reads: held until then
                self._flush(data, out, i)
                self.held = [data[i:] if i else data]
                self.left = end - n
                self.hlen, self.fin, self.keep, self.mask = h, fin, keep, mask
                return
            i = end
            payload = data[start:end] if keep else b""
            if mask and keep:
                payload = apply_mask(payload, mask)
            self._deliver(payload, fin, keep, now)
            if not st.accepting:  # the message ended the session: held back
                self._flush(data, out, start - h)
                out = end
        if i < n:
            self.head = data[i:]
        self._flush(data, out, i)

    def _refuse(self, data: bytes, out: int, i: int, b0: int, b1: int) -> None:
        """The frame at ``data[i]`` breaks RFC 6455: what came before it is forwarded,
        it and everything after it are not, and the session ends."""
        self._flush(data, out, i)
        self.head = b""
        what = violation(b0, b1, self.is_client, self.in_message) or "invalid frame"
        self.session.protocol_error(self, what)

    def _deliver(self, payload: bytes, fin: bool, keep: bool, now: float) -> None:
        """One data frame's payload (empty unless ``keep``): to the session once its
        message is complete, fragments of a kept message assembled first."""
        if keep and (self.parts is not None or not fin):
            if self.parts is None:
                self.parts = []
            self.parts.append(payload)
            if not fin:
                return
            payload = b"".join(self.parts)
            self.parts = None
        if fin:
            core = self.core
            core.message(self.st, self.msg_op, payload, now, self.msg_size)
            if core.actions:
                self.session.run()
