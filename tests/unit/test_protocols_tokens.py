"""The token-stream adapter (openai-completions-tokens): each generated token is a fixed
share of a second of audio, counted from the engine's own fields."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.metering.adapters import AudioFormat, HttpAdapter, http_adapter
from proxy.metering.adapters.tokens import event_tokens
from proxy.metering.session_meter import RecordingReplicaSink, SessionMeter
from tests.unit.test_protocols_http import Recorder

ORPHEUS = AudioFormat(24000, 1, 2, tokens_per_second=84.0)
SSE = {"Content-Type": "text/event-stream; charset=utf-8"}


def tokens(
    fmt: AudioFormat = ORPHEUS, status: int = 200, headers: Any = None
) -> tuple[HttpAdapter, Recorder]:
    sink = Recorder()
    adapter = http_adapter("openai-completions-tokens", sink, fmt)
    adapter.request("POST", {}, "application/json", b'{"prompt": "tara: hi", "stream": true}')
    adapter.response_start(status, SSE if headers is None else headers)
    return adapter, sink


def event(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {data}\n\n".encode()


def completion(text: str, **extra: Any) -> bytes:
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": None}
    return event({"choices": [choice], "object": "text_completion", **extra})


def chat(content: str) -> bytes:
    return event({"choices": [{"index": 0, "delta": {"content": content}}]})


def llama_final(total: int) -> bytes:
    """llama.cpp's last completions event: empty text, the usage and timings totals."""
    choice = {"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}
    usage = {"completion_tokens": total, "prompt_tokens": 5, "total_tokens": total + 5}
    return event({"choices": [choice], "usage": usage, "timings": {"predicted_n": total}})


def test_one_token_per_event_is_one_token_of_audio_and_done_ends_the_response() -> None:
    adapter, sink = tokens()
    adapter.response_chunk(1.0, completion("<custom_token_4012>"))
    adapter.response_chunk(1.1, completion("<custom_token_7>") + completion("<custom_token_9>"))
    adapter.response_chunk(1.2, llama_final(3) + event("[DONE]"))
    assert sink.calls == [
        ("audio", 1.0, pytest.approx(1 / 84)),
        ("audio", 1.1, pytest.approx(2 / 84)),  # one read, one arrival
        ("done", 1.2),
    ]
    assert adapter.tokens == 3  # type: ignore[attr-defined]
    assert adapter.errors == 0


def test_the_running_total_counts_tokens_the_stream_held_back() -> None:
    # llama.cpp sends nothing for a token that leaves incomplete UTF-8; vLLM may put
    # several tokens in one delta: the engine's total settles the count.
    adapter, sink = tokens(AudioFormat(tokens_per_second=10.0))
    adapter.response_chunk(1.0, completion("a"))
    adapter.response_chunk(2.0, completion("b"))
    adapter.response_chunk(3.0, llama_final(5))
    assert [c[:2] for c in sink.calls] == [("audio", 1.0), ("audio", 2.0), ("audio", 3.0)]
    assert sink.audio_seconds == pytest.approx(0.5)


def test_vllm_continuous_usage_counts_each_events_tokens_not_its_text() -> None:
    adapter, sink = tokens(AudioFormat(tokens_per_second=10.0))
    usage = {"prompt_tokens": 9}
    for now, total in ((1.0, 1), (1.5, 3), (2.0, 3), (2.5, 6)):
        usage["completion_tokens"] = total
        adapter.response_chunk(now, completion("x" * 40, usage=usage))
    assert sink.calls == [
        ("audio", 1.0, pytest.approx(0.1)),
        ("audio", 1.5, pytest.approx(0.2)),
        ("audio", 2.5, pytest.approx(0.3)),
    ]
    # vLLM's include_usage: a last event with no choices and the final usage.
    adapter.response_chunk(3.0, event({"choices": [], "usage": {"completion_tokens": 7}}))
    assert sink.calls[-1] == ("audio", 3.0, pytest.approx(0.1))
    # a total below the count adds nothing
    adapter.response_chunk(3.5, event({"choices": [], "usage": {"completion_tokens": 2}}))
    assert len(sink.calls) == 4


def test_chat_completion_deltas_and_llama_native_events_count_too() -> None:
    adapter, sink = tokens(AudioFormat(tokens_per_second=10.0))
    adapter.response_chunk(1.0, event({"choices": [{"delta": {"role": "assistant"}}]}))
    adapter.response_chunk(1.1, chat("<custom_token_1>"))
    adapter.response_chunk(1.2, chat(""))
    adapter.response_chunk(1.3, event({"content": "ab", "tokens": [17, 18], "stop": False}))
    adapter.response_chunk(1.4, event({"content": "c", "stop": False}))
    adapter.response_chunk(1.5, event({"content": "", "stop": True, "tokens_predicted": 5}))
    assert sink.calls == [
        ("audio", 1.1, pytest.approx(0.1)),
        ("audio", 1.3, pytest.approx(0.2)),
        ("audio", 1.4, pytest.approx(0.1)),
        ("audio", 1.5, pytest.approx(0.1)),
    ]


def test_events_split_anywhere_count_the_same() -> None:
    stream = b"".join(completion(f"<custom_token_{i}>") for i in range(20)) + llama_final(20)
    stream += event("[DONE]")
    for size in (1, 2, 7, 64, len(stream)):
        adapter, sink = tokens(AudioFormat(tokens_per_second=20.0))
        for at in range(0, len(stream), size):
            adapter.response_chunk(at, stream[at : at + size])
        assert sink.audio_seconds == pytest.approx(1.0)
        assert sink.calls[-1][0] == "done"


def test_errors_bodies_that_are_not_event_streams_and_junk_count_nothing() -> None:
    for status, headers in ((500, SSE), (200, {"content-type": "application/json"}), (200, {})):
        adapter, sink = tokens(status=status, headers=headers)
        adapter.response_chunk(1.0, completion("a"))
        assert sink.calls == []
    adapter, sink = tokens()
    junk = b'data: {not json\n\ndata: [1, 2]\n\ndata: {"choices": 3}\n\n'
    junk += event({"choices": [{"text": 7}, "x", {"delta": "y"}]})
    junk += event({"usage": {"completion_tokens": True}})  # not a count
    adapter.response_chunk(1.0, junk)
    assert sink.calls == [] and adapter.errors == 0


def test_an_oversized_event_is_dropped_whole() -> None:
    adapter, sink = tokens()
    adapter.response_chunk(1.0, completion("x" * 300_000))
    adapter.response_chunk(1.1, completion("a"))
    assert sink.calls == [("audio", 1.1, pytest.approx(1 / 84))]


def test_a_format_without_a_token_rate_meters_gaps_only() -> None:
    adapter, sink = tokens(AudioFormat())
    adapter.response_chunk(1.0, completion("a"))
    assert sink.calls == [("event", 1.0)]


def test_event_tokens_reads_the_stated_fields() -> None:
    assert event_tokens({"choices": [{"text": "a"}, {"text": "b"}]}) == (None, 2)
    assert event_tokens({"usage": {"completion_tokens": 4}, "choices": []}) == (4, 0)
    assert event_tokens({"timings": {"predicted_n": 9}}) == (9, 0)
    assert event_tokens({"tokens_predicted": -1, "tokens": [1]}) == (None, 1)


def test_the_meter_sees_a_token_stream_as_audio() -> None:
    """Through the real SessionMeter: delivery ratio and playback from token arrivals."""
    rec = RecordingReplicaSink()
    meter = SessionMeter(0.0, rec, prebuffer_s=0.2)
    adapter = http_adapter("openai-completions-tokens", meter, AudioFormat(tokens_per_second=10))
    adapter.response_start(200, SSE)
    now = 0.5
    for _ in range(10):  # 0.1 s of audio every 0.05 s: 2x realtime
        adapter.response_chunk(now, completion("t"))
        now += 0.05
    for _ in range(5):  # then every 0.3 s: the buffer runs dry
        now += 0.25
        adapter.response_chunk(now, completion("t"))
    adapter.response_chunk(now, llama_final(15) + event("[DONE]"))
    summary = meter.finish(now)
    assert rec.ratios[:9] == pytest.approx([2.0] * 9)
    assert min(rec.ratios) == pytest.approx(0.1 / 0.3)
    assert summary.audio_seconds == pytest.approx(1.5)
    assert rec.stalls  # modelled playback ran dry


@given(st.lists(st.integers(0, 5), max_size=40), st.integers(1, 500))
def test_audio_is_the_engines_total_over_the_rate(per_event: list[int], rate: int) -> None:
    adapter, sink = tokens(AudioFormat(tokens_per_second=float(rate)))
    body = b"".join(completion("t" if n else "", usage={"completion_tokens": sum(
        per_event[: i + 1])}) for i, n in enumerate(per_event))  # fmt: skip
    adapter.response_chunk(1.0, body)
    assert sink.audio_seconds == pytest.approx(sum(per_event) / rate)
