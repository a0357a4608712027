"""``/sim/metrics_page``: a simulated GPU's ``/metrics`` page honest, lying (NaN) or
dripping, as a broken engine or exporter would serve it (proxy/sim/engine_metrics.py)."""

from __future__ import annotations

import httpx
import pytest

from proxy.sim.cluster import Cluster
from proxy.upstreams import EnginePageError, parse_engine_metrics

RUNNING = "vllm:num_requests_running"


async def test_a_nan_page_reports_the_running_figure_as_nan(tts: Cluster) -> None:
    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        r = await client.post("/sim/metrics_page", json={"page": "nan"})
        assert r.json() == {"page": "nan", "drip_s": 1.5}
        text = (await client.get("/metrics")).text
        running = [line for line in text.splitlines() if line.startswith(RUNNING + "{")]
        assert running and all(line.endswith(" NaN") for line in running), running
        with pytest.raises(EnginePageError) as info:
            parse_engine_metrics(text)
        assert info.value.reason == "not_finite"
        assert (await client.delete("/sim/metrics_page")).json()["page"] == "honest"
        _, running_now, _ = parse_engine_metrics((await client.get("/metrics")).text)
        assert running_now == 0


async def test_a_slow_page_drips_until_it_is_honest_again(tts: Cluster) -> None:
    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        await client.post("/sim/metrics_page", json={"page": "slow", "drip_s": 0.05})
        async with client.stream("GET", "/metrics") as page:
            chunks = page.aiter_raw()
            first = await anext(chunks)
            assert len(first) == 1  # one byte at a time
            await client.post("/sim/metrics_page", json={"page": "honest"})
            rest = b"".join([chunk async for chunk in chunks])
        # The whole page, then its end.
        _, running_now, _ = parse_engine_metrics((first + rest).decode())
        assert running_now == 0


@pytest.mark.parametrize(
    "body",
    [
        {"page": "broken"},
        {"page": "slow", "drip_s": 0},
        {"page": "slow", "drip_s": True},
        {"pages": "nan"},
        [1],
    ],
)
async def test_a_bad_mode_is_refused_and_changes_nothing(tts: Cluster, body: object) -> None:
    async with httpx.AsyncClient(base_url=tts.urls[0], timeout=30) as client:
        r = await client.post("/sim/metrics_page", json=body)
        assert r.status_code == 400
        assert (await client.get("/sim/metrics_page")).json()["page"] == "honest"
