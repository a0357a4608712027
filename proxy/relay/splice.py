"""The relay hot path: one admitted WebSocket session spliced in protocol callbacks.

After both handshakes, the client's socket (taken over from Headroom's client
WebSocket server, :mod:`proxy.relay.ws_server`) and the upstream's
(:mod:`proxy.relay.upstream_handshake`)
forward bytes to each other as they are read: a server frame is valid unchanged on the
client leg and a masked client frame on the upstream leg, so nothing is re-framed,
copied into message objects or handed to a task. Each leg walks the frame headers of
what it reads, incrementally (:mod:`proxy.relay.splice_leg`).

This module is a shell: every session rule -- limits, timeouts, the write watchdog,
the closing handshake and its codes, metering, keepalive, back-pressure -- is decided
by the session's :class:`~proxy.relay.relay_core.RelayCore`; :class:`Splice` feeds it the
socket events and carries out its actions on the two transports: close frames and
pings are written at a frame boundary of the forwarded stream, sockets are paused,
resumed, closed or dropped. One timer per session stands for the core's next
deadline; one sweep a second per event loop runs the keepalive (:class:`_Keepalive`).
Back-pressure is end to end: a leg whose socket buffer is full pauses reading on the
other leg.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from typing import TYPE_CHECKING, Protocol

from proxy.relay.relay_core import CLOSE_TIMEOUT_S, RelayCore
from proxy.relay.session_actions import (
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
from proxy.relay.session_states import Side
from proxy.relay.splice_leg import Leg
from proxy.relay.wsframes import PING, close_frame, frame

if TYPE_CHECKING:
    from proxy.admission.session_lease import Lease
    from proxy.clock import Clock, TimerHandle
    from proxy.metering.adapters.base import WsAdapter
    from proxy.relay.services import RelayServices
    from proxy.relay.session_record import SessionRecord
    from proxy.settings import LimitsSettings

__all__ = ["CLOSE_TIMEOUT_S", "Splice", "close_frame", "frame"]

log = logging.getLogger("headroom.relay.ws")


class _Swept(Protocol):
    """What the keepalive sweep calls on a session (:class:`Splice`)."""

    def keepalive(self, now: float) -> None: ...

    def fail(self) -> None: ...


class _Keepalive:
    """Pings for every spliced session on one event loop: one sweep a second instead
    of a timer per session and leg."""

    def __init__(self, loop: asyncio.AbstractEventLoop, period_s: float = 1.0) -> None:
        self.loop = loop
        self.period_s = period_s
        self.sessions: set[_Swept] = set()
        self._handle: asyncio.TimerHandle | None = None

    def add(self, session: _Swept) -> None:
        self.sessions.add(session)
        if self._handle is None:
            self._handle = self.loop.call_later(self.period_s, self._sweep)

    def discard(self, session: _Swept) -> None:
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
            self._handle = self.loop.call_later(self.period_s, self._sweep)


_keepalives: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Keepalive] = (
    weakref.WeakKeyDictionary()
)


def _keepalive_for(loop: asyncio.AbstractEventLoop) -> _Keepalive:
    keepalive = _keepalives.get(loop)
    if keepalive is None:
        keepalive = _keepalives[loop] = _Keepalive(loop)
    return keepalive


class Splice:
    """One spliced session: its two legs and the core that decides for them.
    :attr:`done` resolves once both sockets are closed."""

    __slots__ = (
        "_keepalive",
        "_raw_close",
        "_timer",
        "_timer_at",
        "adapter",
        "client",
        "clock",
        "core",
        "done",
        "lease",
        "limits",
        "record",
        "services",
        "upstream",
    )  # fmt: skip

    def __init__(
        self,
        services: RelayServices,
        lease: Lease,
        adapter: WsAdapter,
        record: SessionRecord,
        limits: LimitsSettings,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.services = services
        self.lease = lease
        self.adapter = adapter
        self.record = record
        self.limits = limits
        self.clock: Clock = services.clock
        count = services.upstream_error

        def upstream_error(kind: str) -> None:  # not a bound method: no cycle to the splice
            count(lease.pool, lease.replica, kind)

        self.core = RelayCore(limits, record, adapter, upstream_error, self.clock.now())
        self.client = Leg(self, self.core.client)
        self.upstream = Leg(self, self.core.upstream)
        self.client.peer = self.upstream
        self.upstream.peer = self.client
        self._raw_close = b""  # the close frame being forwarded, as it came
        loop = loop or asyncio.get_running_loop()
        self.done: asyncio.Future[None] = loop.create_future()
        self._keepalive = _keepalive_for(loop) if limits.ping_interval_s else None
        self._timer: TimerHandle | None = None
        self._timer_at = float("inf")

    @property
    def closing(self) -> tuple[int, str] | None:
        """Why Headroom ended the session (code, reason), if it did."""
        return self.core.closing

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
        if self._keepalive is not None and not self.done.done():
            self.core.start_liveness(self._keepalive.loop.time())
            self._keepalive.add(self)
        self._arm(self.core.next_deadline())

    def client_left(self, upstream: asyncio.Transport) -> None:
        """The client left before the session started (during the upstream handshake):
        the upstream is told as the core says, and its socket closed."""
        self.upstream.transport = upstream
        self.client.closed = True  # it never had a socket here
        self.core.connection_lost(self.core.client, self.clock.now())
        self.run()
        self.upstream.close(None)
        self._finished()

    def stop(self, code: int, reason: str, upstream_code: int | None = None) -> None:
        """End the session from Headroom's side (drain, shutdown): see
        :meth:`RelayCore.stop`."""
        self.core.stop(code, reason, self.clock.now(), upstream_code)
        self.run()

    def fail(self) -> None:
        """An internal error: 1011 for the client, then both sockets dropped."""
        self.core.fail()
        self.run()

    def abort(self) -> None:
        """Drop both sockets at once (cancellation, internal error)."""
        self.core.abort()
        self.run()

    # -- events from the legs ------------------------------------------------------------

    def lost(self, leg: Leg) -> None:
        self.core.connection_lost(leg.st, self.clock.now())
        self.run()

    def paused(self, leg: Leg, paused: bool) -> None:
        if paused:
            self.core.buffer_full(leg.st, self.clock.now())
        else:
            self.core.buffer_drained(leg.st, self.clock.now())
        self.run()

    def close_received(self, leg: Leg, payload: bytes, raw: bytes) -> None:
        """A close frame from ``leg``'s endpoint (``raw``: the frame as it came)."""
        self._raw_close = raw
        self.core.close_frame(leg.st, payload, self.clock.now())
        self.run()

    def protocol_error(self, leg: Leg, what: str) -> None:
        self.core.protocol_error(leg.st, what, self.clock.now())
        self.run()

    def keepalive(self, now: float) -> None:
        """One sweep of :class:`_Keepalive` (``now``: loop time, not the injected clock:
        liveness is about real sockets)."""
        self.core.keepalive(now, self.clock.now())
        if self.core.actions:
            self.run()

    # -- actions -------------------------------------------------------------------------

    def run(self) -> None:
        """Carry out what the core decided, in order."""
        actions = self.core.actions
        if not actions:
            return
        batch = actions[:]
        actions.clear()
        for action in batch:
            if isinstance(action, SendClose):
                to_upstream = action.side is Side.UPSTREAM
                self._into(action.side).inject(
                    close_frame(action.code, action.reason, masked=to_upstream)
                )
            elif isinstance(action, RelayClose):
                self._into(action.side).inject(self._raw_close)
            elif isinstance(action, PauseReading):
                leg = self._leg(action.side)
                if not leg.closed:
                    leg.transport.pause_reading()
            elif isinstance(action, ResumeReading):
                leg = self._leg(action.side)
                if not leg.closed and not leg.transport.is_reading():
                    leg.transport.resume_reading()
            elif isinstance(action, Wake):
                self._arm(action.at)
            elif isinstance(action, Ping):
                masked = action.side is Side.UPSTREAM
                self._into(action.side).inject(frame(PING, os.urandom(4), masked=masked))
            elif isinstance(action, CloseSocket):
                leg = self._leg(action.side)
                if leg.peer.walking:  # after what the read in progress forwards to it
                    leg.abort_at = action.abort_at
                    leg.peer.pending.append(None)
                else:
                    leg.close(action.abort_at)
            elif isinstance(action, DropSocket):
                self._leg(action.side).drop()
            elif isinstance(action, Done):
                self._finished()

    def _leg(self, side: Side) -> Leg:
        return self.client if side is Side.CLIENT else self.upstream

    def _into(self, side: Side) -> Leg:
        """The leg whose reads are forwarded to ``side``'s endpoint."""
        return self.upstream if side is Side.CLIENT else self.client

    def _finished(self) -> None:
        if self._keepalive is not None:
            self._keepalive.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.done.done():
            self.done.set_result(None)
        # after the batch of actions this Done ends: the legs are used until then
        self.done.get_loop().call_soon(self.leg_gone)

    def leg_gone(self) -> None:
        """A leg's transport is gone (connection_lost is the last call a transport
        makes), or the session is done. Once both are gone and the session is done,
        nothing calls the legs or the core again: untie the legs from the splice and
        from each other, so that the session's objects (legs, core, meter, transports:
        about 35) go as soon as its task lets go of them, not at the garbage collector's
        next pass."""
        client, upstream = self.client, self.upstream
        if client.gone and upstream.gone and self.done.done():
            for leg in (client, upstream):
                if hasattr(leg, "peer"):  # not untied yet (this can run twice)
                    del leg.session, leg.peer

    # -- the timer -----------------------------------------------------------------------

    def _arm(self, when: float) -> None:
        if when == self._timer_at or when == float("inf") or self.done.done():
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
        due = self.core.tick(self.clock.now())
        self.run()
        self._arm(due)

    def __repr__(self) -> str:
        return f"<Splice {self.record.session} replica={self.lease.replica} {self.core!r}>"
