"""How a stage connection presents its reservation token (issue 26, item 8).

A token that is empty or only whitespace, or two that differ (header and query
parameter, or either twice), is a 400 ``reservation_malformed``: never "no token" and a
normal admission. The token never reaches a log line, not even the refusal line uvicorn
writes with the request's path and query.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.settings import settings_from_mapping
from tests.conftest import Proxy, proxy_settings
from tests.integration.raw_upstream import RawUpstream, raw_upstream
from tests.integration.test_ws_relay import wait_until

RESERVE = "/v1/headroom/reservations"
UPGRADE = ["connection: Upgrade", "upgrade: websocket", "sec-websocket-version: 13",
           "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ=="]  # fmt: skip


def settings(upstream: RawUpstream) -> Any:
    return proxy_settings(
        [("gpu0", upstream.url, 4)],
        [{"path": "/v1/stream", "pool": "main", "protocol": "passthrough-http"},
         {"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}],
        guard={"mode": "off"},
    )  # fmt: skip


async def raw(
    proxy: Proxy, request_line: str, lines: list[str], body: bytes = b""
) -> tuple[int, bytes]:
    """One request over a raw socket (httpx will not send a blank header value)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    head = "\r\n".join([f"{request_line} HTTP/1.1", "host: x", *lines]) + "\r\n\r\n"
    writer.write(head.encode("latin-1") + body)
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    length = int(answer.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    content = await asyncio.wait_for(reader.readexactly(length), 30)
    writer.transport.abort()
    return int(answer.split()[1]), content


async def reserve(client: httpx.AsyncClient) -> str:
    granted = await client.post(RESERVE, json={"pools": ["main"], "hold_s": 30})
    assert granted.status_code == 201, granted.text
    token: str = granted.json()["token"]
    return token


@pytest.mark.parametrize(
    ("headers", "query"),
    [
        ({"X-Headroom-Reservation": "   "}, ""),
        ({"X-Headroom-Reservation": ""}, ""),
        ({}, "?headroom_reservation=%20"),
        ({}, "?headroom_reservation="),
        ({"X-Headroom-Reservation": "   "}, "?headroom_reservation={token}"),
        ({"X-Headroom-Reservation": "{token}"}, "?headroom_reservation=other"),
        ({}, "?headroom_reservation={token}&headroom_reservation=other"),
    ],
)
async def test_a_malformed_or_conflicting_token_is_a_400(
    start_proxy: Any, headers: dict[str, str], query: str
) -> None:
    async with raw_upstream(mode="echo") as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client:
            token = await reserve(client)
            held = proxy.gate.active
            lines = [f"{k}: {v.format(token=token)}" for k, v in headers.items()]
            target = query.format(token=token)
            status, body = await raw(
                proxy, f"POST /v1/stream{target}", [*lines, "content-length: 1"], b"x"
            )
            assert status == 400, body
            assert json.loads(body)["error"]["code"] == "reservation_malformed"
            assert upstream.requests == []  # never admitted the normal way
            assert proxy.gate.active == held  # and the reservation's slot is untouched
            # the WebSocket routes refuse it the same way
            status, _ = await raw(proxy, f"GET /ws{target}", [*lines, *UPGRADE])
            assert status == 400
            # the token itself still works, presented once (or the same in both places)
            same = await client.post(f"/v1/stream?headroom_reservation={token}", content=b"x",
                                     headers={"X-Headroom-Reservation": token})  # fmt: skip
            assert same.status_code == 200, same.text
        await wait_until(lambda: proxy.gate.active == 0)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        # the gateway's own lines, not the test's clients (httpx, websockets.client)
        if record.name.startswith(("uvicorn", "headroom")):
            self.lines.append(record.getMessage() + " " + str(getattr(record, "fields", "")))


@contextlib.contextmanager
def every_line() -> Iterator[list[str]]:
    # uvicorn's own loggers may not propagate (its log config, or an earlier server's)
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "uvicorn.access")]
    handler = _Records()
    saved = [(lg.level, lg.disabled) for lg in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.disabled = False  # headroom's logging turns the access log off; not everyone
    try:
        yield handler.lines
    finally:
        for logger, (level, disabled) in zip(loggers, saved, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.disabled = disabled


async def test_the_token_never_reaches_a_log_line(start_proxy: Any) -> None:
    async with raw_upstream(mode="echo") as upstream:
        proxy: Proxy = await start_proxy(settings(upstream), access_log=True)
        with every_line() as lines:
            async with httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client:
                token = await reserve(client)
                other = await reserve(client)
                # claimed over HTTP; refused over HTTP and a WebSocket (unknown, used)
                used = await client.post(f"/v1/stream?headroom_reservation={token}",
                                         content=b"x")  # fmt: skip
                assert used.status_code == 200
                for bad in (token + "x", token, other + "x"):
                    with pytest.raises(InvalidStatus):
                        await connect(proxy.ws_url + f"/ws?headroom_reservation={bad}",
                                      compression=None)  # fmt: skip
                    refused = await client.post(f"/v1/stream?headroom_reservation={bad}",
                                                content=b"x")  # fmt: skip
                    assert refused.status_code == 409
                assert (await client.delete(f"{RESERVE}/{other}")).status_code == 200
            await wait_until(lambda: proxy.gate.active == 0)
        assert any("headroom_reservation=REDACTED" in line for line in lines), lines
        assert any(f"{RESERVE}/REDACTED" in line for line in lines), lines  # the access log
        assert not [line for line in lines if token in line or other in line]


async def test_a_malformed_token_is_a_400_even_for_a_key_at_its_quota(start_proxy: Any) -> None:
    """The key's quota is checked with the same reading of the token: a key already at
    max_sessions presenting an empty token is told the token is malformed (400), as any
    other key is, not 429 as though it presented none."""
    digest = hashlib.sha256(b"key-a").hexdigest()
    async with raw_upstream(mode="echo") as upstream:
        base = settings(upstream).model_dump(mode="json")
        base["auth"] = {"keys": [{"name": "team-a", "sha256": digest, "max_sessions": 1}]}
        proxy: Proxy = await start_proxy(settings_from_mapping(base, env={}))
        auth = "authorization: Bearer key-a"
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client:
            await reserve_as(client, "key-a")  # the key's one session: a reserved slot
            status, body = await raw(
                proxy, "POST /v1/stream", [auth, "x-headroom-reservation:  ", "content-length: 1"],
                b"x",
            )  # fmt: skip
            assert status == 400, body
            assert json.loads(body)["error"]["code"] == "reservation_malformed"


async def reserve_as(client: httpx.AsyncClient, key: str) -> str:
    granted = await client.post(RESERVE, json={"pools": ["main"], "hold_s": 30},
                                headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert granted.status_code == 201, granted.text
    token: str = granted.json()["token"]
    return token
