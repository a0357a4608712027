"""Every protocol adapter fed adversarial traffic: structured events with hostile field
values (huge, negative, NaN, wrong types), mutated JSON, random bytes, arbitrary
chunking.

Properties: an adapter never raises (its ``errors`` counter may count an internal
failure); every audio duration it reports is finite and >= 0; the audio it meters from
a stream does not depend on how TCP split the stream; and what a *client* declares
cannot make the meter report physically impossible durations (the meter feeds the
guard, which gates admission for everybody on the replica).

``tests/unit/test_protocols_*.py`` pin the exact figures for well-formed traffic; this
module is about hostile input.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.metering.adapters import (
    HTTP_ROUTE_PROTOCOLS,
    WS_ROUTE_PROTOCOLS,
    AudioFormat,
    http_adapter,
    ws_adapter,
)
from proxy.metering.adapters.http_streams import media_type, request_fields
from tests.fuzz.conftest import fuzz_settings

DEFAULT = AudioFormat(24000, 1, 2)
#: The widest PCM formats a route may be configured with (AudioSettings bounds):
#: 8 kHz..192 kHz, 1..8 channels, 1..4 bytes a sample.
MIN_BPS, MAX_BPS = 8000 * 1 * 1, 192000 * 8 * 4


class Sink:
    """A MeterSink that checks what it is told as it is told."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.calls = 0
        self.last_now = -math.inf

    def _at(self, now: float) -> None:
        assert now >= self.last_now
        self.last_now = now
        self.calls += 1

    def audio(self, now: float, seconds: float) -> None:
        self._at(now)
        assert isinstance(seconds, float | int) and math.isfinite(seconds), seconds
        assert seconds >= 0, seconds
        self.seconds.append(float(seconds))

    def event(self, now: float) -> None:
        self._at(now)

    def utterance_end(self, now: float) -> None:
        self._at(now)

    def response_end(self, now: float) -> None:
        self._at(now)

    def commit_final(self, now: float) -> None:
        self._at(now)

    def transcript_final(self, now: float) -> None:
        self._at(now)

    @property
    def total(self) -> float:
        return math.fsum(self.seconds)


# -- hostile values ---------------------------------------------------------------------------

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 8000, 24000, 10**400, -(10**400), 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["pcm", "wav", "pcm16", "g711_ulaw", "audio/pcm", "audio/pcmu", "mp3"]),
)
b64 = st.one_of(
    st.binary(max_size=600).map(lambda b: base64.b64encode(b).decode()),
    st.binary(max_size=600).map(lambda b: base64.b64encode(b).decode().rstrip("=")),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ ",
            max_size=64),
    st.binary(min_size=400, max_size=3000).map(lambda b: base64.b64encode(b).decode()),
)  # fmt: skip
REALTIME_TYPES = [
    "response.output_audio.delta", "response.audio.delta", "response.output_audio.done",
    "response.audio.done", "response.done", "transcription.delta", "transcription.done",
    "session.created", "session.updated", "session.update", "input_audio_buffer.committed",
    "input_audio_buffer.commit", "conversation.item.input_audio_transcription.completed",
    "error",
]  # fmt: skip
SPEECH_TYPES = ["audio.start", "audio.done", "session.done", "error", "input.done",
                "input.text", "session.config", "session.close"]  # fmt: skip


@st.composite
def session_object(draw: st.DrawFn) -> dict[str, Any]:
    fmt = {"type": draw(junk), "rate": draw(junk)}
    session: dict[str, Any] = {"audio": {"output": {"format": fmt}}}
    if draw(st.booleans()):
        session["output_audio_format"] = draw(junk)
    return draw(st.sampled_from([session, {"audio": draw(junk)}, {"audio": {"output": fmt}}]))


@st.composite
def event(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(REALTIME_TYPES + SPEECH_TYPES) | st.text(max_size=10))
    body: dict[str, Any] = {"type": kind}
    for key in draw(st.lists(st.sampled_from(["delta", "audio", "sample_rate_hz", "format",
                                              "sample_rate", "channels", "final", "session",
                                              "text"]), max_size=5, unique=True)):  # fmt: skip
        if key in ("delta", "audio"):
            body[key] = draw(b64 | junk)
        elif key == "session":
            body[key] = draw(session_object())
        else:
            body[key] = draw(junk)
    text = json.dumps(body, allow_nan=True)
    if draw(st.integers(0, 4)) == 0:  # damage it
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(max_size=3)) + text[at + draw(st.integers(0, 3)) :]
    return text


