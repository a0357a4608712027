"""Shared admission state in Redis: leases, the cross-gateway FIFO, the data generation.

A thin client over the atomic Lua scripts of ``proxy/admission/lua``, loaded once and
called by their SHA (redis-py's ``register_script``: EVALSHA, falling back to EVAL
only when the server lost its script cache). It holds no admission state of its own;
the asyncio shell :class:`proxy.admission.shared_gate.SharedGate` keeps the gateway's side.

Model, per pool (every key under the hash tag ``{pool}`` so one script touches one
Redis Cluster slot; a ``redis+cluster://`` URL makes the clients redis-py's cluster
clients, :mod:`proxy.admission.redis_clients`, and each pool's calls go to its shard):

* a **lease** per admitted session, with an expiry on Redis's own clock (``TIME``
  inside the scripts), extended by the owning gateway's batched renewals; an expired
  lease gives its slot back, so a crashed gateway's slots return within one TTL plus
  one renewal interval;
* a **queue** of waiters from every gateway, each kept alive by heartbeats; a freed
  slot is handed to the waiter served next inside the release script (no barging) and
  its gateway is woken by a push onto its wake list, which it reads with ``BLPOP``;
* **tenants**: each waiter and lease carries its key's class, weight,
  ``max_queued`` and name; the scripts apply the rules of
  :mod:`proxy.admission.tenants` (class first, fair share by session-seconds, FIFO
  within a lane, reserves, ``max_queued``, shedding a sheddable waiter, which its
  gateway hears through its wake list as ``<waiter> !preempted_in_queue <position>``).
  With no tenant fields anywhere the queue is the plain FIFO;
* a **generation**: when Redis has lost its data, the first script to run starts a
  new generation and grants are blocked for one TTL while surviving gateways
  re-assert their live leases in their next renewal.

The placement rule is the pure core's (``PoolCore._pick``): least-loaded healthy,
unguarded replica with a free slot, ties to the first configured.

Every Redis failure surfaces as :class:`BackendUnavailable`; callers refuse new
sessions (``backend_unavailable``) rather than fall back to per-process caps.
"""

from __future__ import annotations

import importlib.resources
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.admission.redis_clients import (
    SentinelNodes,
    async_client,
    cluster_nodes,
    sync_client,
)
from proxy.admission.tenants import ANONYMOUS, Reserve, TenantSpec

__all__ = [
    "Acquired",
    "BackendUnavailable",
    "LeaseRenewer",
    "RedisAdmission",
    "ReplicaView",
    "TickResult",
    "redis_available",
]

_SCRIPTS = ("acquire", "release", "leave", "renew", "relocate", "hold", "withdraw")
#: Fragments a script needs after common.lua (Redis scripts cannot ``require``: each
#: is loaded as the concatenation).
_FRAGMENTS = {"acquire": ("newcomer",), "hold": ("newcomer",)}
_KEYS = (
    "leases", "owner", "held", "queue", "beats", "gen", "seq", "flags", "tw", "lanes", "run",
    "shed", "gone", "moving",
)  # fmt: skip


class BackendUnavailable(Exception):
    """Redis could not be reached or did not answer in time."""


