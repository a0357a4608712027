"""The co-location check (issue 19): configuration, the memory maths, ``headroom check``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.errors import ConfigError
from proxy.settings import GpuEngineSettings, GpuSettings, load_settings, settings_from_mapping
from proxy.sim.gpu_memory_check import GB, check_gpu, check_gpus, engine_figures
from proxy.sim.presets import get_preset

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


def base(**extra: Any) -> dict[str, Any]:
    return {
        "pools": [
            {"name": "asr", "replicas": [{"name": "g0", "url": "http://10.0.0.5:8000",
                                          "max_sessions": 40}]},
            {"name": "tts", "replicas": [{"name": "g0", "url": "http://10.0.0.5:8001",
                                          "max_sessions": 10}]},
        ],
        "routes": [
            {"path": "/v1/realtime", "pool": "asr", "protocol": "vllm-realtime"},
            {"path": "/v1/audio/speech/stream", "pool": "tts", "protocol": "vllm-omni-speech-ws"},
        ],
        **extra,
    }  # fmt: skip


def problems(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(data, env={})
    return {loc: why for loc, why in info.value.problems}


def gpu(*engines: dict[str, Any], memory_gb: float | None = None) -> GpuSettings:
    return GpuSettings(name="n0", memory_gb=memory_gb, engines=tuple(
        GpuEngineSettings(**e) for e in engines))  # fmt: skip


# -- configuration ----------------------------------------------------------------------


def test_absent_gpus_is_todays_behaviour() -> None:
    settings = settings_from_mapping(base(), env={})
    assert settings.gpus == ()
    assert check_gpus(settings) == ([], [])


def test_gpus_load_and_name_pool_and_replica() -> None:
    data = base(gpus=[{"name": "node1-0", "memory_gb": 80, "engines": [
        {"replica": "asr/g0", "gpu_memory_utilization": 0.45, "preset": "h100-voxtral-realtime-4b"},
        {"replica": "tts/g0", "gpu_memory_utilization": 0.45, "weights_gb": 6.6,
         "kv_bytes_per_session": 2e8},
    ]}])  # fmt: skip
    settings = settings_from_mapping(data, env={})
    engine = settings.gpus[0].engines[1]
    assert (engine.pool, engine.replica_name, engine.kv_bytes_per_session) == ("tts", "g0", 2e8)


def test_malformed_values_name_the_field_and_the_reason() -> None:
    data = base(gpus=[
        {"name": "n0", "engines": [
            {"replica": "asr/g9", "gpu_memory_utilization": 1.5, "preset": "h100-orfeus"},
            {"replica": "asrg0", "gpu_memory_utilization": 0},
            {"replica": "tts/g0", "gpu_memory_utilization": 0.3, "weights_gb": -1},
        ]},
        {"name": "n0", "engines": [
            {"replica": "tts/g0", "gpu_memory_utilization": 0.3, "preset": "h100-orpheus-3b",
             "kv_bytes_per_session": 1e8, "session_s": 30},
        ]},
    ])  # fmt: skip
    found = problems(data)
    e = "gpus[0].engines"
    assert found[f"{e}[0].gpu_memory_utilization"] == "must be <= 1.0 (got 1.5)"
    assert "unknown preset 'h100-orfeus'" in found[f"{e}[0].preset"]
    assert "h100-orpheus-3b" in found[f"{e}[0].preset"]
    assert found[f"{e}[0].replica"].startswith("unknown replica 'asr/g9'; defined replicas: asr/g0")
    assert found[f"{e}[1].replica"] == "must be 'pool/replica', e.g. 'tts-main/gpu0' (got 'asrg0')"
    assert found[f"{e}[1].gpu_memory_utilization"] == "must be > 0.0 (got 0)"
    assert found[f"{e}[2].weights_gb"] == "must be > 0.0 (got -1)"
    assert "duplicate GPU name 'n0'" in found["gpus[1].name"]
    assert "an engine runs on one GPU" in found["gpus[1].engines[0].replica"]
    again = problems(base(gpus=[{"name": "n0", "engines": [
        {"replica": "tts/g0", "gpu_memory_utilization": 0.3, "preset": "h100-orpheus-3b",
         "kv_bytes_per_session": 1e8, "session_s": 30}]}]))  # fmt: skip
    assert "has no effect with kv_bytes_per_session" in again["gpus[0].engines[0].session_s"]


# -- the maths --------------------------------------------------------------------------


def test_shares_summing_above_one_are_refused_and_exactly_one_is_not() -> None:
    over = gpu({"replica": "asr/g0", "gpu_memory_utilization": 0.6},
               {"replica": "tts/g0", "gpu_memory_utilization": 0.45})  # fmt: skip
    findings = check_gpu(over, [engine_figures(e, 4) for e in over.engines])
    errors = [f for f in findings if f.level == "error"]
    assert len(errors) == 1
    assert "sums to 1.05 (asr/g0 0.6 + tts/g0 0.45), above 1" in errors[0].message
    full = gpu(
        {"replica": "asr/g0", "gpu_memory_utilization": 0.7},
        {"replica": "tts/g0", "gpu_memory_utilization": 0.3},
    )  # 0.7 + 0.3 in floats
    assert not [f for f in check_gpu(full, [engine_figures(e, 4) for e in full.engines])
                if f.level == "error"]  # fmt: skip


def test_a_share_too_small_for_the_cap_warns_with_the_share_that_fits() -> None:
    # 24 GB x 0.5 = 12 GB - 6 GB weights - 2 GB activations = 4 GB = 8 sessions of 0.5 GB.
    g = gpu({"replica": "tts/g0", "gpu_memory_utilization": 0.5, "weights_gb": 6,
             "activations_gb": 2, "kv_bytes_per_session": 0.5 * GB}, memory_gb=24)  # fmt: skip
    figures = engine_figures(g.engines[0], 10)
    assert figures.kv_cache_bytes(24 * GB) == pytest.approx(4 * GB)
    assert figures.sessions_held(24 * GB) == 8
    assert figures.utilization_needed(24 * GB) == pytest.approx(13 / 24)
    (finding,) = check_gpu(g, [figures])
    assert finding.level == "warning"
    assert "leaves a 4.0 GB KV cache, 8 sessions of 500.0 MB, fewer than max_sessions 10" in (
        finding.message
    )
    assert "raise gpu_memory_utilization to 0.54 or lower max_sessions to 8" in finding.message
    assert not check_gpu(g, [engine_figures(g.engines[0], 8)])  # 8 fit: nothing to say


def test_a_share_below_the_weights_is_refused() -> None:
    g = gpu({"replica": "tts/g0", "gpu_memory_utilization": 0.2, "preset": "h100-orpheus-3b"})
    # 80 GB x 0.2 = 16 GB - 6.6 GB weights - 3 GB activations = 6.4 GB: 32 sessions fit.
    assert not check_gpu(g, [engine_figures(g.engines[0], 24)])
    tiny = gpu({"replica": "tts/g0", "gpu_memory_utilization": 0.1, "preset": "h100-orpheus-3b"})
    (finding,) = check_gpu(tiny, [engine_figures(tiny.engines[0], 24)])
    assert finding.level == "error"
    assert "no room for a KV cache and cannot start" in finding.message


def test_preset_figures_come_from_the_model_config() -> None:
    orpheus = get_preset("h100-orpheus-3b")
    # 20 s at 82 tokens/s + 70 text tokens + 24 prompt tokens, 28 x 8 x 128 x 2 x 2 B each
    assert orpheus.kv_tokens_per_session(20) == 24 + 70 + 1640
    assert orpheus.kv_bytes_per_session(20) == 1734 * 112 * 1024
    g = gpu({"replica": "tts/g0", "gpu_memory_utilization": 0.45, "preset": "h100-orpheus-3b",
             "session_s": 60})  # fmt: skip
    figures = engine_figures(g.engines[0], 24)
    assert figures.kv_bytes_per_session == orpheus.kv_bytes_per_session(60)
    assert figures.weights_bytes == orpheus.resident_bytes
    # measured figures win over the preset's
    measured = gpu({"replica": "tts/g0", "gpu_memory_utilization": 0.45,
                    "preset": "h100-orpheus-3b", "weights_gb": 9})  # fmt: skip
    assert engine_figures(measured.engines[0], 24).weights_bytes == 9 * GB
    # 80 x 0.45 = 36 GB - 6.6 - 3 = 26.4 GB / 199 MB = 132 sessions: no warning at 24
    assert not check_gpu(g, [engine_figures(g.engines[0], 24)])


def test_unknown_memory_or_figures_are_noted_not_guessed() -> None:
    g = gpu({"replica": "tts/g0", "gpu_memory_utilization": 0.45, "weights_gb": 5})
    (note,) = check_gpu(g, [engine_figures(g.engines[0], 4)])
    assert note.level == "note" and "set memory_gb" in note.message
    g = gpu({"replica": "tts/g0", "gpu_memory_utilization": 0.45, "weights_gb": 5}, memory_gb=24)
    (note,) = check_gpu(g, [engine_figures(g.engines[0], 4)])
    assert note.level == "note" and "no kv_bytes_per_session" in note.message


# -- headroom check ---------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "headroom.yaml"
    path.write_text(text)
    return str(path)


CONFIG = """
pools:
  - {name: asr, replicas: [{name: g0, url: "http://10.0.0.5:8000", max_sessions: 40}]}
  - {name: tts, replicas: [{name: g0, url: "http://10.0.0.5:8001", max_sessions: 24}]}
