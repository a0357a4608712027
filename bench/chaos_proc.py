"""The Headroom process of the chaos soak: ``headroom serve`` plus an audit and a probe.

    python bench/chaos_proc.py --config settings.yaml

Runs exactly what ``headroom serve`` runs (:class:`proxy.process.gateway.Gateway`, uvloop, JSON
logs on stderr, SIGTERM drains), in its own process so its RSS and file descriptors are
its own, plus two things for the soak:

* an **audit**: every state-changing method of the admission core
  (:class:`proxy.admission.PoolCore`) is wrapped so that, right after each call, every
  replica's ``active`` is compared with its ``cap``. This checks the cap on every
  admission event, not only when a sampler happens to look.
* a **probe** listener (127.0.0.1, its own port): ``GET /probe`` returns a JSON snapshot
  (per replica active/cap/healthy, queue depths, live sessions, asyncio tasks, open fds,
  RSS, peak RSS, the audit's findings, the upstream HTTP pool's connections);
  ``GET /probe?gc=1`` runs a full garbage collection first.

It prints one line to stdout once listening: ``{"port": P, "probe": Q, "pid": N}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from proxy.admission import PoolCore
from proxy.logs import configure_logging
from proxy.process.cli import run_async
from proxy.process.gateway import Gateway
from proxy.process.serving import running_server
from proxy.runtime import Runtime
from proxy.settings import load_settings

__all__ = ["Audit", "install_audit", "main", "snapshot"]

#: PoolCore methods that can change who holds a slot.
_AUDITED = (
    "arrive",
    "release",
    "relocate",
    "abandon",
    "expire",
    "drain",
    "undrain",
    "set_cap",
    "set_healthy",
    "set_guarded",
    "set_queue",
    "add_replica",
    "retire_replica",
)


class Audit:
    """Cap checks after every admission-core event."""

    def __init__(self) -> None:
        self.checks = 0
        self.violations: list[dict[str, Any]] = []
        self.max_active: dict[str, int] = {}
        self.caps: dict[str, int] = {}
        self.max_queue: dict[str, int] = {}

    def check(self, core: PoolCore, event: str) -> None:
        self.checks += 1
        stats = core.statistics()
        self.max_queue[core.name] = max(self.max_queue.get(core.name, 0), stats.queue_depth)
        for r in stats.replicas:
            key = f"{core.name}/{r.name}"
            self.caps[key] = r.cap
            if r.active > self.max_active.get(key, 0):
                self.max_active[key] = r.active
            if r.active > r.cap and len(self.violations) < 50:
                self.violations.append(
                    {"replica": key, "active": r.active, "cap": r.cap, "event": event}
                )
        if stats.queue_depth > stats.max_depth and len(self.violations) < 50:
            self.violations.append(
                {"pool": core.name, "queue": stats.queue_depth, "max_depth": stats.max_depth,
                 "event": event}
            )  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        return {
            "checks": self.checks,
            "violations": self.violations,
            "max_active": self.max_active,
            "caps": self.caps,
            "max_queue": self.max_queue,
        }


def install_audit(audit: Audit) -> None:
    """Wrap :class:`PoolCore`'s state-changing methods (this process only)."""
    for name in _AUDITED:
        original = getattr(PoolCore, name, None)
        if original is None or getattr(original, "__chaos_audit__", False):
            continue

        def wrapped(
            self: PoolCore, *args: Any, __original: Callable[..., Any] = original,
            __name: str = name, **kwargs: Any,
        ) -> Any:  # fmt: skip
            try:
                return __original(self, *args, **kwargs)
            finally:
                audit.check(self, __name)

        functools.update_wrapper(wrapped, original)
        wrapped.__chaos_audit__ = True  # type: ignore[attr-defined]
        setattr(PoolCore, name, wrapped)


def _rss_kb() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _pool_connections(runtime: Runtime) -> int:
    """Connections held by the upstream HTTP client's pool (open, idle or busy)."""
    try:
        transport = getattr(runtime.http, "_transport", None)
        return len(getattr(getattr(transport, "_pool", None), "connections", ()))
    except RuntimeError:  # not started
        return 0


def snapshot(runtime: Runtime, audit: Audit, *, collect: bool = False) -> dict[str, Any]:
    if collect:
        gc.collect()
    pools: dict[str, Any] = {}
    for name, stats in runtime.gate.statistics().items():
        pools[name] = {
            "queue": stats.queue_depth,
            "max_depth": stats.max_depth,
            "replicas": {
                r.name: {"active": r.active, "cap": r.cap, "healthy": r.healthy,
                         "guarded": r.guarded}
                for r in stats.replicas
            },
        }  # fmt: skip
    tasks = asyncio.all_tasks()
    return {
        "pid": os.getpid(),
        "active": runtime.gate.active,
        "queued": runtime.gate.queued,
        "live_sessions": runtime.live_sessions,
        "pools": pools,
        "tasks": len(tasks),
        "task_names": sorted({t.get_name().rstrip("0123456789") for t in tasks}),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kb": _rss_kb(),
        "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "upstream_pool_connections": _pool_connections(runtime),
        "audit": audit.as_json(),
    }


class _Probe:
    """A raw ASGI app: ``GET /probe`` -> :func:`snapshot`."""

    def __init__(self, runtime: Runtime, audit: Audit) -> None:
        self.runtime = runtime
        self.audit = audit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        query = parse_qs(scope.get("query_string", b"").decode())
        status, payload = 404, {"error": "not found"}
        if scope["path"] == "/probe":
            status = 200
            payload = snapshot(self.runtime, self.audit, collect="1" in query.get("gc", []))
        body = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


async def _serve(config: Path) -> None:
    settings = load_settings(config, env={})
    configure_logging(settings.log_level, settings.log_format)
    audit = Audit()
    install_audit(audit)
    runtime = Runtime(settings)
    gateway = Gateway(settings, runtime, config_path=str(config), env={})
    serving = asyncio.ensure_future(gateway.serve())
    try:
        # log_config=None: leave the JSON logging configured above alone
        probe_app = _Probe(runtime, audit)
        async with running_server(probe_app, log_level="warning", log_config=None) as probe:
            while not gateway.started:
                if serving.done():
                    serving.result()
                    return
                await asyncio.sleep(0.01)
            print(json.dumps({"port": gateway.port, "probe": probe.port, "pid": os.getpid()}),
                  flush=True)  # fmt: skip
            await serving
    finally:
        if not serving.done():
            gateway.stop()
            with contextlib.suppress(BaseException):
                await serving


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Headroom under audit, for bench/chaos.py")
    parser.add_argument("--config", required=True, type=Path)
    args = parser.parse_args(argv)
    run_async(_serve(args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
