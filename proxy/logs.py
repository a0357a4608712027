"""Logging: one JSON object per line (or plain text), and the filters Headroom needs.

Refusals are normal operation. uvicorn's ``websockets-sansio`` implementation logs
"ASGI callable returned without completing handshake." at ERROR for every WebSocket
handshake refused through the ASGI denial response; :class:`DenialNoiseFilter` drops
exactly that record so a refusal storm cannot flood the logs.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["DenialNoiseFilter", "JsonFormatter", "configure_logging", "install_denial_filter"]

#: uvicorn ERROR records that are normal operation for a gateway: a refused handshake,
#: and a client's invalid UTF-8 text frame (uvicorn closes it with 1007 itself).
_NOISE = ("without completing handshake", "Invalid UTF-8 sequence received from client")


class DenialNoiseFilter(logging.Filter):
    """Drop uvicorn's per-denial / per-bad-frame ERROR records (see module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in _NOISE)


def install_denial_filter() -> None:
    """Attach Headroom's filters to uvicorn's error logger (idempotent): the denial
    noise filter, and the redaction of ``api_key`` query values (uvicorn logs each
    WebSocket's path with its query string)."""
    from proxy.auth import KeyRedactionFilter

    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, DenialNoiseFilter) for f in logger.filters):
        logger.addFilter(DenialNoiseFilter())
    if not any(isinstance(f, KeyRedactionFilter) for f in logger.filters):
        logger.addFilter(KeyRedactionFilter())


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, plus the mapping passed as
    ``extra={"fields": {...}}``."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            payload.update(fields)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str, separators=(",", ":"))


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Configure the root logger for ``headroom`` commands."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True
    logging.getLogger("websockets").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    install_denial_filter()