def wav_header(rate: int = 24000, channels: int = 1, bits: int = 16, tag: int = 1) -> bytes:
    block = (channels * bits // 8) & 0xFFFF
    fmt = struct.pack("<HHIIHH", tag, channels, rate, (rate * block) & 0xFFFFFFFF, block, bits)
    return b"RIFF\xff\xff\xff\xffWAVEfmt " + struct.pack("<I", 16) + fmt + b"data\xff\xff\xff\xff"


binary_frames = st.one_of(
    st.binary(max_size=2000),
    st.builds(wav_header, st.integers(0, 2**32 - 1), st.integers(0, 65535),
              st.integers(0, 65535), st.sampled_from([1, 3, 0xFFFE, 0, 85])),
    st.builds(lambda h, cut: h[:cut], st.builds(wav_header), st.integers(0, 44)),
)  # fmt: skip
messages = st.lists(
    st.tuples(st.booleans(), event() | st.text(max_size=40) | binary_frames), max_size=25
)
WS_CASES = sorted(WS_ROUTE_PROTOCOLS - {"sagemaker-bidi"}) + [
    f"sagemaker-bidi/{inner}" for inner in sorted(WS_ROUTE_PROTOCOLS - {"sagemaker-bidi"})
]


def make_ws(case: str, sink: Sink) -> Any:
    protocol, _, inner = case.partition("/")
    return ws_adapter(protocol, sink, DEFAULT, inner or None)


@pytest.mark.parametrize("case", WS_CASES)
@fuzz_settings(300)
@given(messages=messages)
def test_ws_adapters_take_anything(case: str, messages: list[tuple[bool, str | bytes]]) -> None:
    sink = Sink()
    adapter = make_ws(case, sink)
    for i, (from_client, message) in enumerate(messages):
        now = float(i)
        if isinstance(message, bytes):
            (adapter.client_binary if from_client else adapter.upstream_binary)(now, message)
        else:
            (adapter.client_text if from_client else adapter.upstream_text)(now, message)
    assert adapter.errors >= 0  # an internal failure may be counted, never raised


@fuzz_settings(500)
@given(
    client=st.lists(event() | st.builds(lambda s: json.dumps(
        {"type": "session.update", "session": s}), session_object()), max_size=4),
    nbytes=st.integers(2, 96000).map(lambda n: n - n % 2),
    beta=st.booleans(),
)  # fmt: skip
def test_a_client_cannot_make_the_meter_report_impossible_audio(
    client: list[str], nbytes: int, beta: bool
) -> None:
    """openai-realtime takes the output format from the session, which the *client* may
    set with ``session.update``. Whatever the client declares, the upstream's audio must
    be metered at a rate some route could be configured with (8 kHz..192 kHz x 1..8
    channels x 1..4 bytes): otherwise one client inflates or zeroes the delivery ratio
    the guard reads for everybody on the replica (guard enforce mode: a denial of
    service; any mode: wrong dashboards)."""
    sink = Sink()
    adapter = ws_adapter("openai-realtime", sink, DEFAULT)
    for i, text in enumerate(client):
        adapter.client_text(float(i), text)
    kind = "response.audio.delta" if beta else "response.output_audio.delta"
    audio = base64.b64encode(bytes(nbytes)).decode()
    adapter.upstream_text(100.0, json.dumps({"type": kind, "delta": audio}))
    assert sink.seconds, "the audio delta was not metered"
    assert nbytes / MAX_BPS <= sink.total <= nbytes / MIN_BPS, (client, sink.total)


# -- HTTP ---------------------------------------------------------------------------------------

content_types = st.one_of(
    st.sampled_from(["text/event-stream", "audio/wav", "audio/x-wav", "audio/pcm",
                     "audio/L16; rate=16000; channels=2", "audio/L16; rate=0",
                     "audio/L16; rate=" + "9" * 400, "audio/pcm; rate=-5", "audio/mpeg",
                     "application/octet-stream", "application/json", "", "text/plain",
                     'audio/pcm; rate="24000"', "AUDIO/PCM;RATE=8000"]),
    st.text(max_size=30),
)  # fmt: skip
request_bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda d: json.dumps(d, allow_nan=True).encode(),
              st.dictionaries(st.sampled_from(["sample_rate", "response_format", "stream_format",
                                               "stream", "input", "SAMPLE_RATE"]), junk)),
    st.just(b"[" * 5000),
)  # fmt: skip
sse_events = st.builds(
    lambda name, data: (f"event: {name}\n" if name else "") + f"data: {data}\n\n",
    st.sampled_from(["", "speech.audio.delta", "speech.audio.done", "speech.audio.error",
                     "message"]),
    event(),
).map(str.encode)  # fmt: skip
chunks = st.lists(
    st.one_of(
        st.binary(max_size=300),
        sse_events,
        binary_frames,
        st.just(b"data: [DONE]\n\n"),
        st.just(b"\r"),
        st.just(b"\n"),
    ),
    max_size=20,
)


