"""What the relays need from the gateway: a narrow interface instead of the whole
:class:`~proxy.runtime.Runtime`.

Every module of :mod:`proxy.relay` is written against :class:`RelayServices`: the
entry points (:mod:`proxy.relay.ws_session`, :mod:`proxy.relay.http_session`), the session lifecycle
they share (:mod:`proxy.relay.lifecycle`), admission (:mod:`proxy.relay.admit`, which
reaches the gang reservations through :attr:`RelayServices.reservations`), the splice
(:mod:`proxy.relay.splice`) and the HTTP
exchange (:mod:`proxy.relay.http_exchange`). ``Runtime`` provides it: mypy checks that
where :mod:`proxy.app` hands the runtime to the relays, and
``tests/unit/test_relay_services.py`` checks the members and that no relay module
imports the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import httpx

    from proxy.admission.auth import Authorization
    from proxy.admission.interface import AdmissionGate
    from proxy.admission.reservations import Reservations
    from proxy.client_request import ClientRequest
    from proxy.clock import Clock
    from proxy.errors import Refused
    from proxy.metering.adapters import HttpAdapter, WsAdapter
    from proxy.metering.session_meter import ReplicaSink, SessionMeter
    from proxy.settings import RouteSettings, Settings
    from proxy.tracing import SessionTracer

__all__ = ["RelayServices", "StopSession"]

#: Ends one live session from the gateway's side (drain): close code, reason.
StopSession = Callable[[int, str], None]


class RelayServices(Protocol):
    """The gateway's services one relayed session uses."""

    # configuration and time
    @property
    def settings(self) -> Settings: ...

    @property
    def clock(self) -> Clock: ...

    # admission
    @property
    def gate(self) -> AdmissionGate: ...

    def authorize(self, request: ClientRequest, pool: str) -> Authorization:
        """The session's key as a value: the tenant token it holds (released with
        :meth:`release_tenant`), and the tenant and quota admission takes; raises
        ``Refused`` / ``PolicyViolation``."""

    def release_tenant(self, token: str | None) -> None: ...

    @property
    def reservations(self) -> Reservations:
        """The gateway's gang reservations: a stage connection claims its slot there."""

    def explain_refusal(self, refusal: Refused) -> Refused:
        """The refusal a client gets: its message says so when the pool's caps are
        lowered for streams the engine runs that Headroom did not admit."""

    # upstreams
    def ws_url(self, pool: str, replica: str) -> str: ...

    def http_url(self, pool: str, replica: str) -> str: ...

    @property
    def http(self) -> httpx.AsyncClient: ...

    def upstream_error(self, pool: str, replica: str, kind: str) -> None:
        """Count an upstream failure of ``kind`` against the replica."""

    # metering
    def new_meter(
        self, pool: str, replica: str, admitted_at: float, arrived_at: float | None = None
    ) -> SessionMeter:
        """The meter of a session admitted at ``admitted_at`` that reached the gateway at
        ``arrived_at`` (before its queue wait; None: when admitted)."""
        ...

    def replica_sink(self, pool: str, replica: str) -> ReplicaSink:
        """Where a meter of a session on ``replica`` observes (SessionMeter.move_to)."""
        ...

    def ws_adapter(self, route: RouteSettings, meter: SessionMeter) -> WsAdapter: ...

    def http_adapter(self, route: RouteSettings, meter: SessionMeter) -> HttpAdapter: ...

    # live sessions (drain) and background work
    def register_session(self, stop: StopSession, pool: str) -> None:
        """A session relaying on a lease of ``pool``: drain, and a fence of that pool,
        end it through ``stop``."""

    def unregister_session(self, stop: StopSession) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...

    # tracing: None while ``tracing.enabled`` is false
    @property
    def tracer(self) -> SessionTracer | None: ...
