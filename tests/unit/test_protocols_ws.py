"""WebSocket adapters: what each protocol's frames turn into, and that nothing raises."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.metering.adapters import (
    WS_ROUTE_PROTOCOLS,
    AudioFormat,
    WsAdapter,
    http_adapter,
    ws_adapter,
)

DEFAULT = AudioFormat(24000, 1, 2)


class Recorder:
    """A MeterSink that records every call as (kind, now[, seconds])."""

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
    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]

    @property
    def audio_seconds(self) -> float:
        return sum(c[2] for c in self.calls if c[0] == "audio")


def j(**fields: Any) -> str:
    return json.dumps(fields)


def b64(nbytes: int) -> str:
    return base64.b64encode(bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)).decode()


def adapter(protocol: str, inner: str | None = None) -> tuple[WsAdapter, Recorder]:
    sink = Recorder()
    return ws_adapter(protocol, sink, DEFAULT, inner), sink


# -- vllm-omni-speech-ws -------------------------------------------------------------------


def test_ten_pcm_frames_of_a_fifth_of_a_second() -> None:
    ws, sink = adapter("vllm-omni-speech-ws")
    ws.upstream_text(0.0, j(type="audio.start", format="pcm", sample_rate=24000))
    for i in range(10):
        ws.upstream_binary(0.1 + i * 0.2, bytes(9600))
    ws.upstream_text(2.1, j(type="audio.done"))
    assert sink.kinds == ["audio"] * 10 + ["done"]
    assert all(c[2] == 0.2 for c in sink.calls[:10])


def test_omni_speech_format_from_audio_start() -> None:
    ws, sink = adapter("vllm-omni-speech-ws")
    ws.upstream_binary(0.0, bytes(48000))  # before audio.start: the route default
    ws.upstream_text(0.1, j(type="audio.start", format="pcm", sample_rate=44100, channels=2))
    ws.upstream_binary(0.2, bytes(44100 * 4))
    assert [c[2] for c in sink.calls] == [1.0, 1.0]


def test_omni_speech_reads_binary_content_only_for_wav() -> None:
    """PCM is metered by length (the relay passes ``b""`` and the size, copying nothing);
    WAV headers are read, so the adapter asks for the content while WAV is announced."""
    ws, sink = adapter("vllm-omni-speech-ws")
    assert ws.reads_binary is False
    ws.upstream_binary(0.0, b"", 48000)  # the route default, by length
    ws.upstream_text(0.1, j(type="audio.start", format="wav", sample_rate=16000))
    assert ws.reads_binary is True
    ws.upstream_text(0.2, j(type="audio.start", format="mp3"))
    assert ws.reads_binary is False
    ws.upstream_text(0.3, j(type="audio.start", format="pcm", sample_rate=16000))
    assert ws.reads_binary is False
    ws.upstream_binary(0.4, b"", 32000)
    ws.upstream_binary(0.5, bytes(16000))  # content without a size: its length
    assert [c[2] for c in sink.calls] == [1.0, 1.0, 0.5]
    assert ws.errors == 0


@pytest.mark.parametrize("protocol", sorted(WS_ROUTE_PROTOCOLS - {"vllm-omni-speech-ws"}))
def test_other_adapters_never_read_binary_content(protocol: str) -> None:
    ws, _ = adapter(protocol, "vllm-omni-speech-ws" if protocol == "sagemaker-bidi" else None)
    assert ws.reads_binary is False


def test_omni_speech_wav_header_per_utterance_split_across_frames() -> None:
    fmt = struct.pack("<HHIIHH", 1, 1, 16000, 32000, 2, 16)
    header = b"RIFF\xff\xff\xff\xffWAVEfmt \x10\x00\x00\x00" + fmt + b"data\xff\xff\xff\xff"
    ws, sink = adapter("vllm-omni-speech-ws")
    for utterance in range(2):
        ws.upstream_text(utterance, j(type="audio.start", format="wav", sample_rate=16000))
        ws.upstream_binary(utterance + 0.1, header[:20])
        ws.upstream_binary(utterance + 0.2, header[20:] + bytes(16000))
        ws.upstream_binary(utterance + 0.3, bytes(16000))
        ws.upstream_text(utterance + 0.4, j(type="audio.done"))
    assert sink.kinds == ["audio", "audio", "done"] * 2
    assert sink.audio_seconds == 2.0


def test_omni_speech_compressed_frames_are_gap_only_events() -> None:
    ws, sink = adapter("vllm-omni-speech-ws")
    ws.upstream_text(0.0, j(type="audio.start", format="mp3"))
    ws.upstream_binary(0.1, b"\xff\xfb" + bytes(400))
    assert sink.kinds == ["event"]


def test_omni_speech_other_frames_pass_unmetered() -> None:
    ws, sink = adapter("vllm-omni-speech-ws")
    ws.client_text(0.0, j(type="input.text", text="hello"))
    ws.client_binary(0.0, b"xx")
    ws.upstream_text(0.1, j(type="session.config.ack"))
    ws.upstream_text(0.1, j(type="error", message="bad"))
    ws.upstream_binary(0.2, b"")
    assert sink.calls == []
    ws.upstream_text(0.3, j(type="session.done"))
    assert sink.kinds == ["done"]


def test_omni_speech_sentences_of_a_flush_are_one_response() -> None:
    ws, sink = adapter("vllm-omni-speech-ws")
    ws.client_text(0.0, j(type="input.text", text="One. Two. input.done"))  # not a flush
    ws.upstream_text(0.5, j(type="audio.done"))
    ws.client_text(1.0, j(type="input.done"))
    ws.upstream_text(1.5, j(type="audio.done"))  # more sentences of this flush follow
    ws.upstream_text(2.0, j(type="audio.done"))
    ws.upstream_text(2.0, j(type="session.done"))
    ws.upstream_text(3.0, j(type="audio.done"))  # the client is typing again
    assert sink.calls == [("done", 0.5), ("end", 1.5), ("end", 2.0), ("done", 2.0), ("done", 3.0)]


# -- vllm-realtime -------------------------------------------------------------------------


def test_vllm_asr_events() -> None:
    ws, sink = adapter("vllm-realtime")
    ws.client_text(0.0, j(type="input_audio_buffer.append", audio=b64(3200)))
    ws.client_text(0.1, j(type="input_audio_buffer.commit"))  # starts generation only
    ws.upstream_text(0.2, j(type="transcription.delta", delta="Hel"))
    ws.upstream_text(0.3, j(type="transcription.delta", delta="lo"))
    ws.client_text(0.4, j(type="input_audio_buffer.commit", final=True))
    ws.upstream_text(0.7, j(type="transcription.done", text="Hello", usage={}))
    assert sink.calls == [("event", 0.2), ("event", 0.3), ("commit", 0.4), ("final", 0.7)]


def test_vllm_large_client_append_is_cheap_and_unmetered() -> None:
    ws, sink = adapter("vllm-realtime")
    ws.client_text(0.0, j(type="input_audio_buffer.append", audio=b64(32000)))
    ws.client_text(
        0.1, '{"type":"input_audio_buffer.commit","final":true,"audio":"' + b64(900) + '"}'
    )
    assert sink.calls == [("commit", 0.1)]


def test_vllm_omni_audio_delta_at_its_sample_rate() -> None:
    ws, sink = adapter("vllm-realtime")
    ws.upstream_text(0.0, j(type="response.audio.delta", audio=b64(4800), sample_rate_hz=24000))
    ws.upstream_text(0.1, j(type="response.audio.delta", audio=b64(4800), sample_rate_hz=16000))
    ws.upstream_text(0.2, j(type="response.output_audio.delta", delta=b64(480)))
    ws.upstream_text(0.3, j(type="response.audio.done", has_audio=True))
    assert sink.calls == [
        ("audio", 0.0, 0.1),
        ("audio", 0.1, 0.15),
        ("audio", 0.2, 0.01),
        ("done", 0.3),
    ]


def test_vllm_ignores_openai_only_markers_and_binary() -> None:
    ws, sink = adapter("vllm-realtime")
    ws.upstream_text(0.0, j(type="input_audio_buffer.committed"))
    ws.upstream_text(0.0, j(type="session.updated", session={"output_audio_format": "g711_ulaw"}))
    ws.upstream_binary(0.0, bytes(100))
    ws.upstream_text(0.1, j(type="response.audio.delta", audio=b64(4800)))
    assert sink.calls == [("audio", 0.1, 0.1)]


# -- openai-realtime -----------------------------------------------------------------------


def test_openai_audio_deltas_beta_and_ga() -> None:
    ws, sink = adapter("openai-realtime")
    ws.upstream_text(0.0, j(type="response.output_audio.delta", response_id="r", delta=b64(4800)))
    ws.upstream_text(0.1, j(type="response.audio.delta", delta=b64(9600)))
    ws.upstream_text(0.2, j(type="response.output_audio_transcript.delta", delta="hi"))
    ws.upstream_text(0.3, j(type="response.output_audio.done"))
    ws.upstream_text(0.3, j(type="response.audio.done"))
    ws.upstream_text(0.4, j(type="response.done", response={}))
    assert sink.calls == [
        ("audio", 0.0, 0.1),
        ("audio", 0.1, 0.2),
        ("event", 0.2),
        ("end", 0.3),
        ("end", 0.3),
        ("done", 0.4),
    ]


@pytest.mark.parametrize(
    ("session", "seconds"),
    [
        ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}}}}, 0.1),
        ({"audio": {"output": {"format": {"type": "audio/pcmu"}}}}, 0.6),
        ({"audio": {"output": {"format": {"type": "audio/pcma"}}}}, 0.6),
        ({"output_audio_format": "g711_alaw"}, 0.6),
        ({"output_audio_format": "pcm16"}, 0.1),
        ({"instructions": "no format here"}, 0.1),
    ],
)
def test_openai_session_format(session: dict[str, Any], seconds: float) -> None:
    ws, sink = adapter("openai-realtime")
    ws.upstream_text(0.0, j(type="session.updated", session=session))
    ws.upstream_text(0.1, j(type="response.output_audio.delta", delta=b64(4800)))
    assert sink.calls == [("audio", 0.1, pytest.approx(seconds))]


def test_a_client_session_update_does_not_set_the_metered_format() -> None:
    """Only the upstream's session.created/updated says what the audio is: a client's
    request alone cannot skew the meter (and the guard that reads it)."""
    ws, sink = adapter("openai-realtime")
    session = {"audio": {"output": {"format": {"type": "audio/pcmu"}}}}
    ws.client_text(0.0, j(type="session.update", session=session))
    ws.upstream_text(0.1, j(type="response.output_audio.delta", delta=b64(4800)))
    assert sink.calls == [("audio", 0.1, pytest.approx(0.1))]


def test_openai_asr_turns() -> None:
    ws, sink = adapter("openai-realtime")
    ws.client_text(1.0, j(type="input_audio_buffer.commit"))
    ws.upstream_text(1.1, j(type="input_audio_buffer.committed", item_id="i"))
    ws.upstream_text(1.2, j(type="conversation.item.input_audio_transcription.delta", delta="a"))
    ws.upstream_text(1.5, j(type="conversation.item.input_audio_transcription.completed"))
    assert sink.calls == [("commit", 1.0), ("commit", 1.1), ("event", 1.2), ("final", 1.5)]


def test_large_event_fast_path_matches_small_event() -> None:
    small, big = adapter("openai-realtime"), adapter("openai-realtime")
    small[0].upstream_text(0.0, j(type="response.output_audio.delta", delta=b64(300)))
    big[0].upstream_text(
        0.0, json.dumps({"delta": b64(48000), "type": "response.output_audio.delta"})
    )
    assert small[1].calls == [("audio", 0.0, 300 / 48000)]
    assert big[1].calls == [("audio", 0.0, 1.0)]


# -- passthrough, sagemaker, factories -----------------------------------------------------


def test_passthrough_counts_each_upstream_frame_as_an_event() -> None:
    ws, sink = adapter("passthrough-ws")
    ws.upstream_text(0.0, "anything")
    ws.upstream_binary(0.1, bytes(9600))
    ws.client_text(0.2, "x")
    ws.client_binary(0.2, b"x")
    assert sink.calls == [("event", 0.0), ("event", 0.1)]


def test_sagemaker_bidi_meters_its_inner_protocol() -> None:
    ws, sink = adapter("sagemaker-bidi", "vllm-omni-speech-ws")
    ws.upstream_binary(0.0, bytes(4800))
    assert sink.calls == [("audio", 0.0, 0.1)]
    ws, sink = adapter("sagemaker-bidi")
    ws.upstream_binary(0.0, bytes(4800))
    assert sink.calls == [("event", 0.0)]


@pytest.mark.parametrize("inner", ["sagemaker-bidi", "openai-speech-http", "nope"])
def test_sagemaker_bidi_rejects_a_bad_inner_protocol(inner: str) -> None:
    with pytest.raises(ValueError, match="inner protocol"):
        adapter("sagemaker-bidi", inner)


@pytest.mark.parametrize("protocol", ["openai-speech-http", "passthrough-http", "vllm"])
def test_ws_factory_rejects_other_protocols(protocol: str) -> None:
    with pytest.raises(ValueError, match="not a WebSocket protocol"):
        ws_adapter(protocol, Recorder(), DEFAULT)


@pytest.mark.parametrize("protocol", sorted(WS_ROUTE_PROTOCOLS))
def test_http_factory_rejects_ws_protocols(protocol: str) -> None:
    with pytest.raises(ValueError, match="not an HTTP protocol"):
        http_adapter(protocol, Recorder(), DEFAULT)


class ExplodingSink(Recorder):
    def audio(self, now: float, seconds: float) -> None:
        raise RuntimeError("boom")

    def event(self, now: float) -> None:
        raise RuntimeError("boom")


def test_a_failing_sink_is_counted_not_raised() -> None:
    for protocol in sorted(WS_ROUTE_PROTOCOLS):
        ws = ws_adapter(protocol, ExplodingSink(), DEFAULT)
        ws.upstream_binary(0.0, bytes(4800))
        ws.upstream_text(0.0, j(type="response.output_audio.delta", delta=b64(480)))
        ws.upstream_text(0.0, j(type="transcription.delta", delta="x"))
        assert ws.errors >= 1, protocol


frames = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200),
    st.builds(
        lambda t, extra: json.dumps({"type": t, **extra}),
        st.sampled_from(
            [
                "audio.start",
                "audio.done",
                "response.audio.delta",
                "response.output_audio.delta",
                "transcription.delta",
                "transcription.done",
                "session.updated",
                "session.update",
                "input_audio_buffer.commit",
                "response.done",
                "x",
            ]
        ),
        st.dictionaries(
            st.sampled_from(
                [
                    "delta",
                    "audio",
                    "format",
                    "sample_rate",
                    "sample_rate_hz",
                    "channels",
                    "session",
                    "final",
                ]
            ),
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats()
            | st.text(max_size=20)
            | st.dictionaries(st.text(max_size=6), st.text(max_size=6) | st.integers()),
        ),
    ),
)


@pytest.mark.parametrize("protocol", sorted(WS_ROUTE_PROTOCOLS))
@given(messages=st.lists(st.tuples(st.booleans(), frames), max_size=20))
def test_adapters_never_raise_and_never_fail_internally(
    protocol: str, messages: list[tuple[bool, str | bytes]]
) -> None:
    sink = Recorder()
    ws = ws_adapter(protocol, sink, DEFAULT, "vllm-omni-speech-ws")
    for i, (from_client, message) in enumerate(messages):
        if isinstance(message, bytes):
            (ws.client_binary if from_client else ws.upstream_binary)(float(i), message)
        else:
            (ws.client_text if from_client else ws.upstream_text)(float(i), message)
    assert ws.errors == 0
    assert all(c[2] >= 0 for c in sink.calls if c[0] == "audio")
