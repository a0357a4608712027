"""Failure paths the chaos soak hit, each reduced to one deterministic reproduction.

Every test here drives real sockets on 127.0.0.1 through a running proxy and asserts the
contract for that path: a clear status or close code for the client, no ERROR log line
(an ERROR with a traceback per client mistake or upstream failure floods the logs and
pages someone), the slot released. Upstreams that misbehave below the WebSocket or HTTP
layer are raw asyncio servers written here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import linecache
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from wsraw import (  # bench/wsraw.py
    OP_TEXT,
    frame,
    handshake_request,
    http_request,
    read_frames,
    read_head,
    read_http_body,
    reset,
)

from proxy.clock import FakeClock
from proxy.logs import JsonFormatter, configure_logging
from proxy.process.gateway import Gateway
from proxy.settings import settings_from_mapping
from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_relay import upstream, wait_until

__all__ = ["upstream"]

_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter
Handler = Callable[[Reader, Writer, asyncio.Event], Awaitable[None]]


class Records(logging.Handler):
    """Collects the records of Headroom's and uvicorn's loggers (uvicorn's do not reach
    the root logger). Call :meth:`watch` once the servers are up: building a uvicorn
    config re-installs uvicorn's logging and drops handlers attached before."""

    LOGGERS = ("headroom", "uvicorn")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def watch(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)

    def unwatch(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)

    def errors(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()}" for r in self.records if r.levelno >= logging.ERROR]


@pytest.fixture
def error_log() -> Any:
    """ERROR records of Headroom's and uvicorn's loggers (after ``error_log.watch()``)."""
    handler = Records()
    yield handler
    handler.unwatch()


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[int]:
    """A TCP server running ``handler(reader, writer, done)`` per connection; handlers
    that must hang wait on ``done``. At exit every connection is reset and every handler
    ends."""
    tasks: set[asyncio.Task[Any]] = set()
    writers: list[asyncio.StreamWriter] = []
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        writers.append(writer)
        with contextlib.suppress(ConnectionError, OSError, asyncio.IncompleteReadError):
            await handler(reader, writer, done)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        done.set()
        for writer in writers:
            reset(writer)
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))
    return head


def accept_key(request_head: bytes) -> str:
    for line in request_head.split(b"\r\n"):
        if line.lower().startswith(b"sec-websocket-key:"):
            key = line.split(b":", 1)[1].strip().decode()
            return base64.b64encode(hashlib.sha1((key + _GUID).encode()).digest()).decode()
    raise AssertionError("no Sec-WebSocket-Key")


def speech_route() -> dict[str, Any]:
    return {"path": "/v1/audio/speech", "pool": "main", "protocol": "openai-speech-http"}


SPEECH_BODY = json.dumps({"input": "Hello.", "stream": True, "response_format": "pcm"}).encode()


async def post(
    port: int, path: str = "/v1/audio/speech", **kw: Any
) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(http_request("POST", path, SPEECH_BODY, **kw))
        await writer.drain()
        head = await asyncio.wait_for(read_head(reader), 30)
        assert head is not None, "the proxy closed without answering"
        body, _ = await asyncio.wait_for(read_http_body(reader, head), 30)
        return head.status, head.headers, body
    finally:
        writer.close()


# -- HTTP: the upstream fails after accepting, before any response byte ------------------------


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_http_upstream_closing_before_its_response_is_a_502(
    start_proxy: Any, error_log: Records, how: str
) -> None:
    async def hang_up(reader: Reader, writer: Writer, done: asyncio.Event) -> None:
        await read_request(reader)
        if how == "rst":
            reset(writer)
        else:
            writer.close()

    async with raw_server(hang_up) as port:
        proxy: Proxy = await start_proxy(
            proxy_settings([("gpu0", f"http://127.0.0.1:{port}", 1)], [speech_route()])
        )
        error_log.watch()
        status, _, body = await post(proxy.server.port)
    assert status == 502, (status, body)
    assert json.loads(body)["error"]["type"]  # the contract's JSON body, not uvicorn's text
    assert not error_log.errors()
    assert proxy.gate.active == 0


