"""The Quick start's curl command, run as written against a gateway that refuses: it
must exit non-zero and say so, not leave the refusal's JSON in hello.wav with exit
status 0 as if it were audio. Real sockets on 127.0.0.1; needs curl (7.76 or later)."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
REFUSAL = {"error": {"type": "capacity_exhausted", "code": "pool_full",
                     "message": "All GPU slots for this model are busy. Retry in about 3 s.",
                     "retry_after_s": 3.0, "fallback": None, "queue_position": None}}  # fmt: skip


def quick_start_curl() -> str:
    """The README's first shell block that runs curl, as one command line."""
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S):
        if block.lstrip().startswith("curl "):
            return block.replace("\\\n", " ").strip()
    raise AssertionError("no curl command in a README sh block")


class _Refusing(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps(REFUSAL).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Retry-After", "3")
        self.send_header("X-Headroom-Reason", "pool_full")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_gateway() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_quick_start_curl_fails_on_a_refusal_and_shows_it(
    refusing_gateway: str, tmp_path: Path
) -> None:
    if shutil.which("curl") is None:  # .ci/run installs it
        message = "curl is not installed (Debian: apt-get install curl)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must provide it")
        pytest.skip(message)
    command = quick_start_curl().replace("http://127.0.0.1:8080", refusing_gateway)
    assert "-o hello.wav" in command
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 22, done  # curl's "HTTP error" status, not 0
    assert "The requested URL returned error: 503" in done.stderr
    # hello.wav holds the refusal (the reason and when to retry), which the README says.
    assert json.loads((tmp_path / "hello.wav").read_text()) == REFUSAL
