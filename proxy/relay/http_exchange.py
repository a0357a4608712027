"""One admitted HTTP exchange: the request sent upstream (failing over while nothing
has flowed), the response streamed back chunk by chunk, and the limits that end it.

It only moves bytes: the meter, the drain registration and the answer when no replica
can be reached are the session lifecycle's (:func:`proxy.relay.lifecycle.run_session`).

Limits run on the runtime's clock and are read from the settings in force when the
session was admitted (a reload reaches every new session). The timers are the relay
core's :class:`~proxy.relay.deadlines.Deadlines`, shared with the WebSocket relays; here,
activity is the upstream sending something (the status line, a body chunk):

* ``upstream_response_timeout_s``: the upstream's response head (status line and
  headers) has not come this long after admission, the connect included -- an upstream
  that accepts the connection and never answers holds the slot this long, not
  ``idle_timeout_s``;
* ``idle_timeout_s``: the upstream sent nothing for this long (a blocked send to the
  client does not count);
* ``max_session_s``: the session has run this long since admission;
* ``client_write_timeout_s``: one send to the client has been blocked this long (its
  socket buffer stayed full: it stopped reading). Its connection is reset at once;
* drain's deadline (:meth:`~proxy.runtime.Runtime.close_sessions`).

Before the response starts, such an end is an error response (504, or 503 for drain).
After it started, and when the upstream fails mid-stream (reset, closed before the end
of the body, idle), the response is *aborted*: the client's connection is closed
without the end of the body (no terminating chunk; a ``Content-Length`` left short),
so the client sees a truncated response (curl exits 18, HTTP libraries raise an
incomplete-read error) and never mistakes cut audio for a complete answer.

The relay yields to the event loop after every :data:`CHUNKS_PER_TURN` body chunks,
so an upstream that always has data ready cannot hold the loop. A client that stops
reading stops the upstream reads: a send to it waits while its socket buffer is full
(uvicorn's flow control, which the client listener passes on), and the exchange reads
from the upstream only between sends, its socket paused meanwhile; what is in flight is
bounded by the socket buffers and one upstream read.

The upstream gets the client's end-to-end headers and nothing else (no default
``Accept``, ``Accept-Encoding`` or ``User-Agent`` from the HTTP client library, no
cookies from earlier responses). A response with a ``Content-Encoding`` other than
``identity`` -- the client asked for it -- is relayed as it is and not metered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from proxy.admission.refusal import http_error
from proxy.admission.session_lease import Lease
from proxy.client_request import ClientRequest
from proxy.errors import (
    HeadroomError,
    UpstreamConnectError,
    UpstreamStreamError,
    UpstreamTimeout,
    refusal_for,
)
from proxy.relay.admit import FALLBACK_RESPONSE_HEADER
from proxy.relay.deadlines import Deadlines, Expiry
from proxy.relay.failover import AttemptFailed, describe, walk
from proxy.relay.headers import forwarded_request_headers, response_headers
from proxy.relay.session_record import SessionRecord

if TYPE_CHECKING:
    from proxy.clock import TimerHandle
    from proxy.metering.session_meter import SessionMeter
    from proxy.relay.lifecycle import SessionStop
    from proxy.relay.services import RelayServices
    from proxy.settings import RouteSettings

__all__ = ["CHUNKS_PER_TURN", "Ending", "HttpExchange", "send_error"]

log = logging.getLogger("headroom.relay.http")

Scope = dict[str, Any]
Receive = Any
Send = Any


#: Sends of one request after the upstream closed a kept-alive connection on it unanswered.
_STALE_RESENDS = 2

#: Body chunks relayed before the relay yields to the event loop once. Neither side
#: bounds a run by itself: a read from the upstream suspends at most once and may hold
#: hundreds of small chunks (up to 64 KiB), and a send suspends only while the client's
#: socket buffer is full -- not while the client keeps up, nor once it has gone (the
#: server drops what is sent on a closed connection, and the disconnect watch waits
#: for the loop's turn).
CHUNKS_PER_TURN = 32


async def _send_fresh(http: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """Send ``request``; when the upstream closes the (pooled) connection before sending
    any response -- a kept-alive connection it was closing as the request went out
    (llama.cpp's server does this after streamed responses) -- send it again, at most
    :data:`_STALE_RESENDS` more times. The request was never answered, so no response
    byte can be duplicated; the closed connection has left the pool."""
    for _ in range(_STALE_RESENDS):
        try:
            return await http.send(request, stream=True)
        except httpx.RemoteProtocolError as exc:
            if "without sending a response" not in str(exc):
                raise
    return await http.send(request, stream=True)


@dataclass(frozen=True, slots=True)
class Ending:
    """Why an exchange ended before its response was complete."""

    #: "no_response", "idle", "max_session", "client_write", "drain", "midstream",
    #: "client_left", "unreachable" (no replica took the request: the lifecycle answers)
    kind: str
    reason: str


async def send_error(send: Send, err: HeadroomError) -> int:
    status, headers, body = http_error(err)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return status


class HttpExchange:
    """Relay one admitted request. :meth:`run` returns True when the response must be
    aborted (the caller raises out of the ASGI app); every other outcome, error
    responses included, has been sent in full."""

    def __init__(
        self,
        services: RelayServices,
        route: RouteSettings,
        request: ClientRequest,
        body: bytes,
        lease: Lease,
        send: Send,
        record: SessionRecord,
        fallback_pool: str | None,
    ) -> None:
        self.services, self.route, self.request, self.body = services, route, request, body
        self.scope = request.scope
        self._meter: SessionMeter | None = None
        self.lease, self._send, self.record, self.fallback_pool = lease, send, record, fallback_pool
        self.clock = services.clock
        self.limits = services.settings.limits
        self.timers = Deadlines(self.limits, self.clock.now())
        self.response_started = False
        self.complete = False  # the whole response was handed to the server
        self.ending: Ending | None = None
        self._task: asyncio.Future[None] | None = None
        self._timer: TimerHandle | None = None
        self._answer_timer: TimerHandle | None = None

    # -- ending it ------------------------------------------------------------------

    def stop(self, code: int, reason: str) -> None:
        """Drain's deadline (:meth:`Runtime.close_sessions`): end the exchange now."""
        self._end(Ending("drain", reason or "server restarting"))

    def _end(self, ending: Ending) -> None:
        if self.ending is None and not self.complete:
            self.ending = ending
            if self._task is not None:
                self._task.cancel()

    def _arm(self) -> None:
        """One timer, at the next deadline (none: the first blocked send arms it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        due = self.timers.wake_at
        if due != float("inf"):
            self._timer = self.clock.call_at(due, self._tick)

    def _no_answer(self) -> None:
        self._answer_timer = None
        if not self.response_started:
            wait = self.limits.upstream_response_timeout_s
            self._end(Ending("no_response", f"no response head within {wait:g} s"))

    def _tick(self) -> None:
        self._timer = None
        if self.ending is not None or self.complete:
            return
        expiry = self.timers.expired(self.clock.now())
        if expiry is Expiry.CLIENT_WRITE:
            # The response is aborted (ResponseAborted out of the app): the server
            # closes the connection, and the client listener drops what is unsent
            # (proxy.relay.listener).
            self.record.error = "client stopped reading"
            self._end(Ending("client_write", "client stopped reading"))
        elif expiry is Expiry.IDLE:
            self._end(Ending("idle", f"idle timeout: the upstream sent nothing for "
                                     f"{self.limits.idle_timeout_s:g} s"))  # fmt: skip
        elif expiry is Expiry.MAX_SESSION:
            self._end(Ending("max_session", "maximum session duration reached"))
        else:
            self.timers.next_deadline()
            self._arm()

    # -- running it -----------------------------------------------------------------

    async def run(self, receive: Receive, meter: SessionMeter, stop: SessionStop) -> bool:
        """Relay until the response is complete, the client leaves or a limit ends it,
        metering into ``meter``; drain ends it through ``stop``. True: the response
        started and must be aborted. Raises :class:`~proxy.errors.UpstreamConnectError`
        when no replica could be reached (nothing was sent to the client)."""
        task = self._task = asyncio.ensure_future(self._exchange(meter))
        watcher = asyncio.ensure_future(self._watch_client(receive))
        stop.attach(self.stop)
        self.timers.next_deadline()
        self._arm()
        answer_by = self.timers.started + self.limits.upstream_response_timeout_s
        self._answer_timer = self.clock.call_at(answer_by, self._no_answer)
        try:
            await asyncio.wait({task})
        finally:
            if self._timer is not None:
                self._timer.cancel()
            if self._answer_timer is not None:
                self._answer_timer.cancel()
            for t in (task, watcher):
                if not t.done():
                    t.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc
        ending = self.ending
        if ending is None or ending.kind == "client_left":
            return False
        if ending.kind == "drain":
            self.record.error = f"closed at drain deadline: {ending.reason}"
        elif ending.kind == "max_session":
            self.record.error = ending.reason
        if self.response_started:
            if ending.kind == "idle":
                self.services.upstream_error(self.lease.pool, self.lease.replica, "midstream")
                self.record.error = f"upstream failed mid-stream: {ending.reason}"
            return True
        await self._refuse_late(ending)
        return False

    async def _refuse_late(self, ending: Ending) -> None:
        """The exchange ended before the upstream answered: tell the client why."""
        lease, record = self.lease, self.record
        err: HeadroomError
        if ending.kind == "drain":
            err = refusal_for("draining", retry_after_s=1.0, pool=lease.pool)
        else:
            if ending.kind in ("idle", "no_response"):
                self.services.upstream_error(lease.pool, lease.replica, "timeout")
                record.decision = "upstream_failed"
            err = UpstreamTimeout(
                f"upstream {lease.replica} sent no response: {ending.reason}",
                replica=lease.replica, kind="timeout",
            )  # fmt: skip
            record.error = str(err)
        with contextlib.suppress(Exception):
            record.status = await send_error(self._send, err)

    async def _watch_client(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        # uvicorn also reports the end of a completed response as a disconnect, and
        # Headroom's own reset of a client that stopped reading
        if self.ending is None and not self.complete:
            self.record.client_close = 1006
            self._end(Ending("client_left", "client went away"))

    async def _send_body(self, chunk: bytes, more: bool, now: float) -> None:
        """Send a body chunk at ``now``, under the write watchdog."""
        if self.timers.sending(now):
            self._arm()
        await self._send({"type": "http.response.body", "body": chunk, "more_body": more})
        self.timers.sent(self.clock.now())

    async def _open(self) -> httpx.Response:
        """Send the request, failing over to another replica while nothing has flowed."""
        services, lease, scope = self.services, self.lease, self.scope
        settings = services.settings
        headers = forwarded_request_headers(
            scope["headers"],
            client_host=(scope.get("client") or (None,))[0],
            scheme=scope.get("scheme", "http"),
            websocket=False,
            keep_authorization=settings.auth is None,
            trusted_proxies=settings.forwarded.trusted_proxies,
        )
        # latin-1 bytes: a header value with obs-text is relayed as the client sent it
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        path = self.route.upstream_path or scope.get("raw_path", b"").decode("latin-1")
        path = (path or scope["path"]).split("?")[0]
        query = self.request.upstream_query(auth=settings.auth is not None)
        connect = self.limits.upstream_connect_timeout_s
        # read/write: the idle watchdog (on the runtime's clock) bounds every wait
        timeout = {"connect": connect, "read": None, "write": None, "pool": connect}

        async def attempt() -> httpx.Response:
            base = services.http_url(lease.pool, lease.replica)
            url = base + path + (f"?{query}" if query else "")
            # httpx.Request, not client.build_request: the client's default headers
            # (Accept, Accept-Encoding, User-Agent) and cookie jar are not the client's
            request = httpx.Request(
                scope["method"], url, headers=raw, content=self.body,
                extensions={"timeout": timeout},
            )  # fmt: skip
            try:
                return await _send_fresh(services.http, request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # the replica refused or did not accept in time: it is unreachable
                reason = f"cannot reach upstream {lease.replica}: {describe(exc)}"
                raise AttemptFailed(reason, kind="connect", eject=True) from exc
            except httpx.PoolTimeout as exc:
                # our own connection pool was full: not the replica's fault
                reason = f"no upstream connection to {lease.replica} free: {describe(exc)}"
                raise AttemptFailed(reason, kind="connect") from exc

        def moved(replica: str) -> None:
            self.record.replica = replica
            if self._meter is not None:  # its observations belong to the new replica
                self._meter.move_to(services.replica_sink(lease.pool, replica))

        # each replica at most once (proxy.relay.failover)
        return await walk(lease, attempt, count=services.upstream_error, moved=moved, log=log)

    async def _exchange(self, meter: SessionMeter) -> None:
        self._meter = meter
        services, lease, record, scope = self.services, self.lease, self.record, self.scope
        clock = self.clock
        adapter = services.http_adapter(self.route, meter)
        request = self.request
        query = {key: value for key, value in request.query if value}
        adapter.request(scope["method"], query, request.content_type, self.body)
        try:
            try:
                response = await self._open()
            except UpstreamConnectError as err:
                self.ending = Ending("unreachable", str(err))
                raise
            except Exception as exc:
                # Connected, but no response came (closed, reset): 502. Whatever the HTTP
                # stack raises here (httpx, or e.g. an AttributeError from anyio on a
                # transport uvloop already closed) is the upstream failing.
                services.upstream_error(lease.pool, lease.replica, "protocol")
                failure = UpstreamStreamError(
                    f"upstream {lease.replica} sent no response: {exc or type(exc).__name__}",
                    replica=lease.replica, kind="protocol",
                )  # fmt: skip
                record.decision = "upstream_failed"
                record.error = str(failure)
                record.status = await send_error(self._send, failure)
                self.complete = True
                return
            try:
                self.timers.last_activity = now = clock.now()
                adapter.request_complete(now)  # the body is sent: the ASR commit
                record.status = response.status_code
                adapter.response_start(response.status_code, response.headers)
                headers = response_headers(response.headers.raw)
                if self.fallback_pool is not None:
                    headers.append((FALLBACK_RESPONSE_HEADER, self.fallback_pool.encode()))
                # An encoded body (the client asked for gzip, say) is relayed as it is,
                # unmetered: its bytes are not audio Headroom can measure.
                encoding = response.headers.get("content-encoding", "").strip().lower()
                metered = encoding in ("", "identity")
                self.response_started = True
                await self._send(
                    {"type": "http.response.start", "status": response.status_code,
                     "headers": headers}
                )  # fmt: skip
                turn = 0
                try:
                    async for chunk in response.aiter_raw():
                        self.timers.last_activity = now = clock.now()
                        if metered:
                            adapter.response_chunk(now, chunk)
                        record.bytes_down += len(chunk)
                        record.frames_down += 1
                        await self._send_body(chunk, True, now)
                        turn += 1
                        if turn == CHUNKS_PER_TURN:
                            turn = 0
                            await asyncio.sleep(0)
                except httpx.HTTPError as exc:
                    # Bytes have flowed: nothing is retried, and the client must see the
                    # stream cut, not end (the caller aborts the response).
                    services.upstream_error(lease.pool, lease.replica, "midstream")
                    reason = f"upstream failed mid-stream: {exc or type(exc).__name__}"
                    record.error = reason
                    self.ending = Ending("midstream", reason)
                    return
                await self._send_body(b"", False, clock.now())
                self.complete = True
            finally:
                with contextlib.suppress(Exception):
                    await response.aclose()
        finally:
            adapter.response_complete(clock.now())