async def test_http_upstream_silent_past_the_read_timeout_is_a_gateway_error(
    start_proxy: Any, error_log: Records
) -> None:
    async def silent(reader: Reader, writer: Writer, done: asyncio.Event) -> None:
        await read_request(reader)
        await done.wait()

    async with raw_server(silent) as port:
        proxy: Proxy = await start_proxy(
            proxy_settings(
                [("gpu0", f"http://127.0.0.1:{port}", 1)],
                [speech_route()],
                limits={"idle_timeout_s": 0.2},
            )
        )
        error_log.watch()
        status, _, body = await post(proxy.server.port)
    assert status in (502, 504), (status, body)
    assert json.loads(body)["error"]["type"]
    assert not error_log.errors()
    assert proxy.gate.active == 0


# -- HTTP: request headers a client may legally send -------------------------------------------


async def test_http_header_with_obs_text_is_relayed(start_proxy: Any, error_log: Records) -> None:
    """RFC 9110 5.5 allows bytes 0x80-0xFF (obs-text) in field values; uvicorn accepts
    them and the WebSocket relay forwards them byte for byte (latin-1). The HTTP relay
    must do the same, not answer 500."""

    async def echo_head(reader: Reader, writer: Writer, done: asyncio.Event) -> None:
        head = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(head) + head)  # fmt: skip
        await writer.drain()

    async with raw_server(echo_head) as port:
        proxy: Proxy = await start_proxy(
            proxy_settings([("gpu0", f"http://127.0.0.1:{port}", 1)],
                           [{"path": "/echo", "pool": "main", "protocol": "passthrough-http"}])
        )  # fmt: skip
        error_log.watch()
        status, _, body = await post(proxy.server.port, "/echo",
                                     headers=[("X-Name", "Jos\xe9")])  # fmt: skip
    assert status == 200, (status, body)
    assert b"x-name: jos\xe9" in body.lower()
    assert not error_log.errors()


async def test_http_response_has_one_date_header(start_proxy: Any, upstream: Any) -> None:
    """Date is a singleton field (RFC 9110 6.6.1); the upstream's and uvicorn's must not
    both reach the client."""
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)],
                       [{"path": "/echo-http", "pool": "main", "protocol": "passthrough-http"}])
    )  # fmt: skip
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        writer.write(http_request("POST", "/echo-http", b"{}"))
        await writer.drain()
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    finally:
        writer.close()
    dates = [line for line in raw.split(b"\r\n") if line.lower().startswith(b"date:")]
    assert len(dates) == 1, raw.decode("latin-1")


# -- WebSocket: the client leaves while Headroom is still connecting upstream -------------------


