"""The client mix of the chaos soak: well-behaved sessions on every protocol the
simulator serves, and clients that leave, stall, never read or send garbage.

Every behaviour is ``async (ctx, rng) -> outcome`` and never raises for anything the
network or the proxy does; the outcome is one of :data:`EXPECTED` (a legitimate way for
a session to end under chaos) or a :data:`FLAGGED` one (a proxy bug, or a hung session).

=====================  =============================================================
kind                   what the client does
=====================  =============================================================
ws_speech              speech WS: config, text, flush, read to ``session.done``,
                       ``session.close``; 30 % opt in to the fallback pool
ws_feedback            the same on the queue-feedback route (accepted at once, told
                       its queue position, refused with 1013 in the protocol's shape)
http_sse               POST /v1/audio/speech, SSE, read to ``speech.audio.done``
http_raw               POST /v1/audio/speech, raw pcm or wav stream, read to the end
realtime               WS /v1/realtime: update, audio in, final commit, read to the end
leave_queued           handshake or request sent, gone before the answer (FIN or RST)
leave_handshake        half an upgrade request (cut anywhere), then gone
leave_midstream        a well-behaved session on any protocol, gone after k chunks
never_read             small receive buffer, asks for long audio, never reads, leaves
slow_reader            reads with pauses between frames
garbage                bytes that are not HTTP, or a good handshake then bad frames
                       (random, invalid UTF-8, huge declared length, unmasked, binary
                       on the text-only realtime protocol)
fragment_stop          first fragment of a message, then silence
=====================  =============================================================
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import socket
import struct
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from wsraw import (  # type: ignore[import-not-found,unused-ignore]
    OP_BINARY,
    OP_CONT,
    OP_TEXT,
    frame,
    handshake_request,
    http_request,
    open_raw,
    read_frames,
    read_head,
    read_http_body,
    reset,
)

__all__ = ["BEHAVIOURS", "EXPECTED", "FLAGGED", "ClientContext", "choose", "flagged", "run_client"]

SPEECH_WS = "/v1/audio/speech/stream"
FEEDBACK_WS = "/fb/audio/speech/stream"
SPEECH_HTTP = "/v1/audio/speech"
REALTIME = "/v1/realtime"
FALLBACK_HEADER = ("X-Headroom-Allow-Fallback", "1")

TEXTS = (
    "Hello there.",
    "The quick brown fox jumps over the lazy dog.",
    "Your order has shipped. It will arrive on Tuesday.",
    "Please hold while I check that for you.",
    "Thanks for calling! Is there anything else?",
    "One, two, three. Testing the line.",
)
LONG_TEXT = " ".join(TEXTS * 4)

#: Outcomes that are a legitimate end of a session under chaos.
EXPECTED = (
    "ok",
    "refused",  # 503/429 at the handshake or request, or 1013 after queue feedback
    "upstream_failed",  # 502, 504, 1014, an upstream error event, a truncated body
    "policy_closed",  # 1008: idle timeout, size limit, client not reading
    "rejected_input",  # garbage answered with 400 / 1002 / 1007 / 1009 / a close
    "left",  # the client left on purpose
)
#: Outcomes that mean a bug: the proxy failed internally, or a session never ended.
FLAGGED = ("internal_error", "hung", "dropped", "client_error")


def flagged(outcome: str) -> bool:
    return outcome.split(":", 1)[0] in FLAGGED


@dataclass(frozen=True, slots=True)
class ClientContext:
    host: str
    port: int
    model: str
    deadline_s: float = 45.0  # a session still running after this is "hung"
    open_timeout_s: float = 25.0


def _ws_url(ctx: ClientContext, path: str) -> str:
    return f"ws://{ctx.host}:{ctx.port}{path}"


def _refused(status: int, headers: Any) -> str:
    reason = headers.get("x-headroom-reason") if headers is not None else None
    if status in (503, 429) and reason:
        return f"refused:{reason}"
    if status in (502, 503, 504):  # 503 without a reason: the upstream's own, relayed;
        return f"upstream_failed:{status}"  # 504: the upstream took it and said nothing
    if status >= 500:
        return f"internal_error:{status}"
    return f"rejected_input:{status}"


def _closed(code: int | None) -> str:
    """Outcome of a WebSocket that closed before a well-behaved client was done with it."""
    if code in (1000, 1001):
        return f"upstream_failed:{code}"
    if code in (1014, 1012):
        return f"upstream_failed:{code}"
    if code == 1013:
        return "refused:1013"
    if code == 1008:
        return "policy_closed"
    if code == 1011:
        return "internal_error:1011"
    return f"dropped:{code}"


def _abort(ws: ClientConnection, rst: bool) -> None:
    sock = ws.transport.get_extra_info("socket")
    if rst and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


def _leave(writer: asyncio.StreamWriter, rng: random.Random) -> None:
    """Go away with RST or FIN, half the time each."""
    if rng.random() < 0.5:
        reset(writer)
    else:
        writer.close()


async def _ws_connect(
    ctx: ClientContext, path: str, headers: list[tuple[str, str]] | None = None
) -> ClientConnection | str:
    try:
        return await connect(
            _ws_url(ctx, path),
            additional_headers=headers,
            compression=None,
            open_timeout=ctx.open_timeout_s,
            close_timeout=3,
            max_size=None,
            ping_interval=None,
        )
    except InvalidStatus as exc:
        return _refused(exc.response.status_code, exc.response.headers)
    except TimeoutError:
        return "hung:handshake"
    except (OSError, InvalidHandshake, EOFError) as exc:
        return f"dropped:handshake:{type(exc).__name__}"


# -- well-behaved sessions (optionally leaving mid-stream or reading slowly) ----------------


async def ws_speech(
    ctx: ClientContext,
    rng: random.Random,
    *,
    path: str = SPEECH_WS,
    leave_after: int | None = None,
    read_pause_s: float = 0.0,
) -> str:
    headers = [FALLBACK_HEADER] if rng.random() < 0.3 else []
    conn = await _ws_connect(ctx, path, headers)
    if isinstance(conn, str):
        return conn
    ws = conn
    feedback = path == FEEDBACK_WS
    stream_audio = rng.random() < 0.6
    fmt = "pcm" if stream_audio or rng.random() < 0.5 else "wav"
    error_seen = False
    chunks = 0
    try:
        # On the feedback route a waiting client is accepted at once: what it sends now is
        # held and relayed once admitted (after "headroom.queue" ... "headroom.admitted").
        await ws.send(json.dumps({"type": "session.config", "response_format": fmt,
                                  "stream_audio": stream_audio}))  # fmt: skip
        await ws.send(json.dumps({"type": "input.text", "text": rng.choice(TEXTS)}))
        await ws.send(json.dumps({"type": "input.done"}))
        while True:
            message = await ws.recv()
            if read_pause_s:
                await asyncio.sleep(rng.uniform(0, read_pause_s))
            if isinstance(message, bytes):
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    _abort(ws, rst=rng.random() < 0.5)
                    return "left:midstream"
                continue
            event = json.loads(message)
            kind = event.get("type")
            if kind == "error":
                if feedback and "retry_after_s" in message:
                    await ws.recv()  # Headroom's refusal in the protocol's shape: 1013 next
                error_seen = True
            if kind == "session.done":
                break
        await ws.send(json.dumps({"type": "session.close"}))
        with contextlib.suppress(ConnectionClosed):
            while True:
                await ws.recv()
        code = ws.close_code
        if code == 1000:
            return "upstream_failed:error_event" if error_seen else "ok"
        return _closed(code)
    except ConnectionClosed as exc:
        return _closed(exc.rcvd.code if exc.rcvd else None)
    except (OSError, EOFError) as exc:
        return f"dropped:{type(exc).__name__}"
    finally:
        await ws.close()


async def realtime(
    ctx: ClientContext, rng: random.Random, *, leave_after: int | None = None
) -> str:
    conn = await _ws_connect(ctx, REALTIME)
    if isinstance(conn, str):
        return conn
    ws = conn
    error_seen = False
    chunks = 0
    try:
        created = json.loads(await ws.recv())
        if created.get("type") != "session.created":
            return "upstream_failed:no_session"
        await ws.send(json.dumps({"type": "session.update", "model": ctx.model}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        seconds = rng.uniform(0.4, 1.6)
        pcm = os.urandom(int(16000 * seconds) * 2)
        for i in range(0, len(pcm), 6400):
            audio = base64.b64encode(pcm[i : i + 6400]).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        while True:
            event = json.loads(await ws.recv())
            kind = event.get("type")
            if kind == "response.audio.delta":
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    _abort(ws, rst=rng.random() < 0.5)
                    return "left:midstream"
            elif kind == "error":
                error_seen = True
            elif kind == "response.audio.done":
                break
        await ws.close()
        return "upstream_failed:error_event" if error_seen else "ok"
    except ConnectionClosed as exc:
        return _closed(exc.rcvd.code if exc.rcvd else None)
    except (OSError, EOFError) as exc:
        return f"dropped:{type(exc).__name__}"
    finally:
        await ws.close()


async def http_speech(
    ctx: ClientContext, rng: random.Random, *, sse: bool, leave_after: int | None = None
) -> str:
    body: dict[str, Any] = {"input": rng.choice(TEXTS), "voice": "default"}
    if sse:
        body |= {"stream": True, "response_format": rng.choice(["pcm", "wav"])}
    else:
        body |= {"stream_format": "audio", "response_format": rng.choice(["pcm", "wav"])}
    headers = [("Content-Type", "application/json")]
    if rng.random() < 0.3:
        headers.append(FALLBACK_HEADER)
    reader, writer = await open_raw(ctx.host, ctx.port)
    try:
        writer.write(http_request("POST", SPEECH_HTTP, json.dumps(body).encode(),
                                  headers=headers))  # fmt: skip
        await writer.drain()
        head = await read_head(reader)
        if head is None:
            return "dropped:no_response"
        if head.status != 200:
            return _refused(head.status, head.headers)
        if leave_after is not None:
            got = len(head.rest)
            while got < leave_after * 2048:
                data = await reader.read(4096)
                if not data:
                    break
                got += len(data)
            _leave(writer, rng)
            return "left:midstream"
        data, complete = await read_http_body(reader, head)
        if not complete:
            return "upstream_failed:truncated"
        if sse:
            if b"speech.audio.error" in data:
                return "upstream_failed:error_event"
            if b"speech.audio.done" not in data:
                return "upstream_failed:no_done"
        return "ok"
    except (ConnectionError, OSError) as exc:
        return f"dropped:{type(exc).__name__}"
    finally:
        writer.close()


# -- departures, abuse ------------------------------------------------------------------------


async def leave_queued(ctx: ClientContext, rng: random.Random) -> str:
    """Send a complete handshake (or request), leave before the answer if none came."""
    if rng.random() < 0.3:
        body = json.dumps({"input": rng.choice(TEXTS), "stream": True,
                           "response_format": "pcm"}).encode()  # fmt: skip
        request = http_request("POST", SPEECH_HTTP, body,
                               headers=[("Content-Type", "application/json")])  # fmt: skip
    else:
        request = handshake_request(rng.choice([SPEECH_WS, REALTIME]))
    reader, writer = await open_raw(ctx.host, ctx.port)
    try:
        writer.write(request)
        await writer.drain()
        try:
            async with asyncio.timeout(rng.uniform(0.0, 1.2)):
                head = await read_head(reader)
        except TimeoutError:
            head = None
        if head is None:
            outcome = "left:queued"
        elif head.status in (101, 200):
            outcome = "left:after_admit"
        else:
            outcome = _refused(head.status, head.headers)
        _leave(writer, rng)
        return outcome
    finally:
        writer.close()


async def leave_queued_feedback(ctx: ClientContext, rng: random.Random) -> str:
    """Wait on the queue-feedback route until told a queue position, then leave."""
    conn = await _ws_connect(ctx, FEEDBACK_WS)
    if isinstance(conn, str):
        return conn
    ws = conn
    try:
        async with asyncio.timeout(rng.uniform(0.05, 1.5)):
            while True:
                event = json.loads(await ws.recv())
                if event.get("type") == "headroom.queue":
                    _abort(ws, rst=rng.random() < 0.5)
                    return "left:queued"
                if event.get("type") != "headroom.admitted":
                    return "refused:1013"
                break
        _abort(ws, rst=rng.random() < 0.5)
        return "left:after_admit"
    except TimeoutError:
        _abort(ws, rst=False)
        return "left:queued"
    except ConnectionClosed as exc:
        return _closed(exc.rcvd.code if exc.rcvd else None)
    finally:
        await ws.close()


async def leave_handshake(ctx: ClientContext, rng: random.Random) -> str:
    request = handshake_request(rng.choice([SPEECH_WS, REALTIME, FEEDBACK_WS]))
    cut = rng.randint(0, len(request) - 1)
    _, writer = await open_raw(ctx.host, ctx.port)
    try:
        writer.write(request[:cut])
        await writer.drain()
        await asyncio.sleep(rng.uniform(0, 0.3))
        _leave(writer, rng)
        return "left:handshake"
    finally:
        writer.close()


async def never_read(ctx: ClientContext, rng: random.Random) -> str:
    reader, writer = await open_raw(ctx.host, ctx.port, rcvbuf=4096)
    try:
        writer.write(handshake_request(SPEECH_WS))
        await writer.drain()
        head = await read_head(reader)
        if head is None:
            return "dropped:no_response"
        if head.status != 101:
            return _refused(head.status, head.headers)
        for event in (
            {"type": "session.config", "response_format": "pcm", "stream_audio": True},
            {"type": "input.text", "text": LONG_TEXT},
            {"type": "input.done"},
        ):
            writer.write(frame(OP_TEXT, json.dumps(event).encode()))
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.5, 4.0))
        reset(writer)
        return "left:never_read"
    except (ConnectionError, OSError):
        return "left:never_read"
    finally:
        writer.close()


async def _garbage_frames(rng: random.Random) -> tuple[str, bytes]:
    choice = rng.randrange(6)
    if choice == 0:
        return SPEECH_WS, bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
    if choice == 1:
        return SPEECH_WS, frame(OP_TEXT, b'{"type": "session.config", "x": "\xff\xfe"}')
    if choice == 2:
        return SPEECH_WS, frame(OP_BINARY, b"", length=1 << 40)
    if choice == 3:
        return SPEECH_WS, frame(OP_TEXT, b'{"type": "input.done"}', mask=False)
    if choice == 4:
        return REALTIME, frame(OP_BINARY, os.urandom(rng.randint(1, 2048)))
    return SPEECH_WS, frame(OP_CONT, b"continuation without a start")


async def garbage(ctx: ClientContext, rng: random.Random) -> str:
    reader, writer = await open_raw(ctx.host, ctx.port)
    try:
        if rng.random() < 0.3:
            # not HTTP at all (or a broken request line)
            junk = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 600)))
            if rng.random() < 0.5:
                junk = b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n" + junk + b"\r\n\r\n"
            writer.write(junk)
            await writer.drain()
            async with asyncio.timeout(10):
                head = await read_head(reader)
            if head is None or 400 <= head.status < 500:
                return "rejected_input:http"
            if head.status == 101:
                return "rejected_input:http"  # junk happened to parse as a handshake
            return _refused(head.status, head.headers)
        path, payload = await _garbage_frames(rng)
        writer.write(handshake_request(path))
        await writer.drain()
        head = await read_head(reader)
        if head is None:
            return "dropped:no_response"
        if head.status != 101:
            return _refused(head.status, head.headers)
        writer.write(payload)
        await writer.drain()
        closed = await read_frames(reader, head.rest, timeout=15)
        if closed.code == 1011:
            return "internal_error:1011"
        if closed.timeout:
            return "hung:garbage"
        return f"rejected_input:{closed.how}"
    except (ConnectionError, OSError):
        return "rejected_input:reset"
    finally:
        writer.close()


async def fragment_stop(ctx: ClientContext, rng: random.Random) -> str:
    reader, writer = await open_raw(ctx.host, ctx.port)
    try:
        writer.write(handshake_request(SPEECH_WS))
        await writer.drain()
        head = await read_head(reader)
        if head is None:
            return "dropped:no_response"
        if head.status != 101:
            return _refused(head.status, head.headers)
        writer.write(frame(OP_TEXT, b'{"type": "session.con', fin=False))
        await writer.drain()
        closed = await read_frames(reader, head.rest, timeout=rng.uniform(0.3, 8.0))
        if closed.code == 1011:
            return "internal_error:1011"
        if closed.code is not None or closed.eof or closed.reset:
            return "policy_closed" if closed.code == 1008 else f"upstream_failed:{closed.how}"
        reset(writer)
        return "left:holding"
    finally:
        writer.close()


async def leave_midstream(ctx: ClientContext, rng: random.Random) -> str:
    k = rng.randint(1, 4)
    which = rng.randrange(4)
    if which == 0:
        return await ws_speech(ctx, rng, leave_after=k)
    if which == 1:
        return await realtime(ctx, rng, leave_after=k)
    return await http_speech(ctx, rng, sse=which == 2, leave_after=k)


Behaviour = Callable[[ClientContext, random.Random], Awaitable[str]]

#: kind -> (weight, behaviour)
BEHAVIOURS: dict[str, tuple[float, Behaviour]] = {
    "ws_speech": (18, ws_speech),
    "ws_feedback": (6, lambda c, r: ws_speech(c, r, path=FEEDBACK_WS)),
    "http_sse": (10, lambda c, r: http_speech(c, r, sse=True)),
    "http_raw": (7, lambda c, r: http_speech(c, r, sse=False)),
    "realtime": (9, realtime),
    "leave_queued": (7, leave_queued),
    "leave_queued_feedback": (3, leave_queued_feedback),
    "leave_handshake": (5, leave_handshake),
    "leave_midstream": (12, leave_midstream),
    "never_read": (4, never_read),
    "slow_reader": (4, lambda c, r: ws_speech(c, r, read_pause_s=0.25)),
    "garbage": (8, garbage),
    "fragment_stop": (3, fragment_stop),
}


def choose(rng: random.Random) -> str:
    kinds = list(BEHAVIOURS)
    return rng.choices(kinds, [BEHAVIOURS[k][0] for k in kinds])[0]


async def run_client(ctx: ClientContext, kind: str, rng: random.Random) -> str:
    """Run one client of ``kind`` to its outcome, within ``ctx.deadline_s``."""
    behaviour = BEHAVIOURS[kind][1]
    try:
        async with asyncio.timeout(ctx.deadline_s):
            return await behaviour(ctx, rng)
    except TimeoutError:
        return "hung"
    except Exception as exc:  # a harness bug or an unclassified failure: report it
        return f"client_error:{type(exc).__name__}:{exc}"[:160]
