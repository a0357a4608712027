"""How the shared admission store's clients reach Redis: one URL, Redis Sentinel, or a
Redis Cluster.

With a :class:`SentinelNodes`, every client is redis-py's ``Sentinel(...).master_for``:
its connection pool asks the sentinels for the current primary whenever it opens a
connection, so after a failover the next connection (the one after an error) goes to
the promoted replica. The data nodes' credentials, database, TLS and query options
(timeouts, TLS settings) come from the configured URL, read as redis-py reads any URL;
its host and port are not used.

A ``redis+cluster://`` URL (``rediss+cluster://`` for TLS) names seed nodes of a Redis
Cluster, ``redis+cluster://[user:password@]host:port[,host:port...][/0][?options]``:
every client is then redis-py's cluster client (``RedisCluster``), which learns the
slot map from any reachable seed, sends each call to the primary of its keys' slot,
follows MOVED and ASK, waits out TRYAGAIN, and reloads the map after a connection error
(a primary that died and a promoted replica). Each pool's keys share one hash tag, so
each script call goes to one shard.

Through a primary's failover a cluster client's calls to that shard fail (each after
its :data:`CLUSTER_RETRIES` attempts) until the client reloads a map that names the
promoted replica. The errors of all its calls in that time ask for one reload, run by
the next call once :data:`CLUSTER_REFRESH_INTERVAL_S` has passed since the last one, so
a client learns of the promotion at most that long after it (at its next call). The
renewals try a failed pool again within their interval
(:mod:`proxy.admission.shared_renewal`), so a pool's renewals pause through a failover
for at most one renewal interval (since the last one before it), the promotion, this
interval and one retry pause with its failed call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "CLUSTER_REFRESH_INTERVAL_S",
    "CLUSTER_RETRIES",
    "CLUSTER_SCHEMES",
    "NO_RETRY",
    "ClusterNodes",
    "SentinelNodes",
    "async_client",
    "cluster_nodes",
    "sync_client",
]

#: Retries redis-py's clients make themselves: none. The backend retries once itself
#: (``RedisBackend._run``): every script is idempotent per lease and waiter id, so a reply
#: lost with a dropped connection is safe to ask for again. Each client kind gets the
#: ``Retry`` of its own kind (redis-py warns when an asyncio client is given the blocking
#: one).
NO_RETRY = 0

#: Attempts the cluster client makes after a failed one (a connection error or a
#: CLUSTERDOWN while a replica is promoted): each reloads the slot map first, so a call
#: that met a dead primary reaches the promoted replica once the cluster names it.
#: MOVED, ASK and TRYAGAIN are followed within one attempt.
CLUSTER_RETRIES = 2

#: The shortest pause between two slot-map reloads of one cluster client that errors ask
#: for (redis-py's ``topology_refresh_min_interval``); the requests in between are
#: collapsed into one. A reload costs the gateway CPU (the map of 16384 slots rebuilt in
#: Python) and every client of every gateway reloads while a shard is down: a shorter
#: pause finds a promoted replica sooner, for more of that cost each second.
CLUSTER_REFRESH_INTERVAL_S = 1.0

#: URL schemes that name a Redis Cluster's seed nodes (TLS with ``rediss+cluster``).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


@dataclass(frozen=True, slots=True)
class ClusterNodes:
    """A ``redis+cluster://`` URL read: the seed nodes, and the data nodes' connection
    options (credentials, TLS, query options) as redis-py reads them from a URL."""

    seeds: tuple[tuple[str, int], ...]
    options: dict[str, Any]

    def __repr__(self) -> str:  # never the password
        return f"ClusterNodes(seeds={list(self.seeds)!r})"


def cluster_nodes(url: str) -> ClusterNodes | None:
    """The seeds and options of a ``redis+cluster://`` URL; None for any other URL.
    Raises ValueError (never echoing the URL, which may carry a password) when it is
    malformed: no seed, a seed without a port, a database other than 0."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in CLUSTER_SCHEMES:
        return None
    rest, _, query = rest.partition("?")
    location, _, path = rest.partition("/")
    credentials, at, hosts = location.rpartition("@")
    seeds: list[tuple[str, int]] = []
    for node in hosts.split(","):
        host, colon, port = node.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("each cluster seed must be host:port (e.g. redis-0:6379)")
        seeds.append((host.strip("[]"), int(port)))
    if path not in ("", "0"):
        raise ValueError("a Redis Cluster has only database 0")
    plain = f"{'rediss' if scheme == 'rediss+cluster' else 'redis'}://"
    plain += f"{credentials}{at}{seeds[0][0]}:{seeds[0][1]}/0"
    options = _data_node_options(plain + (f"?{query}" if query else ""))
    options.pop("db", None)  # a cluster client takes no database
    return ClusterNodes(tuple(seeds), options)


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


def _cluster_backoff() -> Any:
    """The pause before a cluster client's next attempt: short and growing, so a
    promotion that takes a moment is waited for without holding a call for long."""
    from redis.backoff import ExponentialBackoff

    return ExponentialBackoff(cap=0.2, base=0.05)


def _sentinel_options(sentinel: SentinelNodes, timeout_s: float) -> dict[str, Any]:
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if sentinel.password:
        options["password"] = sentinel.password
    return options


def async_client(
    url: str, sentinel: SentinelNodes | None, *, socket_timeout: float, **options: Any
) -> Any:
    """An asyncio client (``redis.asyncio.Redis``) for ``url``, or for the primary the
    sentinels name, or a cluster client (``redis.asyncio.cluster.RedisCluster``) for a
    ``redis+cluster://`` URL. ``options`` are connection options (timeouts); a plain or
    Sentinel client retries nothing itself (:data:`NO_RETRY`), a cluster client
    :data:`CLUSTER_RETRIES` times, with redis-py's asyncio ``Retry``."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    cluster = cluster_nodes(url)
    if cluster is not None:
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        make_cluster: Any = RedisCluster  # its __init__ is only partly annotated
        return make_cluster(
            startup_nodes=[ClusterNode(host, port) for host, port in cluster.seeds],
            require_full_coverage=False,
            retry=Retry(_cluster_backoff(), CLUSTER_RETRIES),
            topology_refresh_min_interval=CLUSTER_REFRESH_INTERVAL_S,
            **{"socket_timeout": socket_timeout, **options, **cluster.options},
        )
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
    """The blocking counterpart of :func:`async_client` (``redis.Redis`` or
    ``redis.cluster.RedisCluster``, with the blocking ``Retry``)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    cluster = cluster_nodes(url)
    if cluster is not None:
        from redis.cluster import ClusterNode, RedisCluster

        make_cluster: Any = RedisCluster  # its __init__ is only partly annotated
        make_node: Any = ClusterNode  # unannotated
        return make_cluster(
            startup_nodes=[make_node(host, port) for host, port in cluster.seeds],
            require_full_coverage=False,
            retry=Retry(_cluster_backoff(), CLUSTER_RETRIES),
            topology_refresh_min_interval=CLUSTER_REFRESH_INTERVAL_S,
            **{"socket_timeout": socket_timeout, **options, **cluster.options},
        )
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
