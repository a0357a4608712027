"""Run one Headroom gateway process: uvicorn + the app, the admin listener, signals,
graceful drain and live reload (SIGHUP or ``POST /admin/reload``).

Drain (SIGTERM, or :meth:`Gateway.drain`): ``/readyz`` fails at once, new sessions
and queued waiters are refused with ``draining`` (the listener stays open so they
learn why), running sessions continue until ``drain_timeout_s``, then are closed
with 1012; the process exits when the last session has ended. A second SIGINT/SIGTERM
skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import Any

from prometheus_client import Counter

from proxy.app import create_app
from proxy.errors import ConfigError, ListenError
from proxy.process.admin import ReloadAnswer, create_admin_app
from proxy.process.serving import EmbeddedServer, bind_socket, make_config
from proxy.relay.listener import client_listener
from proxy.relay.ws_handshake import ASGIApp
from proxy.relay.ws_server import WebSocketSessions
from proxy.runtime import Runtime
from proxy.settings import (
    LimitsSettings,
    Settings,
    cut_short_problems,
    read_config_text,
    reload_problems,
    settings_from_text,
)
from proxy.speedups import build_status

__all__ = ["Gateway", "uvicorn_options"]

log = logging.getLogger("headroom.gateway")

#: Young-generation collection threshold once start-up is frozen (CPython's default: 700).
GC_GEN0_THRESHOLD = 10_000


def uvicorn_options(
    settings: Settings,
    app: ASGIApp,
    live_limits: Callable[[], LimitsSettings] | None = None,
) -> dict[str, Any]:
    """uvicorn settings derived from Headroom's, for serving ``app``: Headroom's client
    listener (request-head limits from ``live_limits()`` when given, so a reload
    applies; WebSocket sessions served and relayed by Headroom), frame limits,
    keepalive pings."""
    limits = settings.limits
    listener = client_listener(app, live_limits or (lambda: limits), WebSocketSessions())
    return {
        # Every request head is read by Headroom (proxy.relay.listener); plain HTTP goes
        # on to uvicorn's own HTTP protocol.
        "http": listener,
        # A WebSocket upgrade after a plain request on a kept-alive connection: uvicorn's
        # HTTP protocol hands the connection, once the responses before it are written,
        # to its WebSocket protocol class -- the same listener, which reads the upgrade
        # as its first head. uvicorn's own WebSocket implementation is never used.
        "ws": listener,
        "h11_max_incomplete_event_size": 64 * 1024,
        # uvicorn's default rewrites scope["client"] from a loopback peer's
        # X-Forwarded-For, so the real peer was lost (and appended twice). Headroom
        # decides trust itself (forwarded.trusted_proxies, proxy.relay.headers).
        "proxy_headers": False,
        "log_level": settings.log_level,
        "timeout_graceful_shutdown": 5,
    }


#: True in the admin server's task (and only there).
_ADMIN_SERVER: ContextVar[bool] = ContextVar("headroom_admin_server", default=False)


class _AdminLifecycleFilter(logging.Filter):
    """Drops uvicorn's informational records logged by the admin server (its start and
    stop lines): both servers run in one process and would log them word for word (same
    message, same process id), so every start-up and shut-down line appeared twice; the
    gateway logs one line naming the admin listener instead. Warnings and errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not _ADMIN_SERVER.get()


def _listen(what: str, host: str, port: int) -> socket.socket:
    """A bound listening socket, or ListenError naming ``what``, the address and the
    operating system's reason (a busy port is an operator's problem, not a traceback)."""
    try:
        return bind_socket(host, port)
    except OSError as exc:
        raise ListenError(what, host, port, exc) from None


def _log_build() -> None:
    """Whether the per-chunk modules run compiled (proxy.speedups); a stale compiled
    module (older than its source: Python still imports it) is a warning."""
    status = build_status()
    log.info("%s", status.describe())
    if status.stale:
        log.warning(
            "compiled modules older than their source (Python still imports them): %s; "
            "rebuild them or remove them (docs/performance.md)",
            ", ".join(status.stale),
        )


