"""A session that waited with queue feedback is relayed by the splice once admitted
(proxy/relay/ws_server.py hands over the connection the app accepted through ASGI): the queue notes
and ``headroom.admitted`` come first, then what the client sent while it waited -- whole
messages, the first fragment of a message and half a frame -- reaches the upstream in
order, and the rest of the stream follows. Real sockets on 127.0.0.1: raw clients
(bench/wsraw.py) and a raw upstream that records every frame it reads."""

from __future__ import annotations

import asyncio
import gc
import json
from typing import Any

from bench.wsraw import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONT,
    OP_TEXT,
    close_frame,
    frame,
    handshake_request,
    read_frames,
    read_head,
)
from proxy.relay.ws_session import _WebSocket
from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_frame_violations import RecordingUpstream, recording_upstream
from tests.integration.test_ws_relay import wait_until

__all__ = ["recording_upstream"]  # the fixture, re-exported for pytest

PATH = "/ws/raw"


def _settings(port: int) -> Any:
    route = {"path": PATH, "pool": "main", "protocol": "passthrough-ws", "queue_feedback": True}
    return proxy_settings(
        [("gpu0", f"http://127.0.0.1:{port}", 1)], [route],
        queue={"max_depth": 2, "max_wait_s": 30}, limits={"ping_interval_s": 0},
        guard={"mode": "off"},
    )  # fmt: skip


async def _open(
    proxy: Proxy, keepalive: bool = False
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A client accepted (101); ``keepalive``: on a connection that carried GET /healthz
    and its response first."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    if keepalive:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        plain = await read_head(reader)
        assert plain is not None and plain.status == 200
        length = int(plain.headers["content-length"])
        body = plain.rest + await reader.readexactly(length - len(plain.rest))
        assert json.loads(body) == {"status": "alive"}
    writer.write(handshake_request(PATH))
    head = await read_head(reader)
    assert head is not None and head.status == 101
    return reader, writer, head.rest


async def _waited_then_admitted(
    proxy: Proxy, upstream: RecordingUpstream, keepalive: bool = False
) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
    """The client's frames the upstream read, and what the client read, for a session
    that sends a stream while it waits, then more once admitted (``keepalive``: upgraded
    after a plain request on its connection)."""
    holder_r, holder_w, _ = await _open(proxy)  # its 101 follows its upstream handshake
    ours = len(upstream.conns)  # the next upstream connection is the waiter's
    await wait_until(lambda: proxy.gate.active == 1)
    reader, writer, rest = await _open(proxy, keepalive)  # accepted to wait
    await wait_until(lambda: proxy.gate.queued == 1)
    cont = frame(OP_CONT, b"-end")
    writer.write(
        frame(OP_TEXT, b"held-1") + frame(OP_BINARY, b"held-2")
        + frame(OP_TEXT, b"frag", fin=False) + cont[:3]
    )  # fmt: skip
    await writer.drain()
    holder_w.write(close_frame(1000))
    await read_frames(holder_r, timeout=10)
    holder_w.close()
    got = await read_frames(reader, rest, timeout=10, until_text="headroom.admitted")
    await wait_until(lambda: len(upstream.conns) > ours and len(upstream.conns[ours].frames) >= 3)
    conn = upstream.conns[ours]
    writer.write(cont[3:] + frame(OP_TEXT, b"after", fin=False))
    await writer.drain()
    # a fragment is forwarded as it comes
    await wait_until(lambda: len(conn.frames) >= 5)
    writer.write(frame(OP_CONT, b"-done") + close_frame(4000))
    await writer.drain()
    closed = await read_frames(reader, got.rest, timeout=10)
    writer.close()
    await asyncio.wait_for(conn.closed.wait(), 10)
    assert closed.code == 4000, closed
    await wait_until(lambda: proxy.gate.active == 0)
    return conn.frames, got.frames


async def test_a_queue_feedback_session_is_spliced_after_admission(
    start_proxy: Any, recording_upstream: RecordingUpstream
) -> None:
    proxy: Proxy = await start_proxy(_settings(recording_upstream.port))
    sent, told = await _waited_then_admitted(proxy, recording_upstream)
    assert [json.loads(p)["type"] for _, p in told] == ["headroom.queue", "headroom.admitted"]
    assert sent == [
        (OP_TEXT, b"held-1"), (OP_BINARY, b"held-2"), (OP_TEXT, b"frag"), (OP_CONT, b"-end"),
        (OP_TEXT, b"after"), (OP_CONT, b"-done"), (OP_CLOSE, (4000).to_bytes(2, "big")),
    ]  # fmt: skip
    sessions = proxy.server.server.sessions
    assert sessions is not None
    await wait_until(lambda: not sessions.live)  # the taken-over session was released


async def test_after_a_kept_alive_request_queue_feedback_is_spliced_too(
    start_proxy: Any, recording_upstream: RecordingUpstream
) -> None:
    """The upgrade came after GET /healthz on the same connection: the listener serves
    it like a first head, so the same stream reaches the upstream in the same frames."""
    proxy: Proxy = await start_proxy(_settings(recording_upstream.port))
    sent, told = await _waited_then_admitted(proxy, recording_upstream, keepalive=True)
    assert [json.loads(p)["type"] for _, p in told] == ["headroom.queue", "headroom.admitted"]
    assert sent == [
        (OP_TEXT, b"held-1"), (OP_BINARY, b"held-2"), (OP_TEXT, b"frag"), (OP_CONT, b"-end"),
        (OP_TEXT, b"after"), (OP_CONT, b"-done"), (OP_CLOSE, (4000).to_bytes(2, "big")),
    ]  # fmt: skip


def _sessions() -> list[Any]:
    """The WebSocket halves of the sessions alive in this process."""
    gc.collect()  # those of earlier tests
    return [o for o in gc.get_objects() if type(o) is _WebSocket]


async def test_the_notes_queue_lives_only_while_the_session_waits(
    start_proxy: Any, recording_upstream: RecordingUpstream
) -> None:
    """A session admitted at once never makes a queue for its notes; one that waited
    drops it once admitted (it would otherwise live as long as the session)."""
    proxy: Proxy = await start_proxy(_settings(recording_upstream.port))
    earlier = _sessions()
    holder_r, holder_w, _ = await _open(proxy)
    await wait_until(lambda: proxy.gate.active == 1)
    (holder,) = [s for s in _sessions() if not any(s is e for e in earlier)]
    assert holder.notes is None
    reader, writer, rest = await _open(proxy)  # accepted to wait
    await wait_until(lambda: proxy.gate.queued == 1)
    (waiter,) = [s for s in _sessions() if s is not holder and not any(s is e for e in earlier)]
    assert waiter.notes is not None  # while it waits
    holder_w.write(close_frame(1000))
    await read_frames(holder_r, timeout=10)
    holder_w.close()
    got = await read_frames(reader, rest, timeout=10, until_text="headroom.admitted")
    assert [json.loads(p)["type"] for _, p in got.frames] == ["headroom.queue", "headroom.admitted"]
    assert waiter.notes is None
    del earlier
    writer.write(close_frame(4000))
    await writer.drain()
    closed = await read_frames(reader, got.rest, timeout=10)
    writer.close()
    assert closed.code == 4000, closed
    await wait_until(lambda: proxy.gate.active == 0)
