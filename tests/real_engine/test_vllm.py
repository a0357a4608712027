"""vLLM itself behind Headroom: token-stream speech on ``/v1/completions`` and
``/v1/chat/completions`` through an ``openai-completions-tokens`` route, driven with the
OpenAI SDK against vLLM's CPU build serving a tiny random-weight Llama
(``python -m bench.vllm_engine`` installs and builds both; .ci/run runs it first).

One server serves the whole module. What the client receives through Headroom equals
what it receives straight from vLLM (every SSE event in order, payloads without the
per-run id and timestamp, ``[DONE]``) for the same greedy request; Headroom's meter
counts exactly the tokens vLLM reported (``usage.completion_tokens`` over the route's
tokens per audio second); at the cap a newcomer gets 503 with Retry-After and the
reason, and vLLM never sees it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from bench.vllm_engine import VllmServer, ensure_model, vllm_server
from tests.real_engine.vllm_support import (
    gateway,
    metric_value,
    need_vllm,
    normalize_sse,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm_completions"),
    pytest.mark.asyncio(loop_scope="module"),
]

#: Every generated token is 20 ms of audio.
TOKENS_PER_AUDIO_SECOND = 50.0
ROUTES = [
    {"path": path, "protocol": "openai-completions-tokens",
     "tokens_per_audio_second": TOKENS_PER_AUDIO_SECOND}
    for path in ("/v1/completions", "/v1/chat/completions")
]  # fmt: skip
#: The engine's fields the meter counts: a running ``usage`` on every event. A random
#: byte-level model streams many tokens as empty text, so text is no count.
USAGE = {"include_usage": True, "continuous_usage_stats": True}
#: Greedy, no early stop: the same request gives the same tokens on both sides.
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 0, "extra_body": {"ignore_eos": True}}
AUDIO = "headroom_audio_delivered_seconds_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm() -> AsyncIterator[VllmServer]:
    engine = need_vllm()
    model = await asyncio.to_thread(ensure_model, engine, "llama")
    async with vllm_server(engine, model, name="tiny", max_num_seqs=4,
                           max_model_len=2048) as server:  # fmt: skip
        yield server


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def completion_events(url: str, chat: bool, max_tokens: int) -> list[str]:
    """The raw SSE lines of one streamed request, through the SDK's streaming response."""
    async with client(url) as sdk:
        return await _completion_events(sdk, chat, max_tokens)


async def _completion_events(sdk: openai.AsyncOpenAI, chat: bool, max_tokens: int) -> list[str]:
    if chat:
        request = sdk.chat.completions.with_streaming_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello world"}],
            max_tokens=max_tokens, stream=True, stream_options=USAGE, **GREEDY,
        )  # fmt: skip
    else:
        request = sdk.completions.with_streaming_response.create(
            model="tiny", prompt="hello world", max_tokens=max_tokens, stream=True,
            stream_options=USAGE, **GREEDY,
        )  # fmt: skip
    async with request as response:
        assert response.status_code == 200
        return [line async for line in response.iter_lines()]


async def parsed_chunks(url: str, chat: bool, max_tokens: int) -> list[dict[str, Any]]:
    """The same request read as the SDK's typed chunks (ids and timestamps dropped)."""
    async with client(url) as sdk:
        return await _parsed_chunks(sdk, chat, max_tokens)


async def _parsed_chunks(
    sdk: openai.AsyncOpenAI, chat: bool, max_tokens: int
) -> list[dict[str, Any]]:
    stream: Any
    if chat:
        stream = await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello world"}],
            max_tokens=max_tokens, stream=True, stream_options=USAGE, **GREEDY,
        )  # fmt: skip
    else:
        stream = await sdk.completions.create(
            model="tiny", prompt="hello world", max_tokens=max_tokens, stream=True,
            stream_options=USAGE, **GREEDY,
        )  # fmt: skip
    return [chunk.model_dump(exclude={"id", "created"}) async for chunk in stream]


