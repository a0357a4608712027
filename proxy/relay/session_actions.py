"""What a :class:`~proxy.relay.relay_core.RelayCore` asks its shell to do, queued in
:attr:`~proxy.relay.relay_core.RelayCore.actions` and carried out in order: write a
close frame, forward the endpoint's own close, ping, close or drop a socket, pause or
resume reading, wake the core at a time, end the session. Data frames are not actions
(the shell forwards a frame when the core's ``data_frame`` says so), so the hot path
allocates none. The actions compare by value, so tests assert on the list.
"""

from __future__ import annotations

from proxy.relay.session_states import Side

__all__ = [
    "Action", "CloseSocket", "Done", "DropSocket", "PauseReading", "Ping", "RelayClose",
    "ResumeReading", "SendClose", "Wake",
]  # fmt: skip


class SendClose:
    """Write Headroom's close frame (``code``, ``reason``) to ``side``'s endpoint, at a
    frame boundary of what is forwarded to it."""

    __slots__ = ("code", "reason", "side")

    def __init__(self, side: Side, code: int, reason: str) -> None:
        self.side, self.code, self.reason = side, code, reason

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SendClose) and (self.side, self.code, self.reason) == (
            other.side, other.code, other.reason,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"SendClose({self.side.name}, {self.code}, {self.reason!r})"


class RelayClose:
    """Forward the other endpoint's close frame to ``side`` as it came (a shell that
    cannot forward frames sends ``code`` -- sendable -- and ``reason``)."""

    __slots__ = ("code", "reason", "side")

    def __init__(self, side: Side, code: int, reason: str) -> None:
        self.side, self.code, self.reason = side, code, reason

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RelayClose) and (self.side, self.code, self.reason) == (
            other.side, other.code, other.reason,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"RelayClose({self.side.name}, {self.code}, {self.reason!r})"


class _SideAction:
    __slots__ = ("side",)

    def __init__(self, side: Side) -> None:
        self.side = side

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _SideAction) and type(other) is type(self) and other.side is self.side
        )

    def __hash__(self) -> int:
        return hash((type(self), self.side))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.side.name})"


class Ping(_SideAction):
    """Send a keepalive ping to ``side``'s endpoint."""

    __slots__ = ()


class DropSocket(_SideAction):
    """Close ``side``'s socket at once, unsent data discarded."""

    __slots__ = ()


class PauseReading(_SideAction):
    __slots__ = ()


class ResumeReading(_SideAction):
    __slots__ = ()


class CloseSocket(_SideAction):
    """Close ``side``'s socket after what was written to it (close frame included);
    drop it at ``abort_at`` if it has not drained by then."""

    __slots__ = ("abort_at",)

    def __init__(self, side: Side, abort_at: float | None = None) -> None:
        super().__init__(side)
        self.abort_at = abort_at

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CloseSocket) and (other.side, other.abort_at) == (
            self.side, self.abort_at,
        )  # fmt: skip

    def __hash__(self) -> int:
        return hash((CloseSocket, self.side, self.abort_at))

    def __repr__(self) -> str:
        at = "" if self.abort_at is None else f", abort_at={self.abort_at:g}"
        return f"CloseSocket({self.side.name}{at})"


class Wake:
    """Call :meth:`~proxy.relay.relay_core.RelayCore.tick` at ``at`` (an earlier
    deadline than announced)."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Wake) and other.at == self.at

    def __hash__(self) -> int:
        return hash((Wake, self.at))

    def __repr__(self) -> str:
        return f"Wake({self.at:g})"


class Done:
    """Both sockets are closed: the session is over."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Done)

    def __hash__(self) -> int:
        return hash(Done)

    def __repr__(self) -> str:
        return "Done()"


Action = SendClose | RelayClose | Ping | DropSocket | PauseReading | ResumeReading | (
    CloseSocket | Wake | Done
)  # fmt: skip