@pytest.mark.parametrize("protocol", sorted(HTTP_ROUTE_PROTOCOLS))
@fuzz_settings(300)
@given(
    query=st.dictionaries(st.text(max_size=12), st.text(max_size=12), max_size=4),
    request_type=content_types,
    body=request_bodies,
    status=st.integers(100, 599),
    response_type=content_types,
    sample_rate=st.none() | st.text(max_size=8) | st.just("9" * 500),
    body_chunks=chunks,
)
def test_http_adapters_take_anything(
    protocol: str, query: dict[str, str], request_type: str, body: bytes, status: int,
    response_type: str, sample_rate: str | None, body_chunks: list[bytes],
) -> None:  # fmt: skip
    sink = Sink()
    adapter = http_adapter(protocol, sink, DEFAULT)
    adapter.request("POST", query, request_type, body)
    adapter.request_complete(0.0)
    headers = {"content-type": response_type}
    if sample_rate is not None:
        headers["X-Sample-Rate"] = sample_rate
    adapter.response_start(status, headers)
    for i, chunk in enumerate(body_chunks):
        adapter.response_chunk(1.0 + i, chunk)
    adapter.response_complete(1.0 + len(body_chunks))
    assert adapter.errors >= 0


@fuzz_settings(500)
@given(
    query=st.dictionaries(st.text(max_size=12), st.text(max_size=12), max_size=4),
    content_type=st.none() | content_types,
    body=request_bodies,
)
def test_request_fields_and_media_type_never_raise(
    query: dict[str, str], content_type: str | None, body: bytes
) -> None:
    fields = request_fields(query, content_type, body)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
    mime, params = media_type(content_type)
    assert mime == mime.strip().lower()
    assert all(isinstance(v, str) for v in params.values())


# -- metering does not depend on TCP segmentation ------------------------------------------------


@st.composite
def speech_stream(draw: st.DrawFn) -> tuple[str, bytes, dict[str, Any]]:
    """A well-formed speech response: (content type, body, request fields)."""
    kind = draw(st.sampled_from(["sse", "wav", "pcm"]))
    pieces = draw(st.lists(st.binary(max_size=4000), min_size=1, max_size=8))
    if kind == "pcm":
        return "audio/pcm", b"".join(pieces), {}
    if kind == "wav":
        rate = draw(st.sampled_from([8000, 16000, 22050, 24000, 48000]))
        return "audio/wav", wav_header(rate) + b"".join(pieces), {}
    out = []
    for piece in pieces:
        if draw(st.booleans()):
            out.append(draw(st.sampled_from([b": keep-alive\n", b"retry: 10\n", b"\n"])))
        delta = {"type": "speech.audio.delta", "audio": base64.b64encode(piece).decode()}
        name = draw(st.sampled_from(["event: speech.audio.delta\n", ""]))
        eol = draw(st.sampled_from(["\n", "\r\n", "\r"]))
        out.append((name + "data: " + json.dumps(delta) + eol + eol).encode())
    out.append(b'event: speech.audio.done\ndata: {"type": "speech.audio.done"}\n\n')
    return "text/event-stream", b"".join(out), {"response_format": "pcm"}


def meter_http(content_type: str, fields: dict[str, Any], parts: list[bytes]) -> float:
    sink = Sink()
    adapter = http_adapter("openai-speech-http", sink, DEFAULT)
    adapter.request("POST", {}, "application/json", json.dumps(fields).encode())
    adapter.response_start(200, {"content-type": content_type})
    for i, part in enumerate(parts):
        adapter.response_chunk(float(i), part)
    adapter.response_complete(float(len(parts)))
    assert adapter.errors == 0
    return sink.total


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@fuzz_settings(400)
@given(stream=speech_stream(), cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_http_audio_seconds_do_not_depend_on_chunking(
    stream: tuple[str, bytes, dict[str, Any]], cuts: list[int]
) -> None:
    content_type, body, fields = stream
    whole = meter_http(content_type, fields, [body])
    pieces = meter_http(content_type, fields, split(body, cuts))
    assert math.isclose(whole, pieces, rel_tol=1e-9, abs_tol=1e-12), (whole, pieces)


@fuzz_settings(300)
@given(
    pcm=st.binary(max_size=20000),
    rate=st.sampled_from([8000, 16000, 24000, 44100]),
    cuts=st.lists(st.integers(0, 10**6), max_size=8),
)
def test_ws_wav_audio_seconds_do_not_depend_on_framing(pcm: bytes, rate: int,
                                                       cuts: list[int]) -> None:  # fmt: skip
    data = wav_header(rate) + pcm

    def meter(frames: list[bytes]) -> float:
        sink = Sink()
        adapter = ws_adapter("vllm-omni-speech-ws", sink, DEFAULT)
        adapter.upstream_text(0.0, json.dumps({"type": "audio.start", "format": "wav"}))
        for i, f in enumerate(frames):
            adapter.upstream_binary(1.0 + i, f)
        assert adapter.errors == 0
        return sink.total

    assert math.isclose(meter([data]), meter(split(data, cuts)), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(meter([data]), len(pcm) / (rate * 2), rel_tol=1e-9, abs_tol=1e-12)
