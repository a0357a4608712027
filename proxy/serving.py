"""Run ASGI apps under uvicorn inside an already running event loop.

Used by ``headroom serve``/``sim``/``demo`` (several servers in one process) and by
the tests (real sockets on 127.0.0.1, port 0). Signal handling is left to the
caller: an embedded server never installs handlers of its own.

Per-message deflate is always off: it costs 6-11x the CPU of relaying an audio
chunk and audio does not compress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn

__all__ = ["EmbeddedServer", "RunningServer", "bind_socket", "running_server"]


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


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its owner, tells when it has
    started (:attr:`ready`), and stops at once when told to while no connection is open
    (uvicorn's own loop notices :attr:`should_exit` on its next 0.1 s tick)."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit = asyncio.Event()  # before uvicorn's __init__, which sets should_exit
        super().__init__(config)
        self.ready = asyncio.Event()

    @property
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit.set()
        else:
            self._exit.clear()

    async def main_loop(self) -> None:
        """uvicorn's loop -- ``on_tick`` every 0.1 s until it says to exit -- except that
        :attr:`should_exit` ends the wait for the next tick when no connection is open.
        With connections open the tick keeps uvicorn's timing: uvicorn's shutdown tells
        each one to close, and raises for a WebSocket whose close handshake is still in
        flight (websockets' ``send_close`` in the CLOSING state), which the tick's delay
        usually lets finish."""
        loop = asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            tick = loop.time() + 0.1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit.wait(), 0.1)
            if self.server_state.connections:
                await asyncio.sleep(max(0.0, tick - loop.time()))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, without its 0.1 s pause for open connections to answer
        the close it sends them when no connection or request task is left: log as
        uvicorn does, close the listeners, wait for them, run the app's lifespan
        shutdown. Anything open, or a connection arriving while the listeners close,
        gets uvicorn's own shutdown (closing twice is harmless)."""
        state = self.server_state
        if state.connections or state.tasks or self.force_exit:
            await super().shutdown(sockets)
            return
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        if state.connections or state.tasks:
            await super().shutdown(sockets)
            return
        logging.getLogger("uvicorn.error").info("Shutting down")
        for server in self.servers:
            await server.wait_closed()
        await self.lifespan.shutdown()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.ready.set()


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
