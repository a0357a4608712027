"""bench/tenants.py's figures: Jain's index and the queue-wait p99 from the histogram."""

from __future__ import annotations

import pytest

from bench.tenants import _wait_p99, jain

W = "headroom_tenant_queue_wait_seconds_bucket"
D = "headroom_tenant_decisions_total"


def test_jain_index() -> None:
    assert jain([5.0, 5.0]) == 1.0
    assert jain([2.0, 1.0]) == pytest.approx(0.9)
    assert jain([1.0, 0.0]) == 0.5
    assert jain([]) is None and jain([0.0, 0.0]) is None


def test_wait_p99_counts_sessions_admitted_at_once_as_zero() -> None:
    before = {(D, "g", "admitted"): 10.0}
    after = {(D, "g", "admitted"): 110.0, (W, "g", "0.01"): 0.0, (W, "g", "+Inf"): 0.0}
    assert _wait_p99(before, after, "g") == 0.0  # 100 direct admissions, none queued
    queued = {(D, "t", "admitted"): 10.0, (D, "t", "queued"): 10.0,
              (W, "t", "0.5"): 5.0, (W, "t", "1.0"): 10.0, (W, "t", "+Inf"): 10.0}  # fmt: skip
    assert _wait_p99({}, queued, "t") == 1.0
    assert _wait_p99({}, {}, "none") is None


def test_the_redis_backend_option_configures_every_tenant_field_on_redis() -> None:
    from types import SimpleNamespace

    from bench.tenants import _config
    from proxy.settings import settings_from_mapping

    preset = SimpleNamespace(sample_rate=24000)
    users = {"a": 12, "b": 6, "free": 6, "gold": 2}
    data = _config("http://127.0.0.1:9", preset, 6, "priority", users, 2, "redis://127.0.0.1:1/0")
    settings = settings_from_mapping(data, env={})  # no longer refused with redis
    assert settings.admission.backend == "redis"
    assert settings.admission.redis.key_prefix == "bench-tenants-priority:"
    assert settings.pools[0].reserve[0].slots == 2
    memory = settings_from_mapping(_config("http://127.0.0.1:9", preset, 6, "fair", users, 2),
                                   env={})  # fmt: skip
    assert memory.admission.backend == "memory"


def test_the_default_cap_is_the_presets_recommended_cap_over_seeds() -> None:
    from bench.overload import _preset
    from bench.tenants import build_parser, pool_cap
    from proxy.sim.capacity import describe

    args = build_parser().parse_args([])
    preset = _preset(args)  # with its chunk schedule
    cap, source = pool_cap(args, preset)
    assert cap == describe(preset)["recommended_cap"]
    assert "recommended_cap" in source
    args = build_parser().parse_args(["--cap", "9"])
    assert pool_cap(args, _preset(args)) == (9, "--cap")
