"""The admin listener: reload, drain and status, bound to 127.0.0.1 by default.

* ``GET /admin/status``  -- pools, replicas (active/cap/health/guard), queue, draining;
  each pool's headroom left and each configured pipeline's limiting stage, with the
  figures behind it (:mod:`proxy.pipelines`).
* ``POST /admin/reload`` -- re-read the configuration file and apply it live (as SIGHUP
  does); an invalid file is refused with 400 and the problems, the old one stays.
* ``POST /admin/drain``  -- start a graceful drain (as SIGTERM does).

Bound anywhere but loopback, it requires ``Authorization: Bearer <key>`` whose SHA-256
is ``admin.api_key_sha256`` (the settings refuse a non-loopback admin without one, and a
reload may change that key but not remove it while the socket stays bound off loopback:
:func:`proxy.settings.reload_problems`). The listener serves only these three endpoints;
``/metrics`` and the health checks are on the client listener (:mod:`proxy.app`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from proxy.errors import ConfigError
from proxy.pipelines import headroom_of
from proxy.runtime import Runtime

__all__ = ["create_admin_app"]


def _authorized(request: Request, sha256_hex: str | None) -> bool:
    if sha256_hex is None:
        return True
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key:
        return False
    digest = hashlib.sha256(key.strip().encode()).hexdigest()
    return hmac.compare_digest(digest, sha256_hex)


def create_admin_app(
    runtime: Runtime,
    reload: Callable[[], list[str]],
    drain: Callable[[], Awaitable[None] | Any],
) -> FastAPI:
    """``reload`` re-reads and applies the configuration (raising ConfigError);
    ``drain`` starts a graceful drain."""
    app = FastAPI(title="Headroom admin", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def require_key(request: Request, call_next: Any) -> Any:
        if not _authorized(request, runtime.settings.admin.api_key_sha256):
            return JSONResponse(
                {"error": {"type": "unauthorized", "message": "admin key required"}},
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="headroom-admin"'},
            )
        return await call_next(request)

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
        pipelines = {p.name: p.as_json() for p in headroom.pipelines}
        return {"ready": ready, "reason": why, "draining": runtime.gate.draining, "pools": pools,
                "pipelines": pipelines}  # fmt: skip

    @app.post("/admin/reload")
    async def do_reload() -> JSONResponse:
        try:
            changes = reload()
        except ConfigError as err:
            return JSONResponse(
                {"reloaded": False,
                 "problems": [{"field": f, "reason": r} for f, r in err.problems]},
                status_code=400,
            )  # fmt: skip
        return JSONResponse({"reloaded": True, "changes": changes})

    @app.post("/admin/drain", status_code=202)
    async def do_drain() -> dict[str, Any]:
        drain()
        return {"draining": True, "active": runtime.gate.active}

    return app
