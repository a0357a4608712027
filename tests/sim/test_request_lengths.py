"""The request lengths a virtual load draws: uniform bounds or a log-normal prompt set."""

from __future__ import annotations

import random
import statistics

import pytest

from proxy.sim.presets import get_preset
from proxy.sim.virtual_load import RequestLengths, run_load


def _draws(lengths: RequestLengths, n: int = 20_000, seed: int = 3) -> list[float]:
    rng = random.Random(seed)
    return [lengths.draw(rng) for _ in range(n)]


def test_uniform_lengths_stay_within_the_spread_around_the_mean() -> None:
    values = _draws(RequestLengths(7.5, spread=0.35))
    assert min(values) >= 7.5 * 0.65 and max(values) <= 7.5 * 1.35
    assert statistics.fmean(values) == pytest.approx(7.5, rel=0.01)


def test_between_is_the_uniform_draw_of_those_bounds() -> None:
    lengths = RequestLengths.between(8.0, 20.0)
    assert (lengths.mean_s, lengths.spread, lengths.sigma) == (14.0, pytest.approx(6 / 14), 0.0)
    assert RequestLengths.between(5.0, 5.0).draw(random.Random(0)) == pytest.approx(5.0)


def test_log_normal_lengths_keep_the_mean_with_the_median_below_it() -> None:
    lengths = RequestLengths(7.5, sigma=0.8)
    values = _draws(lengths)
    assert statistics.fmean(values) == pytest.approx(7.5, rel=0.03)
    assert statistics.median(values) == pytest.approx(lengths.median_s, rel=0.03)
    assert lengths.median_s < 0.75 * 7.5
    assert _draws(lengths, 50) == _draws(lengths, 50)  # seeded


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mean_s": 0.0}, "mean above 0"),
        ({"mean_s": 5.0, "spread": 1.0}, "spread"),
        ({"mean_s": 5.0, "sigma": -0.1}, "sigma"),
        ({"mean_s": 5.0, "spread": 0.2, "sigma": 0.5}, "uniform .* or log-normal"),
    ],
)
def test_malformed_lengths_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RequestLengths(**kwargs)


def test_bounds_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        RequestLengths.between(9.0, 8.0)


def test_a_load_given_bounds_or_their_lengths_runs_the_same() -> None:
    preset = get_preset("l40s-qwen3tts-1.7b")
    as_bounds = run_load(preset, 3, duration_s=20.0, warmup_s=2.0, utterance_s=(6.0, 10.0))
    as_lengths = run_load(
        preset, 3, duration_s=20.0, warmup_s=2.0, utterance_s=RequestLengths.between(6.0, 10.0)
    )
    assert as_lengths == as_bounds


def test_log_normal_lengths_spread_the_requests_a_load_sends() -> None:
    preset = get_preset("l40s-qwen3tts-1.7b")
    kwargs = {"duration_s": 600.0, "warmup_s": 0.0, "stagger_s": 0.0, "think_s": 0.0}
    even = run_load(preset, 1, utterance_s=RequestLengths(6.0), **kwargs)
    skewed = run_load(preset, 1, utterance_s=RequestLengths(6.0, sigma=0.8), **kwargs)
    assert even.e2e_p95_s < 1.5 * even.e2e_mean_s
    assert skewed.e2e_p95_s > 2.5 * skewed.e2e_mean_s
