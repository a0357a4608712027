"""The probe's openai-completions-tokens client: its options and its request."""

from __future__ import annotations

import math

import pytest

from proxy.probe.completions_session import CHARACTERS_PER_SECOND, completion_body
from proxy.probe.probe_command import main
from proxy.probe.probe_session import ClientOptions, endpoint_url
from proxy.probe.workload import SpeechRequest

URL = "http://127.0.0.1:9/v1/completions"


def options(**extra: object) -> ClientOptions:
    return ClientOptions(url=URL, protocol="openai-completions-tokens", **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "argv",
    [
        ["--protocol", "openai-completions-tokens"],
        ["--protocol", "openai-speech-http", "--tokens-per-audio-second", "82"],
        ["--protocol", "openai-completions-tokens", "--tokens-per-audio-second", "0"],
        ["--protocol", "openai-completions-tokens", "--tokens-per-audio-second", "nan"],
    ],
)
def test_the_token_rate_is_required_for_and_only_for_the_token_protocol(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--target", "http://127.0.0.1:9", "--quiet", *argv]) == 2
    assert "--tokens-per-audio-second" in capsys.readouterr().err


def test_the_request_is_sized_from_the_text_at_the_token_rate() -> None:
    text = "x" * 140
    body = completion_body(options(tokens_per_audio_second=82.03), SpeechRequest(text=text))
    assert body["prompt"] == text and body["stream"] is True
    assert body["max_tokens"] == math.ceil(140 / CHARACTERS_PER_SECOND * 82.03)
    assert body["stream_options"] == {"include_usage": True}
    voiced = SpeechRequest(text="Hi.", voice="tara", extra={"max_tokens": 7, "ignore_eos": True})
    body = completion_body(options(tokens_per_audio_second=8), voiced)
    assert body["prompt"] == "tara: Hi." and body["max_tokens"] == 7 and body["ignore_eos"]
    with pytest.raises(ValueError, match="tokens_per_audio_second"):
        completion_body(options(), voiced)


def test_the_default_path_is_completions() -> None:
    assert endpoint_url("http://h:8000", "openai-completions-tokens") == (
        "http://h:8000/v1/completions"
    )
