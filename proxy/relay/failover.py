"""Connecting a session to its pool's replicas: bounded failover, honest ejection.

Shared by both relays. The rules:

* **Each replica at most once per session** (:class:`Failover`): a session moves on
  only to a replica it has not tried, so no session can cycle between replicas while
  the background health re-check restores them.
* **Only an unreachable replica is ejected**: a TCP connect that is refused or does not
  complete within ``limits.upstream_connect_timeout_s`` (:func:`open_tcp` or
  :func:`open_tcp_transport`, which raise :class:`Unreachable`). Anything after the
  connection is up -- a 4xx, a 5xx, a broken or unanswered handshake, a connection
  closed on our request -- may be caused by the request itself, so it never ejects:
  one client must not be able to empty a pool.
* **One overall deadline** bounds a session's whole set-up (every attempt together);
  the relay enforces it on the injected clock.
* **One walk for both relays** (:func:`walk`): a relay gives one attempt at the
  lease's current replica, which returns the connection or raises
  :class:`AttemptFailed` (what went wrong, whether it ejects, whether it is final);
  the walk counts the failure, logs it, and moves on or gives up with
  :class:`~proxy.errors.UpstreamConnectError`.
* **Failures have names**: :func:`describe` never returns an empty string, so a log
  line or close reason built from an exception (``TimeoutError()`` has no message)
  always says what happened.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from proxy.clock import Clock, clock_timeout
from proxy.errors import UpstreamConnectError

if TYPE_CHECKING:
    from proxy.admission.session_lease import Lease

__all__ = [
    "AttemptFailed",
    "Failover",
    "Unreachable",
    "describe",
    "open_tcp",
    "open_tcp_transport",
    "walk",
]

T = TypeVar("T")
P = TypeVar("P", bound=asyncio.BaseProtocol)


def describe(exc: BaseException) -> str:
    """``str(exc)``, or the exception's class name when that is empty."""
    return str(exc) or type(exc).__name__


class Unreachable(Exception):
    """The replica's TCP port refused us, or did not accept within the connect
    timeout: the one failure that ejects a replica."""


async def open_tcp(host: str, port: int, *, clock: Clock, timeout: float) -> socket.socket:
    """A connected non-blocking TCP socket to ``host:port`` (each resolved address in
    turn), within ``timeout`` seconds on ``clock``. Raises :class:`Unreachable`."""
    loop = asyncio.get_running_loop()  # once: it costs a getpid()
    connect = functools.partial(_connected_socket, loop)
    return await _first_connect(loop, host, port, connect, clock=clock, timeout=timeout)


async def open_tcp_transport(
    host: str,
    port: int,
    factory: Callable[[], P],
    *,
    clock: Clock,
    timeout: float,
    loop: asyncio.AbstractEventLoop | None = None,
) -> tuple[asyncio.Transport, P]:
    """:func:`open_tcp`'s connect (each resolved address in turn, within ``timeout``
    seconds on ``clock``, :class:`Unreachable` otherwise), but the event loop makes
    the socket and connects it: a plain TCP transport with ``factory()``'s protocol.
    On uvloop that is libuv's own connect; a socket of ours handed over afterwards
    costs a Python socket, a poll handle made and dropped for the writability wait
    and a second hand-over (13 more system calls per connect, about 25 us of CPU).
    An IPv6 address with a scope id still goes through a socket of ours, connected as
    :func:`open_tcp` does (a host string would lose the scope). ``loop``: the running
    loop, if the caller has it (looking it up costs a getpid())."""
    if loop is None:
        loop = asyncio.get_running_loop()

    async def connect(
        family: int, kind: int, proto: int, address: Any
    ) -> tuple[asyncio.Transport, P]:
        if len(address) == 4 and address[3]:  # IPv6 with a scope id
            sock = await _connected_socket(loop, family, kind, proto, address)
            try:
                return await loop.create_connection(factory, sock=sock)
            except BaseException:
                sock.close()
                raise
        return await loop.create_connection(
            factory, str(address[0]), int(address[1]), family=family, proto=proto
        )

    return await _first_connect(loop, host, port, connect, clock=clock, timeout=timeout)


