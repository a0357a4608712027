"""One relayed session's record: what the end-of-session JSON log line says."""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SessionRecord", "new_session_id"]

log = logging.getLogger("headroom.session")

_prefix = os.urandom(3).hex()
_counter = itertools.count(1)


def new_session_id() -> str:
    """Short, unique within the process, ordered: ``<6 hex>-<n>``."""
    return f"{_prefix}-{next(_counter)}"


@dataclass(slots=True)
class SessionRecord:
    """Mutable while the session runs; logged once, at the end."""

    session: str
    route: str
    pool: str
    transport: str
    started: float
    decision: str = "pending"
    replica: str | None = None
    queue_wait_s: float = 0.0
    admitted_at: float | None = None
    ended: float | None = None
    client_close: int | None = None
    upstream_close: int | None = None
    status: int | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    frames_up: int = 0
    frames_down: int = 0
    error: str | None = None
    meter: dict[str, Any] = field(default_factory=dict)
    #: The API key's name (None: authentication is off, or the key was refused).
    tenant: str | None = None
    #: The client's address: the TCP peer.
    client: str | None = None
    #: The session's trace (32 hex digits), when tracing is on (:mod:`proxy.tracing`).
    trace_id: str | None = None

    def fields(self) -> dict[str, Any]:
        duration = None
        if self.admitted_at is not None and self.ended is not None:
            duration = round(self.ended - self.admitted_at, 4)
        out: dict[str, Any] = {
            "event": "session_end",
            "session": self.session,
            "route": self.route,
            "pool": self.pool,
            "transport": self.transport,
            "tenant": self.tenant,
            "client": self.client,
            "replica": self.replica,
            "decision": self.decision,
            "queue_wait_s": round(self.queue_wait_s, 4),
            "duration_s": duration,
            "client_close": self.client_close,
            "upstream_close": self.upstream_close,
            "status": self.status,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "frames_up": self.frames_up,
            "frames_down": self.frames_down,
        }
        if self.error:
            out["error"] = self.error
        if self.trace_id:
            out["trace_id"] = self.trace_id
        out.update(self.meter)
        return out

    def emit(self) -> None:
        log.info("session %s %s", self.session, self.decision, extra={"fields": self.fields()})
