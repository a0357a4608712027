"""One simulated GPU: an engine, its step loop, its faults, and its listening port.

The port is held for the GPU's whole life. While the GPU listens, uvicorn serves the
app on it; while ``refuse_connections`` is set the socket stays bound but does not
listen, so connects are refused (RST) and nobody else can take the port. Stopping
listening closes only the listener: connections already open carry on.

A protocol handler uses the GPU for everything stateful: :meth:`SimGpu.open_stream`
to submit work, :meth:`SimGpu.stream_faults` to snapshot the faults for a connection,
and :meth:`SimGpu.abort` to cut a connection's TCP without a goodbye.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.process.serving import EmbeddedServer, make_config
from proxy.sim.bypass import BypassStreams
from proxy.sim.connections import ConnectionTable, tracked_http
from proxy.sim.engine import Engine
from proxy.sim.engine_metrics import EngineMetrics
from proxy.sim.engine_runner import Runner, SeqStream
from proxy.sim.faults import Faults, StreamFaults
from proxy.sim.gpu_app import REFUSAL_LOG_FILTER, build_app
from proxy.sim.presets import Preset

__all__ = ["SimGpu", "Timeouts"]

log = logging.getLogger("proxy.sim")


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Upstream limits of the speech WebSocket (vLLM-Omni defaults), injectable."""

    speech_config_s: float = 10.0
    speech_idle_s: float = 30.0


