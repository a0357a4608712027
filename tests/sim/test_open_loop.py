"""Open-loop load: requests sent at a rate, as ``vllm bench serve --request-rate`` does."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from proxy.sim.codec_presets import get_validation_preset
from proxy.sim.virtual_load import RequestLengths, run_load, send_times

_RUN = {"duration_s": 3600.0, "warmup_s": 0.0, "stagger_s": 0.0, "think_s": 0.0}


def test_send_times_are_a_poisson_schedule_whose_last_send_is_at_count_over_rate() -> None:
    times = send_times(random.Random(4), 400, 2.0)
    assert len(times) == 400
    assert all(a < b for a, b in itertools.pairwise(times))
    assert times[-1] == pytest.approx(200.0, rel=1e-12)
    gaps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=1e-9)
    # exponential gaps: their standard deviation is about their mean
    assert 0.8 < statistics.stdev(gaps) / statistics.fmean(gaps) < 1.2
    assert send_times(random.Random(4), 400, 2.0) == times


def test_an_open_loop_run_sends_its_requests_and_spans_throughput_from_its_start() -> None:
    result = run_load(
        get_validation_preset("h100-qwen3tts-1.7b"),
        100,
        utterance_s=RequestLengths(5.6),
        requests=100,
        request_rate=2.0,
        **_RUN,  # type: ignore[arg-type]
    )
    assert result.streams == 100
    # The last request is sent at 100 / 2 = 50 s; the run ends when it does.
    audio = 100 * 5.6
    assert audio / (50.0 + 2 * result.e2e_p95_s) < result.throughput < audio / 50.0
    # Two requests a second of ~0.7 s each: the engine is nearly always at one or two.
    assert result.mean_batch < 2.5


def test_a_light_open_loop_is_lighter_than_a_closed_loop_of_the_same_requests() -> None:
    preset = get_validation_preset("h100-qwen3tts-1.7b")
    common = {"utterance_s": RequestLengths(5.6), "requests": 100, **_RUN}
    open_loop = run_load(preset, 100, request_rate=2.0, **common)  # type: ignore[arg-type]
    closed = run_load(preset, 16, **common)  # type: ignore[arg-type]
    assert open_loop.ttfa_p50_s < closed.ttfa_p50_s / 3
    assert open_loop.request_rtf_p50 < closed.request_rtf_p50


def test_the_concurrency_caps_an_open_loop_and_a_capped_request_waits_off_the_clock() -> None:
    """A rate far above what the engine serves queues the requests at the
    ``--max-concurrency`` limit; a request's clock starts when it gets a place, so
    latency x finished requests a second stays within the limit."""
    preset = get_validation_preset("h100-qwen3tts-1.7b")
    common = {"utterance_s": RequestLengths(5.6), "requests": 100, **_RUN}
    capped = run_load(preset, 4, request_rate=1000.0, **common)  # type: ignore[arg-type]
    assert capped.streams == 100
    assert capped.mean_batch <= 4
    assert capped.e2e_mean_s * capped.requests_per_s <= 4 * (1 + 1e-9)
    # and it runs as the closed loop of four does once everything has been sent
    closed = run_load(preset, 4, **common)  # type: ignore[arg-type]
    assert capped.request_rtf_p50 == pytest.approx(closed.request_rtf_p50, rel=0.05)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"request_rate": 2.0},
        {"request_rate": 0.0, "requests": 5},
        {"request_rate": 2.0, "requests": 0},
    ],
)
def test_an_open_loop_without_requests_or_a_rate_is_refused(kwargs: dict[str, float]) -> None:
    preset = get_validation_preset("h100-qwen3tts-1.7b")
    with pytest.raises(ValueError, match="open-loop run needs a request count and a rate"):
        run_load(preset, 2, **kwargs)  # type: ignore[arg-type]
