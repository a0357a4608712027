"""The one module that uses names uvicorn and websockets do not publish.

Everything else in ``proxy/`` reaches uvicorn through ``uvicorn.Config``/``uvicorn.Server``
(``serve``, ``started``, ``should_exit``) and the protocol classes it is given
(``Config(http=<class>)``, ``Config(ws=<class>)``), and websockets through its
documented API. What is here has no published equivalent; tests/unit/test_library_contract.py
checks each piece against the installed releases, and CI runs it on the lowest and the
newest releases pyproject.toml allows (.ci/run).

- :func:`uvicorn_http`: uvicorn's h11 HTTP protocol, behind the client listener for
  plain HTTP (:mod:`proxy.relay.listener`). uvicorn builds a protocol class given as
  ``Config(http=...)`` with keyword arguments of its own (its config, its server state,
  the lifespan state, and ``_loop``); the listener keeps them as they came and they are
  passed on here, unread, to build uvicorn's protocol. Headroom serves plain HTTP
  through it rather than an HTTP/1.1 server of its own.
- :func:`lifespan_state`: the lifespan state among those arguments (``app_state``),
  which an ASGI scope carries (``scope["state"]``).
- :func:`connection_protocol`: one connection's protocol of a class given as
  ``Config(http=...)``, built with those arguments as uvicorn's server builds it (a
  server state of its own, an empty lifespan state, ``_loop``), for tests that drive the
  client listener on a transport of their own: uvicorn builds it only for a socket it
  accepted.
- :class:`QuietServer`: ``uvicorn.Server`` without its signal capture (the
  ``capture_signals`` context manager ``serve`` runs in, which takes SIGINT/SIGTERM
  from the event loop's handlers and raises them again when the server stops). The
  servers Headroom embeds leave signals to their owner; uvicorn has no option for it.
- :func:`listening_servers`: the asyncio servers a ``uvicorn.Server`` listens with
  (``Server.servers``), for the simulator's refused-connections fault, which closes the
  listening sockets while accepted connections continue.
- :func:`fast_mask`: websockets' C masking function (``websockets.speedups``), far
  faster than a pure-Python XOR on a text message of audio (docs/performance.md);
  without it (a pure wheel, a source build) the framing module masks in pure Python.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Generator, Mapping
from typing import Any, TypeVar

import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string
from uvicorn.server import ServerState

__all__ = [
    "UVICORN_HTTP", "QuietServer", "connection_protocol", "fast_mask", "lifespan_state",
    "listening_servers", "uvicorn_http",
]  # fmt: skip

_Protocol = TypeVar("_Protocol", bound=asyncio.Protocol)

#: uvicorn's HTTP protocol class as its ``http="h11"`` option names it (h11 keeps a
#: chunked body's trailer fields out of the request's headers).
UVICORN_HTTP: Callable[..., asyncio.Protocol] = import_from_string(HTTP_PROTOCOLS["h11"])


def uvicorn_http(protocol_arguments: Mapping[str, Any]) -> asyncio.Protocol:
    """uvicorn's h11 protocol for one connection, built with the keyword arguments
    uvicorn built the listener with (passed on as they came)."""
    return UVICORN_HTTP(**protocol_arguments)


def lifespan_state(protocol_arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the lifespan state among uvicorn's protocol arguments (empty if none)."""
    return dict(protocol_arguments.get("app_state") or {})


def connection_protocol(
    protocol_class: Callable[..., _Protocol],
    config: uvicorn.Config,
    loop: asyncio.AbstractEventLoop | None = None,
) -> _Protocol:
    """One connection's ``protocol_class`` (a class given as ``Config(http=...)``), built
    with the keyword arguments uvicorn's server builds it with for an accepted
    connection: ``config``, a server state of its own, an empty lifespan state (as with
    ``lifespan="off"``) and ``loop`` as ``_loop`` (None: the running loop)."""
    return protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)


class QuietServer(uvicorn.Server):
    """``uvicorn.Server`` that installs no signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def listening_servers(server: uvicorn.Server) -> list[asyncio.Server]:
    """The asyncio servers ``server`` listens with, one per socket (empty before it
    starts)."""
    return list(server.servers)


def fast_mask() -> Callable[[bytes, bytes], bytes] | None:
    """websockets' C ``apply_mask(data, key)``, or None where it is not installed."""
    try:
        from websockets.speedups import apply_mask
    except ImportError:
        return None
    return apply_mask
