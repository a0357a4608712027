"""An HTTP upstream that streams as fast as its socket takes it cannot hold the event
loop, and a client that stops reading stops the upstream reads, over real sockets.

The upstream writes from a thread, so the relay's reads always find data ready. What
is asserted is ordering, never time: how many body chunks one relay sends to its
client without the event loop running anything else in between (at most
:data:`~proxy.relay.http_exchange.CHUNKS_PER_TURN`), that refusals, other sessions,
scrapes and the admin listener are answered while the streams run, that the upstream
found its socket full (the relay stopped reading it), and that the write watchdog,
on an injected clock, then ends the sessions that stopped reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.process.admin import create_admin_app
from proxy.process.gateway import uvicorn_options
from proxy.process.serving import RunningServer, running_server
from proxy.relay.http_exchange import CHUNKS_PER_TURN
from proxy.runtime import Runtime
from proxy.settings import Settings
from tests.conftest import proxy_settings
from tests.integration.test_ws_relay import wait_until

STREAM_PATH = "/v1/completions"
SHORT_PATH = "/v1/short"
#: One completion event as vLLM streams it, in its own HTTP chunk.
EVENT = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"tiny",'
    b'"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}\n\n'
)
#: What the upstream hands its socket per send: a few hundred chunks.
BLOCK = (b"%x\r\n%s\r\n" % (len(EVENT), EVENT)) * 400
REQUEST = (
    b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
)


class FastUpstream:
    """An HTTP/1.1 upstream on 127.0.0.1, one thread per connection: a POST to
    :data:`STREAM_PATH` gets an endless event stream written as fast as the socket
    takes it; a POST to :data:`SHORT_PATH` a complete response; anything else 404.
    ``blocked`` holds the streams that found their socket buffer full (the relay
    stopped reading them); ``streams_closed`` counts the streams that ended."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.blocked: set[int] = set()
        self.streams_closed = 0
        self.threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._spawn(self._accept)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
        self.listener.close()

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _wait(self, sock: socket.socket, *, write: bool) -> bool:
        """Until ``sock`` is ready (True) or the test ends (False)."""
        readers, writers = ([], [sock]) if write else ([sock], [])
        while not self.stop.is_set():
            readable, writable, _ = select.select(readers, writers, [], 0.05)
            if readable or writable:
                return True
        return False

    def _accept(self) -> None:
        self.listener.setblocking(False)
        while self._wait(self.listener, write=False):
            with contextlib.suppress(BlockingIOError):
                conn, _ = self.listener.accept()
                self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        stream = False
        try:
            head = b""
            while b"\r\n\r\n" not in head and self._wait(conn, write=False):
                data = conn.recv(65536)
                if not data:
                    return
                head += data
            line = head.split(b"\r\n", 1)[0]
            if line.startswith(b"POST " + SHORT_PATH.encode()):
                self._send(conn, b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n"
                                 b"connection: close\r\n\r\nshort")  # fmt: skip
            elif line.startswith(b"POST " + STREAM_PATH.encode()):
                stream = True
                self._send(conn, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
                while not self.stop.is_set():
                    self._send(conn, BLOCK)
            else:
                self._send(conn, b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n"
                                 b"connection: close\r\n\r\n")  # fmt: skip
        except OSError:
            pass  # the relay closed the connection
        finally:
            conn.close()
            if stream:
                with self.lock:
                    self.streams_closed += 1

    def _send(self, conn: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view and not self.stop.is_set():
            try:
                view = view[conn.send(view) :]
            except BlockingIOError:
                with self.lock:
                    self.blocked.add(conn.fileno())
                self._wait(conn, write=True)


class TurnCounter:
    """The longest run of body chunks one response sent without the event loop running
    another callback in between: a callback is queued at the first chunk of a run, and
    the run goes on while it has not run."""

    def __init__(self) -> None:
        self.status = 0
        self.run = 0
        self.longest = 0
        self.chunks = 0
        self._pending = False

    def chunk(self) -> None:
        self.chunks += 1
        if self._pending:
            self.run += 1
        else:
            self.run = 1
            self._pending = True
            asyncio.get_running_loop().call_soon(self._turned)
        self.longest = max(self.longest, self.run)

    def _turned(self) -> None:
        self._pending = False


def counting(app: Any, counters: list[TurnCounter]) -> Any:
    """``app`` with a :class:`TurnCounter` on every response to :data:`STREAM_PATH`."""

    async def counted_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != STREAM_PATH:
            await app(scope, receive, send)
            return
        counter = TurnCounter()
        counters.append(counter)

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                counter.status = message["status"]
            elif message["type"] == "http.response.body" and message.get("body"):
                counter.chunk()
            await send(message)

        await app(scope, receive, counted)

    return counted_app


def settings(upstream: FastUpstream, slots: int) -> Settings:
    return proxy_settings(
        [("gpu0", upstream.url, slots)],
        [
            {"path": STREAM_PATH, "pool": "main", "protocol": "openai-completions-tokens",
             "tokens_per_audio_second": 50},
            {"path": SHORT_PATH, "pool": "main", "protocol": "passthrough-http"},
        ],
        limits={"idle_timeout_s": 0, "max_session_s": 0, "client_write_timeout_s": 5},
        guard={"mode": "off"},
    )  # fmt: skip


@contextlib.asynccontextmanager
async def gateway(
    upstream: FastUpstream, slots: int, clock: FakeClock, counters: list[TurnCounter]
) -> AsyncIterator[tuple[Runtime, RunningServer, RunningServer]]:
    """The gateway's client listener (its app counted) and admin listener, as
    ``headroom serve`` runs them; on exit, no slot may be left held."""
    config = settings(upstream, slots)
    runtime = Runtime(config, clock=clock)
    app = counting(create_app(runtime), counters)

    async def no_reload() -> Any:
        raise AssertionError("not reloaded here")

    admin_app = create_admin_app(runtime, no_reload, lambda: None)
    async with (
        running_server(app, **uvicorn_options(config, app)) as server,
        running_server(admin_app) as admin,
    ):
        await asyncio.wait_for(runtime.replicas_checked.wait(), 30)
        yield runtime, server, admin
    assert runtime.gate.active == 0, f"leaked slots: {runtime.gate!r}"


@contextlib.contextmanager
def fast_upstream() -> Any:
    upstream = FastUpstream()
    upstream.start()
    try:
        yield upstream
    finally:
        upstream.close()


async def open_stream(port: int) -> socket.socket:
    """A client that sends a streaming request, reads the response head and the first
    body bytes, then never reads again (its receive buffer kept small)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, REQUEST % STREAM_PATH.encode())
    first = await asyncio.wait_for(loop.sock_recv(sock, 1024), 30)
    assert first.startswith(b"HTTP/1.1 200"), first
    return sock


async def test_a_flooding_upstream_never_holds_the_loop_and_a_stalled_client_stops_it() -> None:
    clock = FakeClock()
    counters: list[TurnCounter] = []
    with fast_upstream() as upstream:
        async with gateway(upstream, 2, clock, counters) as (runtime, server, admin):
            first = await open_stream(server.port)
            async with httpx.AsyncClient() as client:
                # another session, while the first stream floods
                other = await client.post(server.http_url + SHORT_PATH, content=b"{}")
                assert other.status_code == 200 and other.content == b"short"
                second = await open_stream(server.port)
                # the pool is full: a refusal, in its own shape
                refused = await client.post(server.http_url + STREAM_PATH, content=b"{}")
                assert refused.status_code == 503
                assert refused.headers["x-headroom-reason"] == "pool_full"
                # scrapes, on the client port and on the admin listener
                scraped = await client.get(server.http_url + "/metrics")
                assert scraped.status_code == 200 and "headroom_session_slots" in scraped.text
                status = await client.get(admin.http_url + "/metrics")
                assert status.status_code == 200 and "headroom_" in status.text
            # every answer came while both streams were still running
            assert runtime.gate.active == 2 and upstream.streams_closed == 0
            # Neither client reads: the relays block on their sends, stop reading the
            # upstream, and its sends find the socket full.
            await wait_until(lambda: len(upstream.blocked) == 2, 60)
            # The write watchdog (injected clock) ends both sessions.
            for _ in range(2000):
                if runtime.gate.active == 0:
                    break
                clock.advance(5)
                await asyncio.sleep(0.01)
            assert runtime.gate.active == 0
            await wait_until(lambda: upstream.streams_closed == 2, 30)
            first.close()
            second.close()
    assert len(counters) == 3  # two streams and the refusal
    streamed = [c for c in counters if c.status == 200]
    assert len(streamed) == 2 and counters[2].status == 503
    for counter in streamed:
        assert counter.chunks > 10 * CHUNKS_PER_TURN  # the stream did run flat out
        assert counter.longest <= CHUNKS_PER_TURN, counter.longest


async def test_a_client_that_leaves_a_flooding_stream_ends_it_within_one_turn() -> None:
    clock = FakeClock()
    counters: list[TurnCounter] = []
    with fast_upstream() as upstream:
        async with gateway(upstream, 1, clock, counters) as (runtime, server, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(REQUEST % STREAM_PATH.encode())
            got = b""
            while got.count(b"data:") < 2 * CHUNKS_PER_TURN:
                got += await asyncio.wait_for(reader.read(65536), 30)
            writer.transport.abort()  # gone, with the stream still flooding
            await wait_until(lambda: runtime.gate.active == 0, 30)
            await wait_until(lambda: upstream.streams_closed == 1, 30)
    [counter] = counters
    assert counter.longest <= CHUNKS_PER_TURN, counter.longest
