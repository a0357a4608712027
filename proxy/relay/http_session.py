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
is logged, so the server closes the connection without the end of the body (and the
client listener drops what is still unsent if the client does not read,
:mod:`proxy.relay.listener`). uvicorn logs an exception escaping an app at ERROR
with a traceback; for this normal event that record is dropped
(:func:`install_abort_filter`).
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from proxy.client_request import ClientRequest
from proxy.errors import HeadroomError, MessageTooLarge, RequestTimeout
from proxy.relay.http_body import ClientGone, read_body
from proxy.relay.http_exchange import HttpExchange, send_error
from proxy.relay.lifecycle import Declined, run_session

if TYPE_CHECKING:
    from proxy.admission.session_lease import Lease, PositionCallback
    from proxy.metering.session_meter import SessionMeter
    from proxy.relay.lifecycle import SessionStop
    from proxy.relay.services import RelayServices
    from proxy.relay.session_record import SessionRecord
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


async def relay_http(
    services: RelayServices, route: RouteSettings, scope: Scope, receive: Receive, send: Send
) -> None:
    """Serve one HTTP request on ``route`` (:func:`proxy.relay.lifecycle.run_session`);
    every exit path releases the slot and logs one line. Raises
    :class:`ResponseAborted`, after the log line, when a started response could not be
    completed."""
    transport = _Request(services, route, ClientRequest.of(scope), receive, send)
    record = await run_session(services, route, transport.request, transport)
    if transport.abort:
        raise ResponseAborted(f"session {record.session}: {record.error or 'aborted'}")


class _Request:
    """The HTTP half of a session (:class:`proxy.relay.lifecycle.Transport`): the body
    read before admission, refusals as error responses, and the exchange, which sends
    the request upstream itself (failing over while nothing has flowed) under its own
    limits -- so :meth:`open` only builds it, and a connect failure comes out of
    :meth:`relay` for the lifecycle to answer."""

    kind: str = "http"
    log: logging.Logger = log
    on_position: PositionCallback | None = None
    open_races_client: bool = False

    def __init__(
        self, services: RelayServices, route: RouteSettings, request: ClientRequest,
        receive: Receive, send: Send,
    ) -> None:  # fmt: skip
        self.services, self.route, self.request = services, route, request
        self.scope = request.scope
        self.receive, self.send = receive, send
        self.body = b""
        self.exchange: HttpExchange | None = None
        #: The response started and could not be completed: the caller aborts it.
        self.abort = False

    async def prepare(self, record: SessionRecord) -> None:
        """Read the body, bounded in size and, since no slot is held meanwhile, in time
        (a slowloris gets 408)."""
        limits = self.services.settings.limits
        try:
            self.body = await read_body(
                self.receive, limit=limits.max_http_body_bytes, clock=self.services.clock,
                timeout_s=limits.handshake_timeout_s,
            )  # fmt: skip
        except MessageTooLarge as err:
            raise Declined("rejected_too_large", err) from None
        except RequestTimeout as err:
            raise Declined("rejected_timeout", err) from None
        except ClientGone:
            raise Declined("abandoned") from None
        record.bytes_up = len(self.body)

    def queued(self) -> AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def until_disconnect(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return

    async def open(self, lease: Lease, record: SessionRecord) -> HttpExchange:
        self.exchange = HttpExchange(
            self.services, self.route, self.request, self.body, lease, self.send, record, None
        )
        return self.exchange

    def discard(self, upstream: HttpExchange) -> None:
        return None  # the exchange closes its own upstream response

    async def relay(
        self, lease: Lease, upstream: HttpExchange, fallback_pool: str | None,
        record: SessionRecord, meter: SessionMeter, stop: SessionStop,
    ) -> None:  # fmt: skip
        upstream.fallback_pool = fallback_pool
        self.abort = await upstream.run(self.receive, meter, stop)

    async def refuse(self, err: HeadroomError, record: SessionRecord) -> None:
        record.status = await send_error(self.send, err)

    def client_gone(self, exc: Exception) -> bool:
        return False

    async def internal_error(self) -> None:
        # logged already: a started response is cut without uvicorn's second traceback
        exchange = self.exchange
        self.abort = exchange is not None and exchange.response_started and not exchange.complete
