"""A request body read under bounds: the relay's and the control plane's, one reader.

:func:`read_body` takes an ASGI ``receive`` and reads the whole body, at most ``limit``
bytes (past it: :class:`~proxy.errors.MessageTooLarge`, 413) within ``timeout_s`` on
the injected clock (past it: :class:`~proxy.errors.RequestTimeout`, 408). A client that
disconnects meanwhile raises :class:`ClientGone`: there is nobody to answer, and nothing
to log beyond the caller's own line.

The relay routes bound a body by ``limits.max_http_body_bytes``; the control plane (gang
reservations, the admin listener, every other endpoint of the client listener) by
``limits.max_control_body_bytes``, small enough that parsing it as JSON on the event
loop takes no measurable time. :func:`replay` hands a body already read to an ASGI app
that reads its own (FastAPI's ``Request.body()``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from proxy.admission.refusal import http_error
from proxy.clock import Clock, clock_timeout
from proxy.errors import HeadroomError, MessageTooLarge, RequestTimeout
from proxy.settings import LimitsSettings

__all__ = ["ClientGone", "control_body", "read_body", "refuse", "replay"]

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its body was complete."""


async def _read(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise MessageTooLarge(f"request body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def read_body(receive: Receive, *, limit: int, clock: Clock, timeout_s: float) -> bytes:
    """The whole request body; raises :class:`~proxy.errors.MessageTooLarge` past
    ``limit`` bytes, :class:`~proxy.errors.RequestTimeout` when it is not complete
    within ``timeout_s`` (``clock``), :class:`ClientGone` when the client left."""
    try:
        async with clock_timeout(clock, timeout_s):
            return await _read(receive, limit)
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout_s:g} s") from None


async def refuse(send: Send, err: HeadroomError) -> None:
    """Answer ``err`` with the error contract's status, headers and JSON body, as the
    relay routes answer theirs. What the client still sends of its body is thrown away
    as it arrives, and the connection closes ``limits.handshake_timeout_s`` after the
    answer unless a whole new request has come by then (the head deadline,
    :mod:`proxy.relay.listener`). It is not closed at once: closing on a client that
    is still sending resets the connection, and the reset can destroy the answer
    before the client reads it."""
    status, headers, body = http_error(err)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def control_body(
    receive: Receive, send: Send, limits: LimitsSettings, clock: Clock
) -> bytes | None:
    """A control-plane request's body, under ``limits.max_control_body_bytes`` and
    ``limits.handshake_timeout_s``; None when there is nothing more to do: the client
    was answered 413 or 408, or it left."""
    try:
        return await read_body(
            receive, limit=limits.max_control_body_bytes, clock=clock,
            timeout_s=limits.handshake_timeout_s,
        )  # fmt: skip
    except (MessageTooLarge, RequestTimeout) as err:
        await refuse(send, err)
    except ClientGone:
        pass
    return None


def replay(body: bytes, receive: Receive) -> Receive:
    """An ASGI ``receive`` that gives ``body`` as the whole request body once, then
    defers to ``receive`` (for the disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again() -> dict[str, Any]:
        if pending:
            return pending.pop()
        return await receive()

    return receive_again