def redis_available() -> bool:
    """Whether the ``redis`` package (the ``headroom-proxy[redis]`` extra) is installed."""
    try:
        import redis.asyncio  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What this gateway knows of one replica: it is configured, healthy and not
    retired (others are left out of the view), its cap, and whether its own guard
    holds it."""

    name: str
    cap: int
    guarded: bool = False


@dataclass(frozen=True, slots=True)
class Acquired:
    """The answer to one acquire: ``kind`` is ``admit`` (``value`` the replica),
    ``queued`` (``value`` the position), ``reject`` (``value`` the reason; ``position``
    where the newcomer would have stood, for its Retry-After) or ``blocked`` (``value``
    ms until grants resume)."""

    kind: str
    value: str | int
    position: int = 1


@dataclass(frozen=True, slots=True)
class TickResult:
    """The answer to one renewal tick of one pool."""

    generation: str
    #: This gateway's leases that Redis no longer holds (expired: the gateway was
    #: cut off or paused past the TTL). Their sessions must end.
    lost: tuple[str, ...]
    #: Per waiter sent: its queue position (1 = served next), 0 if a slot was handed to
    #: it, -2 if it was refused ``preempted_in_queue``, -1 if Redis no longer knows it
    #: (its heartbeat lapsed, or data was lost).
    waiters: tuple[int, ...]
    #: Sessions held per replica, counted over every gateway.
    held: dict[str, int]
    queue_depth: int
    #: How long grants stay blocked (a new generation: Redis lost its data), seconds.
    blocked_s: float = 0.0


def _redis_errors() -> tuple[type[BaseException], ...]:
    """What a failed call to Redis raises, of any client kind (a cluster client's
    slot-map errors too)."""
    from redis import exceptions

    return (exceptions.RedisError, exceptions.RedisClusterException, OSError, TimeoutError)


def _connection_errors() -> tuple[type[BaseException], ...]:
    from redis import exceptions

    return (exceptions.ConnectionError,)


def _load(name: str) -> str:
    return (importlib.resources.files("proxy.admission") / "lua" / f"{name}.lua").read_text()


def _pool_script(name: str) -> str:
    """The source of pool script ``name``: common.lua, the fragments it shares with
    other scripts (:data:`_FRAGMENTS`), then its own."""
    return "\n".join(_load(part) for part in ("common", *_FRAGMENTS.get(name, ()), name))


def _view_args(view: Sequence[ReplicaView]) -> list[str | int]:
    args: list[str | int] = []
    for r in view:
        args += [r.name, r.cap, 1 if r.guarded else 0]
    return args


def _tenant_args(tenant: TenantSpec) -> list[str | int]:
    return [
        tenant.priority,
        "-" if tenant.weight is None else repr(float(tenant.weight)),
        "-" if tenant.max_queued is None else tenant.max_queued,
        tenant.name,
    ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisAdmission:
    """The Redis side of shared admission for one gateway process.

    ``gateway_id`` names this process in lease and waiter ids (``<gateway>:<n>``); it
    must be unique among live gateways (the default is host, pid and random bits).
    ``clock_ms`` is for tests only: the scripts take their time from it instead of
    Redis ``TIME`` (a fake clock, or the differential test against ``PoolCore``).
    ``address_remap`` (a Redis Cluster only) maps each node address the cluster
    announces to the one this process connects to (address translation between them;
    the tests' partition of one shard)."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "headroom:",
        lease_ttl_s: float = 10.0,
        heartbeat_ttl_s: float = 3.0,
        timeout_s: float = 1.0,
        gateway_id: str | None = None,
        clock_ms: Callable[[], int] | None = None,
        sentinel: SentinelNodes | None = None,
        address_remap: Callable[[tuple[str, int]], tuple[str, int]] | None = None,
    ) -> None:
        try:
            import redis.asyncio  # noqa: F401
        except ImportError as exc:  # pragma: no cover - exercised by the CLI check
            raise RuntimeError(
                "admission.backend: redis needs the 'redis' package: "
                "pip install 'headroom-proxy[redis]'"
            ) from exc
        if lease_ttl_s <= 0 or heartbeat_ttl_s <= 0 or timeout_s <= 0:
            raise ValueError("lease_ttl_s, heartbeat_ttl_s and timeout_s must be > 0")
        self.key_prefix = key_prefix
        self._url = url
        self._sentinel = sentinel
        #: Whether the store is a Redis Cluster (a ``redis+cluster://`` URL).
        self.cluster = cluster_nodes(url) is not None
        self.ttl_ms = round(lease_ttl_s * 1000)
        self.beat_ms = round(heartbeat_ttl_s * 1000)
        self.timeout_s = timeout_s
        host = "".join(c if c.isalnum() or c in "-._" else "-" for c in socket.gethostname())
        self.gateway_id = gateway_id or f"{host}-{os.getpid()}-{os.urandom(3).hex()}"
        if not self.gateway_id or any(c in self.gateway_id for c in ":=, "):
            raise ValueError(f"gateway id {self.gateway_id!r}: must be non-empty, without ':=, '")
        common: dict[str, Any] = dict(
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
        )
        if address_remap is not None:
            if not self.cluster:
                raise ValueError("address_remap applies to a redis+cluster:// URL only")
            common["address_remap"] = address_remap
        self._remap = address_remap
        self._client: Any = async_client(url, sentinel, socket_timeout=timeout_s, **common)
        # BLPOP holds its connection while it blocks: a client of its own, whose socket
        # timeout outlasts the longest block. With a cluster, it is sent to the shard of
        # the wake list's slot (the pool's), so each pool's wake-ups follow its shard.
        self._blocking: Any = async_client(url, sentinel, socket_timeout=timeout_s + 5.0,
                                           **common)  # fmt: skip
        self._closed = False
        self._clock_ms = clock_ms
        self._schedule: dict[str, tuple[float, tuple[Reserve, ...]]] = {}
        self._scripts = {
            name: self._client.register_script(_pool_script(name)) for name in _SCRIPTS
        }
        # Not a pool script: its keys are the tenants' (no prelude).
        self._tenants = self._client.register_script(_load("tenants"))
        # Gang reservations: the tenants' hash tag too (a reservation counts in its
        # key's quota).
        self._reservations = self._client.register_script(_load("reservations"))
        self._errors = _redis_errors()
        # A cluster client retries a dropped connection itself (after reloading the
        # slot map); a plain one gets one more try here.
        self._connection_errors = () if self.cluster else _connection_errors()

    # -- keys -------------------------------------------------------------------------

    def prefix(self, pool: str) -> str:
        return f"{self.key_prefix}{{{pool}}}:"

    def keys(self, pool: str) -> list[str]:
        p = self.prefix(pool)
        return [p + k for k in _KEYS]

    def wake_key(self, pool: str) -> str:
        return f"{self.prefix(pool)}wake:{self.gateway_id}"

    def slot(self, pool: str) -> int:
        """The Redis Cluster hash slot of every key of ``pool`` (its hash tag's)."""
        from redis.crc import key_slot

        return int(key_slot(self.prefix(pool).encode()))

    def configure_pool(
        self, pool: str, *, session_estimate_s: float = 20.0, reserves: Sequence[Reserve] = ()
    ) -> None:
        """The pool's scheduling context, sent with every script call: the seed of its
        mean session length and its reserves (every gateway has the same
        configuration)."""
        self._schedule[pool] = (session_estimate_s, tuple(reserves))

    def _context(self, pool: str) -> list[str | int]:
        estimate, reserves = self._schedule.get(pool, (20.0, ()))
        args: list[str | int] = [
            "" if self._clock_ms is None else self._clock_ms(), repr(float(estimate)),
            len(reserves),
        ]  # fmt: skip
        for r in reserves:
            args += [r.priority, r.slots, r.per_replica]
        return args

    # -- scripts ----------------------------------------------------------------------

    async def _run(self, script: str, pool: str, args: list[str | int]) -> Any:
        return await self._call(self._scripts[script], self.keys(pool), args)

    async def _call(self, script: Any, keys: list[str], args: list[str | int]) -> Any:
        """``script`` on ``keys`` with ``args``, once more on a new connection when the
        first one was dropped; :class:`BackendUnavailable` when Redis does not answer."""
        if self._closed:
            raise BackendUnavailable("admission store client closed")
        try:
            try:
                return await script(keys=keys, args=args)
            except self._connection_errors:  # a pooled connection the server dropped
                return await script(keys=keys, args=args)
        except self._errors as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def tenant_key(self, tenant: str) -> str:
        """A tenant's reservations: under one hash tag for every tenant, apart from the
        pools' (a tenant's quota spans pools)."""
        return f"{self.key_prefix}{{tenants}}:{tenant}"

    async def _run_tenants(self, keys: list[str], args: list[str | int]) -> Any:
        return await self._call(self._tenants, keys, args)

    async def reserve_tenant(self, tenant: str, reservation_id: str, max_sessions: int) -> bool:
        """Count one session of ``tenant`` over every gateway, unless it already holds
        ``max_sessions`` (False). Idempotent per ``reservation_id``."""
        args: list[str | int] = ["reserve", reservation_id, max_sessions, self.ttl_ms]
        reply = await self._run_tenants([self.tenant_key(tenant)], args)
        return _text(reply[0]) == "ok"

    async def release_tenant(self, tenant: str, reservation_id: str) -> bool:
        """Stop counting one session; idempotent (False if it was not counted)."""
        args: list[str | int] = ["release", reservation_id]
        return bool(await self._run_tenants([self.tenant_key(tenant)], args))

    async def renew_tenants(self, reservations: Sequence[tuple[str, str]]) -> int:
        """Extend ``(tenant, reservation id)`` pairs by one lease TTL, re-adding any that
        expired or were lost; one round trip. Returns how many were renewed."""
        by_tenant: dict[str, list[str]] = {}
        for tenant, reservation_id in reservations:
            by_tenant.setdefault(tenant, []).append(reservation_id)
        if not by_tenant:
            return 0
        args: list[str | int] = ["renew", self.ttl_ms]
        for ids in by_tenant.values():
            args += [len(ids), *ids]
        keys = [self.tenant_key(tenant) for tenant in by_tenant]
        return int(await self._run_tenants(keys, args))

    async def tenant_active(self, tenant: str) -> int:
        """Sessions ``tenant`` holds over every gateway (unexpired reservations)."""
        return int(await self._run_tenants([self.tenant_key(tenant)], ["active"]))

    # -- gang reservations (reservations.lua, hold.lua) ---------------------------------

    def reservation_keys(self, digest: str, key: str) -> list[str]:
        """The keys of reservations.lua: the reservation (by the token's digest), the
        key's live reservations, the key's quota set."""
        tag = f"{self.key_prefix}{{tenants}}:"
        return [f"{tag}r:{digest}", f"{tag}live:{key}", self.tenant_key(key)]

    async def reservation(self, digest: str, key: str, args: Sequence[str | int]) -> list[Any]:
        """One operation of reservations.lua (``args`` from its op on); the reply with
        its strings decoded."""
        keys = self.reservation_keys(digest, key)
        reply = await self._call(self._reservations, keys, list(args))
        if not isinstance(reply, list):
            return [reply]
        return [x if isinstance(x, int) else _text(x) for x in reply]

    async def hold(
        self,
        pool: str,
        lease_id: str,
        hold_s: float,
        view: Sequence[ReplicaView],
        tenant: TenantSpec | None = None,
    ) -> Acquired:
        """A slot for a gang reservation now or never, held ``hold_s`` without renewal
        (hold.lua). ``admit`` (the replica), ``reject`` (the reason) or ``blocked``."""
        args: list[str | int] = [lease_id, self.ttl_ms, round(hold_s * 1000), self.prefix(pool)]
        args += [*self._context(pool), *_tenant_args(tenant or ANONYMOUS)]
        reply = await self._run("hold", pool, [*args, *_view_args(view)])
        kind = _text(reply[0])
        value = reply[1]
        position = int(reply[2]) if len(reply) > 2 else 1
        return Acquired(kind, value if isinstance(value, int) else _text(value), position)

    async def acquire(
        self, pool: str, lease_id: str, view: Sequence[ReplicaView], max_depth: int
    ) -> tuple[str, str | int]:
        """Take a slot for ``lease_id`` (no tenant fields). Returns ``('admit', replica)``,
        ``('queued', position)``, ``('reject', reason)`` or ``('blocked', ms)``."""
        got = await self.acquire_as(pool, lease_id, view, max_depth)
        return got.kind, got.value

    async def acquire_as(
        self,
        pool: str,
        lease_id: str,
        view: Sequence[ReplicaView],
        max_depth: int,
        tenant: TenantSpec | None = None,
    ) -> Acquired:
        """Take a slot for ``lease_id``, a session of ``tenant`` (None: no key)."""
        args: list[str | int] = [lease_id, self.ttl_ms, self.prefix(pool), max_depth]
        args += [self.beat_ms, *self._context(pool), *_tenant_args(tenant or ANONYMOUS)]
        reply = await self._run("acquire", pool, [*args, *_view_args(view)])
        kind = _text(reply[0])
        value = reply[1]
        position = int(reply[2]) if len(reply) > 2 else 1
        return Acquired(kind, value if isinstance(value, int) else _text(value), position)

    async def release(self, pool: str, lease_id: str, view: Sequence[ReplicaView]) -> bool:
        """Drop ``lease_id`` and hand its slot to the head waiter. Idempotent: returns
        False if the lease was already gone."""
        args: list[str | int] = [lease_id, self.ttl_ms, self.prefix(pool), *self._context(pool)]
        return bool(await self._run("release", pool, [*args, *_view_args(view)]))

    async def relocate(
        self,
        pool: str,
        lease_id: str,
        current: str,
        view: Sequence[ReplicaView],
        exclude: Sequence[str] = (),
    ) -> tuple[str, str | None]:
        """Failover before the first byte: move ``lease_id`` off ``current`` to another
        replica of ``view`` with a free slot, not one in ``exclude``. Returns
        ``('moved', replica)``, ``('stay', current)`` (nowhere to go; the lease is
        unchanged) or ``('gone', None)`` (the lease expired). Idempotent."""
        args: list[str | int] = [lease_id, self.ttl_ms, self.prefix(pool), current]
        args += [len(exclude), *exclude, *self._context(pool), *_view_args(view)]
        reply = await self._run("relocate", pool, args)
        kind = _text(reply[0])
        return kind, (_text(reply[1]) if len(reply) > 1 else None)

    async def leave(
        self, pool: str, waiter_id: str, view: Sequence[ReplicaView]
    ) -> tuple[str, str | None]:
        """Take a waiter out of the queue: ``('left', None)``, ``('granted', replica)``
        if a slot reached it first (it now holds a lease), ``('shed', None)`` if it was
        refused ``preempted_in_queue``, or ``('gone', None)``."""
        args: list[str | int] = [waiter_id, self.ttl_ms, self.prefix(pool), *self._context(pool)]
        reply = await self._run("leave", pool, [*args, *_view_args(view)])
        kind = _text(reply[0])
        return kind, (_text(reply[1]) if len(reply) > 1 else None)

    async def withdraw(self, pool: str, lease_id: str, view: Sequence[ReplicaView]) -> str:
        """Give back whatever an acquire or hold of ``lease_id`` took, whether it ran
        before this call or runs after it (withdraw.lua): ``'left'``, ``'released'``,
        ``'shed'`` or ``'gone'`` (it held nothing)."""
        args: list[str | int] = [lease_id, self.ttl_ms, self.prefix(pool), *self._context(pool)]
        return _text(await self._run("withdraw", pool, [*args, *_view_args(view)]))

    async def tick(
        self,
        pool: str,
        *,
        generation: str,
        view: Sequence[ReplicaView],
        leases: Sequence[tuple[str, str]],
        waiters: Sequence[str],
        guards: Sequence[str],
        guard_ttl_s: float,
    ) -> TickResult:
        """Renew ``leases`` ((id, replica) pairs), beat for ``waiters``, refresh the
        guard flags of ``guards`` and hand out slots freed by expiry -- one round trip."""
        args: list[str | int] = [
            self.ttl_ms, self.prefix(pool), self.beat_ms, generation, round(guard_ttl_s * 1000),
            self.gateway_id, *self._context(pool),
        ]  # fmt: skip
        view_args = _view_args(view)
        args += [len(view_args), *view_args, len(leases)]
        for lease_id, replica in leases:
            args += [lease_id, replica]
        args += [len(waiters), *waiters, len(guards), *guards]
        reply = await self._run("renew", pool, args)
        held_flat = reply[3]
        held = {_text(held_flat[i]): int(held_flat[i + 1]) for i in range(0, len(held_flat), 2)}
        return TickResult(
            generation=_text(reply[0]),
            lost=tuple(_text(x) for x in reply[1]),
            waiters=tuple(int(x) for x in reply[2]),
            held=held,
            queue_depth=int(reply[4]),
            blocked_s=int(reply[5]) / 1000,
        )

    async def wakeups(self, pool: str, block_s: float) -> list[tuple[str, str]]:
        """Wait up to ``block_s`` for slots handed to this gateway's waiters; returns
        (waiter id, replica) pairs, everything pending at once. A waiter refused in the
        queue comes as (waiter id, ``!<reason> <position>``)."""
        key = self.wake_key(pool)
        if self._closed:
            raise BackendUnavailable("admission store client closed")
        try:
            first = await self._blocking.blpop([key], timeout=block_s)
            if first is None:
                return []
            items = [first[1]]
            rest = await self._blocking.lpop(key, 1000)
            items += rest or []
        except self._errors as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc
        out = []
        for item in items:
            waiter, _, replica = _text(item).partition(" ")
            out.append((waiter, replica))
        return out

    def lease_renewer(self) -> LeaseRenewer:
        """A blocking client of its own running ``keep.lua``, for the lease keeper's
        thread (:mod:`proxy.admission.lease_keeper`): it shares nothing with this
        object's asyncio clients, so it works while the event loop is blocked."""
        client: Any = sync_client(
            self._url,
            self._sentinel,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            health_check_interval=30,
            **({} if self._remap is None else {"address_remap": self._remap}),
        )
        script = client.register_script(_pool_script("keep"))
        return LeaseRenewer(
            client, script, self.keys, self.ttl_ms, self._clock_ms, cluster=self.cluster
        )

    async def ping(self) -> None:
        try:
            try:
                await self._client.ping()
            except self._connection_errors:
                await self._client.ping()
        except self._errors as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        """Close both clients; any call after this raises :class:`BackendUnavailable`
        without opening a connection."""
        self._closed = True
        await self._client.aclose()
        await self._blocking.aclose()

    def __repr__(self) -> str:
        return f"<RedisAdmission gateway={self.gateway_id} prefix={self.key_prefix!r}>"