def merged(events: list[Any]) -> dict[str, Any]:
    """What a stream says once vLLM's grouping of tokens into events is set aside: its
    text, finish reasons, final usage, the usage counts in order, and its last line.
    vLLM merges the outputs of several engine steps into one event when its API server
    reads them late (the grouping depends on timing, direct as through Headroom), so
    equal streams are compared by this, and every event must be one of the stream's.
    Works on parsed SSE events and on the SDK's chunks alike."""
    text, finishes, counts = [], [], []
    usage: Any = None
    for event in events:
        if not isinstance(event, dict):
            continue
        for choice in event.get("choices") or []:
            delta = choice.get("delta")
            text.append((delta or {}).get("content") or choice.get("text") or "")
            if choice.get("finish_reason") is not None:
                finishes.append(choice["finish_reason"])
        if event.get("usage"):
            usage = event["usage"]
            counts.append(usage["completion_tokens"])
    assert counts == sorted(counts), counts  # usage only grows
    return {
        "text": "".join(text),
        "finish": finishes,
        "usage": usage,
        "last": events[-1] if events and not isinstance(events[-1], dict) else None,
    }


def completion_tokens(events: list[Any]) -> int:
    """The engine's own count: the last ``usage.completion_tokens`` it sent."""
    totals = [e["usage"]["completion_tokens"] for e in events
              if isinstance(e, dict) and e.get("usage")]  # fmt: skip
    assert totals, events
    return int(totals[-1])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_stream_through_headroom_equals_direct_and_is_metered_exactly(
    vllm: VllmServer, chat: bool
) -> None:
    max_tokens = 64
    direct = normalize_sse(await completion_events(vllm.url, chat, max_tokens))
    direct_chunks = await parsed_chunks(vllm.url, chat, max_tokens)
    async with gateway(vllm, ROUTES, cap=2) as url:
        before = await metric_value(url, AUDIO)
        relayed = normalize_sse(await completion_events(url, chat, max_tokens))
        relayed_chunks = await parsed_chunks(url, chat, max_tokens)
        tokens = completion_tokens(relayed)
        expected = before + 2 * tokens / TOKENS_PER_AUDIO_SECOND
        metered = await wait_for(lambda: metric_value(url, AUDIO),
                                 lambda v: v >= expected - 1e-9)  # fmt: skip
    assert merged(relayed) == merged(direct)
    assert relayed[-1] == "data: [DONE]"
    assert merged(relayed_chunks) == merged(direct_chunks)
    # Every event relayed is an event vLLM sends (same fields, same shape).
    assert {tuple(sorted(e)) for e in relayed if isinstance(e, dict)} == {
        tuple(sorted(e)) for e in direct if isinstance(e, dict)
    }
    assert tokens == max_tokens  # ignore_eos: the engine ran to max_tokens
    assert metered == pytest.approx(expected, abs=1e-9)


async def engine_idle(url: str) -> float:
    """Requests running or waiting at vLLM."""
    running = await metric_value(url, "vllm:num_requests_running")
    return running + await metric_value(url, "vllm:num_requests_waiting")


async def test_a_newcomer_at_the_cap_is_refused_and_never_reaches_vllm(
    vllm: VllmServer,
) -> None:
    idle = await wait_for(lambda: engine_idle(vllm.url), lambda v: v == 0)
    assert idle == 0
    prompts_before = await metric_value(vllm.url, PROMPT_TOKENS)
    async with gateway(vllm, ROUTES, cap=1) as url, client(url) as sdk:
        # The held session: a long greedy stream, its first chunk read, then left open.
        held = await sdk.completions.create(
            model="tiny", prompt="hello world", max_tokens=1900, stream=True,
            stream_options=USAGE, **GREEDY,
        )  # fmt: skip
        try:
            first = await held.__anext__()
            assert first.usage is not None
            held_prompt = first.usage.prompt_tokens
            with pytest.raises(openai.APIStatusError) as refused:
                await sdk.completions.create(
                    model="tiny", prompt="a newcomer at the cap", max_tokens=8,
                    stream=True, stream_options=USAGE, **GREEDY,
                )  # fmt: skip
        finally:
            await held.close()
    response = refused.value.response
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert response.headers["x-headroom-reason"]
    # Once nothing runs or waits at vLLM, every request that reached it has had its
    # prompt counted: only the held session's.
    idle = await wait_for(lambda: engine_idle(vllm.url), lambda v: v == 0)
    assert idle == 0
    prompts = await metric_value(vllm.url, PROMPT_TOKENS)
    assert prompts - prompts_before == held_prompt
