"""``headroom healthcheck`` (the image's HEALTHCHECK) and what ``headroom check`` says about
the admission backend. Real sockets on 127.0.0.1, a real configuration file."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from .support import REPO, dockerfile_instructions

CONFIG = """\
listen: {{host: {host}, port: {port}}}
admission: {{backend: {backend}, redis: {{url: "redis://:s3cret@redis.example:6380/2"}}}}
pools:
  - name: tts
    replicas: [{{name: gpu0, url: "http://127.0.0.1:9", max_sessions: 4}}]
routes:
  - {{path: /v1/audio/speech, pool: tts, protocol: openai-speech-http}}
"""


def _write(tmp_path: Path, port: int, host: str = "0.0.0.0", backend: str = "memory") -> str:
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG.format(host=host, port=port, backend=backend))
    return str(path)


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _server(status: int = 200) -> Iterator[int]:
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


@pytest.fixture(autouse=True)
def _no_headroom_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("HEADROOM_"):
            monkeypatch.delenv(name)


def _image_healthcheck() -> list[str]:
    (healthcheck,) = [
        i for i in dockerfile_instructions(REPO / "Dockerfile") if i.keyword == "HEALTHCHECK"
    ]
    options, _, command = healthcheck.args.partition("CMD ")
    assert "--interval" in options and "--timeout" in options
    parsed: list[str] = json.loads(command)
    return parsed


def _run_image_healthcheck(env: dict[str, str]) -> int:
    """The image's HEALTHCHECK command, with this interpreter as the image's `python`."""
    command = _image_healthcheck()
    assert command[0] == "python"
    return subprocess.run(
        [sys.executable, *command[1:]],
        env={"PATH": "", **env},
        cwd=REPO,
        capture_output=True,
        timeout=60,
    ).returncode


def test_the_image_healthcheck_asks_the_port_set_in_the_file(tmp_path: Path) -> None:
    """HEADROOM_CONFIG (as the image sets it) names a file whose listen.port is not 8080
    and no HEADROOM_LISTEN__PORT is set: the healthcheck still finds the gateway."""
    with _server() as port:
        config = _write(tmp_path, port)
        assert _run_image_healthcheck({"HEADROOM_CONFIG": config}) == 0
    assert _run_image_healthcheck({"HEADROOM_CONFIG": config}) != 0  # nothing listens now


def test_the_environment_overrides_the_file_as_for_serve(tmp_path: Path) -> None:
    with _server() as port, _server() as other:
        config = _write(tmp_path, other)
        env = {"HEADROOM_CONFIG": config, "HEADROOM_LISTEN__PORT": str(port)}
        assert _run_image_healthcheck(env) == 0
    with _server() as other:
        config = _write(tmp_path, other)
        # the environment's port has nobody listening: the file's live port must not count
        assert _run_image_healthcheck(env) != 0


@pytest.mark.parametrize(("status", "code"), [(200, 0), (204, 0), (503, 1), (404, 1)])
def test_exit_status_follows_healthz(tmp_path: Path, status: int, code: int) -> None:
    from proxy.process.cli import main

    with _server(status) as port:
        assert main(["healthcheck", "--config", _write(tmp_path, port)]) == code


def test_a_listener_on_a_named_loopback_host_is_asked_there(tmp_path: Path) -> None:
    from proxy.process.cli import main
    from proxy.process.healthcheck import probe_address

    assert probe_address("0.0.0.0") == "127.0.0.1" and probe_address("::") == "::1"
    assert probe_address("127.0.0.1") == "127.0.0.1"
    with _server() as port:
        assert main(["healthcheck", "-c", _write(tmp_path, port, host="127.0.0.1")]) == 0


def test_an_invalid_configuration_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.process.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text("listen: {port: eighty}\n")
    assert main(["healthcheck", "--config", str(path)]) == 2
    assert "listen.port" in capsys.readouterr().err
    assert main(["healthcheck", "--config", _write(tmp_path, 1), "--timeout", "0"]) == 2


# --- headroom check: the admission backend ---------------------------------------------


def test_check_shows_the_memory_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.process.cli import main

    assert main(["check", "--config", _write(tmp_path, 8080)]) == 0
    out = capsys.readouterr().out
    assert "admission memory (caps in this process: one gateway per set of GPUs)" in out


def test_check_shows_the_redis_backend_without_its_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.process.cli import main

    assert main(["check", "--config", _write(tmp_path, 8080, backend="redis")]) == 0
    out = capsys.readouterr().out
    assert "admission redis redis://***@redis.example:6380/2 (caps shared" in out
    assert "lease 10 s, renew 2 s, fence 1 s; on backend loss: close" in out
    assert "s3cret" not in out


def test_check_names_the_sentinels_rather_than_the_urls_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.process.cli import main

    config = _write(tmp_path, 8080, backend="redis")
    text = (
        Path(config)
        .read_text()
        .replace(
            '{url: "redis://:s3cret@redis.example:6380/2"}',
            '{url: "redis://:s3cret@redis.example:6380/2", '
            'sentinel: {master: headroom, nodes: ["sentinel-0:26379", "sentinel-1:26379"]}}',
        )
    )
    Path(config).write_text(text)
    assert main(["check", "--config", config]) == 0
    out = capsys.readouterr().out
    assert (
        "admission redis redis://***@<primary of headroom>/2 via sentinels sentinel-0:26379, "
        "sentinel-1:26379 (caps shared" in out
    )
    assert "redis.example" not in out and "s3cret" not in out


def test_check_refuses_a_redis_config_without_the_redis_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The package made unimportable as it is when the extra is not installed."""
    from proxy.process.cli import main

    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)
    assert main(["check", "--config", _write(tmp_path, 8080, backend="redis")]) == 2
    err = capsys.readouterr().err
    assert "refused: admission.backend is redis but the 'redis' package is not installed" in err
    assert "pip install 'headroom-proxy[redis]'" in err
    # a memory config needs no redis package
    assert main(["check", "--config", _write(tmp_path, 8080)]) == 0
