"""Workload files: YAML and JSONL, validation messages, audio, seeded sampling, bundles."""

from __future__ import annotations

import array
import base64
import collections
import io
import statistics
import wave
from pathlib import Path

import pytest

from proxy.probe.workload import (
    ASR_SAMPLE_RATE,
    AudioRequest,
    SpeechRequest,
    WorkloadError,
    bundled,
    load_workload,
    open_workload,
    read_wav,
)


def wav_bytes(samples: list[int], rate: int, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(array.array("h", samples).tobytes())
    return out.getvalue()


def test_yaml_with_defaults_weights_and_extra(tmp_path: Path) -> None:
    (tmp_path / "me.wav").write_bytes(b"RIFF-not-really")
    text = """
kind: tts
seed: 7
defaults: {voice: vivian, extra: {language: English}}
requests:
  - text: "Short."
    weight: 3
  - {text: "A second one.", voice: ryan, instructions: calm}
  - {text: "Clone me.", ref_audio: me.wav, ref_text: "what me.wav says"}
  - {text: "By URL.", ref_audio: "https://example.com/a.wav"}
"""
    w = load_workload(text, "w.yaml", tmp_path)
    assert (w.kind, w.seed, len(w.requests)) == ("tts", 7, 4)
    first, second, clone, url = w.requests
    assert isinstance(first, SpeechRequest) and first.weight == 3.0
    assert first.voice == "vivian" and first.extra == {"language": "English"}
    assert isinstance(second, SpeechRequest) and second.voice == "ryan"
    assert second.instructions == "calm"
    assert isinstance(clone, SpeechRequest) and clone.ref_audio is not None
    encoded = base64.b64encode(b"RIFF-not-really").decode()
    assert clone.ref_audio == "data:audio/wav;base64," + encoded
    assert isinstance(url, SpeechRequest) and url.ref_audio == "https://example.com/a.wav"


def test_jsonl_and_a_bare_list() -> None:
    w = load_workload('{"text": "one"}\n\n{"text": "two", "weight": 0.5}\n', "w.jsonl")
    assert w.kind == "tts"
    assert [r.text for r in w.requests if isinstance(r, SpeechRequest)] == ["one", "two"]
    listed = load_workload("- {text: a}\n- {text: b}\n", "list.yaml")
    assert len(listed.requests) == 2


@pytest.mark.parametrize(
    ("text", "source", "message"),
    [
        ("requests: []", "w.yaml", "no requests"),
        ("requests: [{text: a, colour: red}]", "w.yaml", r"unknown field\(s\) colour for a tts"),
        ("requests: [{voice: x}]", "w.yaml", r"requests\[0\]: 'text' is required"),
        ("requests: [{text: '  '}]", "w.yaml", "must not be blank"),
        ("requests: [{text: a, weight: 0}]", "w.yaml", "'weight' must be a number > 0"),
        ("requests: [{text: a, extra: [1]}]", "w.yaml", "'extra' must be a mapping"),
        ("kind: video\nrequests: [{text: a}]", "w.yaml", "'kind' must be tts or asr"),
        ("seed: x\nrequests: [{text: a}]", "w.yaml", "'seed' must be an integer"),
        ("requests: [{text: a}]\nmode: fast", "w.yaml", "unknown top-level field"),
        ("requests: {text: a}", "w.yaml", "a mapping with a 'requests' list"),
        ("requests: [1]", "w.yaml", "a request must be a mapping"),
        ("requests: [{text: 'a'", "w.yaml", "invalid YAML"),
        ('{"text": "a"}\n{"text": ', "w.jsonl", r"w.jsonl:2: invalid JSON"),
        ("kind: asr\nrequests: [{seconds: 3}]", "w.yaml", "'audio' \\(a WAV file\\) is required"),
        ("kind: asr\nrequests: [{audio: nope.wav}]", "w.yaml", "cannot read audio"),
        ("requests: [{text: a, ref_audio: nope.wav}]", "w.yaml", "cannot read ref_audio"),
    ],
)
def test_errors_say_where_and_why(text: str, source: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_workload(text, source, tmp_path)


def test_a_yaml_error_names_the_file_not_a_unicode_string(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError) as caught:
        load_workload("kind: tts\nrequests: [\n", "traffic/w.yaml", tmp_path)
    assert 'in "traffic/w.yaml", line 3' in str(caught.value)
    assert "<unicode string>" not in str(caught.value)


def test_asr_audio_is_mixed_down_resampled_and_looped(tmp_path: Path) -> None:
    # 0.5 s of stereo 48 kHz: left 1000, right 3000 -> mono 2000 at 16 kHz.
    (tmp_path / "s.wav").write_bytes(wav_bytes([1000, 3000] * 24000, 48000, channels=2))
    w = load_workload(
        "kind: asr\ndefaults: {audio: s.wav}\nrequests: [{}, {seconds: 1.25}, {seconds: 0.1}]",
        "a.yaml",
        tmp_path,
    )
    plain, looped, cut = w.requests
    assert isinstance(plain, AudioRequest) and isinstance(looped, AudioRequest)
    assert isinstance(cut, AudioRequest)
    assert plain.seconds == pytest.approx(0.5, abs=1e-3)
    assert set(array.array("h", plain.pcm)) == {2000}
    assert looped.seconds == pytest.approx(1.25) and cut.seconds == pytest.approx(0.1)
    assert w.preflight_request() is plain  # the median-length clip


def test_read_wav_refuses_what_it_cannot_use() -> None:
    with pytest.raises(WorkloadError, match="not a readable WAV"):
        read_wav(b"nope")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(8000)
        w.writeframes(b"\x80" * 800)
    with pytest.raises(WorkloadError, match="16-bit"):
        read_wav(out.getvalue())
    with pytest.raises(WorkloadError, match="no audio"):
        read_wav(wav_bytes([], 16000))


def test_sampling_is_seeded_and_weighted() -> None:
    w = load_workload("requests: [{text: a, weight: 3}, {text: b}]", "w.yaml")
    draws = [w.sampler(1).next() for _ in range(3)]
    assert draws[0] is draws[1] is draws[2]  # same seed, same first draw
    sampler = w.sampler(42)
    texts = [r.text for r in (sampler.next() for _ in range(4000)) if isinstance(r, SpeechRequest)]
    counts = collections.Counter(texts)
    assert counts["a"] / 4000 == pytest.approx(0.75, abs=0.03)
    a, b = w.sampler(5), w.sampler(5)
    assert [a.next() for _ in range(100)] == [b.next() for _ in range(100)]


def test_bundled_workloads_have_long_tails() -> None:
    tts = bundled("tts")
    lengths = sorted(len(r.text) for r in tts.requests if isinstance(r, SpeechRequest))
    assert tts.kind == "tts" and len(lengths) == 48
    p50, p90 = statistics.median(lengths), lengths[int(0.9 * len(lengths))]
    assert p90 / p50 > 2.5 and lengths[-1] / p50 > 5
    shortest = tts.preflight_request()
    assert isinstance(shortest, SpeechRequest) and len(shortest.text) == lengths[0]
    asr = bundled("asr")
    secs = sorted(r.seconds for r in asr.requests if isinstance(r, AudioRequest))
    assert asr.kind == "asr" and len(secs) == 24
    assert secs[-1] / statistics.median(secs) > 3
    clip = read_wav((Path(__file__).parents[2] / "proxy/probe/data/asr-clip.wav").read_bytes())
    assert len(clip) / (2 * ASR_SAMPLE_RATE) == pytest.approx(5.8, abs=0.1)


def test_open_workload_by_name_and_path(tmp_path: Path) -> None:
    assert open_workload("asr").kind == "asr"
    path = tmp_path / "mine.jsonl"
    path.write_text('{"text": "hello"}\n')
    assert open_workload(str(path)).source == str(path)
    with pytest.raises(WorkloadError, match="cannot read workload"):
        open_workload(str(tmp_path / "missing.yaml"))