def _placeholder(host: str, port: int) -> socket.socket:
    """A bound, non-listening socket: it reserves the port and refuses connects."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class SimGpu:
    """A simulated GPU serving ``preset`` on ``host:port`` (port 0: a free port)."""

    def __init__(
        self,
        preset: Preset,
        *,
        index: int = 0,
        seed: int = 0,
        faults: Faults | None = None,
        timeouts: Timeouts | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.preset = preset
        self.index = index
        self.seed = seed
        self.timeouts = timeouts or Timeouts()
        self.host = host
        self._requested_port = port
        self.port = port
        self.engine = Engine(preset.engine, seed=seed * 1009 + index)
        self.metrics = EngineMetrics(self.engine, preset.model)
        self.runner = Runner(self.engine, on_step=self.metrics.on_step)
        self._faults = faults or Faults()
        self._sock: socket.socket | None = None
        self._servers: list[tuple[EmbeddedServer, asyncio.Task[None]]] = []
        self._connections = ConnectionTable()
        self._refuse_timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._sessions = 0
        #: Sibling GPUs of the same cluster, for ``/sim/faults?gpu=N``.
        self.cluster: list[SimGpu] = [self]
        #: Streams no gateway admitted (``/sim/bypass``).
        self.bypass = BypassStreams(self)
        self.app = build_app(self)

    # -- identity ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[4:]

    @property
    def listening(self) -> bool:
        return bool(self._servers) and not self._faults.refuse_connections

    def __repr__(self) -> str:
        return (
            f"<SimGpu {self.index} {self.preset.name} {self.url} "
            f"listening={self.listening} {self.engine!r}>"
        )

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the port, start the step loop, and listen unless refusing."""
        # a handshake refused on purpose is not an error (proxy.sim.gpu_app); added once
        logging.getLogger("uvicorn.error").addFilter(REFUSAL_LOG_FILTER)
        self._sock = _placeholder(self.host, self._requested_port)
        self.port = self._sock.getsockname()[1]
        self.runner.start(name=f"sim-gpu{self.index}")
        if self._faults.refuse_connections:
            self._schedule_refuse_end(self._faults)
        else:
            await self._listen()

    async def stop(self) -> None:
        """End every stream, stop every server instance, release the port."""
        if self._refuse_timer is not None:
            self._refuse_timer.cancel()
        await self.bypass.stop()
        await self.runner.stop()
        for task in list(self._background):
            task.cancel()
        for server, _ in self._servers:
            server.should_exit = True
        for _, task in self._servers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._servers.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _listen(self) -> None:
        assert self._sock is not None
        # proxy_headers=False: scope["client"] stays the socket's peer even when a
        # gateway in front sends X-Forwarded-For (faults find connections by it).
        config = make_config(
            self.app, timeout_graceful_shutdown=2, lifespan="off", proxy_headers=False,
            http=tracked_http(self._connections),
        )  # fmt: skip
        server = EmbeddedServer(config)
        sock = self._sock
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"sim-http{self.index}")
        self._servers.append((server, task))
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError(f"simulated GPU {self.index} failed to listen on {self.url}")
            await asyncio.sleep(0.005)

    def _stop_listening(self) -> None:
        if not self._servers:
            return
        server, _ = self._servers[-1]
        for listener in server.servers:
            listener.close()  # closes the socket; accepted connections continue
        self._sock = _placeholder(self.host, self.port)

    # -- faults ----------------------------------------------------------------------------

    @property
    def faults(self) -> Faults:
        return self._faults

    async def set_faults(self, faults: Faults) -> None:
        """Replace the faults; starts or stops listening when ``refuse_connections``
        changes. New sessions see the new faults; running ones keep theirs."""
        was_refusing = self._faults.refuse_connections
        self._faults = faults
        if self._refuse_timer is not None:
            self._refuse_timer.cancel()
            self._refuse_timer = None
        if self._sock is None and not self._servers:
            return  # not started yet: start() applies them
        if faults.refuse_connections and not was_refusing:
            self._stop_listening()
        elif was_refusing and not faults.refuse_connections:
            await self._listen()
        if faults.refuse_connections:
            self._schedule_refuse_end(faults)

    def set_faults_soon(self, faults: Faults) -> None:
        """:meth:`set_faults` from synchronous code (the admin endpoint answers first)."""
        task = asyncio.get_running_loop().create_task(self.set_faults(faults))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _schedule_refuse_end(self, faults: Faults) -> None:
        if faults.refuse_for_s is None:
            return
        cleared = faults.updated({"refuse_connections": False, "refuse_for_s": None})
        self._refuse_timer = asyncio.get_running_loop().call_later(
            faults.refuse_for_s, self.set_faults_soon, cleared
        )

    def stream_faults(self) -> StreamFaults:
        """The faults a new connection runs under (a snapshot)."""
        return StreamFaults(self._faults)

    def abort(self, scope: Mapping[str, Any]) -> bool:
        """Abort the TCP connection of ``scope``: no WebSocket close frame, no end of
        HTTP body. ``False`` if the connection is already gone.

        The connection is found by ``scope["client"]``, the socket's own peer address
        (the simulator serves with ``proxy_headers=False``), in the table its HTTP
        protocol keeps (:mod:`proxy.sim.connections`).
        """
        return self._connections.abort(scope.get("client"))

    async def drop(self, scope: Mapping[str, Any]) -> bool:
        """:meth:`abort`, then let the server notice, so later sends are no-ops.
        ``False`` if there was no connection left to abort."""
        aborted = self.abort(scope)
        for _ in range(3):
            await asyncio.sleep(0.002)
        return aborted

    # -- work ------------------------------------------------------------------------------

    def open_stream(
        self, *, prompt_tokens: int, output_tokens: int | None, first_chunk_tokens: int = 0
    ) -> SeqStream:
        """Submit one sequence with the preset's chunk schedule (``first_chunk_tokens`` >
        0 fixes the first chunk, like vLLM-Omni's ``initial_codec_chunk_frames``)."""
        schedule = self.preset.schedule
        if first_chunk_tokens > 0:
            schedule = schedule.with_first(first_chunk_tokens)
        return self.runner.open(
            prompt_tokens=prompt_tokens, output_tokens=output_tokens, schedule=schedule
        )

    def next_session_seed(self) -> int:
        """A deterministic per-session seed (transcript words, babble)."""
        self._sessions += 1
        return self.seed * 1_000_003 + self.index * 10_007 + self._sessions

    def stats_json(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {
            "gpu": self.index,
            "preset": self.preset.name,
            "model": self.preset.model,
            "url": self.url,
            "listening": self.listening,
            "running": s.running,
            "waiting": s.waiting,
            "kv_cache_usage": round(s.kv_usage, 6),
            "steps": s.steps,
            "tokens_generated": s.tokens_generated,
            "preemptions": s.preemptions,
            "last_batch": s.last_batch,
            "last_step_ms": round(s.last_step_s * 1e3, 3),
            "open_streams": self.runner.open_streams,
            "bypass_streams": self.bypass.count,
            "faults": self._faults.as_json(),
        }
