"""The admin listener: reload, drain and status, bound to 127.0.0.1 by default.

* ``GET /admin/status``  -- pools, replicas (active/cap/health/guard), queue, draining;
  each pool's headroom left and each configured pipeline's limiting stage, with the
  figures behind it (:mod:`proxy.pool_headroom`).
* ``POST /admin/reload`` -- re-read the configuration file and apply it live (as SIGHUP
  does); an invalid file is refused with 400 and the problems, the old one stays. Under
  ``serve --workers`` the listener runs in worker 0 and a reload is applied by every
  worker or none, the answer listing each (:mod:`proxy.process.worker_control`).
* ``POST /admin/drain``  -- start a graceful drain (as SIGTERM does).
* ``GET /metrics``       -- the Prometheus exposition (on the client listener too only
  with ``metrics: {client_port: true}``: it names tenants and the topology).

Every request is checked before its body is read: the key from the head (401), then
the body, under ``limits.max_control_body_bytes`` and ``limits.handshake_timeout_s``
(413, 408; no endpoint here takes one).

Bound anywhere but loopback, it requires ``Authorization: Bearer <key>`` whose SHA-256
is ``admin.api_key_sha256`` (the settings refuse a non-loopback admin without one, and a
reload may change that key but not remove it while the listener runs, on loopback too:
:func:`proxy.settings.reload_problems`); ``/metrics`` is checked like the rest. The
health checks are on the client listener (:mod:`proxy.app`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.errors import ConfigError
from proxy.pool_headroom import headroom_of
from proxy.relay.http_body import control_body, replay
from proxy.runtime import Runtime

__all__ = ["ReloadAnswer", "create_admin_app", "problem_list"]


Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

_UNAUTHORIZED = json.dumps(
    {"error": {"type": "unauthorized", "message": "admin key required"}}
).encode()


def _authorized(scope: Scope, sha256_hex: str | None) -> bool:
    if sha256_hex is None:
        return True
    header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    scheme, _, key = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not key:
        return False
    digest = hashlib.sha256(key.strip().encode()).hexdigest()
    return hmac.compare_digest(digest, sha256_hex)


def problem_list(problems: list[tuple[str, str]]) -> list[dict[str, str]]:
    """A configuration's ``(field, reason)`` problems as a reload's answer lists them."""
    return [{"field": f, "reason": r} for f, r in problems]


@dataclass(frozen=True)
class ReloadAnswer:
    """The answer to ``POST /admin/reload``: its status and JSON body."""

    status: int
    body: dict[str, Any]

    @classmethod
    def invalid(cls, problems: list[tuple[str, str]]) -> ReloadAnswer:
        """400: the configuration is refused for ``problems``; nothing applied."""
        return cls(400, {"reloaded": False, "problems": problem_list(problems)})


def create_admin_app(
    runtime: Runtime,
    reload: Callable[[], Awaitable[ReloadAnswer]],
    drain: Callable[[], Awaitable[None] | Any],
) -> ASGIApp:
    """``reload`` re-reads and applies the configuration everywhere it must apply (one
    gateway, or every worker of ``serve --workers``: :mod:`proxy.process.worker_control`) and
    answers; a ConfigError it raises is answered 400 with the problems;
    ``drain`` starts a graceful drain. The key and the body are checked before the
    endpoints' app sees a request (:func:`_bounded`)."""
    app = FastAPI(title="Headroom admin", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/admin/status")
    async def status() -> dict[str, Any]:
        headroom = headroom_of(runtime)
        left = {h.pool: h.as_json() for h in headroom.pools}
        pools = {}
        for name, stats in runtime.gate.statistics().items():
            pools[name] = {
                "active": stats.active,
                "slots": stats.slots,
                "queue_depth": stats.queue_depth,
                "max_depth": stats.max_depth,
                "draining": stats.draining,
                "replicas": [
                    {"name": r.name, "active": r.active, "cap": r.cap, "healthy": r.healthy,
                     "guarded": runtime.guard.guarded(name, r.name), "retired": r.retired}
                    for r in stats.replicas
                ],
                "headroom": left.get(name),
            }  # fmt: skip
        ready, why = runtime.ready()
        upstream, upstream_why = runtime.upstream_ready()
        pipelines = {p.name: p.as_json() for p in headroom.pipelines}
        return {"ready": ready, "reason": why, "draining": runtime.gate.draining,
                "readiness": runtime.settings.readiness,
                "upstream": {"ready": upstream, "reason": upstream_why},
                "pools": pools, "pipelines": pipelines}  # fmt: skip

    @app.post("/admin/reload")
    async def do_reload() -> JSONResponse:
        try:
            answer = await reload()
        except ConfigError as err:
            answer = ReloadAnswer.invalid(err.problems)
        return JSONResponse(answer.body, status_code=answer.status)

    @app.get("/metrics")
    async def metrics() -> Response:
        exposition = generate_latest(runtime.metrics.registry)
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/drain", status_code=202)
    async def do_drain() -> dict[str, Any]:
        drain()
        return {"draining": True, "active": runtime.gate.active}

    return _bounded(runtime, app)


def _bounded(runtime: Runtime, app: ASGIApp) -> ASGIApp:
    """``app`` behind the key check (from the request head) and the control-plane body
    bounds, in that order."""

    async def admin(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if not _authorized(scope, runtime.settings.admin.api_key_sha256):
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                (b"www-authenticate", b'Bearer realm="headroom-admin"'),
            ]})  # fmt: skip
            await send({"type": "http.response.body", "body": _UNAUTHORIZED})
            return
        body = await control_body(receive, send, runtime.settings.limits, runtime.clock)
        if body is not None:
            await app(scope, replay(body, receive), send)

    return admin
