"""The incremental event-stream parser: any chunking gives the events of the whole stream."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.metering.adapters.sse import SseEvent, SseParser


def parse_whole(stream: bytes) -> list[SseEvent]:
    """A reference parser over the complete stream (bytes.splitlines: CRLF, LF, CR)."""
    if stream.startswith(b"\xef\xbb\xbf"):
        stream = stream[3:]
    lines = stream.splitlines(keepends=True)
    if lines and not lines[-1].endswith((b"\n", b"\r")):
        lines.pop()  # an unterminated last line is not a line yet
    events: list[SseEvent] = []
    name, data = "", []
    for raw in lines:
        line = raw.rstrip(b"\r\n").decode("utf-8", "replace")
        if not line:
            if data:
                events.append((name or "message", "\n".join(data)))
            name, data = "", []
            continue
        if line.startswith(":"):
            continue
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "event":
            name = value
    return events


def feed_all(chunks: list[bytes], parser: SseParser | None = None) -> list[SseEvent]:
    parser = parser or SseParser()
    events: list[SseEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events


STREAM = (
    b": keep-alive\r\n\r\n"
    b'event: speech.audio.delta\r\ndata: {"audio": "AAAA"}\r\n\r\n'
    b"data: one\ndata:two\n\n"
    b"event: speech.audio.done\rdata: {}\r\r"
)
EXPECTED = [
    ("speech.audio.delta", '{"audio": "AAAA"}'),
    ("message", "one\ntwo"),
    ("speech.audio.done", "{}"),
]


def test_whole_stream() -> None:
    assert feed_all([STREAM]) == EXPECTED == parse_whole(STREAM)


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_an_event_split_anywhere_is_parsed_once(cut: int) -> None:
    assert feed_all([STREAM[:cut], STREAM[cut:]]) == EXPECTED


def test_byte_at_a_time() -> None:
    assert feed_all([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED


def test_crlf_split_between_chunks_is_one_line_end() -> None:
    # Were the LF taken as a blank line, "a" would be dispatched on its own.
    assert feed_all([b"data: a\r", b"\ndata: b\r\n\r\n"]) == [("message", "a\nb")]


def test_event_without_data_is_not_dispatched_and_its_name_does_not_leak() -> None:
    assert feed_all([b"event: x\n\ndata: y\n\n"]) == [("message", "y")]


def test_incomplete_event_at_the_end_is_not_dispatched() -> None:
    assert feed_all([b"data: a\n\ndata: b\n"]) == [("message", "a")]


def test_field_names_are_exact_and_value_keeps_extra_spaces() -> None:
    stream = b"datum: no\ndata\ndata:  two spaces\nid: 7\nretry: 10\n\n"
    assert feed_all([stream]) == [("message", "\n two spaces")]


def test_leading_bom_is_ignored_even_when_split() -> None:
    assert feed_all([b"\xef", b"\xbb", b"\xbfdata: a\n\n"]) == [("message", "a")]
    assert feed_all([b"\xef\xbb\xbfdata: a\n\n"]) == [("message", "a")]


def test_over_long_line_drops_its_event_and_parsing_resumes() -> None:
    parser = SseParser(max_event_bytes=64)
    chunks = [b"data: " + b"A" * 50, b"A" * 50, b"A" * 50 + b"\n\n", b"data: ok\n\n"]
    assert feed_all(chunks, parser) == [("message", "ok")]


def test_over_long_line_ending_in_a_split_crlf() -> None:
    parser = SseParser(max_event_bytes=16)
    chunks = [b"data: " + b"A" * 40, b"AAAA\r", b"\n\r\ndata: ok\r\n\r\n"]
    assert feed_all(chunks, parser) == [("message", "ok")]
    # Without the blank line, "ok" belongs to the dropped event.
    parser = SseParser(max_event_bytes=16)
    chunks = [b"data: " + b"A" * 40, b"AAAA\r", b"\ndata: ok\r\n\r\n"]
    assert feed_all(chunks, parser) == []


def test_over_large_event_of_many_lines_is_dropped() -> None:
    parser = SseParser(max_event_bytes=20)
    stream = b"data: 0123456789\ndata: 0123456789\ndata: 0123456789\n\ndata: ok\n\n"
    assert feed_all([stream], parser) == [("message", "ok")]


def test_buffer_holds_only_the_partial_line() -> None:
    parser = SseParser()
    parser.feed(b"data: a\n\ndata: partial")
    assert "buffered=13" in repr(parser)


lines = st.sampled_from(
    [
        b"data: x",
        b"data:y",
        b"data",
        b"event: e",
        b"event:",
        b": c",
        b"",
        b"id: 1",
        b'data: {"a":1}',
    ]
)
eols = st.sampled_from([b"\n", b"\r\n", b"\r"])


@given(st.lists(st.tuples(lines, eols), max_size=30), st.data())
def test_any_chunking_equals_the_whole_stream(
    parts: list[tuple[bytes, bytes]], data: st.DataObject
) -> None:
    stream = b"".join(line + eol for line, eol in parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert feed_all(chunks) == parse_whole(stream)


@given(st.lists(st.binary(max_size=40), max_size=20))
def test_garbage_never_raises(chunks: list[bytes]) -> None:
    events = feed_all(chunks)
    assert all(isinstance(name, str) and isinstance(data, str) for name, data in events)
