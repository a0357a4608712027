"""Pure helpers: the speech synthesiser, WAV, multipart, text splitting, transcripts."""

from __future__ import annotations

import itertools

import pytest

from proxy.sim.audio import (
    SpeechAudio,
    pcm_duration_s,
    split_sentences,
    synthesize,
    wav_header,
    words_for_tokens,
)
from proxy.sim.multipart import MultipartError, parse_multipart
from proxy.sim.speech_ws_api import TextSplitter
from proxy.sim.transcription import audio_duration_s


def test_token_ranges_tile_the_utterance_exactly() -> None:
    audio = SpeechAudio(24000, "vivian")
    audio.extend("Tokens map to samples without gaps or overlaps. Really!")
    rate = 12.5
    tokens = audio.tokens(rate)
    cuts = [0, 4, *range(29, tokens, 25), tokens]
    pieces = [audio.token_range(a, b, rate, final=b == tokens) for a, b in itertools.pairwise(cuts)]
    assert b"".join(pieces) == audio.render(0, audio.total_samples)
    assert all(len(p) % 2 == 0 for p in pieces)
    assert tokens == -(-audio.total_samples * rate // 24000)


def test_speech_is_deterministic_and_paced_like_speech() -> None:
    text = "The quick brown fox jumps over the lazy dog."
    a = synthesize(text, 24000, "x")
    assert a == synthesize(text, 24000, "x")
    assert a != synthesize(text, 24000, "y")
    seconds = pcm_duration_s(len(a), 24000)
    assert 1.5 < 9 / seconds < 4.0  # words per second of natural speech
    slow = synthesize(text, 24000, "x", speed=0.5)
    assert len(slow) > 1.6 * len(a)


def test_question_rises_and_cjk_is_spoken() -> None:
    assert synthesize("你好世界", 16000) != b""
    assert synthesize("Ready?", 16000) != synthesize("Ready.", 16000)


@pytest.mark.parametrize("rate", [3000, 200000])
def test_rejects_silly_sample_rates(rate: int) -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        SpeechAudio(rate)


def test_wav_header_fields() -> None:
    header = wav_header(16000, 3200)
    assert len(header) == 44
    assert header[:4] == b"RIFF"
    assert int.from_bytes(header[4:8], "little") == 36 + 3200
    assert int.from_bytes(header[24:28], "little") == 16000
    assert int.from_bytes(header[28:32], "little") == 32000
    assert int.from_bytes(header[40:44], "little") == 3200
    assert wav_header(24000)[40:44] == b"\xff" * 4
    assert audio_duration_s(header + bytes(3200), "a.wav", "") == pytest.approx(0.1)
    assert audio_duration_s(wav_header(16000) + bytes(3200), "a.wav", "") == pytest.approx(0.1)


def test_audio_duration_rejects_other_formats() -> None:
    eight_bit = bytearray(wav_header(8000, 10))
    eight_bit[34:36] = (8).to_bytes(2, "little")
    with pytest.raises(ValueError, match="16-bit"):
        audio_duration_s(bytes(eight_bit) + bytes(10), "a.wav", "audio/wav")
    with pytest.raises(ValueError, match="even number"):
        audio_duration_s(b"abc", "a.pcm", "")
    assert audio_duration_s(bytes(32000), "x.raw", "") == 1.0


def test_sentences_and_transcript_words() -> None:
    assert split_sentences("One. Two? Three") == ["One.", "Two?", "Three"]
    words = words_for_tokens(7, 0, 125, 12.5)  # 10 s of audio
    assert len(words.split()) == 25
    assert words == words_for_tokens(7, 0, 125, 12.5)
    halves = words_for_tokens(7, 0, 60, 12.5) + words_for_tokens(7, 60, 125, 12.5)
    assert halves == words


def test_text_splitter_granularities() -> None:
    none = TextSplitter("none")
    assert none.feed("Hello. World") == []
    assert none.flush() == ["Hello. World"]
    sentence = TextSplitter("sentence")
    assert sentence.feed("Hello. Wor") == ["Hello."]
    assert sentence.feed("ld, again! Tail") == ["World, again!"]
    assert sentence.flush() == ["Tail"]
    assert sentence.flush() == []
    clause = TextSplitter("clause")
    assert clause.feed("a, b; c") == ["a,", "b;"]


def test_multipart_parser() -> None:
    body = (
        b"--XyZ\r\n"
        b'Content-Disposition: form-data; name="model"\r\n\r\n'
        b"m1\r\n"
        b"--XyZ\r\n"
        b'Content-Disposition: form-data; name="file"; filename="a b.wav"\r\n'
        b"Content-Type: audio/wav\r\n\r\n"
        b"RIFF\r\n--not-a-boundary\r\n"
        b"--XyZ--\r\n"
    )
    form = parse_multipart(body, "multipart/form-data; boundary=XyZ")
    assert form.text("model") == "m1"
    upload = form.get("file")
    assert upload is not None
    assert upload.filename == "a b.wav"
    assert upload.content_type == "audio/wav"
    assert upload.data == b"RIFF\r\n--not-a-boundary"
    assert form.text("missing") == ""


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (b"", "application/json", "multipart/form-data"),
        (b"", "multipart/form-data", "boundary"),
        (b"--b\r\nx\r\n", "multipart/form-data; boundary=b", "closing boundary"),
        (b"--b\r\nno headers\r\n--b--", "multipart/form-data; boundary=b", "without headers"),
        (b"--b\r\nX: y\r\n\r\nv\r\n--b--", "multipart/form-data; boundary=b", "Content-Disp"),
    ],
)
def test_multipart_errors(body: bytes, content_type: str, message: str) -> None:
    with pytest.raises(MultipartError, match=message):
        parse_multipart(body, content_type)
