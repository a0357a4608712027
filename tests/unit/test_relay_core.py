"""The relay core (proxy.relay.relay_core) as a playbook: sequences of events at explicit
times, and the actions each must produce, in order. No sockets, no clock, no loop:
every session rule both relays share is pinned here once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.relay.deadlines import Deadlines, Expiry
from proxy.relay.relay_core import CLOSE_TIMEOUT_S, RelayCore
from proxy.relay.session_actions import (
    Action,
    CloseSocket,
    Done,
    DropSocket,
    PauseReading,
    Ping,
    RelayClose,
    ResumeReading,
    SendClose,
    Wake,
)  # fmt: skip
from proxy.relay.session_record import SessionRecord
from proxy.relay.session_states import LegState, Phase, Side
from proxy.relay.wsframes import BINARY, TEXT
from proxy.settings import LimitsSettings

C, U = Side.CLIENT, Side.UPSTREAM
T0 = 1000.0


@dataclass
class Meter:
    events: list[tuple[str, Any]] = field(default_factory=list)
    errors: int = 0
    reads_binary: bool = True

    def client_text(self, now: float, text: str) -> None:
        self.events.append(("client_text", text))

    def client_binary(self, now: float, data: bytes) -> None:
        self.events.append(("client_binary", data))

    def upstream_text(self, now: float, text: str) -> None:
        self.events.append(("upstream_text", text))

    def upstream_binary(self, now: float, data: bytes, size: int = -1) -> None:
        assert size == len(data)
        self.events.append(("upstream_binary", data))


class Session:
    """A core, its record, meter and counted upstream errors."""

    def __init__(self, **limits: Any) -> None:
        options: dict[str, Any] = {
            "idle_timeout_s": 60, "max_session_s": 3600, "client_write_timeout_s": 20,
            "ping_interval_s": 20, "ping_timeout_s": 10, "max_message_bytes": 1024,
            **limits,
        }  # fmt: skip
        self.limits = LimitsSettings(**options)
        self.record = SessionRecord("s-1", "/ws", "main", "ws", T0)
        self.meter = Meter()
        self.errors: list[str] = []
        self.core = RelayCore(self.limits, self.record, self.meter, self.errors.append, T0)
        self.client, self.upstream = self.core.client, self.core.upstream

    def do(self, event: Callable[[], object], *expected: Action) -> object:
        """Run one event; its actions must be ``expected``, in order."""
        result = event()
        got, self.core.actions[:] = list(self.core.actions), []
        assert got == list(expected)
        return result


def close_payload(code: int, reason: str = "") -> bytes:
    return code.to_bytes(2, "big") + reason.encode()


# -- timers --------------------------------------------------------------------------


def test_idle_timeout_counts_from_the_last_data_frame_either_way() -> None:
    s = Session(idle_timeout_s=60)
    assert s.core.next_deadline() == T0 + 60
    s.do(lambda: s.core.data_frame(s.upstream, 10, T0 + 30))
    assert s.do(lambda: s.core.tick(T0 + 60)) == T0 + 90  # not idle yet: the next check
    s.do(lambda: s.core.data_frame(s.client, 10, T0 + 80))
    assert s.do(lambda: s.core.tick(T0 + 90)) == T0 + 140
    assert s.do(
        lambda: s.core.tick(T0 + 140),
        SendClose(C, 1008, "idle timeout"), SendClose(U, 1000, "idle timeout"),
    ) == T0 + 140 + CLOSE_TIMEOUT_S  # fmt: skip
    assert s.core.closing == (1008, "idle timeout") and s.record.client_close == 1008
    assert not s.client.accepting and not s.upstream.accepting


def test_session_length_ends_even_a_busy_session() -> None:
    s = Session(idle_timeout_s=0, max_session_s=100)
    assert s.core.next_deadline() == T0 + 100
    s.do(lambda: s.core.data_frame(s.upstream, 10, T0 + 99.9))
    s.do(
        lambda: s.core.tick(T0 + 100),
        SendClose(C, 1008, "maximum session duration reached"),
        SendClose(U, 1000, "maximum session duration reached"),
    )


def test_no_limits_no_deadline() -> None:
    s = Session(idle_timeout_s=0, max_session_s=0)
    assert s.core.next_deadline() == float("inf")


def test_a_full_client_buffer_pauses_the_upstream_and_the_watchdog_drops_the_client() -> None:
    s = Session(idle_timeout_s=0, max_session_s=0, client_write_timeout_s=20)
    s.core.next_deadline()
    s.do(lambda: s.core.buffer_full(s.client, T0), Wake(T0 + 20), PauseReading(U))
    s.do(lambda: s.core.buffer_drained(s.client, T0 + 1), ResumeReading(U))
    assert s.do(lambda: s.core.tick(T0 + 20)) == float("inf")  # it drained in time
    s.do(lambda: s.core.buffer_full(s.client, T0 + 30), Wake(T0 + 50), PauseReading(U))
    assert s.do(lambda: s.core.tick(T0 + 49)) == T0 + 50
    s.do(
        lambda: s.core.tick(T0 + 50),
        SendClose(U, 1000, "client not reading"), DropSocket(C), ResumeReading(U),
    )  # fmt: skip
    assert s.record.error == "client stopped reading" and s.record.client_close == 1008
    assert s.client.state is LegState.GONE


def test_a_full_upstream_buffer_pauses_the_client_without_a_watchdog() -> None:
    s = Session()
    s.core.next_deadline()
    s.do(lambda: s.core.buffer_full(s.upstream, T0), PauseReading(C))
    s.do(lambda: s.core.buffer_drained(s.upstream, T0 + 1), ResumeReading(C))


def test_a_stuck_closing_handshake_drops_the_upstream_and_closes_the_client() -> None:
    s = Session()
    s.core.next_deadline()
    s.do(
        lambda: s.core.stop(1008, "idle timeout", T0),
        SendClose(C, 1008, "idle timeout"), SendClose(U, 1000, "idle timeout"),
        Wake(T0 + CLOSE_TIMEOUT_S),
    )  # fmt: skip
    s.do(
        lambda: s.core.tick(T0 + CLOSE_TIMEOUT_S),
        DropSocket(U), CloseSocket(C, abort_at=T0 + CLOSE_TIMEOUT_S + 20), Done(),
    )  # fmt: skip
    assert s.core.phase is Phase.DONE


# -- size limit ----------------------------------------------------------------------


def test_an_oversized_client_message_is_refused_with_1008() -> None:
    s = Session(max_message_bytes=1024)
    s.core.next_deadline()
    assert s.do(lambda: s.core.data_frame(s.client, 1024, T0)) is True
    assert s.do(
        lambda: s.core.data_frame(s.client, 1025, T0),
        SendClose(C, 1008, "message over 1024 bytes"),
        SendClose(U, 1000, "message over 1024 bytes"), Wake(T0 + CLOSE_TIMEOUT_S),
    ) is False  # fmt: skip
    assert s.record.error == "client message too large" and s.errors == []
    assert s.do(lambda: s.core.data_frame(s.client, 1, T0)) is False  # nothing more


def test_an_oversized_upstream_message_is_an_upstream_protocol_error() -> None:
    s = Session(max_message_bytes=1024)
    s.core.next_deadline()
    assert s.do(
        lambda: s.core.data_frame(s.upstream, 4096, T0),
        SendClose(C, 1014, "upstream message too large"),
        SendClose(U, 1009, "upstream message too large"), Wake(T0 + CLOSE_TIMEOUT_S),
    ) is False  # fmt: skip
    assert s.errors == ["protocol"] and s.record.client_close == 1014


# -- metering ------------------------------------------------------------------------


def test_messages_are_counted_and_metered() -> None:
    s = Session()
    s.do(lambda: s.core.message(s.client, TEXT, b'{"a":1}', T0, 7))
    s.do(lambda: s.core.message(s.client, BINARY, b"", T0, 300))  # not metered
    s.do(lambda: s.core.message(s.upstream, BINARY, b"pcm", T0, 3))
    s.do(lambda: s.core.text(s.upstream, "done", T0, 4))
    assert s.meter.events == [
        ("client_text", '{"a":1}'), ("upstream_binary", b"pcm"), ("upstream_text", "done"),
    ]  # fmt: skip
    r = s.record
    assert (r.frames_up, r.bytes_up, r.frames_down, r.bytes_down) == (2, 307, 2, 7)


def test_invalid_utf8_text_ends_the_session() -> None:
    s = Session()
    s.core.next_deadline()
    s.do(
        lambda: s.core.message(s.client, TEXT, b"\xff", T0, 1),
        SendClose(C, 1007, "invalid UTF-8 in a text message"),
        SendClose(U, 1000, "invalid UTF-8 in a text message"), Wake(T0 + CLOSE_TIMEOUT_S),
    )  # fmt: skip
    s2 = Session()
    s2.core.next_deadline()
    s2.do(
        lambda: s2.core.message(s2.upstream, TEXT, b"\xff", T0, 1),
        SendClose(C, 1014, "upstream sent invalid UTF-8"),
        SendClose(U, 1007, "upstream sent invalid UTF-8"), Wake(T0 + CLOSE_TIMEOUT_S),
    )  # fmt: skip
    assert s2.errors == ["protocol"] and s.meter.events == s2.meter.events == []


# -- closing handshakes and the close-code mapping -----------------------------------


def test_a_client_initiated_close_travels_both_ways_then_the_server_closes_tcp() -> None:
    s = Session()
    s.core.next_deadline()
    s.do(
        lambda: s.core.close_frame(s.client, close_payload(1000, "bye"), T0),
        RelayClose(U, 1000, "bye"), Wake(T0 + CLOSE_TIMEOUT_S),
    )  # fmt: skip
    assert s.core.phase is Phase.CLIENT_CLOSING and s.record.client_close == 1000
    assert s.upstream.accepting and not s.client.accepting  # the upstream may still send
    s.do(
        lambda: s.core.close_frame(s.upstream, close_payload(1000, "bye"), T0 + 1),
        RelayClose(C, 1000, "bye"), CloseSocket(C), ResumeReading(U),
    )  # fmt: skip
    assert s.client.state is LegState.GONE and s.upstream.state is LegState.CLOSED
    s.do(lambda: s.core.connection_lost(s.upstream, T0 + 2), Done())
    assert s.errors == [] and s.record.upstream_close == 1000


@pytest.mark.parametrize(
    ("code", "expected", "errors"),
    [
        (4001, RelayClose(C, 4001, "r"), []),
        (1000, RelayClose(C, 1000, "r"), []),
        (1005, SendClose(C, 1000, ""), []),
        (1015, SendClose(C, 1011, "r"), ["upstream_internal_error"]),
        (2999, SendClose(C, 1011, "r"), ["upstream_internal_error"]),
    ],
    ids=["app-code", "normal", "no-code", "tls-code", "reserved"],
)
def test_an_upstream_close_is_mapped_for_the_client(
    code: int, expected: Action, errors: list[str]
) -> None:
    s = Session()
    s.core.next_deadline()
    s.do(
        lambda: s.core.close_received(s.upstream, code, "r", T0),
        expected, Wake(T0 + CLOSE_TIMEOUT_S),
    )  # fmt: skip
    assert s.errors == errors and s.record.upstream_close == code
    assert s.core.phase is Phase.UPSTREAM_CLOSING
    # the client's answer completes the upstream's handshake
    s.do(
        lambda: s.core.close_frame(s.client, close_payload(1000), T0 + 1),
        RelayClose(U, 1000, ""), CloseSocket(C), ResumeReading(U),
    )  # fmt: skip


def test_an_upstream_that_vanishes_gives_the_client_1014() -> None:
    s = Session()
    s.core.next_deadline()
    s.do(
        lambda: s.core.connection_lost(s.upstream, T0),
        ResumeReading(C), SendClose(C, 1014, "upstream connection lost"),
        Wake(T0 + CLOSE_TIMEOUT_S),
    )  # fmt: skip
    assert s.errors == ["midstream"] and s.record.client_close == 1014
    s.do(lambda: s.core.close_frame(s.client, close_payload(1014), T0 + 1), CloseSocket(C), Done())


def test_an_upstream_gone_after_headroom_closed_is_not_an_upstream_error() -> None:
    s = Session()
    s.core.next_deadline()
    s.do(
        lambda: s.core.stop(1012, "server shutting down", T0),
        SendClose(C, 1012, "server shutting down"), SendClose(U, 1001, "server shutting down"),
        Wake(T0 + CLOSE_TIMEOUT_S),
    )  # fmt: skip
    s.do(lambda: s.core.connection_lost(s.upstream, T0 + 1), ResumeReading(C))
    assert s.errors == []


def test_a_client_that_vanishes_closes_the_upstream_with_1001() -> None:
    s = Session()
    s.core.next_deadline()
    s.do(
        lambda: s.core.connection_lost(s.client, T0),
        ResumeReading(U), SendClose(U, 1001, "client went away"), Wake(T0 + CLOSE_TIMEOUT_S),
    )  # fmt: skip
    assert s.record.client_close == 1006 and s.core.phase is Phase.CLIENT_CLOSING
    s.do(lambda: s.core.close_received(s.upstream, 1001, "", T0 + 1))  # nobody to tell
    s.do(lambda: s.core.connection_lost(s.upstream, T0 + 1), Done())
    assert s.errors == []


@pytest.mark.parametrize(
    ("payload", "answer"),
    [(b"\x03", 1002), (close_payload(1005), 1002), (close_payload(1000) + b"\xff", 1007)],
    ids=["one-byte", "reserved-code", "bad-utf8"],
)
def test_an_invalid_client_close_is_answered_not_forwarded(payload: bytes, answer: int) -> None:
    s = Session()
    s.core.next_deadline()
    s.core.close_frame(s.client, payload, T0)
    got = s.core.actions
    assert got[0] == SendClose(C, answer, got[0].reason)  # type: ignore[union-attr]
    assert not any(isinstance(a, RelayClose) for a in got)
    assert CloseSocket(C) in got  # close frames crossed both ways: the socket closes
    assert s.client.state is LegState.GONE


def test_an_invalid_client_close_actions() -> None:
    s = Session()
    s.core.next_deadline()
    s.do(
        lambda: s.core.close_frame(s.client, b"\x03", T0),
        SendClose(C, 1002, "invalid close frame"), SendClose(U, 1000, "invalid close frame"),
        Wake(T0 + CLOSE_TIMEOUT_S), CloseSocket(C), ResumeReading(U),
    )  # fmt: skip


def test_a_protocol_error_fails_the_offending_connection() -> None:
    s = Session()
    s.core.next_deadline()
    s.do(
        lambda: s.core.protocol_error(s.upstream, "masked server frame", T0),
        SendClose(C, 1014, "upstream protocol error: masked server frame"),
        SendClose(U, 1002, "upstream protocol error: masked server frame"),
        Wake(T0 + CLOSE_TIMEOUT_S), CloseSocket(U), ResumeReading(C),
    )  # fmt: skip
    assert s.errors == ["protocol"]  # not also "midstream": it was closed, not lost


def test_stop_is_idempotent_and_drain_gives_the_upstream_1001() -> None:
    s = Session()
    s.core.next_deadline()
    s.do(
        lambda: s.core.stop(1012, "draining", T0),
        SendClose(C, 1012, "draining"), SendClose(U, 1001, "draining"),
        Wake(T0 + CLOSE_TIMEOUT_S),
    )  # fmt: skip
    s.do(lambda: s.core.stop(1008, "idle timeout", T0))
    assert s.core.closing == (1012, "draining")


# -- keepalive -----------------------------------------------------------------------


def test_keepalive_pings_a_silent_leg_and_drops_a_dead_one() -> None:
    s = Session(ping_interval_s=20, ping_timeout_s=10)
    s.core.next_deadline()
    s.core.start_liveness(0.0)
    s.do(lambda: s.core.keepalive(19.0, T0))
    s.do(lambda: s.core.keepalive(20.0, T0), Ping(C), Ping(U))
    s.upstream.fresh = True  # the upstream answered
    s.do(lambda: s.core.keepalive(25.0, T0))
    assert s.upstream.ping_at is None
    s.do(
        lambda: s.core.keepalive(30.0, T0 + 30),
        SendClose(U, 1000, "keepalive ping timeout"), Wake(T0 + 30 + CLOSE_TIMEOUT_S),
        DropSocket(C), ResumeReading(U),
    )  # fmt: skip
    assert s.record.client_close == 1006 and s.record.error == "client keepalive timeout"
    s.do(lambda: s.core.keepalive(60.0, T0 + 60))  # closing: no more pings


def test_a_dead_upstream_is_a_midstream_error() -> None:
    s = Session(ping_interval_s=20, ping_timeout_s=10)
    s.core.next_deadline()
    s.core.start_liveness(0.0)
    s.client.fresh = True
    s.do(lambda: s.core.keepalive(20.0, T0), Ping(U))
    s.client.fresh = True
    s.do(
        lambda: s.core.keepalive(30.0, T0),
        SendClose(C, 1014, "upstream connection lost"),
        SendClose(U, 1011, "upstream connection lost"), Wake(T0 + CLOSE_TIMEOUT_S),
        DropSocket(U), ResumeReading(C),
    )  # fmt: skip
    assert s.errors == ["midstream"]


# -- failure -------------------------------------------------------------------------


def test_an_internal_error_tells_the_client_1011_and_drops_everything() -> None:
    s = Session()
    s.do(
        s.core.fail,
        SendClose(C, 1011, "internal error"), CloseSocket(C), DropSocket(U), Done(),
    )  # fmt: skip
    assert s.record.error == "internal error" and s.record.client_close == 1011
    s.do(lambda: s.core.connection_lost(s.client, T0))  # already gone: nothing
    assert s.core.tick(T0 + 1e6) == float("inf")


def test_a_blocked_send_is_the_watchdogs_business_not_idle() -> None:
    s = Session(idle_timeout_s=10, max_session_s=0, client_write_timeout_s=20)
    assert s.core.next_deadline() == T0 + 10
    s.do(lambda: s.core.buffer_full(s.client, T0 + 5), PauseReading(U))  # 25 > 10: no wake
    assert s.do(lambda: s.core.tick(T0 + 10)) == T0 + 25  # not idle: waiting on the client
    s.do(lambda: s.core.buffer_drained(s.client, T0 + 24), ResumeReading(U))
    assert s.do(lambda: s.core.tick(T0 + 25)) == T0 + 34  # idle counts from the drain
    s.do(
        lambda: s.core.tick(T0 + 34),
        SendClose(C, 1008, "idle timeout"), SendClose(U, 1000, "idle timeout"),
    )  # fmt: skip


def test_deadlines_alone_are_the_http_relays_timers() -> None:
    limits = LimitsSettings(idle_timeout_s=30, max_session_s=100, client_write_timeout_s=20)
    d = Deadlines(limits, T0)
    assert d.next_deadline() == T0 + 30 and d.expired(T0 + 29) is None
    assert d.sending(T0 + 1) is True and d.wake_at == T0 + 21  # the timer must move
    assert d.sending(T0 + 2) is False  # still armed earlier
    assert d.expired(T0 + 21) is None and d.expired(T0 + 22) is Expiry.CLIENT_WRITE
    d.sent(T0 + 3)
    assert d.expired(T0 + 32) is None and d.expired(T0 + 33) is Expiry.IDLE
    d.last_activity = T0 + 90
    assert d.next_deadline() == T0 + 100 and d.expired(T0 + 100) is Expiry.MAX_SESSION
