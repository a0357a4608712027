"""Logging: one JSON object per line (or text), and the filters Headroom needs.

Both formats carry a record's structured fields (``extra={"fields": {...}}``, e.g. the
end-of-session line): the JSON format as keys of the object, the text format as
``key=value`` pairs after the message (:class:`TextFormatter`).

Refusals are normal operation and log nothing at ERROR: every WebSocket handshake is
served by Headroom's client listener (:mod:`proxy.relay.listener`), never by uvicorn's
WebSocket implementation.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

__all__ = [
    "JsonFormatter",
    "TextFormatter",
    "configure_logging",
    "install_uvicorn_filters",
]


def install_uvicorn_filters() -> None:
    """Attach Headroom's filter to uvicorn's loggers (idempotent): the redaction of
    ``api_key`` and ``headroom_reservation`` query values (uvicorn's access log, when
    turned on, logs each request's target with its query string)."""
    from proxy.admission.auth import KeyRedactionFilter

    for name in ("uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
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


#: A text value written bare; anything else (spaces, quotes, ``=``, control characters,
#: the empty string) is written as a JSON string, so one record stays one parseable line.
_BARE = re.compile(r"[^\s\"'=\\\x00-\x1f\x7f]+")


def _text_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if _BARE.fullmatch(text) else json.dumps(text)


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <message> key=value ...``, one line per record (a
    traceback follows on the next lines, as with :class:`logging.Formatter`).

    The pairs are the record's ``fields`` in their order, leaving out None values, the
    ``event`` name, and text values the message already states as a word (the session
    line's message is ``session <id> <decision>``)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            said = set(record.message.split())
            pairs = [
                f"{key}={_text_value(value)}"
                for key, value in fields.items()
                if value is not None
                and key != "event"
                and not (isinstance(value, str) and value in said)
            ]
            if pairs:
                line += " " + " ".join(pairs)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + record.exc_text
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Configure the root logger for ``headroom`` commands."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True
    logging.getLogger("websockets").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    install_uvicorn_filters()
