"""Coverage-guided fuzzing of the untrusted-input parsers with atheris (libFuzzer).

Not collected by pytest (atheris is not a test dependency): run by hand, one target per
process, e.g.::

    python -m pip install atheris
    python tests/fuzz/atheris_targets.py sse -runs=2000000 -max_len=4096
    python tests/fuzz/atheris_targets.py --all 500000        # every target, 500k runs each

``--all`` passes each target a libFuzzer dictionary of its format's tokens
(:data:`DICTIONARIES`); pass ``-dict=FILE`` yourself when running one target.

Each target asserts the same contracts as the hypothesis properties in this directory
(never raise; finite, non-negative audio; chunking-independent results; only ConfigError
out of the configuration loader; forwardable headers and URLs). A failure is reported by
libFuzzer as a crash with the input that caused it (saved as ``crash-*``).
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import atheris

with atheris.instrument_imports():
    import httpx
    import yaml
    from websockets.uri import parse_uri

    from proxy.client_request import ClientRequest
    from proxy.errors import ConfigError
    from proxy.metering.adapters import AudioFormat, http_adapter, ws_adapter
    from proxy.metering.adapters.b64json import scan_event
    from proxy.metering.adapters.http_streams import request_fields
    from proxy.metering.adapters.sse import SseParser
    from proxy.metering.adapters.wav import WavStream
    from proxy.relay.headers import forwarded_request_headers, response_headers
    from proxy.settings import settings_from_mapping

DEFAULT = AudioFormat(24000, 1, 2)
WS = ["vllm-realtime", "openai-realtime", "vllm-omni-speech-ws", "passthrough-ws"]
HTTP = ["openai-speech-http", "openai-transcription-sse", "passthrough-http"]


class Sink:
    def audio(self, now: float, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            raise AssertionError(f"audio seconds {seconds!r}")

    def event(self, now: float) -> None: ...
    def utterance_end(self, now: float) -> None: ...
    def response_end(self, now: float) -> None: ...
    def commit_final(self, now: float) -> None: ...
    def transcript_final(self, now: float) -> None: ...


def _cuts(fdp: atheris.FuzzedDataProvider) -> list[int]:
    """Up to 8 cut offsets, drawn before the stream (so the fuzzer steers them freely)."""
    return [fdp.ConsumeIntInRange(0, 4096) for _ in range(fdp.ConsumeIntInRange(0, 8))]


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def sse(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    bound = fdp.ConsumeIntInRange(1, 256)
    cuts = _cuts(fdp)
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    whole = SseParser(bound).feed(stream)
    parser = SseParser(bound)
    split: list[tuple[str, str]] = []
    for part in _split(stream, cuts):
        split += parser.feed(part)
    if whole != split:
        raise AssertionError(f"chunking changed the events: {whole!r} != {split!r}")


def wav(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    max_header = fdp.ConsumeIntInRange(12, 1024)
    cuts = _cuts(fdp)
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    whole = WavStream(DEFAULT, max_header).feed(stream)
    parser = WavStream(DEFAULT, max_header)
    split = 0.0
    for part in _split(stream, cuts):
        seconds = parser.feed(part)
        if not (math.isfinite(seconds) and seconds >= 0):
            raise AssertionError(seconds)
        split += seconds
    if not math.isclose(whole, split, rel_tol=1e-9, abs_tol=1e-12):
        raise AssertionError(f"chunking changed the audio: {whole} != {split}")


def b64json(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    for keys in (("delta", "audio"), ("audio",), ()):
        scanned = scan_event(text, keys)
        if scanned is not None and scanned[1] is not None and scanned[1].nbytes < 0:
            raise AssertionError("negative length")


def ws_adapters(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    adapter = ws_adapter(fdp.PickValueInList(WS), Sink(), DEFAULT)
    now = 0.0
    while fdp.remaining_bytes():
        now += 1.0
        kind = fdp.ConsumeIntInRange(0, 3)
        size = fdp.ConsumeIntInRange(0, 512)
        if kind < 2:
            text = fdp.ConsumeUnicodeNoSurrogates(size)
            (adapter.client_text if kind == 0 else adapter.upstream_text)(now, text)
        else:
            chunk = fdp.ConsumeBytes(size)
            (adapter.client_binary if kind == 2 else adapter.upstream_binary)(now, chunk)


def http_adapters(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    adapter = http_adapter(fdp.PickValueInList(HTTP), Sink(), DEFAULT)
    query = {fdp.ConsumeUnicodeNoSurrogates(8): fdp.ConsumeUnicodeNoSurrogates(8)}
    adapter.request("POST", query, fdp.ConsumeUnicodeNoSurrogates(30),
                    fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 200)))  # fmt: skip
    adapter.request_complete(0.0)
    adapter.response_start(fdp.ConsumeIntInRange(100, 599),
                           {"content-type": fdp.ConsumeUnicodeNoSurrogates(30),
                            "x-sample-rate": fdp.ConsumeUnicodeNoSurrogates(6)})  # fmt: skip
    now = 1.0
    while fdp.remaining_bytes():
        adapter.response_chunk(now, fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 300)))
        now += 1.0
    adapter.response_complete(now)


def request_body(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    request_fields({}, fdp.ConsumeUnicodeNoSurrogates(30), fdp.ConsumeBytes(fdp.remaining_bytes()))


def headers(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    raw = []
    for _ in range(fdp.ConsumeIntInRange(0, 8)):
        name = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 12)).lower()
        value = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 30))
        value = bytes(c for c in value if c not in (0, 10, 13))
        raw.append((name, value))
    query = bytes(c for c in fdp.ConsumeBytes(fdp.remaining_bytes()) if 0x21 <= c < 0x7F)
    scope = {"headers": raw, "query_string": query}
    request = ClientRequest.of(scope)
    for _, value in forwarded_request_headers(raw, client_host="127.0.0.1", scheme="http",
                                              websocket=False):  # fmt: skip
        value.encode("latin-1")
        if "\r" in value or "\n" in value:
            raise AssertionError("CR/LF forwarded")
    response_headers(raw)
    for auth in (False, True):
        out = request.upstream_query(auth=auth)
        suffix = f"?{out}" if out else ""
        parse_uri("ws://127.0.0.1:1/p" + suffix)
        httpx.URL("http://127.0.0.1:1/p" + suffix)


def config(data: bytes) -> None:
    try:
        loaded = yaml.safe_load(data.decode("utf-8", "replace"))
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError):
        return
    if not isinstance(loaded, dict):
        return
    try:
        settings_from_mapping(loaded, env={})
    except ConfigError:
        pass


def env(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    variables = {}
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        name = "HEADROOM_" + fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
        variables[name] = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
    base = {"pools": [{"name": "p", "replicas": [
        {"name": "g", "url": "http://127.0.0.1:1", "max_sessions": 1}]}],
        "routes": [{"path": "/x", "pool": "p", "protocol": "passthrough-ws"}]}  # fmt: skip
    try:
        settings_from_mapping(base, env=variables)
    except ConfigError:
        pass


#: libFuzzer dictionaries: tokens a byte-level mutator would not invent (Python's bytes
#: comparisons are not instrumented, so "data" is never learned from the parser).
DICTIONARIES: dict[str, list[bytes]] = {
    "sse": [b"data:", b"data: ", b"event:", b": ", b"\n", b"\r\n", b"\r", b"\n\n",
            b"\xef\xbb\xbf", b"id:", b"retry:"],
    "wav": [b"RIFF", b"RF64", b"WAVE", b"fmt ", b"data", b"LIST", b"\x10\x00\x00\x00",
            b"\x01\x00", b"\xfe\xff"],
    "b64json": [b'"delta"', b'"audio"', b'"type"', b"\\/", b"=="],
    "ws_adapters": [b'"type"', b"response.output_audio.delta", b"audio.start",
                    b"session.update", b"sample_rate_hz", b"RIFF"],
    "http_adapters": [b"text/event-stream", b"audio/wav", b"audio/pcm", b"data: ",
                      b"speech.audio.delta", b"RIFF", b"rate="],
}  # fmt: skip


def write_dictionary(name: str, directory: str) -> str | None:
    """A libFuzzer ``-dict=`` file for target ``name`` in ``directory``, if it has one."""
    tokens = DICTIONARIES.get(name)
    if not tokens:
        return None
    path = Path(directory) / f"{name}.dict"
    path.write_text("".join('"' + "".join(f"\\x{b:02x}" for b in t) + '"\n' for t in tokens))
    return str(path)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "sse": sse,
    "wav": wav,
    "b64json": b64json,
    "ws_adapters": ws_adapters,
    "http_adapters": http_adapters,
    "request_body": request_body,
    "headers": headers,
    "config": config,
    "env": env,
}


def run_all(runs: int) -> int:
    """Each target in its own process; prints runs, time and outcome per target. Inputs
    that fail are written to a temporary directory (printed), not the working directory."""
    failed = 0
    artifacts = tempfile.mkdtemp(prefix="headroom-atheris-")
    print(f"failing inputs go to {artifacts}/", flush=True)
    for name in TARGETS:
        start = time.monotonic()
        flags = [f"-runs={runs}", "-max_len=4096", "-print_final_stats=1",
                 f"-artifact_prefix={artifacts}/{name}-"]  # fmt: skip
        dictionary = write_dictionary(name, artifacts)
        if dictionary:
            flags.append(f"-dict={dictionary}")
        proc = subprocess.run(
            [sys.executable, __file__, name, *flags], capture_output=True, text=True, check=False
        )
        took = time.monotonic() - start
        done = next((line.split()[-1] for line in proc.stderr.splitlines()
                     if line.startswith("stat::number_of_executed_units")), "?")  # fmt: skip
        status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        print(f"{name:<14} {done:>10} runs  {took:7.1f} s  {status}", flush=True)
        if proc.returncode:
            failed += 1
            print("\n".join(proc.stderr.splitlines()[-25:]))
    return 1 if failed else 0


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "--all":
        return run_all(int(sys.argv[2]) if len(sys.argv) > 2 else 100_000)
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        print(f"usage: {Path(__file__).name} TARGET [libFuzzer flags] | --all RUNS\n"
              f"targets: {', '.join(TARGETS)}", file=sys.stderr)  # fmt: skip
        return 2
    target = TARGETS[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
