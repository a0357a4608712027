"""Fault injection: what a simulated GPU does wrong, on purpose.

A :class:`Faults` value is held per GPU and may be replaced at any time (CLI flags at
start, :meth:`proxy.sim.cluster.Cluster.set_faults`, or ``POST /sim/faults``). A
session snapshots the faults when it starts, so flipping a fault affects new sessions
and leaves running ones alone (except ``refuse_connections``, which stops the
listener at once; open connections continue).

=========================  ============================================================
field                      effect
=========================  ============================================================
``refuse_connections``     the port stops listening: new TCP connects are refused
``refuse_for_s``           with ``refuse_connections``: listen again after this long
``handshake_503``          WebSocket handshakes and HTTP requests get HTTP 503
``unhealthy``              ``/health`` and ``/ping`` answer 503
``drop_after_chunks``      after N chunks the TCP connection is aborted (no WS close
                           frame, truncated HTTP body)
``stall_after_chunks``     after N chunks the stream goes silent for ``stall_s``
``stall_s``                stall length in seconds (0 = no stall)
``slow_start_s``           extra time before a request reaches the engine (extra TTFA)
``error_after_chunks``     after N chunks the protocol's error event ends the stream
=========================  ============================================================

"Chunks" count audio chunks (TTS) or transcript events (ASR) on one connection.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

__all__ = ["FAULT_FIELDS", "Faults", "StreamFaults", "add_fault_arguments", "faults_from_args"]


@dataclass(frozen=True, slots=True)
class Faults:
    """The faults of one simulated GPU. The default injects nothing."""

    refuse_connections: bool = False
    refuse_for_s: float | None = None
    handshake_503: bool = False
    unhealthy: bool = False
    drop_after_chunks: int | None = None
    stall_after_chunks: int = 0
    stall_s: float = 0.0
    slow_start_s: float = 0.0
    error_after_chunks: int | None = None

    def __post_init__(self) -> None:
        for name in ("drop_after_chunks", "error_after_chunks", "stall_after_chunks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer")
        for name in ("stall_s", "slow_start_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.refuse_for_s is not None and self.refuse_for_s <= 0:
            raise ValueError("refuse_for_s must be > 0")

    @property
    def active(self) -> bool:
        """Whether any fault is set."""
        return self != Faults()

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def updated(self, changes: dict[str, Any]) -> Faults:
        """A copy with ``changes`` applied; ``ValueError`` on unknown or ill-typed fields."""
        unknown = set(changes) - set(FAULT_FIELDS)
        if unknown:
            raise ValueError(f"unknown fault field(s): {', '.join(sorted(unknown))}")
        checked: dict[str, Any] = {}
        for name, value in changes.items():
            kind = FAULT_FIELDS[name]
            if value is None and name in _NULLABLE:
                checked[name] = None
            elif (kind is bool and isinstance(value, bool)) or (
                kind is int and isinstance(value, int) and not isinstance(value, bool)
            ):
                checked[name] = value
            elif kind is float and isinstance(value, int | float) and not isinstance(value, bool):
                checked[name] = float(value)
            else:
                raise ValueError(f"fault field {name} must be {kind.__name__}, got {value!r}")
        return replace(self, **checked)


#: Field name -> its scalar type (for JSON validation).
FAULT_FIELDS: dict[str, type] = {
    "refuse_connections": bool,
    "refuse_for_s": float,
    "handshake_503": bool,
    "unhealthy": bool,
    "drop_after_chunks": int,
    "stall_after_chunks": int,
    "stall_s": float,
    "slow_start_s": float,
    "error_after_chunks": int,
}
assert set(FAULT_FIELDS) == {f.name for f in fields(Faults)}


Action = Literal["send", "drop", "error"]
_NULLABLE = ("refuse_for_s", "drop_after_chunks", "error_after_chunks")


class StreamFaults:
    """Per-connection fault state: call :meth:`before_chunk` before sending each chunk.

    Drop and error take precedence over a stall due at the same chunk.
    """

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.sent = 0
        self._stalled = False
        self._started = False

    async def before_chunk(self) -> Action:
        """What to do with the next chunk: ``drop`` the connection, answer an ``error``,
        or ``send`` it (after the one stall, when it is due), counting it as sent."""
        f = self.faults
        if f.drop_after_chunks is not None and self.sent >= f.drop_after_chunks:
            return "drop"
        if f.error_after_chunks is not None and self.sent >= f.error_after_chunks:
            return "error"
        if f.stall_s > 0 and not self._stalled and self.sent >= f.stall_after_chunks:
            self._stalled = True
            await asyncio.sleep(f.stall_s)
        self.sent += 1
        return "send"

    async def slow_start(self) -> None:
        """Delay the connection's first request by ``slow_start_s`` (once)."""
        if not self._started:
            self._started = True
            if self.faults.slow_start_s > 0:
                await asyncio.sleep(self.faults.slow_start_s)


def add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--fault-*`` flags of ``headroom sim``."""
    group = parser.add_argument_group("fault injection (every simulated GPU)")
    group.add_argument(
        "--fault-refuse", action="store_true", help="do not listen: TCP connects are refused"
    )
    group.add_argument(
        "--fault-refuse-for", type=float, metavar="S", help="with --fault-refuse: for S seconds"
    )
    group.add_argument(
        "--fault-503", action="store_true", help="answer handshakes and requests with HTTP 503"
    )
    group.add_argument(
        "--fault-unhealthy", action="store_true", help="/health and /ping answer 503"
    )
    group.add_argument("--fault-drop-after", type=int, metavar="N", help="abort TCP after N chunks")
    group.add_argument(
        "--fault-stall", type=float, default=0.0, metavar="S", help="stall streams for S seconds"
    )
    group.add_argument(
        "--fault-stall-after", type=int, default=0, metavar="N", help="stall after N chunks"
    )
    group.add_argument(
        "--fault-slow-start", type=float, default=0.0, metavar="S", help="add S seconds of TTFA"
    )
    group.add_argument(
        "--fault-error-after", type=int, metavar="N", help="send an error event after N chunks"
    )


def faults_from_args(args: argparse.Namespace) -> Faults:
    """The :class:`Faults` the ``--fault-*`` flags describe (``ValueError`` if invalid)."""
    return Faults(
        refuse_connections=bool(args.fault_refuse),
        refuse_for_s=args.fault_refuse_for,
        handshake_503=bool(args.fault_503),
        unhealthy=bool(args.fault_unhealthy),
        drop_after_chunks=args.fault_drop_after,
        stall_after_chunks=args.fault_stall_after,
        stall_s=args.fault_stall,
        slow_start_s=args.fault_slow_start,
        error_after_chunks=args.fault_error_after,
    )
