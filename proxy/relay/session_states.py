"""Where a relayed WebSocket session stands, as its
:class:`~proxy.relay.relay_core.RelayCore` keeps it: the two sides, each leg's
closing handshake (:class:`LegState`) and status (:class:`LegStatus`), and the session's
phase (:class:`Phase`). The core changes them; the shells read them.
"""

from __future__ import annotations

import enum

__all__ = ["CLIENT", "UPSTREAM", "LegState", "LegStatus", "Phase", "Side"]


class Side(enum.IntEnum):
    CLIENT = 0
    UPSTREAM = 1


class LegState(enum.Enum):
    """Where one leg's closing handshake stands."""

    OPEN = "open"  # no close frame either way
    CLOSE_SENT = "close_sent"  # a close frame was written to the endpoint; its answer awaited
    CLOSE_RCVD = "close_rcvd"  # the endpoint sent a close frame; ours not written yet
    CLOSED = "closed"  # close frames crossed both ways; the socket is still open
    GONE = "gone"  # the socket is closed (by us or by the other end)


CLIENT, UPSTREAM = Side.CLIENT, Side.UPSTREAM


class Phase(enum.Enum):
    """The session's phase: who started the end, if anyone."""

    RELAYING = "relaying"
    CLIENT_CLOSING = "client_closing"  # the client sent the first close (or vanished)
    UPSTREAM_CLOSING = "upstream_closing"  # the upstream sent the first close
    HEADROOM_CLOSING = "headroom_closing"  # a limit, drain, error: RelayCore.closing
    DONE = "done"  # both sockets are closed


class LegStatus:
    """One leg as the core sees it. ``accepting`` (data frames from this endpoint are
    forwarded and metered) is derived from the states, kept as an attribute because
    the splice's hot path reads it on every frame."""

    __slots__ = ("accepting", "fresh", "ping_at", "side", "silent_since", "state")

    def __init__(self, side: Side) -> None:
        self.side = side
        self.state = LegState.OPEN
        self.accepting = True
        self.fresh = False  # bytes arrived since the last keepalive sweep
        self.silent_since = 0.0  # loop time of the sweep that first found the leg silent
        self.ping_at: float | None = None  # a ping to this endpoint is unanswered since

    def __repr__(self) -> str:
        return f"<LegStatus {self.side.name} {self.state.value}>"
