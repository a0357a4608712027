"""Capacity against vLLM itself (``bench/vllm_capacity.py``): the probe and the overload,
streams that bypass Headroom and the caps they take, refusals at the cap, all through an
``openai-completions-tokens`` route to vLLM's CPU build serving the tiny Llama.

One server serves the module, niced (its session's scheduling group too:
:func:`bench.vllm_engine.nice_session`), with ``--max-num-seqs 2`` and requests of
1,000 tokens (``ignore_eos``), so that its batch limit is the bottleneck: a third stream
waits in vLLM's own queue (``vllm:num_requests_waiting``) for a running one to end,
longer than the probe's TTFA limit once two wait. Each SSE event carries vLLM's running
usage and ``--stream-interval`` tokens, 2 s of audio at the route's 12.5 tokens a second
(80 ms a token, as Qwen3-TTS's).

No figure is fixed in advance: the probe measures the ceiling, the overload runs at the
low end of the range it saw. Through Headroom at that cap no admitted stream's modelled
playback runs dry; straight at vLLM with three times as many users, streams run dry or
their slow tail falls below the 1.2x margin, or vLLM queues requests while the time to
first audio breaks the probe's limit. Clients that go straight to vLLM show in the
gateway's ``headroom_engine_unadmitted_streams`` and lower its cap
(``headroom_session_slots``) until they leave.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bench.vllm_capacity import (
    MODEL,
    probe_and_overload,
    reconcile_timeline,
    refusal_latency,
    render,
    workload_file,
)
from bench.vllm_engine import ensure_model, vllm_server
from tests.real_engine.vllm_support import need_vllm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm_capacity"),
    pytest.mark.asyncio(loop_scope="module"),
]

SLOTS = 2  #: vLLM's --max-num-seqs
TOKENS_PER_AUDIO_SECOND = 12.5
MAX_TOKENS = 1000  #: every request's length: 80 s of audio
HELD_TOKENS = 4000  #: the streams holding the cap while refusals are timed
STREAM_INTERVAL = 25  #: tokens per SSE event
TTFA_LIMIT_S = 3.0  #: the real-engine tier's TTFA p99 limit
#: The CI version of bench.real_engine's probe and overload (6 s holds, one repeat); the
#: direct side offers at least three times vLLM's slots, so that two requests or more
#: wait there even when a busy moment made the probed cap 1.
SHORT = ["--max-level", str(4 * SLOTS), "--hold", "6", "--warmup", "4", "--repeat", "1",
         "--ttfa-limit", str(TTFA_LIMIT_S), "--probe-time-limit", "300", "--load", "3",
         "--overload-hold", "15", "--overload-warmup", "5", "--clients", "2",
         "--min-users", str(3 * SLOTS)]  # fmt: skip
#: The delivery-ratio margin a ceiling keeps (the guard's default threshold).
GUARD = 1.2


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_url() -> AsyncIterator[str]:
    engine = need_vllm()
    model = await asyncio.to_thread(ensure_model, engine, "llama")
    extra = ("--stream-interval", str(STREAM_INTERVAL))
    async with vllm_server(
        engine, model, name=MODEL, max_num_seqs=SLOTS, max_model_len=4096, extra=extra
    ) as server:
        group = await asyncio.to_thread(Path(f"/proc/{server.pid}/autogroup").read_text)
        assert group.rstrip().endswith("nice 10"), f"vLLM's session group is not niced: {group}"
        yield server.url


async def test_probe_and_three_times_its_ceiling_through_headroom_and_direct(
    vllm_url: str,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workload = workload_file(Path(tmp), MAX_TOKENS)
        result = await probe_and_overload(vllm_url, workload, TOKENS_PER_AUDIO_SECOND, SHORT)
    print(render({"overload": result}))
    probe = result["probe"]
    low, high = probe["ceiling_range"]
    assert 1 <= low <= probe["ceiling"] <= high, render({"overload": result})
    assert result["cap"] == low
    headroom, direct = result["headroom"], result["direct"]
    assert headroom["chunks"] > 0 and headroom["errors"] == 0, render({"overload": result})
    assert headroom["sessions_refused"] > 0, render({"overload": result})
    assert headroom["underruns"] == 0, render({"overload": result})
    # Direct, vLLM is past its batch limit: streams run dry or slow, or its own queue holds
    # requests while the time to first audio breaks the probe's limit.
    queued = direct["vllm_waiting_max"] > 0 and direct["ttfa_p99_s"] > TTFA_LIMIT_S
    broke = direct["underruns"] > 0 or direct["worst_delivery_ratio"] < GUARD
    assert broke or queued, render({"overload": result})


async def test_streams_straight_to_vllm_lower_the_cap_until_they_leave(vllm_url: str) -> None:
    cap, bypass = SLOTS, 1
    result = await reconcile_timeline(
        vllm_url, cap=cap, bypass=bypass, tokens_per_audio_second=TOKENS_PER_AUDIO_SECOND,
        max_tokens=MAX_TOKENS,
    )  # fmt: skip
    print(render({"reconcile": result}))
    timeline: list[dict[str, Any]] = result["timeline"]
    assert result["lowered"] and result["restored"], render({"reconcile": result})
    # While the bypass ran: the gateway counted it and admitted only into what it left.
    assert any(s["unadmitted"] >= bypass for s in timeline), render({"reconcile": result})
    assert result["admitted_during_bypass"] == cap - bypass
    refused = result["refused_during_bypass"]
    assert [r["status"] for r in refused] == [503] * bypass
    assert "did not admit" in refused[0]["body"]
    # After it left: nothing unadmitted, the configured cap again.
    assert timeline[-1]["unadmitted"] == 0 and timeline[-1]["slots"] == cap


async def test_newcomers_at_the_cap_are_refused_while_vllm_streams(vllm_url: str) -> None:
    newcomers = 50
    result = await refusal_latency(
        vllm_url, cap=SLOTS, tokens_per_audio_second=TOKENS_PER_AUDIO_SECOND,
        max_tokens=HELD_TOKENS, newcomers=newcomers,
    )  # fmt: skip
    print(render({"refusals": result}))
    statuses = result["statuses"]
    # Every newcomer while the held streams ran was refused; one let in after a held
    # stream ended came only once its slot was free.
    assert statuses.get(503, 0) >= 1, result
    assert set(statuses) <= {200, 503}, result
    assert all(result["admitted_after_a_held_stream_ended"]), result
    assert result["vllm_running"][0] == SLOTS, result
