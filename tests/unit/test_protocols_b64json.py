"""Base64 length arithmetic and the JSON fast path, checked against decoding / json.loads."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.metering.adapters.b64json import (
    FAST_PATH_MIN,
    B64Span,
    b64_decoded_len,
    fast_scan,
    scan_event,
)

KEYS = ("delta", "audio")


def trailing_pad(text: str) -> int:
    return len(text) - len(text.rstrip("="))


def reference(text: str, keys: tuple[str, ...]) -> tuple[dict[str, Any], int | None] | None:
    """What a full json.loads gives: the event (audio field emptied) and decoded length."""
    try:
        event = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(event, dict):
        return None
    for key in keys:
        value = event.get(key)
        if isinstance(value, str):
            event[key] = ""
            return event, b64_decoded_len(len(value), trailing_pad(value))
    return event, None


def scanned(text: str, keys: tuple[str, ...]) -> tuple[dict[str, Any], int | None] | None:
    result = scan_event(text, keys)
    if result is None:
        return None
    event, span = result
    return event, None if span is None else span.nbytes


# -- base64 arithmetic ---------------------------------------------------------------------


@given(st.binary(max_size=300))
def test_decoded_length_of_padded_base64_equals_decoded_bytes(data: bytes) -> None:
    text = base64.b64encode(data).decode()
    assert b64_decoded_len(len(text), trailing_pad(text)) == len(data)
    assert B64Span(text, 0, len(text)).nbytes == len(base64.b64decode(text)) == len(data)


@given(st.binary(max_size=300))
def test_decoded_length_of_unpadded_base64_equals_decoded_bytes(data: bytes) -> None:
    text = base64.b64encode(data).decode().rstrip("=")
    assert B64Span(text, 0, len(text)).nbytes == len(data)


@pytest.mark.parametrize(
    ("size", "padding"), [(3, 0), (4, 2), (5, 1), (6, 0), (1, 2), (2, 1), (0, 0)]
)
def test_every_padding_case(size: int, padding: int) -> None:
    text = base64.b64encode(bytes(range(size))).decode()
    assert trailing_pad(text) == padding
    assert B64Span(text, 0, len(text)).nbytes == size


@given(st.binary(min_size=1, max_size=100), st.text(max_size=20), st.text(max_size=20))
def test_span_inside_a_larger_string(data: bytes, before: str, after: str) -> None:
    b64 = base64.b64encode(data).decode()
    source = before + b64 + after
    assert B64Span(source, len(before), len(before) + len(b64)).nbytes == len(data)


@pytest.mark.parametrize("text", ["A", "AAAAA", "A===", "====", "AA=A=", "AB=", "ABC=="])
def test_impossible_lengths_count_zero(text: str) -> None:
    assert B64Span(text, 0, len(text)).nbytes == 0


@given(st.binary(max_size=5000), st.integers(0, 6000))
def test_head_decodes_a_prefix(data: bytes, nbytes: int) -> None:
    text = base64.b64encode(data).decode()
    head = B64Span(text, 0, len(text)).head(nbytes)
    assert data.startswith(head)
    assert len(head) >= min(nbytes, len(data))


# -- the JSON fast path --------------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["delta", "audio", "type", "x"]) | st.text(), inner)
    ),
    max_leaves=8,
)
names = st.sampled_from(["type", "event_id", "delta", "audio", "sample_rate_hz", "x\\y"])
whitespace = st.text(alphabet=" \t\r\n", max_size=2)


@st.composite
def audio_events(draw: st.DrawFn) -> str:
    """Realistic and adversarial events, assembled by hand so keys may repeat."""
    key = draw(st.sampled_from(KEYS))
    audio = draw(st.binary(max_size=300)) * draw(st.sampled_from([1, 1, 5, 40]))
    payload = base64.b64encode(audio).decode()
    if draw(st.booleans()):
        payload = payload.rstrip("=")
    items: list[tuple[str, Any]] = [
        ("type", draw(st.sampled_from(["response.output_audio.delta", "speech.audio.delta"]))),
        (key, payload),
    ]
    items += draw(st.lists(st.tuples(names | st.text(max_size=6), json_values), max_size=4))
    items = draw(st.permutations(items))
    ensure_ascii = draw(st.booleans())
    ws = draw(whitespace)
    text = (
        ws
        + "{"
        + ",".join(
            draw(whitespace)
            + json.dumps(k, ensure_ascii=ensure_ascii)
            + draw(whitespace)
            + ":"
            + draw(whitespace)
            + json.dumps(v, ensure_ascii=ensure_ascii)
            for k, v in items
        )
        + "}"
        + ws
    )
    if draw(st.booleans()):
        text = text.replace("/", "\\/")  # every "/" of a JSON text is inside a string
    return text


@given(audio_events())
def test_scan_event_equals_json_loads(text: str) -> None:
    assert scanned(text, KEYS) == reference(text, KEYS)
    assert scanned(text, ("audio",)) == reference(text, ("audio",))


@given(audio_events(), st.sampled_from(KEYS))
def test_fast_scan_when_it_answers_equals_json_loads(text: str, key: str) -> None:
    hit = fast_scan(text, key)
    if hit is not None:
        event, span = hit
        ref = reference(text, (key,))
        assert ref is not None
        assert (event, span.nbytes) == ref


@given(st.binary(min_size=FAST_PATH_MIN, max_size=20000), st.sampled_from([", ", ","]))
def test_fast_path_takes_realistic_events(audio: bytes, sep: str) -> None:
    b64 = base64.b64encode(audio).decode()
    for event in (
        {"type": "response.output_audio.delta", "event_id": "ev_1", "response_id": "r/1",
         "item_id": "it_1", "output_index": 0, "content_index": 0, "delta": b64},
        {"type": "response.audio.delta", "audio": b64, "sample_rate_hz": 24000},
    ):  # fmt: skip
        text = json.dumps(event, separators=(sep, ": " if sep == ", " else ":"))
        key = "delta" if "delta" in event else "audio"
        hit = fast_scan(text, key)
        assert hit is not None
        assert hit[1].nbytes == len(audio)
        assert hit[0] == {**event, key: ""}


def test_escaped_slashes_fall_back_and_still_count() -> None:
    audio = bytes(range(256)) * 8  # its base64 holds "/"
    text = json.dumps({"type": "response.audio.delta", "audio": base64.b64encode(audio).decode()})
    escaped = text.replace("/", "\\/")
    assert "\\/" in escaped
    assert fast_scan(escaped, "audio") is None
    assert scanned(escaped, ("audio",)) == ({"type": "response.audio.delta", "audio": ""}, 2048)


def test_nested_key_of_the_same_name_is_not_taken_for_the_top_level_one() -> None:
    inner = base64.b64encode(b"x" * 900).decode()
    text = json.dumps({"response": {"delta": inner}, "delta": "AAAA", "type": "t"})
    assert fast_scan(text, "delta") is None
    assert scanned(text, ("delta",)) == (
        {"response": {"delta": inner}, "delta": "", "type": "t"},
        3,
    )


def test_key_in_a_string_value_is_not_taken_for_a_key() -> None:
    text = json.dumps({"type": "t", "note": 'say "delta": "AAAA"', "delta": "A" * 1000})
    assert scanned(text, ("delta",)) == (
        {"type": "t", "note": 'say "delta": "AAAA"', "delta": ""},
        750,
    )


@pytest.mark.parametrize("text", ["", "[]", "null", '"x"', "{", '{"type": }', "[" * 100_000])
def test_not_an_object_gives_none(text: str) -> None:
    assert scan_event(text, KEYS) is None


@given(audio_events(), st.data())
def test_damaged_events_never_raise(text: str, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(text)))
    # Raw control characters are invalid inside JSON strings, and the fast path does not
    # look for them inside a payload (that would cost a pass over it): not generated here.
    noise = data.draw(st.text(st.characters(min_codepoint=0x20), max_size=3))
    damaged = text[:cut] + noise + text[cut + data.draw(st.integers(0, 3)) :]
    assert scanned(damaged, KEYS) == reference(damaged, KEYS)


def test_control_character_inside_a_payload_is_the_known_divergence() -> None:
    text = json.dumps({"type": "t", "delta": "A" * 1000})
    damaged = text.replace("AAAA", "AA\x01A", 1)
    assert reference(damaged, KEYS) is None  # strict JSON rejects it ...
    assert scanned(damaged, KEYS) == ({"type": "t", "delta": ""}, 750)  # ... we count it
