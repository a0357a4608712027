"""How the shared admission store's clients reach Redis: one URL, or Redis Sentinel.

With a :class:`SentinelNodes`, every client is redis-py's ``Sentinel(...).master_for``:
its connection pool asks the sentinels for the current primary whenever it opens a
connection, so after a failover the next connection (the one after an error) goes to
the promoted replica. The data nodes' credentials, database and TLS come from the
configured URL; its host and port are not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["SentinelNodes", "async_client", "sync_client"]


@dataclass(frozen=True, slots=True)
class SentinelNodes:
    """The sentinels to ask and the name of the primary they watch."""

    master: str
    nodes: tuple[tuple[str, int], ...]
    password: str | None = None

    @classmethod
    def parse(cls, master: str, nodes: list[str], password: str | None) -> SentinelNodes:
        pairs = []
        for node in nodes:
            host, _, port = node.rpartition(":")
            pairs.append((host.strip("[]"), int(port)))
        return cls(master, tuple(pairs), password)

    def __repr__(self) -> str:  # never the password
        return f"SentinelNodes(master={self.master!r}, nodes={list(self.nodes)!r})"


def _data_node_options(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    options: dict[str, Any] = {}
    if parts.username:
        options["username"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    db = parts.path.lstrip("/")
    if db:
        options["db"] = int(db)
    if parts.scheme == "rediss":
        options["ssl"] = True
    return options


def _sentinel_options(sentinel: SentinelNodes, timeout_s: float) -> dict[str, Any]:
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if sentinel.password:
        options["password"] = sentinel.password
    return options


def async_client(
    url: str, sentinel: SentinelNodes | None, *, socket_timeout: float, **options: Any
) -> Any:
    """An asyncio client (``redis.asyncio.Redis``) for ``url``, or for the primary the
    sentinels name. ``options`` are connection options (timeouts, retry)."""
    import redis.asyncio as aioredis

    if sentinel is None:
        return aioredis.from_url(url, socket_timeout=socket_timeout, **options)
    from redis.asyncio.sentinel import Sentinel

    make: Any = Sentinel  # its __init__ has no annotations
    connect_timeout = float(options.get("socket_connect_timeout", socket_timeout))
    sentinels = make(
        list(sentinel.nodes), sentinel_kwargs=_sentinel_options(sentinel, connect_timeout)
    )
    return sentinels.master_for(
        sentinel.master, socket_timeout=socket_timeout, **_data_node_options(url), **options
    )


def sync_client(
    url: str, sentinel: SentinelNodes | None, *, socket_timeout: float, **options: Any
) -> Any:
    """The blocking counterpart of :func:`async_client` (``redis.Redis``)."""
    import redis

    if sentinel is None:
        return redis.Redis.from_url(url, socket_timeout=socket_timeout, **options)
    from redis.sentinel import Sentinel

    make: Any = Sentinel  # redis-py's blocking Sentinel has no annotations
    connect_timeout = float(options.get("socket_connect_timeout", socket_timeout))
    sentinels = make(
        list(sentinel.nodes), sentinel_kwargs=_sentinel_options(sentinel, connect_timeout)
    )
    return sentinels.master_for(
        sentinel.master, socket_timeout=socket_timeout, **_data_node_options(url), **options
    )
