"""The SageMaker recipe: image contract checked statically, entrypoint run with fake
vllm/headroom executables (real bash, real signals, no GPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .support import (
    PROXY_PORT,
    REPO,
    copy_sources,
    dockerfile_instructions,
    dockerignore_excludes,
    dockerignore_patterns,
    load_yaml,
)

SAGEMAKER = REPO / "deploy" / "sagemaker"
ENTRYPOINT = SAGEMAKER / "entrypoint.sh"
CONFIG = SAGEMAKER / "headroom.yaml"


def _final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions(SAGEMAKER / "Dockerfile")
    last = max(i.stage for i in instructions)
    return [(i.keyword, i.args) for i in instructions if i.stage == last]


def test_image_contract() -> None:
    final = _final_stage()
    keywords = [k for k, _ in final]
    assert final[0] == ("FROM", "${VLLM_IMAGE}")
    labels = " ".join(a for k, a in final if k == "LABEL")
    assert "com.amazonaws.sagemaker.capabilities.bidirectional-streaming=true" in labels
    assert ("EXPOSE", str(PROXY_PORT)) in final
    assert "USER" not in keywords, "SageMaker runs inference containers as root"
    (entrypoint,) = [json.loads(a) for k, a in final if k == "ENTRYPOINT"]
    copies = [a for k, a in final if k == "COPY"]
    assert any(a.endswith(f"deploy/sagemaker/entrypoint.sh {entrypoint[0]}") for a in copies)
    assert any(
        a.endswith("deploy/sagemaker/headroom.yaml /etc/headroom/config.yaml") for a in copies
    )
    install = " ".join(a for k, a in final if k == "RUN")
    assert "/opt/headroom" in install, "Headroom needs its own virtualenv beside vLLM's"


def test_build_context_filter_keeps_every_copied_file() -> None:
    patterns = dockerignore_patterns(SAGEMAKER / "Dockerfile.dockerignore")
    for instruction in dockerfile_instructions(SAGEMAKER / "Dockerfile"):
        if instruction.keyword in {"COPY", "ADD"}:
            for source in copy_sources(instruction):
                assert (REPO / source).exists(), source
                assert not dockerignore_excludes(patterns, source), source


def test_entrypoint_is_valid_executable_bash() -> None:
    assert os.access(ENTRYPOINT, os.X_OK)
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True, timeout=30)


# --- the entrypoint, run --------------------------------------------------------------------

_FAKE = """#!/usr/bin/env bash
echo "{name} start $*" >> "$FAKE_LOG"
if [[ -n "${{FAKE_{upper}_EXIT:-}}" ]]; then sleep 0.2; exit "$FAKE_{upper}_EXIT"; fi
on_term() {{ echo "{name} TERM" >> "$FAKE_LOG"; sleep {drain}; echo "{name} exit" >> "$FAKE_LOG"; }}
trap 'on_term; exit 0' TERM
while true; do sleep 0.05; done
"""


@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # headroom "drains" for a while on SIGTERM; vLLM must not be stopped before it is done.
    for name, drain in (("vllm", "0"), ("headroom", "0.5")):
        script = bin_dir / name
        script.write_text(_FAKE.format(name=name, upper=name.upper(), drain=drain))
        script.chmod(0o755)
    python = bin_dir / "python3"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    log = tmp_path / "log"
    log.touch()
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "HEADROOM_CONFIG": str(CONFIG),
        "FAKE_LOG": str(log),
    }


def _log(env: dict[str, str]) -> list[str]:
    return Path(env["FAKE_LOG"]).read_text().splitlines()


def _start(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["bash", str(ENTRYPOINT), "serve"], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def _wait_started(env: dict[str, str], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = _log(env)
        if any(x.startswith("vllm start") for x in lines) and any(
            x.startswith("headroom start") for x in lines
        ):
            return
        if proc.poll() is not None:
            pytest.fail(f"entrypoint exited early: {proc.communicate()}")
        time.sleep(0.05)
    pytest.fail(f"processes did not start: {_log(env)}")


def _finish(proc: subprocess.Popen[str]) -> int:
    try:
        return proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.communicate()


def test_sigterm_drains_headroom_before_stopping_vllm(fake_env: dict[str, str]) -> None:
    cap = load_yaml(CONFIG)["pools"][0]["replicas"][0]["max_sessions"]
    fake_env["ENGINE_EXTRA_ARGS"] = "--enforce-eager --max-model-len 4096"
    proc = _start(fake_env)
    _wait_started(fake_env, proc)
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc) == 0
    lines = _log(fake_env)
    vllm = next(x for x in lines if x.startswith("vllm start")).split()[2:]
    assert vllm[:2] == ["serve", "mistralai/Voxtral-Mini-4B-Realtime-2602"]
    flags = " ".join(vllm[2:])
    assert "--host 127.0.0.1 --port 8081" in flags
    assert f"--max-num-seqs {cap}" in flags
    assert "--gpu-memory-utilization 0.90" in flags
    assert flags.endswith("--enforce-eager --max-model-len 4096")
    assert next(x for x in lines if x.startswith("headroom start")) == (
        f"headroom start serve --config {CONFIG}"
    )
    assert lines.index("headroom exit") < lines.index("vllm TERM"), lines


def test_engine_batch_follows_the_cap_including_env_overrides(
    fake_env: dict[str, str],
) -> None:
    fake_env["HEADROOM_POOLS__0__REPLICAS__0__MAX_SESSIONS"] = "7"
    proc = _start(fake_env)
    _wait_started(fake_env, proc)
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc) == 0
    vllm = next(x for x in _log(fake_env) if x.startswith("vllm start"))
    assert "--max-num-seqs 7" in vllm


def test_engine_exit_stops_headroom_and_fails(fake_env: dict[str, str]) -> None:
    fake_env["FAKE_VLLM_EXIT"] = "3"
    proc = _start(fake_env)
    assert _finish(proc) == 3
    assert "headroom TERM" in _log(fake_env)


def test_invalid_config_stops_before_starting_anything(
    fake_env: dict[str, str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: []\nroutes: []\n")
    fake_env["HEADROOM_CONFIG"] = str(bad)
    proc = _start(fake_env)
    assert _finish(proc) != 0
    assert _log(fake_env) == []
