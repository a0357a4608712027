"""The Dockerfile, checked statically (no Docker engine here). Its build script is run by
test_docker_build.py and its HEALTHCHECK by test_deploy_healthcheck.py."""

from __future__ import annotations

import json

from .support import (
    CONFIG_PATH,
    PROXY_PORT,
    REPO,
    Instruction,
    copy_sources,
    dockerfile_instructions,
    dockerignore_excludes,
    dockerignore_patterns,
)

DOCKERFILE = REPO / "Dockerfile"


def _final_stage() -> list[Instruction]:
    instructions = dockerfile_instructions(DOCKERFILE)
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def _one(keyword: str) -> Instruction:
    found = [i for i in _final_stage() if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword} in the runtime stage, got {len(found)}"
    return found[0]


def test_multi_stage_build_on_python_3_11_slim() -> None:
    instructions = dockerfile_instructions(DOCKERFILE)
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert len(froms) >= 2
    args = {
        i.args.split("=")[0]: i.args.split("=", 1)[1] for i in instructions if i.keyword == "ARG"
    }
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert froms[-1].args.split()[0] == "${PYTHON_IMAGE}"
    builder = froms[0].args.split()
    assert builder[-2].upper() == "AS"
    build_steps = " ".join(i.args for i in instructions if i.stage == 0 and i.keyword == "RUN")
    assert "deploy/docker/build.sh wheels" in build_steps


def test_the_image_ships_the_per_chunk_modules_compiled_unless_asked_not_to() -> None:
    """HEADROOM_MYPYC=1 by default in both stages: the builder's script compiles with mypyc
    and the runtime stage's install step refuses wheels whose per-chunk modules are not
    compiled (deploy/docker/build.sh; tests/deploy/test_docker_build.py runs it)."""
    instructions = dockerfile_instructions(DOCKERFILE)
    for stage in (0, max(i.stage for i in instructions)):
        args = [i.args for i in instructions if i.stage == stage and i.keyword == "ARG"]
        assert "HEADROOM_MYPYC=1" in args, stage
    build = [i.args for i in instructions if i.stage == 0 and i.keyword == "RUN"]
    assert build == ["sh deploy/docker/build.sh wheels /wheels"]
    copied = [s for i in instructions if i.keyword == "COPY" for s in copy_sources(i)]
    assert {"setup.py", "deploy/docker/build.sh"} <= set(copied)
    script = (REPO / "deploy" / "docker" / "build.sh").read_text()
    assert "--no-build-isolation" in script and "gcc" in script and "mypy" in script
    assert "HEADROOM_MYPYC=0 $pip install" in script, "the dependencies' build must not compile"
    assert "'.[redis,otel]'" in script, "mypy checks the optional extras' modules too"
    assert 'python" -m proxy.speedups --require-compiled' in script


def test_runtime_stage_installs_only_wheels() -> None:
    runtime = _final_stage()
    assert not [i for i in runtime if i.keyword in {"COPY", "ADD"} and copy_sources(i)], (
        "the runtime stage must not copy the source tree"
    )
    install = " ".join(i.args for i in runtime if i.keyword == "RUN")
    assert "from=builder,source=/wheels" in install
    assert "sh /tmp/build.sh install /wheels" in install
    script = (REPO / "deploy" / "docker" / "build.sh").read_text()
    assert "--no-index" in script and "'headroom-proxy[redis]'" in script


def test_runs_as_a_non_root_user() -> None:
    user = _one("USER").args.split(":")[0]
    assert user not in {"root", "0"}
    assert user.isdigit(), "numeric uid, so Kubernetes can verify runAsNonRoot"


def test_entrypoint_cmd_port_signal_and_config_path() -> None:
    assert json.loads(_one("ENTRYPOINT").args) == ["headroom"]
    assert json.loads(_one("CMD").args) == ["serve", "--config", CONFIG_PATH]
    assert _one("EXPOSE").args.split() == [str(PROXY_PORT)]
    assert _one("STOPSIGNAL").args == "SIGTERM"
    env = " ".join(i.args for i in _final_stage() if i.keyword == "ENV")
    assert f"HEADROOM_CONFIG={CONFIG_PATH}" in env


def test_healthcheck_reads_the_configuration_as_serve_does() -> None:
    """`headroom healthcheck`'s module (tests/deploy/test_deploy_healthcheck.py runs it with
    a port set only in the file): not a script that reads one environment variable."""
    args = _one("HEALTHCHECK").args
    options, _, command = args.partition("CMD ")
    assert "--interval" in options and "--timeout" in options
    assert json.loads(command) == ["python", "-m", "proxy.process.healthcheck"]


def test_comments_say_what_the_image_does_today() -> None:
    text = DOCKERFILE.read_text()
    comments = " ".join(line for line in text.splitlines() if line.startswith("#"))
    assert "never run several" not in comments and "--workers" in comments
    assert "admission.backend: redis" in comments
    assert "deploy/docker/build.sh" in comments


def test_build_context_keeps_what_the_builder_copies() -> None:
    patterns = dockerignore_patterns(REPO / ".dockerignore")
    for instruction in dockerfile_instructions(DOCKERFILE):
        if instruction.keyword not in {"COPY", "ADD"}:
            continue
        for source in copy_sources(instruction):
            assert (REPO / source).exists(), f"COPY source {source} missing from the repo"
            assert not dockerignore_excludes(patterns, source), f"{source} is .dockerignored"
    for kept in ("proxy/metering/series.py", "pyproject.toml", "deploy/docker/build.sh"):
        assert not dockerignore_excludes(patterns, kept)
    for dropped in (
        ".git/HEAD",
        "tests/conftest.py",
        "proxy/__pycache__/x.pyc",
        "bench/x",
        "deploy/README.md",
    ):
        assert dockerignore_excludes(patterns, dropped), dropped
