"""Headroom left per pool and each pipeline's limiting stage (proxy.pool_headroom, issue 19)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.admission import PoolStatistics, ReplicaStatistics
from proxy.admission.session_lease import Lease
from proxy.clock import FakeClock
from proxy.errors import ConfigError
from proxy.pool_headroom import PoolHeadroom, headroom_of, limiting_stage, pool_headroom
from proxy.runtime import Runtime
from proxy.settings import load_settings, settings_from_mapping, summary

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


def stats(*replicas: ReplicaStatistics, name: str = "p") -> PoolStatistics:
    return PoolStatistics(name, replicas, 0, 0, 10.0, False, 20.0)


def replica(name: str, active: int, cap: int, **flags: bool) -> ReplicaStatistics:
    return ReplicaStatistics(
        name, active, cap, flags.get("healthy", True), flags.get("guarded", False),
        flags.get("retired", False),
    )  # fmt: skip


def no_ratio(_replica: str) -> float | None:
    return None


# -- one pool ------------------------------------------------------------------------------


def test_slots_count_only_replicas_that_take_sessions() -> None:
    h = pool_headroom(
        stats(
            replica("a", 3, 4),
            replica("b", 6, 4),  # over its cap after a reload lowered it: 0 free, not -2
            replica("down", 0, 8, healthy=False),
            replica("held", 0, 8, guarded=True),
            replica("gone", 0, 8, retired=True),
        ),
        ratio=no_ratio,
        threshold=1.2,
    )
    assert (h.slots_usable, h.slots_free) == (8, 1)
    assert h.slots_free_ratio == 1 / 8
    assert h.delivery_ratio_worst_1pct is None and h.delivery_margin is None
    assert h.left == 1 / 8


def test_no_usable_replica_is_no_headroom() -> None:
    h = pool_headroom(stats(replica("a", 0, 4, healthy=False)), ratio=no_ratio, threshold=1.2)
    assert (h.slots_usable, h.slots_free, h.left) == (0, 0, 0.0)


def test_pool_wide_counts_replace_this_gateways_own_when_higher() -> None:
    # redis backend: held is every gateway's sessions, read at the last renewal; a session
    # this gateway admitted after that renewal still counts.
    s = stats(replica("a", 1, 4), replica("b", 2, 4))
    h = pool_headroom(s, ratio=no_ratio, threshold=1.2, held={"a": 3, "b": 0})
    assert h.slots_free == (4 - 3) + (4 - 2)


def test_delivery_margin_is_the_worst_usable_replica_against_the_threshold() -> None:
    ratios = {"a": 3.0, "b": 1.5, "down": 0.5}
    h = pool_headroom(
        stats(replica("a", 0, 4), replica("b", 0, 4), replica("down", 0, 4, healthy=False)),
        ratio=ratios.get,
        threshold=1.2,
    )
    assert h.delivery_ratio_worst_1pct == 1.5  # the ejected replica's 0.5 is not counted
    assert h.delivery_margin == pytest.approx(0.25)
    assert h.slots_free_ratio == 1.0
    assert h.left == pytest.approx(0.25)  # all slots free, but listeners near the threshold


@pytest.mark.parametrize(
    ("ratio", "left"), [(0.9, 0.0), (1.2, 0.0), (1.8, 0.5), (2.4, 0.75), (30.0, 0.75)]
)
def test_left_is_the_lesser_of_slots_and_delivery(ratio: float, left: float) -> None:
    h = PoolHeadroom("p", 4, 3, ratio, 1.2)
    assert h.left == pytest.approx(left)


def test_limiting_stage_least_left_then_fewer_free_slots_then_order() -> None:
    asr = PoolHeadroom("asr", 48, 24, None, 1.2)  # 0.5
    tts = PoolHeadroom("tts", 12, 3, None, 1.2)  # 0.25
    assert limiting_stage([asr, tts]) == "tts"
    assert limiting_stage([tts, asr]) == "tts"
    small = PoolHeadroom("small", 4, 1, None, 1.2)  # 0.25 too, but 1 slot free against 3
    assert limiting_stage([tts, small]) == "small"
    twin = PoolHeadroom("twin", 12, 3, None, 1.2)
    assert limiting_stage([tts, twin]) == "tts"
    assert limiting_stage([twin, tts]) == "twin"
    with pytest.raises(ValueError, match="at least one stage"):
        limiting_stage([])


# -- a runtime: the gate's state, the meter's rolling signals, the injected clock --------------


def voice_agent(**extra: Any) -> dict[str, Any]:
    return {
        "pools": [
            {"name": "asr-main", "replicas": [
                {"name": "gpu0", "url": "http://127.0.0.1:9", "max_sessions": 4}]},
            {"name": "tts-main", "replicas": [
                {"name": "gpu1", "url": "http://127.0.0.1:9", "max_sessions": 2},
                {"name": "gpu2", "url": "http://127.0.0.1:9", "max_sessions": 2}]},
        ],
        "routes": [
            {"path": "/asr", "pool": "asr-main", "protocol": "vllm-realtime"},
            {"path": "/tts", "pool": "tts-main", "protocol": "vllm-omni-speech-ws"},
        ],
        "pipelines": [{"name": "voice-agent", "stages": ["asr-main", "tts-main"]}],
        **extra,
    }  # fmt: skip


def sample(runtime: Runtime, name: str, **labels: str) -> float | None:
    return runtime.metrics.registry.get_sample_value(name, labels)


def limiting(runtime: Runtime) -> str:
    (pipeline,) = headroom_of(runtime).pipelines
    return pipeline.limiting


def test_runtime_headroom_follows_sessions_and_the_rolling_ratio() -> None:
    clock = FakeClock()
    runtime = Runtime(settings_from_mapping(voice_agent(), env={}), clock=clock)
    leases: list[Lease] = []
    for _ in range(2):  # ASR: 2 of 4 taken (0.5 left); TTS: 1 of 4 (0.75 left)
        lease = runtime.gate.enter("asr-main")
        assert isinstance(lease, Lease)
        leases.append(lease)
    lease = runtime.gate.enter("tts-main")
    assert isinstance(lease, Lease)
    leases.append(lease)
    assert limiting(runtime) == "asr-main"
    assert sample(runtime, "headroom_pool_slots_free", pool="tts-main") == 3
    assert sample(runtime, "headroom_pool_slots_usable", pool="tts-main") == 4
    assert sample(runtime, "headroom_pool_headroom_left_ratio", pool="asr-main") == 0.5
    assert sample(runtime, "headroom_pool_delivery_ratio_worst_1pct", pool="tts-main") is None
    key = {"pipeline": "voice-agent"}
    assert sample(runtime, "headroom_pipeline_limiting_stage", pool="asr-main", **key) == 1
    assert sample(runtime, "headroom_pipeline_limiting_stage", pool="tts-main", **key) == 0

    # TTS listeners slow down: gpu1's worst-1% delivery ratio falls to 1.32 (margin 0.1).
    signals = runtime.signals[("tts-main", "gpu1")]
    for _ in range(50):
        signals.observe(clock.now(), 1.32, 0.1)
    assert limiting(runtime) == "tts-main"
    margin = sample(runtime, "headroom_pool_delivery_margin_ratio", pool="tts-main")
    assert margin == pytest.approx(0.1, abs=0.03)  # the log histogram's 2 % bound
    assert sample(runtime, "headroom_pipeline_limiting_stage", pool="tts-main", **key) == 1
    stage = sample(runtime, "headroom_pipeline_stage_headroom_left_ratio", pool="tts-main", **key)
    assert stage == sample(runtime, "headroom_pool_headroom_left_ratio", pool="tts-main")

    # The window moves on without more audio: the slow tail is forgotten, ASR limits again.
    clock.advance(runtime.settings.meter.window_s + 2)
    assert sample(runtime, "headroom_pool_delivery_margin_ratio", pool="tts-main") is None
    assert limiting(runtime) == "asr-main"

    # An ejected TTS replica takes half the stage's cap with it.
    runtime.gate.set_healthy("tts-main", "gpu2", False)
    (pipeline,) = headroom_of(runtime).pipelines
    tts = next(s for s in pipeline.stages if s.pool == "tts-main")
    on_gpu1 = 1 if lease.replica == "gpu1" else 0  # the TTS lease's replica
    assert (tts.slots_usable, tts.slots_free) == (2, 2 - on_gpu1)
    for lease in leases:
        lease.release()


def test_no_pipelines_no_pipeline_series_but_pool_headroom() -> None:
    data = voice_agent()
    del data["pipelines"]
    runtime = Runtime(settings_from_mapping(data, env={}), clock=FakeClock())
    assert headroom_of(runtime).pipelines == ()
    assert sample(runtime, "headroom_pool_slots_free", pool="asr-main") == 4
    families = {f.name: f for f in runtime.metrics.registry.collect()}
    assert families["headroom_pipeline_limiting_stage"].samples == []


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pipelines", "field", "reason"),
    [
        ([{"name": "va", "stages": ["asr-main", "tts-typo"]}], "pipelines[0].stages[1]",
         "unknown pool 'tts-typo'; defined pools: asr-main, tts-main"),
        ([{"name": "va", "stages": []}], "pipelines[0].stages", "at least 1"),
        ([{"name": "va", "stages": ["asr-main", "asr-main"]}], "pipelines[0].stages[1]",
         "duplicate stage 'asr-main'"),
        ([{"name": "va", "stages": ["asr-main"]}, {"name": "va", "stages": ["tts-main"]}],
         "pipelines[1].name", "duplicate pipeline name 'va'"),
        ([{"name": "voice agent", "stages": ["asr-main"]}], "pipelines[0].name",
         "must use only letters"),
        ([{"stages": ["asr-main"]}], "pipelines[0].name", "required"),
        ([{"name": "va", "stage": ["asr-main"]}], "pipelines[0].stage", "unknown key"),
        ("asr-main,tts-main", "pipelines", "must be a list"),
    ],
)  # fmt: skip
def test_malformed_pipelines_fail_at_start_up_naming_the_field(
    pipelines: Any, field: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(voice_agent(pipelines=pipelines), env={})
    problems = dict(info.value.problems)
    assert field in problems, info.value.problems
    assert reason in problems[field]


def test_the_voice_agent_example_names_its_pipeline() -> None:
    settings = load_settings(CONFIG_DIR / "voice-agent.yaml", env={})
    assert [(p.name, p.stages) for p in settings.pipelines] == [
        ("voice-agent", ("asr-main", "tts-main"))
    ]
    assert {p.name for p in settings.pools} == {"asr-main", "tts-main"}
    assert settings.warnings() == []
    assert "voice-agent: asr-main -> tts-main" in summary(settings)
