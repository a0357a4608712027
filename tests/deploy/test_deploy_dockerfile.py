"""The Dockerfile, checked statically (no Docker engine here), and its HEALTHCHECK run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

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
    assert "pip wheel" in build_steps


def test_the_image_ships_the_per_chunk_modules_compiled_unless_asked_not_to() -> None:
    """HEADROOM_MYPYC=1 by default: the builder compiles with mypyc (needs mypy and a C
    compiler, hence no build isolation), and the runtime stage fails the build unless
    every per-chunk module is compiled (proxy/speedups.py)."""
    instructions = dockerfile_instructions(DOCKERFILE)
    for stage in (0, max(i.stage for i in instructions)):
        args = [i.args for i in instructions if i.stage == stage and i.keyword == "ARG"]
        assert "HEADROOM_MYPYC=1" in args, stage
    build = " ".join(i.args for i in instructions if i.stage == 0 and i.keyword == "RUN")
    assert "gcc" in build and "mypy" in build
    assert 'HEADROOM_MYPYC="$HEADROOM_MYPYC"' in build and "--no-build-isolation" in build
    copied = [s for i in instructions if i.keyword == "COPY" for s in copy_sources(i)]
    assert "setup.py" in copied
    runtime = " ".join(i.args for i in _final_stage() if i.keyword == "RUN")
    assert "python -m proxy.speedups --require-compiled" in runtime


def test_runtime_stage_installs_only_wheels() -> None:
    runtime = _final_stage()
    assert not [i for i in runtime if i.keyword in {"COPY", "ADD"} and copy_sources(i)], (
        "the runtime stage must not copy the source tree"
    )
    install = " ".join(i.args for i in runtime if i.keyword == "RUN")
    assert "--no-index" in install
    assert "headroom-proxy" in install
    assert "from=builder" in install


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


def _healthcheck_command() -> list[str]:
    args = _one("HEALTHCHECK").args
    options, _, command = args.partition("CMD ")
    assert "--interval" in options
    assert "--timeout" in options
    parsed: list[str] = json.loads(command)
    return parsed


def test_healthcheck_probes_healthz_with_python() -> None:
    command = _healthcheck_command()
    assert command[:2] == ["python", "-c"]
    assert "/healthz" in command[2]
    assert f"'{PROXY_PORT}'" in command[2]
    compile(command[2], "<healthcheck>", "exec")


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _server(status: int) -> Iterator[int]:
    handler = type("Handler", (_Health,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _run_healthcheck(port: int) -> int:
    command = _healthcheck_command()
    env = {"HEADROOM_LISTEN__PORT": str(port), "PATH": ""}
    return subprocess.run(
        [sys.executable, *command[1:]], env=env, capture_output=True, timeout=30
    ).returncode


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_exit_status_follows_healthz(status: int, healthy: bool) -> None:
    with _server(status) as port:
        assert (_run_healthcheck(port) == 0) is healthy


def test_healthcheck_fails_when_nothing_listens() -> None:
    with _server(200) as port:
        pass
    assert _run_healthcheck(port) != 0


def test_build_context_keeps_what_the_builder_copies() -> None:
    patterns = dockerignore_patterns(REPO / ".dockerignore")
    for instruction in dockerfile_instructions(DOCKERFILE):
        if instruction.keyword not in {"COPY", "ADD"}:
            continue
        for source in copy_sources(instruction):
            assert (REPO / source).exists(), f"COPY source {source} missing from the repo"
            assert not dockerignore_excludes(patterns, source), f"{source} is .dockerignored"
    for kept in ("proxy/metrics.py", "pyproject.toml"):
        assert not dockerignore_excludes(patterns, kept)
    for dropped in (".git/HEAD", "tests/conftest.py", "proxy/__pycache__/x.pyc", "bench/x"):
        assert dockerignore_excludes(patterns, dropped), dropped
