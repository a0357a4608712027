"""How a refusal or error reaches a client (docs/contracts.md).

* Plain HTTP and a refused WebSocket handshake: status (503 capacity, 429 tenant
  quota, 401/403/413 policy, 502 upstream), ``Retry-After`` + ``X-Headroom-Reason``
  for refusals, and the JSON body ``{"error": {...}}``.
* ``refusal: close`` WebSocket routes (browsers cannot read a refused handshake):
  accept, send one JSON event in the route protocol's own error shape carrying the
  same fields, close with the error's close code (1013 for refusals) and a reason of
  at most 123 bytes.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.errors import HeadroomError, Refused, Unauthorized
from proxy.metering.adapters.registry import generic_error, spec

__all__ = ["close_reason", "error_body", "error_event", "http_error", "truncate_reason"]

_MAX_REASON_BYTES = 123


def error_body(err: HeadroomError) -> dict[str, Any]:
    """The JSON body for any Headroom error (refusals carry the full contract)."""
    if isinstance(err, Refused):
        return err.body()
    return {
        "error": {
            "type": _error_type(err),
            "code": _error_code(err),
            "message": str(err),
            "retry_after_s": None,
            "fallback": None,
            "queue_position": None,
        }
    }


def _error_code(err: HeadroomError) -> str:
    from proxy.errors import PolicyViolation, UpstreamError

    if isinstance(err, UpstreamError):
        return f"upstream_{err.kind}"
    if isinstance(err, PolicyViolation):
        return err.code
    return "internal_error"


def _error_type(err: HeadroomError) -> str:
    from proxy.errors import PolicyViolation, UpstreamError

    if isinstance(err, UpstreamError):
        return "upstream_error"
    if isinstance(err, PolicyViolation):
        return "invalid_request_error"
    return "internal_error"


def http_error(
    err: HeadroomError, extra_headers: dict[str, str] | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, raw headers, body) for an HTTP response or a WebSocket denial."""
    body = json.dumps(error_body(err), separators=(",", ":")).encode()
    headers: dict[str, str] = {"content-type": "application/json"}
    if isinstance(err, Refused):
        headers.update({k.lower(): v for k, v in err.headers().items()})
    elif isinstance(err, Unauthorized):
        headers["www-authenticate"] = err.challenge
    if extra_headers:
        headers.update({k.lower(): v for k, v in extra_headers.items()})
    headers["content-length"] = str(len(body))
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    return err.http_status, raw, body


def truncate_reason(text: str) -> str:
    """A WebSocket close reason: at most 123 UTF-8 bytes, cut on a character boundary."""
    encoded = text.encode()
    if len(encoded) <= _MAX_REASON_BYTES:
        return text
    return encoded[:_MAX_REASON_BYTES].decode(errors="ignore")


def close_reason(err: HeadroomError) -> str:
    """The WebSocket close reason for ``err``: a refusal's reason code and Retry-After, else the
    error's message (within the 123-byte limit)."""
    if isinstance(err, Refused):
        return truncate_reason(f"{err.reason}: retry after {err.retry_after_header} s")
    return truncate_reason(str(err) or type(err).__name__)


def error_event(protocol: str, err: HeadroomError) -> str:
    """One JSON error event in ``protocol``'s own shape (its ``error_shape`` in
    :mod:`proxy.metering.adapters.registry`), carrying the contract fields."""
    inner = error_body(err)["error"]
    extra = {
        "retry_after_s": inner["retry_after_s"],
        "fallback": inner["fallback"],
        "queue_position": inner["queue_position"],
    }
    entry = spec(protocol)
    shape = entry.error_shape if entry is not None else generic_error
    return json.dumps(shape(inner, extra), separators=(",", ":"))
