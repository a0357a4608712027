"""How the shared admission store's clients reach Redis: one URL, or Redis Sentinel.

With a :class:`SentinelNodes`, every client is redis-py's ``Sentinel(...).master_for``:
its connection pool asks the sentinels for the current primary whenever it opens a
connection, so after a failover the next connection (the one after an error) goes to
the promoted replica. The data nodes' credentials, database, TLS and query options
(timeouts, TLS settings) come from the configured URL, read as redis-py reads any URL;
its host and port are not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["NO_RETRY", "SentinelNodes", "async_client", "sync_client"]

#: Retries redis-py's clients make themselves: none. The backend retries once itself
#: (``RedisBackend._run``): every script is idempotent per lease and waiter id, so a reply
#: lost with a dropped connection is safe to ask for again. Each client kind gets the
#: ``Retry`` of its own kind (redis-py warns when an asyncio client is given the blocking
#: one).
NO_RETRY = 0


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
    """The connection options of the data nodes from ``url``, as redis-py reads a URL
    (:func:`redis.connection.parse_url`: credentials, database, query options such as
    ``socket_timeout`` or ``ssl_cert_reqs``), without its host and port (the sentinels
    name the primary) and with ``ssl`` for ``rediss://``."""
    from redis import connection

    parse_url: Any = connection.parse_url  # redis-py leaves it unannotated
    options: dict[str, Any] = parse_url(url)
    for key in ("host", "port", "path", "connection_class"):
        options.pop(key, None)
    if urlsplit(url).scheme == "rediss":
        options["ssl"] = True
    return options


def _master_options(url: str, socket_timeout: float, options: dict[str, Any]) -> dict[str, Any]:
    """The primary's connection options: the caller's, then the URL's over them (as
    ``from_url`` without Sentinel does: the URL's query options win)."""
    return {"socket_timeout": socket_timeout, **options, **_data_node_options(url)}


def _sentinel_options(sentinel: SentinelNodes, timeout_s: float) -> dict[str, Any]:
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if sentinel.password:
        options["password"] = sentinel.password
    return options


def async_client(
    url: str, sentinel: SentinelNodes | None, *, socket_timeout: float, **options: Any
) -> Any:
    """An asyncio client (``redis.asyncio.Redis``) for ``url``, or for the primary the
    sentinels name. ``options`` are connection options (timeouts); the client retries
    nothing itself (:data:`NO_RETRY`), with redis-py's asyncio ``Retry``."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    options = {"retry": Retry(NoBackoff(), NO_RETRY), **options}

    if sentinel is None:
        return aioredis.from_url(url, socket_timeout=socket_timeout, **options)
    from redis.asyncio.sentinel import Sentinel

    make: Any = Sentinel  # its __init__ has no annotations
    connect_timeout = float(options.get("socket_connect_timeout", socket_timeout))
    sentinels = make(
        list(sentinel.nodes), sentinel_kwargs=_sentinel_options(sentinel, connect_timeout)
    )
    return sentinels.master_for(sentinel.master, **_master_options(url, socket_timeout, options))


def sync_client(
    url: str, sentinel: SentinelNodes | None, *, socket_timeout: float, **options: Any
) -> Any:
    """The blocking counterpart of :func:`async_client` (``redis.Redis``, with the
    blocking ``Retry``)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options = {"retry": Retry(NoBackoff(), NO_RETRY), **options}

    if sentinel is None:
        return redis.Redis.from_url(url, socket_timeout=socket_timeout, **options)
    from redis.sentinel import Sentinel

    make: Any = Sentinel  # redis-py's blocking Sentinel has no annotations
    connect_timeout = float(options.get("socket_connect_timeout", socket_timeout))
    sentinels = make(
        list(sentinel.nodes), sentinel_kwargs=_sentinel_options(sentinel, connect_timeout)
    )
    return sentinels.master_for(sentinel.master, **_master_options(url, socket_timeout, options))