async def test_ws_client_leaving_during_the_upstream_handshake_is_not_an_error(
    start_proxy: Any, error_log: Records
) -> None:
    seen = asyncio.Event()

    async def never_answer(reader: Reader, writer: Writer, done: asyncio.Event) -> None:
        await reader.readuntil(b"\r\n\r\n")
        seen.set()
        await done.wait()

    async with raw_server(never_answer) as port:
        proxy: Proxy = await start_proxy(
            proxy_settings(
                [("gpu0", f"http://127.0.0.1:{port}", 1)],
                [{"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}],
                limits={"handshake_timeout_s": 0.5},
            )
        )
        error_log.watch()
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        writer.write(handshake_request("/ws"))
        await writer.drain()
        await asyncio.wait_for(seen.wait(), 30)  # Headroom is mid-handshake upstream
        writer.close()  # ... and the client gives up
        await wait_until(lambda: proxy.gate.active == 0, 30)
        await asyncio.sleep(0.1)  # let the session's last lines be logged
    assert not error_log.errors()


# -- WebSocket: the client vanishes while a send to it is stuck -----------------------------------


def _awaiting(task: asyncio.Task[Any]) -> list[str]:
    """The source lines a task's coroutine chain is suspended on, outermost first."""
    lines = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame_ = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame_ is not None:
            lines.append(linecache.getline(frame_.f_code.co_filename, frame_.f_lineno).strip())
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


async def test_ws_client_gone_then_write_timeout_does_not_escape_the_app(
    start_proxy: Any, error_log: Records
) -> None:
    """The upstream -> client send fails (client gone); while the relay closes the
    upstream, the client-write timeout fires and cancels the relay task. The relay must
    end quietly (slot released, no 'Exception in ASGI application')."""
    got_close = asyncio.Event()

    async def upstream_ignoring_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, done: asyncio.Event
    ) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept_key(head).encode() + b"\r\n\r\n"
        )
        writer.write(frame(OP_TEXT, b"hello", mask=False))
        await writer.drain()
        while True:  # read masked client frames until Headroom's close frame
            b0, b1 = await reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                n = int.from_bytes(await reader.readexactly(2), "big")
            elif n == 127:
                n = int.from_bytes(await reader.readexactly(8), "big")
            await reader.readexactly(4 + n)
            if b0 & 0x0F == 0x8:
                break
        got_close.set()
        writer.write(frame(OP_TEXT, b"late", mask=False))  # data after its close; no reply
        await writer.drain()
        await done.wait()

    async with raw_server(upstream_ignoring_close) as port:
        clock = FakeClock()
        proxy: Proxy = await start_proxy(
            proxy_settings([("gpu0", f"http://127.0.0.1:{port}", 1)],
                           [{"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}],
                           limits={"client_write_timeout_s": 20, "idle_timeout_s": 0,
                                   "max_session_s": 0, "ping_interval_s": 0}),
            clock,
        )  # fmt: skip
        error_log.watch()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        writer.write(handshake_request("/ws"))
        await writer.drain()
        head = await asyncio.wait_for(read_head(reader), 30)
        assert head is not None and head.status == 101
        hello = await read_frames(reader, head.rest, timeout=30, until_text="hello")
        assert hello.frames
        reset(writer)  # the client vanishes
        await asyncio.wait_for(got_close.wait(), 30)  # Headroom closes the upstream (1001)
        # The upstream never answers: the close deadline (and the client-write timeout,
        # for a relay still sending) fall due.
        clock.advance(25)
        await wait_until(lambda: proxy.gate.active == 0, 30)
        await asyncio.sleep(0.1)
    assert not error_log.errors()


# -- WebSocket: odd but accepted request targets and frames ---------------------------------------


async def test_ws_request_target_with_a_fragment_is_not_an_internal_error(
    start_proxy: Any, upstream: Any, error_log: Records
) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)],
                       [{"path": "/ws/echo", "pool": "main", "protocol": "passthrough-ws"}])
    )  # fmt: skip
    error_log.watch()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        writer.write(handshake_request("/ws/echo?a=b#frag"))
        await writer.drain()
        head = await asyncio.wait_for(read_head(reader), 30)
    finally:
        writer.close()
    assert head is not None and head.status in (101, 400), head
    await wait_until(lambda: proxy.gate.active == 0)
    assert not error_log.errors()


async def test_invalid_utf8_text_frame_is_1007_without_an_error_log(
    start_proxy: Any, upstream: Any, error_log: Records
) -> None:
    """A client's bad frame is the client's problem: a 1007 close, not an ERROR record
    with a traceback (a stream of bad clients would flood the logs, like refusals would;
    docs/reliability.md: no ERROR line, no traceback)."""
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)],
                       [{"path": "/ws/echo", "pool": "main", "protocol": "passthrough-ws"}])
    )  # fmt: skip
    error_log.watch()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        writer.write(handshake_request("/ws/echo"))
        await writer.drain()
        head = await asyncio.wait_for(read_head(reader), 30)
        assert head is not None and head.status == 101
        writer.write(frame(OP_TEXT, b"caf\xc3"))
        await writer.drain()
        closed = await read_frames(reader, head.rest, timeout=30)
    finally:
        writer.close()
    assert closed.code == 1007, closed
    await wait_until(lambda: proxy.gate.active == 0)
    assert not error_log.errors()


# -- logging: one JSON object per line, uvicorn's records included ---------------------------------


@pytest.fixture
def restore_logging() -> Any:
    names = ("", "uvicorn", "uvicorn.error", "uvicorn.access")
    saved = {
        n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level,
            logging.getLogger(n).propagate, logging.getLogger(n).disabled)
        for n in names
    }  # fmt: skip
    yield
    for n, (handlers, level, propagate, disabled) in saved.items():
        logger = logging.getLogger(n)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
        logger.disabled = disabled


