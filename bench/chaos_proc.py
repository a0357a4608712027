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
  RSS, peak RSS, the audit's findings, the upstream HTTP client's open connections as
  :class:`PoolSockets` counts them);
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

import httpx

from proxy.admission import PoolCore
from proxy.logs import configure_logging
from proxy.process.cli import run_async
from proxy.process.gateway import Gateway
from proxy.process.serving import running_server
from proxy.runtime import Runtime
from proxy.settings import load_settings

__all__ = ["Audit", "PoolSockets", "install_audit", "main", "snapshot", "socket_inodes"]

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


def socket_inodes() -> set[int]:
    """The inodes of the sockets this process holds a descriptor for: the links
    ``socket:[inode]`` in ``/proc/self/fd`` (the kernel's descriptor table)."""
    inodes: set[int] = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed since the listing (or the listing's own descriptor)
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            inodes.add(int(target[8:-1]))
    return inodes


class PoolSockets:
    """The connections an ``httpx.AsyncClient`` holds open, counted without reading
    httpx's internals.

    :meth:`watch` adds a response hook to the client (its public ``event_hooks``). For
    every response the hook records the inode of the socket the response came on (the
    ``network_stream`` response extension, ``get_extra_info("socket")``). :meth:`count` is
    the number of recorded sockets this process still holds a descriptor for
    (:func:`socket_inodes`): every connection of the client's pool, idle or busy, that has
    carried at least one response and is not closed yet, including one its server has
    closed that the pool has not dropped yet (it still holds a descriptor). Not counted:
    a new connection whose first response has not arrived, and every socket the client
    did not open (WebSocket relays and health checks to the same upstream included).
    """

    def __init__(self) -> None:
        self._inodes: set[int] = set()

    def watch(self, client: httpx.AsyncClient) -> None:
        """Record the sockets of ``client``'s responses from now on (once per client)."""
        hooks = client.event_hooks
        response_hooks = list(hooks.get("response", []))
        if self._on_response in response_hooks:
            return
        client.event_hooks = {
            "request": list(hooks.get("request", [])),
            "response": [*response_hooks, self._on_response],
        }

    async def _on_response(self, response: httpx.Response) -> None:
        # A connection closed already has nothing to count. The lookup must not fail the
        # gateway's request: on a transport uvloop has closed, anyio's socket lookup raises
        # AttributeError (tests/chaos/test_failure_paths.py), a closed socket's fileno()
        # is -1 (OSError from fstat) or raises ValueError.
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream = response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                self._inodes.add(os.fstat(sock.fileno()).st_ino)

    def count(self) -> int:
        """The recorded sockets still open in this process (closed ones are forgotten)."""
        self._inodes &= socket_inodes()
        return len(self._inodes)


def _pool_connections(runtime: Runtime, sockets: PoolSockets) -> int:
    """The probe's ``upstream_pool_connections``: the sockets of the gateway's upstream
    HTTP client (:attr:`Runtime.http`) that have carried a response and are still open
    in this process, idle or busy (:class:`PoolSockets`); 0 before the client exists."""
    try:
        sockets.watch(runtime.http)
    except RuntimeError:  # not started
        return 0
    return sockets.count()


def snapshot(
    runtime: Runtime, audit: Audit, sockets: PoolSockets, *, collect: bool = False
) -> dict[str, Any]:
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
        "upstream_pool_connections": _pool_connections(runtime, sockets),
        "audit": audit.as_json(),
    }


class _Probe:
    """A raw ASGI app: ``GET /probe`` -> :func:`snapshot`."""

    def __init__(self, runtime: Runtime, audit: Audit, sockets: PoolSockets) -> None:
        self.runtime = runtime
        self.audit = audit
        self.sockets = sockets

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
            collect = "1" in query.get("gc", [])
            payload = snapshot(self.runtime, self.audit, self.sockets, collect=collect)
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
        sockets = PoolSockets()
        probe_app = _Probe(runtime, audit, sockets)
        # log_config=None: leave the JSON logging configured above alone
        async with running_server(probe_app, log_level="warning", log_config=None) as probe:
            while not gateway.started:
                if serving.done():
                    serving.result()
                    return
                await asyncio.sleep(0.01)
            sockets.watch(runtime.http)  # started: the client exists
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
