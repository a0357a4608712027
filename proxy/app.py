"""The ASGI application: relays on the configured routes, operations endpoints on
the rest.

* A WebSocket on a WebSocket route -> :func:`proxy.relay.ws_session.relay_websocket`.
* An HTTP request on an HTTP route -> :func:`proxy.relay.http_session.relay_http`.
* ``POST /v1/headroom/reservations`` and ``DELETE /v1/headroom/reservations/{token}``:
  gang admission across stages (:mod:`proxy.admission.reservations`, docs/voice-agents.md).
* ``/healthz`` (alive), ``/readyz`` (config loaded, not draining and, with ``readiness:
  upstream``, the admission backend answering and at least one healthy replica; 503
  otherwise), ``/ping`` (the same, for SageMaker's container contract), ``/metrics``
  (Prometheus text format; only with ``metrics: {client_port: true}``, else 404: it is
  on the admin listener), served by a small
  FastAPI app. Anything else: 404 (a WebSocket is denied with 404). Upstreams come only
  from configuration: no header, path or query can choose a host.

Routing is an exact dict lookup on the path, before any framework code, so the relay
hot path pays nothing for the operations endpoints.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy import __version__
from proxy.admission.auth import identify
from proxy.admission.refusal import http_error
from proxy.admission.reservations import ReservationUnknown, key_of, parse_request
from proxy.client_request import ClientRequest
from proxy.errors import HeadroomError, PolicyViolation, Refused, Unauthorized
from proxy.logs import install_uvicorn_filters
from proxy.relay.http_body import control_body, refuse, replay
from proxy.relay.http_session import install_abort_filter, relay_http
from proxy.relay.ws_session import relay_websocket
from proxy.runtime import Runtime

__all__ = ["HeadroomApp", "create_app"]

log = logging.getLogger("headroom.app")

Scope = dict[str, Any]

RESERVATIONS_PATH = "/v1/headroom/reservations"


def _ops_app(rt: Runtime) -> FastAPI:
    ops = FastAPI(
        title="Headroom",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    @ops.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @ops.get("/readyz")
    async def readyz() -> JSONResponse:
        ready, why = rt.ready()
        upstream, upstream_why = rt.upstream_ready()
        return JSONResponse(
            {"ready": ready, "reason": why, "active": rt.gate.active, "queued": rt.gate.queued,
             "readiness": rt.settings.readiness,
             "upstream": {"ready": upstream, "reason": upstream_why}},
            status_code=200 if ready else 503,
        )  # fmt: skip

    @ops.get("/ping")
    async def ping() -> JSONResponse:
        """SageMaker's container health check: 200 while ready (answers from cached
        state, well inside SageMaker's 2 s timeout)."""
        ready, why = rt.ready()
        return JSONResponse({"status": why}, status_code=200 if ready else 503)

    def error_response(err: HeadroomError, stage: str | None = None) -> Response:
        status, raw, body = http_error(err, {"X-Headroom-Stage": stage} if stage else None)
        if stage is not None:
            doc = json.loads(body)
            doc["error"]["stage"] = stage
            doc["error"]["message"] = f"stage {stage}: {doc['error']['message']}"
            body = json.dumps(doc, separators=(",", ":")).encode()
        headers = {k.decode(): v.decode() for k, v in raw if k != b"content-length"}
        return Response(body, status_code=status, headers=headers)

    @ops.post("/v1/headroom/reservations")
    async def reserve(request: Request) -> Response:
        """Gang admission: one slot in every named pool, or one refusal."""
        store = rt.reservations
        try:
            # the body is whole and within limits.max_control_body_bytes here
            # (HeadroomApp._control); nesting too deep for the parser is malformed too
            try:
                doc = json.loads(await request.body() or b"null")
            except (ValueError, RecursionError):
                doc = None
            pools, hold_s = parse_request(doc, rt.gate.pools(), rt.settings.reservations)
            key = key_of(rt.settings.auth, ClientRequest.of(dict(request.scope)), pools)
        except PolicyViolation as err:
            store.count_invalid()
            return error_response(err)
        try:
            reservation = await store.reserve(pools, hold_s, key)
        except Refused as refusal:
            return error_response(refusal, stage=refusal.pool)
        path = f"/v1/headroom/reservations/{reservation.token}"
        return JSONResponse(
            {"token": reservation.token, "pools": list(reservation.pools), "hold_s": hold_s},
            status_code=201,
            headers={"Location": path},
        )

    @ops.delete("/v1/headroom/reservations/{token}")
    async def release(token: str, request: Request) -> Response:
        """Release a reservation's unclaimed slots (claimed ones end with their
        connections)."""
        store = rt.reservations
        try:
            # Only the key that reserved may release: any other gets the 404 of an
            # unknown token (never a 403 that would tell the token exists).
            key = identify(rt.settings.auth, ClientRequest.of(dict(request.scope)))
        except PolicyViolation as err:
            return error_response(err)
        try:
            released = await store.release(token, key)
        except Refused as refusal:
            return error_response(refusal)
        if released is None:
            unknown = ReservationUnknown("no such reservation (or not this key's)")
            body = http_error(unknown)[2]
            return Response(body, status_code=404, media_type="application/json")
        return JSONResponse({"token": token, "released": released})

    @ops.get("/metrics")
    async def metrics() -> Response:
        if not rt.settings.metrics.client_port:  # served on the admin listener
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return ops


class HeadroomApp:
    """The gateway's ASGI callable. ``runtime`` is started by the ASGI lifespan."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._ops = _ops_app(runtime)
        self.reservations = runtime.reservations
        install_uvicorn_filters()
        install_abort_filter()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "websocket":
            route = self.runtime.route_for(scope["path"])
            if route is not None and route.is_websocket:
                await relay_websocket(self.runtime, route, scope, receive, send)
            else:
                await self._deny_ws(scope, receive, send)
        elif kind == "http":
            route = self.runtime.route_for(scope["path"])
            if route is not None and not route.is_websocket:
                # The request's headers as they are now: the server may append a
                # chunked body's trailer fields to the same list later, and trailers
                # are not headers (RFC 9110, 6.5.1).
                scope = {**scope, "headers": list(scope["headers"])}
                await relay_http(self.runtime, route, scope, receive, send)
            else:
                await self._control(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _control(self, scope: Scope, receive: Any, send: Any) -> None:
        """Every HTTP request that is not a relay: on the reservation endpoints the key
        is checked from the head first (401 before a byte of body is read); then the
        body is read whole under the control-plane bounds (413, 408); only then does
        the operations app see it."""
        rt = self.runtime
        if scope["path"].startswith(RESERVATIONS_PATH):
            try:
                identify(rt.settings.auth, ClientRequest.of(scope))
            except Unauthorized as err:
                await refuse(send, err)
                return
        body = await control_body(receive, send, rt.settings.limits, rt.clock)
        if body is not None:
            await self._ops(scope, replay(body, receive), send)

    async def _deny_ws(self, scope: Scope, receive: Any, send: Any) -> None:
        await receive()  # websocket.connect
        body = json.dumps(
            {"error": {"type": "not_found", "code": "no_route",
                       "message": f"no WebSocket route at {scope['path']}"}}
        ).encode()  # fmt: skip
        if "websocket.http.response" in scope.get("extensions", {}):
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": 404,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.runtime.start()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.reservations.close()
                await self.runtime.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_app(runtime: Runtime) -> HeadroomApp:
    """The gateway's ASGI application over ``runtime`` (:class:`HeadroomApp`; its lifespan starts
    and stops the runtime)."""
    return HeadroomApp(runtime)