class LeaseRenewer:
    """``keep.lua`` over a blocking Redis connection: extends leases this gateway still
    holds (``keep``), from a thread (or a process) that does not need the event loop,
    and hands back a dead gateway's leases (``lapse``). Made by
    :meth:`RedisAdmission.lease_renewer`; one thread uses it at a time. With a Redis
    Cluster each pool's call goes to the primary of the pool's slot, so the pools of
    one shard are renewed while another shard is out of reach (each unreachable
    shard's pools cost up to the client's timeout per round)."""

    def __init__(
        self,
        client: Any,
        script: Any,
        keys: Callable[[str], list[str]],
        ttl_ms: int,
        clock_ms: Callable[[], int] | None = None,
        *,
        cluster: bool = False,
    ) -> None:
        self._client = client
        self._keys = keys
        self._ttl_ms = ttl_ms
        self._clock_ms = clock_ms
        self._script = script
        self._errors = _redis_errors()
        self._connection_errors = () if cluster else _connection_errors()

    def _call(self, pool: str, args: list[str | int]) -> Any:
        keys = self._keys(pool)
        try:
            try:
                return self._script(keys=keys, args=args)
            except self._connection_errors:  # a pooled connection the server dropped
                return self._script(keys=keys, args=args)
        except self._errors as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def keep(self, pool: str, generation: str, lease_ids: Sequence[str]) -> tuple[str, ...] | None:
        """Extend ``lease_ids`` of ``pool`` by one lease TTL where Redis still holds them
        unexpired. Returns the ids it did not find (expired or gone), or None when the
        data generation is not ``generation`` (nothing was extended). Raises
        :class:`BackendUnavailable` when Redis cannot be reached in time."""
        clock = "" if self._clock_ms is None else self._clock_ms()
        reply = self._call(pool, ["keep", self._ttl_ms, generation, clock, *lease_ids])
        if _text(reply[0]) != "ok":
            return None
        return tuple(_text(x) for x in reply[1])

    def lapse(self, pool: str, lease_ids: Sequence[str]) -> int:
        """Mark ``lease_ids`` of ``pool`` expired now where Redis still holds them, for a
        gateway that has died (the next script on the pool frees their slots). Returns
        how many it marked. Raises :class:`BackendUnavailable` when Redis cannot be
        reached in time."""
        clock = "" if self._clock_ms is None else self._clock_ms()
        reply = self._call(pool, ["lapse", self._ttl_ms, "", clock, *lease_ids])
        return len(lease_ids) - len(reply[1])

    def close(self) -> None:
        self._client.close()