routes:
  - {path: /v1/realtime, pool: asr, protocol: vllm-realtime}
  - {path: /v1/audio/speech/stream, pool: tts, protocol: vllm-omni-speech-ws}
gpus:
  - name: node1-0
    engines:
      - {replica: asr/g0, gpu_memory_utilization: ASR, preset: h100-voxtral-realtime-4b}
      - {replica: tts/g0, gpu_memory_utilization: TTS, preset: h100-orpheus-3b}
"""


def test_check_refuses_an_over_committed_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.process.cli import main

    path = write(tmp_path, CONFIG.replace("ASR", "0.6").replace("TTS", "0.5"))
    assert main(["check", "--config", path]) == 2
    out, err = capsys.readouterr()
    assert "headroom check: refused: gpu node1-0: gpu_memory_utilization sums to 1.10" in err
    assert "node1-0: 80.0 GB (preset GPU H100 SXM), gpu_memory_utilization 1.10 in all" in out


def test_check_warns_when_a_share_leaves_too_little_kv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.process.cli import main

    path = write(tmp_path, CONFIG.replace("ASR", "0.8").replace("TTS", "0.15"))
    assert main(["check", "--config", path]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    # 80 GB x 0.15 = 12 GB - 6.6 GB - 3 GB = 2.4 GB: 12 sessions of 198.9 MB < 24
    assert "warning: gpu node1-0: tts/g0: gpu_memory_utilization 0.15 leaves a 2.4 GB KV " in out
    assert "12 sessions of 198.9 MB, fewer than max_sessions 24" in out


def test_check_passes_a_sound_co_location(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.process.cli import main

    path = write(tmp_path, CONFIG.replace("ASR", "0.45").replace("TTS", "0.45"))
    assert main(["check", "--config", path]) == 0
    out, _ = capsys.readouterr()
    assert "warning" not in out and "asr/g0  0.45  KV cache" in out


def test_the_example_config_passes_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.process.cli import main

    settings = load_settings(CONFIG_DIR / "colocated.yaml", env={})
    assert len(settings.gpus) == 1 and len(settings.gpus[0].engines) == 2
    assert main(["check", "--config", str(CONFIG_DIR / "colocated.yaml")]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "warning" not in out
