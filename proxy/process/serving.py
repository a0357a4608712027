"""Run ASGI apps under uvicorn inside an already running event loop.

Used by ``headroom serve``/``sim``/``demo`` (several servers in one process) and by
the tests (real sockets on 127.0.0.1, port 0). Signal handling is left to the
caller: an embedded server never installs handlers of its own.

Per-message deflate is always off: it costs several times the CPU of relaying an
audio chunk (the figure is in README.md) and audio does not compress.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn

from proxy.relay.library_contract import QuietServer, listening_servers

if TYPE_CHECKING:
    from proxy.relay.ws_server import WebSocketSessions

__all__ = [
    "EmbeddedServer",
    "RunningServer",
    "bind_socket",
    "running_server",
]


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """Bind a listening TCP socket; port 0 picks a free port. On failure (OSError) the
    socket is closed, not leaked."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class EmbeddedServer:
    """A uvicorn server (``uvicorn.Server``, run through ``serve``) that leaves signal
    handling to its owner, tells when it has started (:attr:`ready`), and when told to
    stop (:attr:`should_exit`) tells the WebSocket sessions Headroom's client listener
    serves (:class:`~proxy.relay.ws_server.WebSocketSessions`) and waits for them, before
    and after uvicorn's own shut-down of its connections."""

    def __init__(self, config: uvicorn.Config) -> None:
        self.config = config
        self.uvicorn: uvicorn.Server = QuietServer(config)
        self.ready = asyncio.Event()
        # Headroom's client listener class (proxy.relay.listener) carries its sessions.
        sessions = getattr(config.http, "sessions", None)
        self.sessions: WebSocketSessions | None = (
            sessions if callable(getattr(sessions, "shutdown", None)) else None
        )
        self._exit = False
        self._stopping: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return bool(self.uvicorn.started)

    @property
    def servers(self) -> list[asyncio.Server]:
        """The asyncio servers it listens with, one per socket."""
        return listening_servers(self.uvicorn)

    @property
    def should_exit(self) -> bool:
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """Setting it starts the shut-down: the WebSocket sessions first, then uvicorn's."""
        if not value or self._exit:
            return
        self._exit = True
        if self.sessions is None:
            self.uvicorn.should_exit = True
        else:
            self._stopping = asyncio.ensure_future(self._stop_sessions_then_uvicorn())

    def _grace(self) -> float:
        return float(self.config.timeout_graceful_shutdown or 0)

    async def _stop_sessions_then_uvicorn(self) -> None:
        try:
            await self._stop_sessions()
        finally:
            self.uvicorn.should_exit = True

    async def _stop_sessions(self) -> None:
        sessions = self.sessions
        if sessions is not None:
            sessions.shutdown()
            await sessions.wait(self._grace())

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until stopped (``should_exit``); :attr:`ready` is set once listening."""
        serving = asyncio.ensure_future(self.uvicorn.serve(sockets=sockets))
        try:
            while not self.uvicorn.started and not serving.done():
                await asyncio.wait({serving}, timeout=0.005)  # uvicorn has no start event
            if self.uvicorn.started:
                self.ready.set()
            await serving
            await self._stop_sessions()  # any that came while the listeners were closing
        finally:
            if not serving.done():
                serving.cancel()
            stopping = self._stopping
            if stopping is not None and not stopping.done():
                stopping.cancel()


@dataclass
class RunningServer:
    server: EmbeddedServer
    task: asyncio.Task[None]
    host: str
    port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def make_config(app: Any, *, log_level: str = "warning", **overrides: Any) -> uvicorn.Config:
    options: dict[str, Any] = {
        "ws": "auto",
        "ws_per_message_deflate": False,
        "log_level": log_level,
        "lifespan": "on",
        "access_log": False,
        "server_header": False,
        "timeout_graceful_shutdown": 5,
        "timeout_keep_alive": 5,
        # Headroom configures logging (JSON lines); uvicorn must not replace it.
        "log_config": None,
    }
    options.update(overrides)
    try:
        import uvloop  # noqa: F401

        options.setdefault("loop", "uvloop")
    except ImportError:  # pragma: no cover - platform without uvloop
        pass
    try:
        import httptools  # noqa: F401

        options.setdefault("http", "httptools")
    except ImportError:  # pragma: no cover
        pass
    return uvicorn.Config(app, **options)


@contextlib.asynccontextmanager
async def running_server(
    app: Any, host: str = "127.0.0.1", port: int = 0, **config: Any
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` on ``host:port`` for the duration of the ``async with`` block."""
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    server = EmbeddedServer(make_config(app, **config))
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn:{bound_port}")
    try:
        ready = asyncio.ensure_future(server.ready.wait())
        await asyncio.wait({ready, task}, return_when=asyncio.FIRST_COMPLETED)
        if not server.started:
            ready.cancel()
            if task.done():
                task.result()
            raise RuntimeError(f"server on {host}:{bound_port} exited during start-up")
        yield RunningServer(server, task, host, bound_port)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()


@contextlib.contextmanager
def signal_handlers(handlers: Mapping[int, Callable[[], None]]) -> Iterator[None]:
    """Run ``handlers`` on their signals while the block runs, where the platform lets
    the event loop take signals (Unix, main thread); elsewhere the defaults stay."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig, handler in handlers.items():
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, handler)
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
