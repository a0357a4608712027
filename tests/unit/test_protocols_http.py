"""HTTP adapters: speech (SSE, PCM, WAV), transcription SSE, passthrough."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.metering.adapters import HTTP_ROUTE_PROTOCOLS, AudioFormat, HttpAdapter, http_adapter
from proxy.metering.adapters.http_streams import media_type, request_fields
from proxy.metering.adapters.sse import SseParser

DEFAULT = AudioFormat(24000, 1, 2)
JSON = "application/json"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def audio(self, now: float, seconds: float) -> None:
        self.calls.append(("audio", now, seconds))

    def event(self, now: float) -> None:
        self.calls.append(("event", now))

    def utterance_end(self, now: float) -> None:
        self.calls.append(("end", now))

    def response_end(self, now: float) -> None:
        self.calls.append(("done", now))

    def commit_final(self, now: float) -> None:
        self.calls.append(("commit", now))

    def transcript_final(self, now: float) -> None:
        self.calls.append(("final", now))

    @property
    def audio_seconds(self) -> float:
        return sum(c[2] for c in self.calls if c[0] == "audio")


def speech(
    body: dict[str, Any] | None = None, content_type: str = "audio/pcm", status: int = 200
) -> tuple[HttpAdapter, Recorder]:
    sink = Recorder()
    http = http_adapter("openai-speech-http", sink, DEFAULT)
    http.request("POST", {}, JSON, json.dumps(body or {}).encode())
    http.response_start(status, {"Content-Type": content_type})
    return http, sink


def wav_header(rate: int, channels: int = 1) -> bytes:
    block = channels * 2
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * block, block, 16)
    return b"RIFF\xff\xff\xff\xffWAVEfmt \x10\x00\x00\x00" + fmt + b"data\xff\xff\xff\xff"


def sse_delta(nbytes: int, named: bool = True, crlf: bool = False) -> bytes:
    data = json.dumps({"audio": base64.b64encode(bytes(nbytes)).decode(), "response_format": "pcm"})
    if named:
        text = f"event: speech.audio.delta\ndata: {data}\n\n"
    else:
        text = f"data: {json.dumps({'type': 'speech.audio.delta', **json.loads(data)})}\n\n"
    return (text.replace("\n", "\r\n") if crlf else text).encode()


# -- openai-speech-http: SSE -------------------------------------------------------------------

SSE_STREAM = (
    sse_delta(4800)
    + sse_delta(9600, crlf=True)
    + sse_delta(2400, named=False)
    + (b'event: speech.audio.done\ndata: {"usage": {}}\n\n')
)


# Cuts around every line end (where split CRLFs and blank lines hide) plus a spread.
SSE_CUTS = sorted(
    {c for i, b in enumerate(SSE_STREAM) if b in b"\r\n" for c in range(i - 2, i + 3)}
    | set(range(1, len(SSE_STREAM), len(SSE_STREAM) // 40))
)


@pytest.mark.parametrize("cut", SSE_CUTS)
def test_sse_event_split_across_chunks_is_counted_once(cut: int) -> None:
    http, sink = speech({"stream": True, "stream_format": "sse"}, "text/event-stream")
    http.response_chunk(1.0, SSE_STREAM[:cut])
    http.response_chunk(2.0, SSE_STREAM[cut:])
    # Each event counts once, with the chunk that completed it; a chunk's events are summed.
    done_in_first = len(SseParser().feed(SSE_STREAM[:cut]))
    durations = [0.1, 0.2, 0.05]
    first, second = sum(durations[:done_in_first]), sum(durations[done_in_first:])
    expected = [("audio", 1.0, first)] if first else []
    expected += [("audio", 2.0, second)] if second else []
    assert sink.calls[:-1] == [(k, t, pytest.approx(v)) for k, t, v in expected]
    assert sink.calls[-1] == ("done", 1.0 if done_in_first == 4 else 2.0)
    assert sink.audio_seconds == pytest.approx(0.35)


def test_sse_events_in_one_chunk_are_one_metered_chunk() -> None:
    http, sink = speech({"stream": True}, "text/event-stream")
    http.response_chunk(1.0, sse_delta(4800) + sse_delta(4800) + b"event: speech.audio.done\n")
    http.response_chunk(1.5, b"data: {}\n\n" + sse_delta(2400))
    assert sink.calls == [("audio", 1.0, 0.2), ("done", 1.5), ("audio", 1.5, 0.05)]


def test_sse_event_byte_by_byte_is_counted_once_at_its_last_byte() -> None:
    http, sink = speech({"stream": True}, "text/event-stream")
    event = sse_delta(4800)
    for i in range(len(event)):
        http.response_chunk(float(i), event[i : i + 1])
    assert sink.calls == [("audio", float(len(event) - 1), 0.1)]


def test_sse_rate_from_the_request() -> None:
    http, sink = speech({"sample_rate": 16000, "stream_format": "sse"}, "text/event-stream")
    http.response_chunk(0.0, sse_delta(32000))
    assert sink.audio_seconds == 1.0


def test_sse_wav_delta_skips_its_header_and_uses_its_format() -> None:
    http, sink = speech({"response_format": "wav", "stream_format": "sse"}, "text/event-stream")
    first = base64.b64encode(wav_header(16000) + bytes(16000)).decode()
    later = base64.b64encode(bytes(32000)).decode()
    for i, payload in enumerate((first, later)):
        http.response_chunk(
            float(i),
            f"data: {json.dumps({'type': 'speech.audio.delta', 'audio': payload})}\n\n".encode(),
        )
    assert sink.calls == [("audio", 0.0, 0.5), ("audio", 1.0, 1.0)]


def test_sse_unknown_and_error_events_pass_unmetered() -> None:
    http, sink = speech({}, "text/event-stream")
    http.response_chunk(0.0, b'event: speech.audio.error\ndata: {"error": {"message": "x"}}\n\n')
    http.response_chunk(0.1, b"data: not json\n\n: comment\n\ndata: [1, 2]\n\n")
    http.response_chunk(0.2, b'data: {"type": "speech.audio.delta"}\n\n')  # no audio field
    assert sink.calls == []


# -- openai-speech-http: raw audio ------------------------------------------------------------


def test_pcm_at_the_request_sample_rate() -> None:
    http, sink = speech({"response_format": "pcm", "sample_rate": 16000, "stream": True})
    for i in range(10):
        http.response_chunk(i * 0.2, bytes(6400))
    http.response_complete(2.0)
    assert len(sink.calls) == 10
    assert sink.audio_seconds == pytest.approx(2.0)


def test_raw_pcm_reads_split_by_tcp_are_one_chunk() -> None:
    """A 9,600-byte write read as 7,773 + 1,827 bytes 0.1 ms apart is one chunk."""
    http, sink = speech({"response_format": "pcm", "sample_rate": 24000, "stream": True})
    http.response_chunk(1.0, bytes(9600))
    http.response_chunk(1.2, bytes(7773))
    http.response_chunk(1.2001, bytes(1827))
    http.response_chunk(1.4, bytes(9600))
    assert sink.calls == [("audio", 1.0, pytest.approx(0.2)), ("audio", 1.2, pytest.approx(0.2))]
    http.response_complete(1.5)  # the last chunk is reported when the response ends
    assert sink.calls[-1] == ("audio", 1.4, pytest.approx(0.2))
    assert sink.audio_seconds == pytest.approx(0.6)


def test_pcm_rate_from_the_content_type_parameters() -> None:
    http, sink = speech({"sample_rate": 16000}, "audio/L16; rate=8000; channels=2")
    http.response_chunk(0.0, bytes(32000))
    http.response_complete(1.0)
    assert sink.audio_seconds == 1.0


def test_pcm_rate_from_the_sample_rate_header() -> None:
    sink = Recorder()
    http = http_adapter("openai-speech-http", sink, DEFAULT)
    http.request("POST", {}, JSON, b'{"sample_rate": 16000}')
    http.response_start(200, {"content-type": "audio/pcm", "X-Sample-Rate": "44100"})
    http.response_chunk(0.0, bytes(88200))
    http.response_complete(1.0)
    assert sink.audio_seconds == 1.0


def test_pcm_route_default_without_request_fields() -> None:
    http, sink = speech({}, "audio/pcm")
    http.response_chunk(0.0, bytes(48000))
    http.response_chunk(0.1, b"")
    http.response_complete(1.0)
    assert sink.calls == [("audio", 0.0, 1.0)]


@pytest.mark.parametrize("cut", range(1, 50))
def test_wav_header_split_across_chunks_is_parsed(cut: int) -> None:
    http, sink = speech({"response_format": "wav"}, "audio/wav")
    stream = wav_header(48000, 2) + bytes(192000)
    http.response_chunk(0.0, stream[:cut])
    http.response_chunk(0.1, stream[cut:])
    http.response_complete(1.0)
    assert sink.audio_seconds == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": "wav"}, 0.5),  # header parsed: 16 kHz
        ({"response_format": "pcm", "sample_rate": 16000}, (44 + 16000) / 32000),
        ({"stream_format": "sse"}, 0.0),  # not an event stream: nothing parses
    ],
)
def test_octet_stream_follows_the_request(body: dict[str, Any], expected: float) -> None:
    http, sink = speech(body, "application/octet-stream")
    http.response_chunk(0.0, wav_header(16000) + bytes(16000))
    http.response_complete(1.0)
    assert sink.audio_seconds == pytest.approx(expected)


def test_compressed_audio_is_gap_only_events() -> None:
    http, sink = speech({"response_format": "mp3"}, "audio/mpeg")
    http.response_chunk(0.0, b"\xff\xfb" + bytes(100))
    http.response_chunk(0.1, bytes(100))
    assert sink.calls == [("event", 0.0), ("event", 0.1)]


@pytest.mark.parametrize(
    ("status", "content_type"), [(500, "audio/pcm"), (200, JSON), (429, "text/event-stream")]
)
def test_errors_and_json_responses_are_unmetered(status: int, content_type: str) -> None:
    http, sink = speech({}, content_type, status)
    http.response_chunk(0.0, b'{"error": {"message": "x"}}')
    http.request_complete(0.0)
    assert sink.calls == []


# -- request parsing -------------------------------------------------------------------------


def test_request_fields_from_query_json_and_form() -> None:
    assert request_fields(
        {"sample_rate": "8000"}, JSON, b'{"stream": true, "response_format": "wav"}'
    ) == {
        "sample_rate": "8000",
        "stream": "true",
        "response_format": "wav",
    }
    form = b"response_format=pcm&sample_rate=16000&stream=true"
    assert request_fields({}, "application/x-www-form-urlencoded", form)["sample_rate"] == "16000"
    assert request_fields({}, None, b'{"stream_format": "sse"}') == {"stream_format": "sse"}
    assert request_fields({}, JSON, b'{"truncated": ') == {}
    assert request_fields({}, "multipart/form-data; boundary=x", b"--x...") == {}


def test_media_type() -> None:
    assert media_type('audio/L16; rate="24000"; Channels=1') == (
        "audio/l16",
        {"rate": "24000", "channels": "1"},
    )
    assert media_type(None) == ("", {})


# -- openai-transcription-sse ----------------------------------------------------------------


def transcription(content_type: str = "text/event-stream") -> tuple[HttpAdapter, Recorder]:
    sink = Recorder()
    http = http_adapter("openai-transcription-sse", sink, DEFAULT)
    http.request("POST", {}, "multipart/form-data; boundary=b", b"--b...")
    return http, sink


def test_transcription_chunks_and_done() -> None:
    http, sink = transcription()
    http.request_complete(1.0)
    http.response_start(200, {"content-type": "text/event-stream; charset=utf-8"})
    chunk = {"object": "transcription.chunk", "choices": [{"delta": {"content": "hi"}}]}
    event = f"data: {json.dumps(chunk)}\n\n".encode()
    http.response_chunk(1.2, event[:30])
    http.response_chunk(1.3, event[30:])
    http.response_chunk(1.4, event + event + b"data: [DONE]\n\n")  # two at once: one event
    assert sink.calls == [("commit", 1.0), ("event", 1.3), ("event", 1.4), ("final", 1.4)]


def test_transcription_openai_event_types() -> None:
    http, sink = transcription()
    http.response_start(200, {"Content-Type": "text/event-stream"})
    http.response_chunk(0.1, b'data: {"type": "transcript.text.delta", "delta": "a"}\n\n')
    http.response_chunk(0.2, b'data: {"type": "transcript.text.done", "text": "a"}\n\n')
    assert sink.calls == [("event", 0.1), ("final", 0.2)]


def test_transcription_json_response_is_final_once() -> None:
    http, sink = transcription()
    http.request_complete(1.0)
    http.response_start(200, {"content-type": JSON})
    http.response_chunk(1.5, b'{"text": ')
    http.response_chunk(1.6, b'"hi"}')
    assert sink.calls == [("commit", 1.0), ("final", 1.5)]


# -- passthrough-http, factory, robustness ---------------------------------------------------


def test_passthrough_http_chunks_are_events_unless_error() -> None:
    sink = Recorder()
    http = http_adapter("passthrough-http", sink, DEFAULT)
    http.request("POST", {}, None, b"")
    http.request_complete(0.0)
    http.response_start(200, {})
    http.response_chunk(0.1, b"a")
    http.response_chunk(0.2, b"b")
    http.response_start(502, {})
    http.response_chunk(0.3, b"c")
    assert sink.calls == [("event", 0.1), ("event", 0.2)]


content_types = st.sampled_from(
    [
        "text/event-stream",
        "audio/wav",
        "audio/pcm",
        "audio/L16; rate=x",
        "audio/mpeg",
        "application/octet-stream",
        JSON,
        "",
    ]
)
request_values = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats()
request_keys = st.sampled_from(["sample_rate", "response_format", "stream_format", "stream"])
bodies = st.binary(max_size=100) | st.builds(
    lambda d: json.dumps(d).encode(), st.dictionaries(request_keys, request_values)
)
special_chunks = st.sampled_from([sse_delta(30), b"data: [DONE]\n\n", wav_header(0)])


@pytest.mark.parametrize("protocol", sorted(HTTP_ROUTE_PROTOCOLS))
@given(
    body=bodies,
    content_type=content_types,
    chunks=st.lists(st.binary(max_size=80) | special_chunks, max_size=10),
)
def test_adapters_never_raise_and_never_fail_internally(
    protocol: str, body: bytes, content_type: str, chunks: list[bytes]
) -> None:
    http = http_adapter(protocol, Recorder(), DEFAULT)
    http.request("POST", {"sample_rate": "-1"}, JSON, body)
    http.request_complete(0.0)
    http.response_start(200, {"content-type": content_type})
    for i, chunk in enumerate(chunks):
        http.response_chunk(float(i), chunk)
    assert http.errors == 0
