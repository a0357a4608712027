"""A raw HTTP/1.1 upstream on 127.0.0.1 (asyncio streams, no framework) whose failures
are exact: it can reset, close without the terminating chunk, stall, or flood.

Modes (``RawUpstream.mode``):
  chunks   head + the given chunks, then the terminating chunk (a complete response;
           the connection stays open for the next request)
  reset    head + chunks, then a TCP reset (SO_LINGER 0)
  fin      head + chunks, then a close without the terminating chunk
  short    ``Content-Length`` larger than the chunks, then a close
  stall    head + chunks, then silence until the test ends
  never    reads the request and never answers
  flood    head + 64 KiB chunks for as long as the connection takes them
  echo     a JSON body naming the request headers it got (and a ``Set-Cookie``)

``close_reused``: a second request on a kept-alive connection is read and the connection
closed without an answer (as llama.cpp's server does to a connection it is closing as the
next request arrives); ``unanswered`` counts those.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["RawUpstream", "raw_upstream"]


@dataclass
class RawUpstream:
    port: int = 0
    mode: str = "chunks"
    content_type: str = "application/octet-stream"
    chunks: list[bytes] = field(default_factory=lambda: [b"a" * 4800, b"b" * 4800])
    extra_headers: bytes = b""  # raw header lines, each ending in CRLF
    requests: list[list[tuple[str, str]]] = field(default_factory=list)
    closed: int = 0  # requests whose connection has ended (the proxy closed it)
    close_reused: bool = False
    unanswered: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0  # requests read on this connection
        try:
            while True:  # keep-alive: the next request on the same connection
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")[1:]
                headers = [(n.strip().lower(), v.strip()) for n, _, v in
                           (line.partition(":") for line in lines if line)]  # fmt: skip
                self.requests.append(headers)
                served += 1
                length = int(dict(headers).get("content-length", "0"))
                if length:
                    await reader.readexactly(length)
                if self.close_reused and served > 1:
                    self.unanswered += 1
                    break
                if not await self._respond(reader, writer, headers):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the proxy closed it, or the test ended
        finally:
            self.closed += served
            writer.transport.abort()

    async def _respond(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        headers: list[tuple[str, str]],
    ) -> bool:
        """Answer one request; True when the connection stays open for another."""
        mode = self.mode
        if mode == "never":
            await reader.read()  # until the proxy gives up
            return False
        if mode == "echo":
            body = json.dumps({"headers": headers}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"set-cookie: sid=upstream-secret; Path=/\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            await writer.drain()
            return False
        framing = (
            b"content-length: %d" % (sum(map(len, self.chunks)) + 1000)
            if mode == "short"
            else b"transfer-encoding: chunked"
        )
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\n%s%s\r\n\r\n"
                     % (self.content_type.encode(), self.extra_headers, framing))  # fmt: skip
        for chunk in self.chunks:
            writer.write(chunk if mode == "short" else b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()
        if mode == "chunks":
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        elif mode == "fin":
            writer.close()
            await writer.wait_closed()
        elif mode == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif mode == "stall":
            await reader.read()  # silence; returns when the proxy closes
        elif mode == "flood":
            block = b"%x\r\n%s\r\n" % (65536, b"f" * 65536)
            while True:
                writer.write(block)
                await writer.drain()
        return False


class ServedUpstream(Protocol):
    """An upstream stand-in :func:`serving` can run: a connection handler and the port it
    is given."""

    port: int

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None: ...


@contextlib.asynccontextmanager
async def serving(upstream: ServedUpstream) -> AsyncIterator[None]:
    """Serve ``upstream.handle`` on 127.0.0.1, a port the OS picks (set on
    ``upstream.port``); on exit stop listening and cancel the connections still open."""
    tasks: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await upstream.handle(reader, writer)
        finally:
            tasks.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    upstream.port = server.sockets[0].getsockname()[1]
    try:
        yield
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


@contextlib.asynccontextmanager
async def raw_upstream(**options: object) -> AsyncIterator[RawUpstream]:
    upstream = RawUpstream(**options)  # type: ignore[arg-type]
    async with serving(upstream):
        yield upstream
