"""Log formats: the text format carries the session line's fields as key=value pairs."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest

from proxy.logs import JsonFormatter, TextFormatter
from proxy.relay.session_record import SessionRecord

PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def session_record() -> SessionRecord:
    record = SessionRecord(
        session="a1b2c3-7",
        route="/v1/audio/speech",
        pool="tts-main",
        transport="http",
        started=10.0,
        decision="admitted",
        replica="gpu0",
        queue_wait_s=0.25,
        admitted_at=10.25,
        ended=12.75,
        upstream_close=None,
        status=200,
        bytes_down=96_000,
        error='upstream reset mid-stream: "ECONNRESET"\nafter 2 chunks',
    )
    record.meter = {
        "audio_s": 2.0,
        "wall_s": 2.5,
        "active_s": 0.8,
        "delivery_ratio_worst_1pct": 1.234,
        "gap_p99_s": 0.2,
        "underruns": 1,
        "stall_s": 0.3,
        "ttfa_s": 0.8,
        "finalize_s": None,
    }
    return record


def log_record(fields: dict[str, object], msg: str = "session %s %s") -> logging.LogRecord:
    args = ("a1b2c3-7", "admitted") if "%s" in msg else ()
    record = logging.LogRecord("headroom.session", logging.INFO, __file__, 1, msg, args, None)
    record.fields = fields
    return record


def parse_pairs(text: str) -> dict[str, str]:
    out = {}
    for key, raw in PAIR.findall(text):
        out[key] = json.loads(raw) if raw.startswith('"') else raw
    return out


def test_the_text_session_line_carries_every_field_as_key_value() -> None:
    fields = session_record().fields()
    line = TextFormatter().format(log_record(fields))
    assert "\n" not in line  # the error's newline is escaped: one record, one line
    head, _, tail = line.partition("headroom.session: session a1b2c3-7 admitted ")
    assert head and tail, line
    pairs = parse_pairs(tail)
    # Everything the JSON line has, except None values, the event name and what the
    # message already says (session id, decision).
    expected = {
        k: v
        for k, v in fields.items()
        if v is not None and k not in {"event", "session", "decision"}
    }
    assert list(pairs) == list(expected)
    for key, value in expected.items():
        assert pairs[key] == (value if isinstance(value, str) else str(value)), key
    assert "route=/v1/audio/speech pool=tts-main transport=http replica=gpu0" in tail
    assert "status=200" in tail and "duration_s=2.5" in tail
    assert "delivery_ratio_worst_1pct=1.234" in tail and "underruns=1" in tail
    assert pairs["error"] == 'upstream reset mid-stream: "ECONNRESET"\nafter 2 chunks'
    assert "upstream_close" not in pairs and "finalize_s" not in pairs  # None: left out


@pytest.mark.parametrize(
    ("value", "written"),
    [
        ("plain", "plain"),
        ("", '""'),
        ("two words", '"two words"'),
        ("k=v", '"k=v"'),
        ("tab\there", '"tab\\there"'),
        (True, "true"),
        (3, "3"),
        (0.125, "0.125"),
        ([1, 2], '"[1, 2]"'),
    ],
)
def test_text_values_are_bare_only_when_unambiguous(value: object, written: str) -> None:
    line = TextFormatter().format(log_record({"x": value}, msg="m"))
    assert line.endswith(f"m x={written}")


def test_a_record_without_fields_is_the_plain_format() -> None:
    name, level = "headroom.gateway", logging.WARNING
    record = logging.LogRecord(name, level, __file__, 1, "hi %d", (5,), None)
    line = TextFormatter().format(record)
    assert line.endswith(" WARNING headroom.gateway: hi 5")


def test_a_traceback_follows_the_fields() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = log_record({"status": 502}, msg="failed")
        record.exc_info = sys.exc_info()
    first, *rest = TextFormatter().format(record).splitlines()
    assert first.endswith("failed status=502")
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: boom"


def test_json_and_text_formats_carry_the_same_fields() -> None:
    fields = session_record().fields()
    record = log_record(fields)
    payload = json.loads(JsonFormatter().format(record))
    pairs = parse_pairs(TextFormatter().format(record).partition(" admitted ")[2])
    for key, value in pairs.items():
        assert str(payload[key]) == value or payload[key] == value, key


def test_log_format_text_writes_the_session_fields(tmp_path: object) -> None:
    """Through configure_logging in a fresh interpreter: what `log_format: text` prints."""
    code = (
        "from proxy.logs import configure_logging\n"
        "configure_logging('info', 'text')\n"
        "from tests.unit.test_logs import session_record\n"
        "session_record().emit()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert " INFO headroom.session: session a1b2c3-7 admitted route=/v1/audio/speech " in lines[0]
    assert parse_pairs(lines[0])["status"] == "200"
