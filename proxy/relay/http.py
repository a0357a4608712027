"""The streaming HTTP relay (httpx, one pooled AsyncClient).

The request body is read first, bounded by ``limits.max_http_body_bytes`` (413 past
it): the adapter needs it to learn the audio format, and only a body still in hand
can be replayed on another replica when the first cannot be reached. Then the gate
decides (a queued request is simply held; a client that disconnects leaves the
queue), and :class:`~proxy.relay.http_exchange.HttpExchange` sends the request
upstream with the client's end-to-end headers only and streams the response back
chunk by chunk as it arrives, status and headers preserved (SSE, raw PCM, WAV). The
slot is released when the response ends, the client goes away or a limit ends the
session, which also closes the upstream request. Unreachable upstream: 502 if nothing
was sent yet; nothing is retried once bytes have flowed.

A response that cannot be completed (the upstream failed mid-stream, a limit, drain)
is aborted: :class:`ResponseAborted` is raised out of the ASGI app after the session
is logged, so the server closes the connection without the end of the body. uvicorn
logs an exception escaping an app at ERROR with a traceback; for this normal event
that record is dropped (:func:`install_abort_filter`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from proxy.clock import clock_timeout
from proxy.errors import MessageTooLarge, PolicyViolation, Refused, RequestTimeout
from proxy.gate import Lease
from proxy.relay.admit import enter
from proxy.relay.http_exchange import HttpExchange, send_error
from proxy.relay.session import SessionRecord, new_session_id

if TYPE_CHECKING:
    from proxy.runtime import Runtime
    from proxy.settings import RouteSettings

__all__ = ["ResponseAborted", "install_abort_filter", "relay_http", "send_error"]

log = logging.getLogger("headroom.relay.http")

Scope = dict[str, Any]
Receive = Any
Send = Any


class ResponseAborted(Exception):
    """Raised out of the ASGI app once a response has started and cannot be completed:
    the server then closes the connection without the end of the body, so the client
    sees a truncated response instead of a short one that looks complete."""


class _AbortNoiseFilter(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" record for :class:`ResponseAborted`
    (the session's own log line already says what happened)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, ResponseAborted)


def install_abort_filter() -> None:
    """Attach the filter to uvicorn's error logger (idempotent)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _AbortNoiseFilter) for f in logger.filters):
        logger.addFilter(_AbortNoiseFilter())


class _ClientGone(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise MessageTooLarge(f"request body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _await_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _while_connected(receive: Receive, work: asyncio.Future[Any]) -> bool:
    """Run ``work`` until done or the client disconnects (then cancel it). True if the
    client went away first."""
    gone = asyncio.ensure_future(_await_disconnect(receive))
    client_left = False
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        client_left = gone.done()
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    return client_left


async def relay_http(
    rt: Runtime, route: RouteSettings, scope: Scope, receive: Receive, send: Send
) -> None:
    """Serve one HTTP request on ``route``; every exit path releases the slot and logs
    one line."""
    clock = rt.clock
    record = SessionRecord(
        new_session_id(), route.path, route.pool, "http", clock.now(), decision="admitted"
    )
    lease: Lease | None = None
    tenant: str | None = None
    exchange: HttpExchange | None = None
    abort = False
    try:
        try:
            tenant = rt.authorize(scope, route.pool)
        except Refused as refusal:
            record.decision = f"rejected_{refusal.reason}"
            record.status = await send_error(send, refusal)
            return
        except PolicyViolation as err:
            record.decision = f"rejected_{err.code}"
            record.status = await send_error(send, err)
            return
        limits = rt.settings.limits
        try:
            async with clock_timeout(clock, limits.handshake_timeout_s):
                body = await _read_body(receive, limits.max_http_body_bytes)
        except MessageTooLarge as err:
            record.decision = "rejected_too_large"
            record.status = await send_error(send, err)
            return
        except TimeoutError:
            # slowloris: the body must arrive within the handshake timeout (no slot is
            # held meanwhile: admission comes after the body)
            record.decision = "rejected_timeout"
            record.status = await send_error(
                send, RequestTimeout(f"request body not received within "
                                     f"{limits.handshake_timeout_s:g} s")
            )  # fmt: skip
            return
        except _ClientGone:
            record.decision = "abandoned"
            return
        record.bytes_up = len(body)
        try:
            entry, fallback_pool = await enter(rt, route, scope)
            if fallback_pool is not None:
                record.pool = fallback_pool
            if isinstance(entry, Lease):
                lease = entry
            else:
                record.decision = "queued"
                wait = asyncio.ensure_future(entry.wait())
                if await _while_connected(receive, wait):
                    record.decision = "abandoned"
                    if not wait.cancelled() and wait.exception() is None:
                        wait.result().release()  # granted in the instant the client left
                    return
                lease = wait.result()
                record.decision = "admitted_after_queue"
        except Refused as refusal:
            record.decision = f"rejected_{refusal.reason}"
            record.status = await send_error(send, refusal)
            return
        except PolicyViolation as err:  # a reservation token without a slot here
            record.decision = f"rejected_{err.code}"
            record.status = await send_error(send, err)
            return
        record.admitted_at = clock.now()
        record.queue_wait_s = lease.waited_s
        record.replica = lease.replica
        exchange = HttpExchange(rt, route, scope, body, lease, send, record, fallback_pool)
        abort = await exchange.run(receive)
    except asyncio.CancelledError:
        record.error = "cancelled"
        raise
    except Exception as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        log.exception("internal error in session %s", record.session)
        # logged above: a started response is cut without uvicorn's second traceback
        abort = exchange is not None and exchange.response_started and not exchange.complete
    finally:
        if lease is not None:
            lease.release()
        rt.release_tenant(tenant)
        record.ended = clock.now()
        record.emit()
    if abort:
        raise ResponseAborted(f"session {record.session}: {record.error or 'aborted'}")
