"""The session timers every relay shares, WebSocket and HTTP (:class:`Deadlines`), on the
session clock, and which of them passed (:class:`Expiry`). The WebSocket core
(:class:`~proxy.relay.relay_core.RelayCore`) extends them with the close deadline's
handshake; the HTTP exchange (:mod:`proxy.relay.http_exchange`) uses them as they are.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from proxy.settings import LimitsSettings

__all__ = ["Deadlines", "Expiry"]

_EPS: Final = 1e-6  # timers may fire a hair early on float clocks
_INF: Final = float("inf")


class Expiry(enum.Enum):
    """Which deadline of :class:`Deadlines` passed."""

    CLOSE = "close"
    CLIENT_WRITE = "client_write"
    IDLE = "idle"
    MAX_SESSION = "max_session"


class Deadlines:
    """The session timers every relay shares (WebSocket and HTTP), on the session clock:

    - the **write watchdog**: a send to the client blocked (its socket buffer full)
      for ``client_write_timeout_s``;
    - the **idle timeout**: no activity for ``idle_timeout_s`` -- what counts as
      activity is the relay's to say (a data frame either way; an upstream chunk), and
      time spent on a blocked send does not count (a client that is not reading is the
      watchdog's business, and its end restarts the idle clock);
    - the **session length**: ``max_session_s`` since the start;
    - the **close deadline**, once set, replaces them all.

    A relay arms one timer for :meth:`next_deadline` and asks :meth:`expired` when it
    fires; :meth:`earlier` says whether a new deadline needs the timer moved."""

    __slots__ = ("close_deadline", "last_activity", "limits", "send_since", "started", "wake_at")

    def __init__(self, limits: LimitsSettings, now: float) -> None:
        self.limits = limits
        self.started = now
        self.last_activity = now
        self.send_since: float | None = None  # a send to the client is blocked since
        self.close_deadline: float | None = None
        self.wake_at = _INF  # the earliest deadline the relay's timer was set for

    def sending(self, now: float) -> bool:
        """A send to the client starts blocking (or may): True if the timer must move
        earlier, to :attr:`wake_at`."""
        self.send_since = now
        return self.earlier(now + self.limits.client_write_timeout_s)

    def sent(self, now: float) -> None:
        """The blocked send is over: activity."""
        self.send_since = None
        self.last_activity = now

    def earlier(self, at: float) -> bool:
        if at < self.wake_at:
            self.wake_at = at
            return True
        return False

    def due(self) -> float:
        if self.close_deadline is not None:
            return self.close_deadline
        limits = self.limits
        due = _INF
        if self.send_since is not None:
            due = self.send_since + limits.client_write_timeout_s
        elif limits.idle_timeout_s:
            due = self.last_activity + limits.idle_timeout_s
        if limits.max_session_s:
            due = min(due, self.started + limits.max_session_s)
        return due

    def next_deadline(self) -> float:
        """When the timer must fire next (``inf``: never)."""
        self.wake_at = due = self.due()
        return due

    def expired(self, now: float) -> Expiry | None:
        """The deadline that has passed at ``now``, if one has."""
        limits = self.limits
        if self.close_deadline is not None:
            return Expiry.CLOSE if now >= self.close_deadline - _EPS else None
        if self.send_since is not None:
            if now >= self.send_since + limits.client_write_timeout_s - _EPS:
                return Expiry.CLIENT_WRITE
        elif limits.idle_timeout_s and now >= self.last_activity + limits.idle_timeout_s - _EPS:
            return Expiry.IDLE
        if limits.max_session_s and now >= self.started + limits.max_session_s - _EPS:
            return Expiry.MAX_SESSION
        return None