def test_uvicorn_records_are_json_under_headroom_serve(restore_logging: Any) -> None:
    """``headroom serve`` configures JSON logging, then builds the gateway (whose uvicorn
    config installs uvicorn's own text handlers unless told not to): uvicorn's records
    ("Invalid HTTP request received.", start-up lines, ...) must still come out as JSON."""
    settings = settings_from_mapping(
        {"listen": {"host": "127.0.0.1", "port": 0}, "admin": {"enabled": False},
         "pools": [{"name": "p", "replicas": [
             {"name": "g", "url": "http://127.0.0.1:9", "max_sessions": 1}]}],
         "routes": [{"path": "/x", "pool": "p", "protocol": "passthrough-ws"}]},
        env={},
    )  # fmt: skip
    configure_logging("info", "json")  # what `headroom serve` does first
    gateway = Gateway(settings)
    try:
        logger = logging.getLogger("uvicorn.error")
        handlers: list[logging.Handler] = []
        node: logging.Logger | None = logger
        while node is not None:  # the handlers a uvicorn.error record reaches
            handlers += node.handlers
            node = node.parent if node.propagate else None
        assert handlers
        assert all(isinstance(h.formatter, JsonFormatter) for h in handlers), [
            type(h.formatter).__name__ for h in handlers
        ]
    finally:
        gateway._sock.close()


# -- the simulator: a realtime generation killed by a drop fault --------------------------------


class _ScriptedChannel:
    """A WsChannel stand-in for one RealtimeSession: hands out scripted client events;
    before the second commit, waits until the first generation has died."""

    def __init__(self, pcm_b64: str) -> None:
        self.session: Any = None
        self.sent: list[dict[str, Any]] = []
        self.closed = False
        self._script: list[dict[str, Any] | str] = [
            {"type": "session.update"},
            {"type": "input_audio_buffer.commit"},
            {"type": "input_audio_buffer.append", "audio": pcm_b64},
            "wait-for-the-generation-to-die",
            {"type": "input_audio_buffer.commit"},
        ]

    async def receive(self, timeout: float | None = None) -> str:
        from proxy.sim.common import ChannelClosed

        while self._script:
            step = self._script.pop(0)
            if step == "wait-for-the-generation-to-die":
                await wait_until(lambda: self.session.task is not None and self.session.task.done())
                continue
            return json.dumps(step)
        raise ChannelClosed()

    async def send_json(self, payload: dict[str, Any]) -> None:
        self.sent.append(payload)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = True


async def test_sim_realtime_generation_killed_by_a_drop_is_not_left_unretrieved() -> None:
    """``drop_after_chunks`` kills the generation task with ChannelClosed; a commit the
    client had already sent (queued before the abort was noticed) must not replace that
    task without looking at it (asyncio: "Task exception was never retrieved", seen in
    the soak's stderr)."""
    import gc
    from dataclasses import replace

    from proxy.sim import Faults, get_preset, running_cluster
    from proxy.sim.common import ChannelClosed
    from proxy.sim.realtime_api import RealtimeSession

    loop = asyncio.get_running_loop()
    unretrieved: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(str(ctx.get("message"))))
    preset = replace(get_preset("h200-voxtral-tts-4b"), name="drop-test", chunk_tokens=5)
    try:
        async with running_cluster(preset, gpus=1, faults=Faults(drop_after_chunks=0)) as cluster:
            channel = _ScriptedChannel(base64.b64encode(bytes(32000)).decode())
            session = RealtimeSession(cluster.gpus[0], channel, {"client": ("127.0.0.1", 1)})  # type: ignore[arg-type,unused-ignore]
            channel.session = session
            with contextlib.suppress(ChannelClosed):
                await session.run()
            del session, channel
            for _ in range(3):
                gc.collect()
                await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert not [m for m in unretrieved if "never retrieved" in m], unretrieved


# -- security: what one client declares must not take a replica away from everybody -------------


