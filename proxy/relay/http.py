"""The streaming HTTP relay (httpx, one pooled AsyncClient).

The request body is read first, bounded by ``limits.max_http_body_bytes`` (413 past
it): the adapter needs it to learn the audio format, and only a body still in hand
can be replayed on another replica when the first cannot be reached. Then the gate
decides (a queued request is simply held; a client that disconnects leaves the
queue), the request goes upstream with end-to-end headers, and the response is
streamed back chunk by chunk as it arrives with status and headers preserved (SSE,
raw PCM, WAV). The slot is released when the response ends or the client goes away,
which also closes the upstream request. Unreachable upstream: 502 if nothing was
sent yet; nothing is retried once bytes have flowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import httpx

from proxy.clock import clock_timeout
from proxy.errors import (
    HeadroomError,
    MessageTooLarge,
    PolicyViolation,
    Refused,
    RequestTimeout,
    UpstreamConnectError,
    UpstreamStreamError,
    UpstreamTimeout,
)
from proxy.gate import Lease
from proxy.refusal import http_error
from proxy.relay.admit import FALLBACK_RESPONSE_HEADER, enter, upstream_query
from proxy.relay.headers import forwarded_request_headers, response_headers
from proxy.relay.session import SessionRecord, new_session_id

if TYPE_CHECKING:
    from proxy.runtime import Runtime
    from proxy.settings import RouteSettings

__all__ = ["relay_http", "send_error"]

log = logging.getLogger("headroom.relay.http")

Scope = dict[str, Any]
Receive = Any
Send = Any


class _ClientGone(Exception):
    pass


async def send_error(send: Send, err: HeadroomError) -> int:
    status, headers, body = http_error(err)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return status


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
        record.admitted_at = clock.now()
        record.queue_wait_s = lease.waited_s
        record.replica = lease.replica
        streaming = asyncio.ensure_future(
            _exchange(rt, route, scope, body, lease, send, record, fallback_pool)
        )
        if await _while_connected(receive, streaming):
            record.client_close = 1006  # the client went away mid-response
        elif not streaming.cancelled() and streaming.exception() is not None:
            raise streaming.exception()  # type: ignore[misc]
    except asyncio.CancelledError:
        record.error = "cancelled"
        raise
    except Exception as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        log.exception("internal error in session %s", record.session)
    finally:
        if lease is not None:
            lease.release()
        rt.release_tenant(tenant)
        record.ended = clock.now()
        record.emit()


async def _open(
    rt: Runtime,
    route: RouteSettings,
    scope: Scope,
    body: bytes,
    lease: Lease,
    record: SessionRecord,
) -> httpx.Response:
    """Send the request, failing over to another replica while nothing has flowed."""
    headers = forwarded_request_headers(
        scope["headers"],
        client_host=(scope.get("client") or (None,))[0],
        scheme=scope.get("scheme", "http"),
        websocket=False,
        keep_authorization=rt.settings.auth is None,
    )
    path = route.upstream_path or scope.get("raw_path", b"").decode("latin-1") or scope["path"]
    path = path.split("?")[0]
    query = upstream_query(scope, auth=rt.settings.auth is not None)
    while True:
        url = rt.http_url(lease.pool, lease.replica) + path + (f"?{query}" if query else "")
        # latin-1 bytes: a header value with obs-text is relayed as the client sent it
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        request = rt.http.build_request(scope["method"], url, headers=raw, content=body)
        try:
            return await rt.http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            reason = f"cannot reach upstream {lease.replica}: {exc or type(exc).__name__}"
        rt.upstream_error(lease.pool, lease.replica, "connect")
        log.warning("%s; failing over", reason)
        failed = lease.replica
        if not lease.fail_over():
            raise UpstreamConnectError(reason, replica=failed, kind="connect")
        record.replica = lease.replica


async def _exchange(
    rt: Runtime,
    route: RouteSettings,
    scope: Scope,
    body: bytes,
    lease: Lease,
    send: Send,
    record: SessionRecord,
    fallback_pool: str | None,
) -> None:
    clock = rt.clock
    meter = rt.new_meter(lease.pool, lease.replica, record.admitted_at or clock.now())
    adapter = rt.http_adapter(route, meter)
    content_type = next(
        (v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"content-type"), None
    )
    query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
    adapter.request(scope["method"], query, content_type, body)
    try:
        try:
            response = await _open(rt, route, scope, body, lease, record)
        except UpstreamConnectError as err:
            record.decision = "upstream_unreachable"
            record.error = str(err)
            record.status = await send_error(send, err)
            return
        except Exception as exc:
            # Connected, but no response came (closed, reset, read timeout): 502 / 504.
            # Whatever the HTTP stack raises here (httpx, or e.g. an AttributeError from
            # anyio on a transport uvloop already closed) is the upstream failing.
            timeout = isinstance(exc, httpx.TimeoutException)
            kind = "timeout" if timeout else "protocol"
            rt.upstream_error(lease.pool, lease.replica, kind)
            failure = (UpstreamTimeout if timeout else UpstreamStreamError)(
                f"upstream {lease.replica} sent no response: {exc or type(exc).__name__}",
                replica=lease.replica,
                kind=kind,
            )
            record.decision = "upstream_failed"
            record.error = str(failure)
            record.status = await send_error(send, failure)
            return
        try:
            adapter.request_complete(clock.now())  # the body is sent: the ASR commit
            record.status = response.status_code
            adapter.response_start(response.status_code, response.headers)
            headers = response_headers(response.headers.raw)
            if fallback_pool is not None:
                headers.append((FALLBACK_RESPONSE_HEADER, fallback_pool.encode()))
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": headers}
            )
            try:
                async for chunk in response.aiter_raw():
                    adapter.response_chunk(clock.now(), chunk)
                    record.bytes_down += len(chunk)
                    record.frames_down += 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:
                # Bytes have flowed: nothing is retried. The client sees the stream end.
                rt.upstream_error(lease.pool, lease.replica, "midstream")
                record.error = f"upstream failed mid-stream: {exc or type(exc).__name__}"
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with contextlib.suppress(Exception):
                await response.aclose()
    finally:
        now = clock.now()
        adapter.response_complete(now)
        record.meter = meter.finish(now).as_log_fields()