async def _first_connect(
    loop: asyncio.AbstractEventLoop,
    host: str,
    port: int,
    connect: Callable[[int, int, int, Any], Awaitable[T]],
    *,
    clock: Clock,
    timeout: float,
) -> T:
    """The connect rules of :func:`open_tcp` and :func:`open_tcp_transport`:
    ``connect(family, kind, proto, address)`` for each resolved address of
    ``host:port`` in turn until one does not raise :class:`OSError`, all within
    ``timeout`` seconds on ``clock``; :class:`Unreachable` when none connects."""
    try:
        async with clock_timeout(clock, timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            error: OSError = OSError(f"no address for {host}")
            for family, kind, proto, _, address in infos:
                try:
                    return await connect(family, kind, proto, address)
                except OSError as exc:
                    error = exc
            raise error
    except TimeoutError as exc:
        raise Unreachable(f"no TCP connection within {timeout:g} s (TimeoutError)") from exc
    except OSError as exc:
        raise Unreachable(describe(exc)) from exc


async def _connected_socket(
    loop: asyncio.AbstractEventLoop, family: int, kind: int, proto: int, address: Any
) -> socket.socket:
    """A non-blocking socket connected to the resolved ``address`` (closed if that
    fails or is cancelled)."""
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        await _connect(loop, sock, address)
    except BaseException:
        sock.close()
        raise
    return sock


async def _connect(loop: asyncio.AbstractEventLoop, sock: socket.socket, address: Any) -> None:
    """Connect the non-blocking ``sock`` to the resolved ``address``: what
    ``loop.sock_connect`` does, without resolving the address again. uvloop's
    sock_connect resolves even a numeric address, with no socket type, which takes
    libuv's thread pool (a thread round trip and three results per connect, about 50 us
    of wall time on a quiet machine); :func:`open_tcp` has resolved it already."""
    try:
        sock.connect(address)
        return
    except (BlockingIOError, InterruptedError):
        pass
    fd = sock.fileno()
    writable: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not writable.done():
            writable.set_result(None)

    loop.add_writer(fd, ready)
    try:
        await writable
    finally:
        loop.remove_writer(fd)
    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if error:
        raise OSError(error, f"Connect call failed {address}")


class Failover:
    """One session's walk over its pool's replicas, starting at the lease's."""

    __slots__ = ("lease", "tried")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.tried = {lease.replica}

    async def next(self, *, eject: bool) -> bool:
        """Leave the lease's replica (ejecting it if ``eject``: it was unreachable) for
        another with a free slot that this session has not tried. False if there is
        none; the lease then still holds a slot, to be released as usual."""
        if not await self.lease.fail_over(eject=eject, exclude=self.tried):
            return False
        self.tried.add(self.lease.replica)
        return True

    def __repr__(self) -> str:
        return f"<Failover {self.lease!r} tried={sorted(self.tried)}>"


class AttemptFailed(Exception):
    """One connect attempt at one replica failed. ``kind`` is the upstream-error label
    counted against the replica; ``eject``: the replica is unreachable (take it out of
    placement); ``final``: the request itself was refused, so another replica would
    refuse it too -- give up without failing over."""

    def __init__(self, reason: str, *, kind: str, eject: bool = False, final: bool = False):
        super().__init__(reason)
        self.reason, self.kind, self.eject, self.final = reason, kind, eject, final


async def walk(
    lease: Lease,
    attempt: Callable[[], Awaitable[T]],
    *,
    count: Callable[[str, str, str], None],
    moved: Callable[[str], None],
    log: logging.Logger,
) -> T:
    """``attempt()`` at the lease's replica, then at each other replica with a free
    slot this session has not tried (:class:`Failover`), until one succeeds. Every
    failure is counted (``count(pool, replica, kind)``) and logged; ``moved(replica)``
    after each move. Raises :class:`~proxy.errors.UpstreamConnectError` naming the last
    replica tried when none is left, or at once for a final failure; the lease still
    holds a slot then, released as usual."""
    failover = Failover(lease)
    while True:
        try:
            return await attempt()
        except AttemptFailed as failed:
            failed_replica = lease.replica
            count(lease.pool, failed_replica, failed.kind)
            error = UpstreamConnectError(failed.reason, replica=failed_replica, kind=failed.kind)
            if failed.final:
                log.warning("%s; not failing over (the request was refused)", failed.reason)
                raise error from failed.__cause__
            if not await failover.next(eject=failed.eject):
                log.warning("%s; no other replica to try", failed.reason)
                raise error from failed.__cause__
            log.warning("%s; failing over to %s", failed.reason, lease.replica)
            moved(lease.replica)
