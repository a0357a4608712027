"""What applying a large configuration costs: parse, validate, apply.

    python bench/config_apply.py                    # a 4 MiB file, in this process
    python bench/config_apply.py --mib 1 --repeat 5
    python bench/config_apply.py --serve            # and POST /admin/reload on a gateway
    python bench/config_apply.py --serve --workers 2   # the same under --workers (redis)
    python bench/config_apply.py --json out.json

Generates a configuration of ``--mib`` MiB: a few pools, replicas and routes and then as
many API keys (``auth.keys``: name, SHA-256, one pool, a session cap) as fill the size --
the shape of a gateway serving many tenants. Then, in this process, ``--repeat`` times
each (the best run is reported, the machine is shared):

1. parse: :func:`proxy.settings.strict_yaml.load` of the text (duplicate keys refused);
2. validate: :func:`proxy.settings.settings_from_mapping` of the parsed data;
3. apply: :meth:`proxy.runtime.Runtime.apply` of the settings to a runtime started on a
   small configuration (what a reload changes live).

With ``--serve``, starts ``headroom serve`` on 127.0.0.1 with the small configuration
(``--workers N``: N workers on a local redis-server), writes the big one over it, and
times ``POST /admin/reload``; meanwhile a client asks ``/healthz`` every 10 ms and the
longest answer is reported, with the event-loop stalls the gateway logged (its loop
watch: over a second). Bounded: the reload is waited for at most 60 s, every process is
stopped at the end. Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1024 * 1024
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
RELOAD = b"POST /admin/reload HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
#: The gateway's loop watch, when its event loop runs again after a stall.
STALL = re.compile(r"ran again after a stall of ([0-9.]+) s")
POOLS = 8
REPLICAS_PER_POOL = 4


def _head(port: int, admin_port: int, admission: str) -> str:
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        f"admin: {{host: 127.0.0.1, port: {admin_port}}}",
        "log_level: warning",
        admission,
        "pools:",
    ]
    for p in range(POOLS):
        lines.append(f"  - name: pool-{p}")
        lines.append("    replicas:")
        for r in range(REPLICAS_PER_POOL):
            lines.append(
                f"      - {{name: gpu-{p}-{r}, url: 'http://127.0.0.1:{9 + r}', max_sessions: 4}}"
            )
    lines.append("routes:")
    for p in range(POOLS):
        lines.append(
            f"  - {{path: /v1/pool-{p}/speech, pool: pool-{p}, protocol: passthrough-http}}"
        )
    lines.append("auth:")
    lines.append("  keys:")
    return "\n".join(lines) + "\n"


def _key(i: int) -> str:
    sha = hashlib.sha256(f"bench-key-{i}".encode()).hexdigest()
    return (
        f"    - name: tenant-{i:06d}\n"
        f"      sha256: {sha}\n"
        f"      pools: [pool-{i % POOLS}]\n"
        f"      max_sessions: {1 + i % 16}\n"
    )


def generate(
    size_bytes: int, *, port: int = 0, admin_port: int = 0, admission: str = ""
) -> tuple[str, int]:
    """A configuration of about ``size_bytes`` (not over it) and its number of API keys."""
    parts = [_head(port, admin_port, admission)]
    size = len(parts[0])
    keys = 0
    while True:
        entry = _key(keys)
        if size + len(entry) > size_bytes:
            break
        parts.append(entry)
        size += len(entry)
        keys += 1
    return "".join(parts), keys


def mapping_keys(data: Any) -> int:
    """How many mapping keys the parsed document holds."""
    if isinstance(data, dict):
        return len(data) + sum(mapping_keys(v) for v in data.values())
    if isinstance(data, list):
        return sum(mapping_keys(v) for v in data)
    return 0


def _best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def in_process(mib: float, repeat: int) -> dict[str, Any]:
    from proxy.runtime import Runtime
    from proxy.settings import settings_from_mapping, strict_yaml

    text, keys = generate(int(mib * MiB))
    small, _ = generate(len(_head(0, 0, "")) + 400)
    parse_s, data = _best(lambda: strict_yaml.load(text), repeat)
    validate_s, settings = _best(lambda: settings_from_mapping(data, env={}), repeat)

    async def apply() -> None:  # a Runtime lives on an event loop
        runtime = Runtime(settings_from_mapping(strict_yaml.load(small), env={}))
        start = time.perf_counter()
        runtime.apply(settings)
        timings.append(time.perf_counter() - start)

    timings: list[float] = []
    for _ in range(repeat):
        asyncio.run(apply())
    return {
        "bytes": len(text),
        "api_keys": keys,
        "mapping_keys": mapping_keys(data),
        "yaml_loader": strict_yaml.StrictLoader.__mro__[1].__name__,
        "parse_s": round(parse_s, 3),
        "validate_s": round(validate_s, 3),
        "apply_s": round(min(timings), 3),
        "total_s": round(parse_s + validate_s + min(timings), 3),
    }


# -- against a gateway -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _redis() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--workers needs redis-server (apt-get install redis-server)")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


async def _http(port: int, raw: bytes, timeout: float) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data.partition(b"\r\n\r\n")[2]


async def _wait_ready(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            status, _ = await _http(port, HEALTHZ, 2)
            if status == 200:
                return
        await asyncio.sleep(0.1)
    raise SystemExit("the gateway did not start")


async def _reload(port: int, admin_port: int, path: Path, text: str) -> dict[str, Any]:
    """Once the gateway answers: write ``text`` to ``path``, reload, and ask ``/healthz``
    every 10 ms meanwhile."""
    await _wait_ready(port, time.monotonic() + 60)
    await asyncio.to_thread(path.write_text, text)
    worst = 0.0
    stop = asyncio.Event()

    async def ping() -> None:
        nonlocal worst
        while not stop.is_set():
            start = time.perf_counter()
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await _http(port, HEALTHZ, 60)
            worst = max(worst, time.perf_counter() - start)
            await asyncio.sleep(0.01)

    pinger = asyncio.ensure_future(ping())
    start = time.perf_counter()
    status, body = await _http(admin_port, RELOAD, 60)
    took = time.perf_counter() - start
    stop.set()
    await pinger
    answer = json.loads(body) if body.startswith(b"{") else {"raw": body[:300].decode()}
    return {
        "reload_status": status,
        "reload_s": round(took, 3),
        "worst_healthz_s": round(worst, 3),
        "reloaded": answer.get("reloaded"),
        "error": answer.get("error") or answer.get("problems"),
    }


def served(mib: float, workers: int) -> dict[str, Any]:
    """Start ``headroom serve`` on a small configuration, then reload it with the big
    one (see the module docstring)."""
    port, admin_port = _free_port(), _free_port()
    with contextlib.ExitStack() as stack:
        admission = ""
        if workers > 1:
            url = stack.enter_context(_redis())
            admission = f'admission: {{backend: redis, redis: {{url: "{url}"}}}}'
        path = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "headroom.yaml"
        path.write_text(_head(port, admin_port, admission) + _key(0))
        text, keys = generate(int(mib * MiB), port=port, admin_port=admin_port,
                              admission=admission)  # fmt: skip
        command = [sys.executable, "-m", "proxy", "serve", "--config", str(path)]
        if workers > 1:
            command += ["--workers", str(workers)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log = stack.enter_context((path.parent / "gateway.log").open("w+"))
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=log)  # fmt: skip
        try:
            result = asyncio.run(_reload(port, admin_port, path, text))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.seek(0)
        stalls = [float(s) for s in STALL.findall(log.read())]
    return {"workers": workers, "bytes": len(text), "api_keys": keys, **result,
            "loop_stalls_s": stalls}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=4.0, help="configuration size (MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per phase; best kept")
    parser.add_argument("--serve", action="store_true", help="also reload a gateway")
    parser.add_argument("--workers", type=int, default=1, help="with --serve: serve --workers")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    results: dict[str, Any] = {"in_process": in_process(args.mib, args.repeat)}
    print(json.dumps(results["in_process"]))
    if args.serve:
        results["served"] = served(args.mib, args.workers)
        print(json.dumps(results["served"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