@pytest.mark.parametrize("claimed_rate", [1_000_000_000, 192_000])
async def test_a_client_declared_output_rate_cannot_trip_the_guard_for_everyone(
    start_proxy: Any, claimed_rate: int
) -> None:
    """openai-realtime meters the upstream's audio at the session's output format, and the
    client may set that format (``session.update``). OpenAI's audio deltas carry no rate,
    so a client claiming a rate far above the real one makes its own session's audio
    count for almost nothing: the replica's worst-1% delivery ratio collapses and, in
    ``enforce`` mode, the guard stops admitting *anyone* to that replica. 1e9 Hz is
    absurd; 192 kHz is a rate a route may be configured with and still divides the
    ratio by 8. Metering must use a format the upstream confirmed (``session.created``/
    ``session.updated``), not the client's claim.

    The upstream streams 24 kHz audio at about 9x realtime (0.45 s every 50 ms): honest
    metering stays far above the 1.2 threshold even on a loaded machine."""
    from websockets.asyncio.client import connect
    from websockets.asyncio.server import ServerConnection, serve

    chunk = base64.b64encode(bytes(21600)).decode()  # 0.45 s of 24 kHz PCM16

    async def openai_like(conn: ServerConnection) -> None:
        await conn.send(json.dumps({"type": "session.created", "session": {}}))
        async for message in conn:
            if json.loads(message).get("type") == "response.create":
                for _ in range(25):
                    await conn.send(json.dumps(
                        {"type": "response.output_audio.delta", "delta": chunk}))  # fmt: skip
                    await asyncio.sleep(0.05)
                await conn.send(json.dumps({"type": "response.done"}))

    async with serve(openai_like, "127.0.0.1", 0, compression=None, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        proxy: Proxy = await start_proxy(
            proxy_settings(
                [("gpu0", f"http://127.0.0.1:{port}", 4)],
                [{"path": "/v1/realtime", "pool": "main", "protocol": "openai-realtime"}],
                guard={"mode": "enforce", "min_samples": 20, "hold_s": 1},
            )
        )
        claim = {"type": "session.update", "session": {"audio": {"output": {"format": {
            "type": "audio/pcm", "rate": claimed_rate}}}}}  # fmt: skip
        async with connect(proxy.ws_url + "/v1/realtime", compression=None) as ws:
            await ws.recv()
            await ws.send(json.dumps(claim))
            await ws.send(json.dumps({"type": "response.create"}))
            while json.loads(await ws.recv())["type"] != "response.done":
                pass
        proxy.runtime.guard.evaluate()
        ratio = proxy.runtime.delivery_ratio_worst_1pct("main", "gpu0")
        assert not proxy.runtime.guard.guarded("main", "gpu0"), f"worst-1% delivery ratio {ratio}"
        async with connect(proxy.ws_url + "/v1/realtime", compression=None) as other:
            assert json.loads(await other.recv())["type"] == "session.created"
        await wait_until(lambda: proxy.gate.active == 0)


# -- HTTP: the client library fails in an unexpected way while a connection drops ---------------


async def test_http_client_library_failing_on_a_dropped_connection_is_a_502(
    start_proxy: Any, upstream: Any, error_log: Records
) -> None:
    """Seen in the soak (anyio 4.16 + uvloop): an upstream that resets a connection right
    after accepting it can make httpx raise ``AttributeError: 'NoneType' object has no
    attribute 'getpeername'`` (anyio's SocketStream asks a closed uvloop transport for its
    socket) instead of an httpx error. Whatever the HTTP stack raises while talking to the
    upstream is an upstream failure for the client (502, the contract body), not a 500
    with an ERROR traceback. Reproduced here with a transport that raises it."""
    import httpx

    def dropped(request: httpx.Request) -> httpx.Response:
        raise AttributeError("'NoneType' object has no attribute 'getpeername'")

    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [speech_route()])
    )
    error_log.watch()
    real = proxy.runtime.upstreams._client
    proxy.runtime.upstreams._client = httpx.AsyncClient(transport=httpx.MockTransport(dropped))
    assert real is not None
    await real.aclose()
    status, _, body = await post(proxy.server.port)
    assert status == 502, (status, body)
    assert json.loads(body)["error"]["type"]
    assert not error_log.errors()
    assert proxy.gate.active == 0