class Gateway:
    """A gateway bound to ``settings.listen`` (and the admin listener, if enabled);
    :meth:`serve` runs until stopped. ``config_path`` is what a reload re-reads."""

    def __init__(
        self,
        settings: Settings,
        runtime: Runtime | None = None,
        *,
        config_path: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.config_path = config_path
        self._env = env
        self.runtime = runtime or Runtime(settings)
        self.app = create_app(self.runtime)
        live_limits = lambda: self.runtime.settings.limits  # noqa: E731
        self.server = EmbeddedServer(
            make_config(self.app, **uvicorn_options(settings, self.app, live_limits))
        )
        self._sock = _listen("listener", settings.listen.host, settings.listen.port)
        self.port: int = self._sock.getsockname()[1]
        self.admin_server: EmbeddedServer | None = None
        self._admin_sock = None
        self.admin_port: int | None = None
        if settings.admin.enabled:
            admin = create_admin_app(self.runtime, self.admin_reload, self.drain)
            admin_config = make_config(
                admin, log_level=settings.log_level, lifespan="off",
                http=client_listener(admin, live_limits, WebSocketSessions()),
            )  # fmt: skip
            self.admin_server = EmbeddedServer(admin_config)
            try:
                self._admin_sock = _listen("admin listener", settings.admin.host,
                                           settings.admin.port)  # fmt: skip
            except ListenError:
                self._sock.close()
                raise
            self.admin_port = self._admin_sock.getsockname()[1]
        self._drain_task: asyncio.Task[None] | None = None
        self._reload_lock = asyncio.Lock()  # reloads apply one at a time, in order
        self._reload_tasks: set[asyncio.Task[None]] = set()
        self._signals = 0
        self._admin_lifecycle = _AdminLifecycleFilter()
        self._reloads = Counter(
            "headroom_config_reloads",
            "Configuration reloads (SIGHUP, POST /admin/reload) by result: applied, "
            "invalid (the file does not validate), refused (valid but unsafe live)",
            ["result"],
            registry=self.runtime.metrics.registry,
        )
        for result in ("applied", "invalid", "refused"):
            self._reloads.labels(result)

    async def serve(self, *, install_signals: bool = True) -> None:
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal)
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        admin_task = None
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(self._admin_lifecycle)
        if self.admin_server is not None and self._admin_sock is not None:
            admin = self._serve_admin(self.admin_server, self._admin_sock)
            admin_task = asyncio.ensure_future(admin)
        freeze = asyncio.ensure_future(self._freeze_when_started())
        _log_build()
        try:
            await self.server.serve(sockets=[self._sock])
        finally:
            if install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    loop.remove_signal_handler(sig)
            freeze.cancel()
            if admin_task is not None and self.admin_server is not None:
                self.admin_server.should_exit = True
                with contextlib.suppress(BaseException):
                    await admin_task
            self._sock.close()
            if self._admin_sock is not None:
                self._admin_sock.close()
            uvicorn_log.removeFilter(self._admin_lifecycle)

    async def _serve_admin(self, server: EmbeddedServer, sock: socket.socket) -> None:
        _ADMIN_SERVER.set(True)  # this task's context only: see _AdminLifecycleFilter
        host, port = sock.getsockname()[:2]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("admin listener on http://%s (/admin/status, /admin/reload, /admin/drain)",
                 address)  # fmt: skip
        await server.serve(sockets=[sock])

    async def _freeze_when_started(self) -> None:
        """Move everything allocated during start-up out of the collector's reach: a
        refusal storm then triggers no full collection over it (one pauses the loop: an
        audible gap for every live stream; the figures are in bench/RESULTS.md)."""
        await self.server.ready.wait()
        gc.collect()
        gc.freeze()
        # Sessions allocate in bursts (a connect, a handshake): collect the young
        # generation every GC_GEN0_THRESHOLD net allocations rather than CPython's 700,
        # whose collections took a share of session set-up (bench/RESULTS.md).
        gc.set_threshold(GC_GEN0_THRESHOLD, 10, 10)

    def reload(self) -> list[str]:
        """Re-read the configuration file and apply it live. Raises ConfigError (the
        running configuration stays) if the new one is invalid or looks cut short
        (:func:`~proxy.settings.cut_short_problems`), or valid but unsafe to apply live
        (:func:`~proxy.settings.reload_problems`: authentication dropped without
        ``auth: {enabled: false}``, the admin key removed). Each outcome is counted in
        ``headroom_config_reloads_total{result="applied"|"invalid"|"refused"}``."""
        return self.apply_reload(self._read_and_validate())

    def _read_and_validate(self) -> Settings:
        if self.config_path is None:
            raise ConfigError([("<file>", "this gateway was not started from a file")])
        try:
            text = read_config_text(self.config_path)
        except ConfigError as err:
            self._reloads.labels("invalid").inc()
            log.error("reload refused, keeping the running configuration: %s", err)
            raise
        return self.validate_reload(text, self.config_path)

    def validate_reload(self, text: str, source: str) -> Settings:
        """The configuration in ``text`` (the file ``source``) if it may replace the running
        one live; otherwise ConfigError, logged and counted, and nothing applied."""
        try:
            problems = cut_short_problems(text)
            if problems:
                raise ConfigError(problems, source)
            settings = settings_from_text(text, env=self._env, source=source)
        except ConfigError as err:
            self._reloads.labels("invalid").inc()
            log.error("reload refused, keeping the running configuration: %s", err)
            raise
        problems = reload_problems(self.runtime.settings, settings, admin_bound=self._admin_host())
        if problems:
            self._reloads.labels("refused").inc()
            unsafe = ConfigError(problems, source)
            log.error("reload refused as unsafe, keeping the running configuration: %s", unsafe)
            raise unsafe
        return settings

    def apply_reload(self, settings: Settings) -> list[str]:
        """Apply a configuration :meth:`validate_reload` accepted; returns the changes."""
        old = self.runtime.settings
        changes = self.runtime.apply(settings)
        self.settings = self.runtime.settings
        self._reloads.labels("applied").inc()
        if old.auth is not None and settings.auth is None:
            log.warning(
                "client authentication is now OFF (auth.enabled: false in %s): every "
                "client is admitted without a key",
                self.config_path,
            )
        log.info("configuration reloaded: %s", "; ".join(changes) or "no changes")
        return changes

    async def reload_off_loop(self) -> list[str]:
        """:meth:`reload` with the file read, parsed and validated in a worker thread (a
        large configuration takes a while to parse), then applied on the event loop;
        reloads asked for together run one at a time, in order."""
        async with self._reload_lock:
            settings = await asyncio.to_thread(self._read_and_validate)
            return self.apply_reload(settings)

    async def admin_reload(self) -> ReloadAnswer:
        """``POST /admin/reload``: this gateway's reload (ConfigError: refused, 400)."""
        return ReloadAnswer(200, {"reloaded": True, "changes": await self.reload_off_loop()})

    def _admin_host(self) -> str | None:
        """The host the admin listener is bound to (None without one)."""
        if self._admin_sock is None:
            return None
        return str(self._admin_sock.getsockname()[0])

    def _on_sighup(self) -> asyncio.Task[None] | None:
        """SIGHUP: :meth:`reload_off_loop` in the background; its task (a worker of
        ``serve --workers`` forwards the signal instead, and has none)."""
        task = asyncio.ensure_future(self._sighup_reload())
        self._reload_tasks.add(task)
        task.add_done_callback(self._reload_tasks.discard)
        return task

    async def _sighup_reload(self) -> None:
        with contextlib.suppress(ConfigError):  # the reload has logged why
            await self.reload_off_loop()

    @property
    def started(self) -> bool:
        return bool(self.server.started)

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("signal received: draining (send again to stop at once)")
            self.drain()
        else:
            log.warning("second signal: closing every session now")
            self.runtime.close_sessions(1012, "server restarting")
            self.server.should_exit = True

    def drain(self, timeout_s: float | None = None) -> asyncio.Task[None]:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(timeout_s))
        return self._drain_task

    async def _drain(self, timeout_s: float | None) -> None:
        rt = self.runtime
        rt.gate.drain()
        deadline = timeout_s if timeout_s is not None else self.settings.drain_timeout_s
        log.info("draining: %d active sessions, deadline %.0f s", rt.gate.active, deadline)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(rt.gate.wait_idle(), deadline)
        if rt.gate.active:
            n = rt.close_sessions(1012, "server restarting")
            log.warning("drain deadline reached: closed %d sessions with 1012", n)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rt.gate.wait_idle(), 5.0)
        self.server.should_exit = True

    def stop(self) -> None:
        self.server.should_exit = True


async def run_until_stopped(*aws: Awaitable[None]) -> None:
    """Await several long-running servers; stop all when one ends."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
