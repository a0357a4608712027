"""Shared machinery of the relay benchmarks: child processes, /proc accounting, and the
relays under test (direct, nginx, Headroom), each in its own process so its CPU and
memory can be read from /proc.

Every child is started in its own process group and stopped (SIGTERM, then SIGKILL) by
:class:`Processes` on exit, whatever happens; every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BENCH_DIR",
    "ROUTE_PATH",
    "ProcSample",
    "Processes",
    "Relay",
    "Worker",
    "cpu_busy",
    "gc_summary",
    "machine_facts",
    "percentile",
    "raise_fd_limit",
    "read_samples",
    "sample",
    "source_revision",
    "start_relay",
    "start_upstreams",
]

BENCH_DIR = Path(__file__).resolve().parent
WSLOAD = BENCH_DIR / "wsload.py"
ROUTE_PATH = "/v1/audio/speech/stream"
TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


# -- /proc ----------------------------------------------------------------------------


def _task_dirs(pid: int) -> list[Path]:
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []


def _cpu_stat_ns(pid: int) -> tuple[int, int]:
    """(utime, stime) of the whole process (all threads), in ns (tick resolution)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0, 0
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) * TICK_NS, int(fields[12]) * TICK_NS


def _cpu_sched_ns(pid: int) -> int | None:
    """On-CPU time summed over the live threads, in ns (schedstat), or None."""
    total = 0
    found = False
    for task in _task_dirs(pid):
        try:
            total += int((task / "schedstat").read_text().split()[0])
            found = True
        except (OSError, ValueError, IndexError):
            continue
    return total if found else None


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def gc_summary(path: Path, start_ns: int, end_ns: int) -> dict[str, Any]:
    """Collections logged by ``bench/gc_trace.py`` between two monotonic instants."""
    by_gen: dict[str, dict[str, float]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        parts = line.split()
        if len(parts) != 4:
            continue
        at, gen, pause = int(parts[0]), parts[1], int(parts[2])
        if not start_ns <= at <= end_ns:
            continue
        g = by_gen.setdefault(gen, {"count": 0, "total_ms": 0.0, "max_ms": 0.0})
        g["count"] += 1
        g["total_ms"] += pause / 1e6
        g["max_ms"] = max(g["max_ms"], pause / 1e6)
    return {k: {n: round(v, 3) for n, v in g.items()} for k, g in sorted(by_gen.items())}


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in _task_dirs(pid):
        with contextlib.suppress(OSError, ValueError):
            found += [int(x) for x in (task / "children").read_text().split()]
    return found


@dataclass(frozen=True)
class ProcSample:
    """CPU (ns) and RSS (KiB) of a set of processes at one instant."""

    at_ns: int
    cpu_ns: int  # schedstat when available, else utime+stime
    user_ns: int  # utime (10 ms ticks)
    sys_ns: int  # stime (10 ms ticks)
    rss_kb: int

    @property
    def stat_ns(self) -> int:
        return self.user_ns + self.sys_ns


def sample(pids: list[int]) -> ProcSample:
    cpu = user = system = rss = 0
    for pid in pids:
        ut, st = _cpu_stat_ns(pid)
        sched = _cpu_sched_ns(pid)
        cpu += sched if sched is not None else ut + st
        user += ut
        system += st
        rss += _rss_kb(pid)
    return ProcSample(time.monotonic_ns(), cpu, user, system, rss)


def cpu_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- samples ----------------------------------------------------------------------------


def read_samples(paths: list[Path]) -> list[int]:
    from array import array

    values = array("q")
    for path in paths:
        with contextlib.suppress(FileNotFoundError), path.open("rb") as f:
            values.frombytes(f.read())
    return sorted(values)


def percentile(ordered: list[int], q: float) -> float | None:
    """Nearest-rank percentile of sorted ns samples, in ms."""
    if not ordered:
        return None
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[rank] / 1e6


# -- processes --------------------------------------------------------------------------


class Processes:
    """Owns every child process; :meth:`stop_all` ends them (process groups)."""

    def __init__(self) -> None:
        self._procs: list[asyncio.subprocess.Process | subprocess.Popen[bytes]] = []

    def add(self, proc: asyncio.subprocess.Process | subprocess.Popen[bytes]) -> None:
        self._procs.append(proc)

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)

    async def stop(
        self, proc: asyncio.subprocess.Process | subprocess.Popen[bytes], grace_s: float = 5.0
    ) -> None:
        if proc.returncode is None:
            self._signal(proc.pid, signal.SIGTERM)
            await _wait_exit(proc, grace_s)
        self._signal(proc.pid, signal.SIGKILL)  # the group: stragglers too
        if isinstance(proc, asyncio.subprocess.Process):
            with contextlib.suppress(TimeoutError, ProcessLookupError):
                await asyncio.wait_for(proc.wait(), 5)
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        if proc in self._procs:
            self._procs.remove(proc)

    async def stop_all(self) -> None:
        for proc in list(reversed(self._procs)):
            await self.stop(proc, grace_s=2.0)

    def kill_all_now(self) -> None:
        for proc in self._procs:
            self._signal(proc.pid, signal.SIGKILL)


async def _wait_exit(
    proc: asyncio.subprocess.Process | subprocess.Popen[bytes], timeout_s: float
) -> None:
    """Poll until ``proc`` has exited (a zombie counts) or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / 0.05) + 1):
        if not _alive(proc) or time.monotonic() >= deadline:
            return
        await asyncio.sleep(0.05)


def _alive(proc: asyncio.subprocess.Process | subprocess.Popen[bytes]) -> bool:
    if isinstance(proc, subprocess.Popen):
        return proc.poll() is None
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); check its state.
    try:
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Worker:
    """A ``bench/wsload.py`` process driven over its stdin/stdout line protocol."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.pid = proc.pid

    @classmethod
    async def start(cls, procs: Processes, name: str, *args: str) -> tuple[Worker, dict[str, Any]]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WSLOAD),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        procs.add(proc)
        worker = cls(proc, name)
        ready = await worker.expect("ready", 15.0)
        return worker, ready

    def send(self, cmd: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **fields}) + "\n").encode())

    async def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    line = await self.proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"{self.name} exited (waiting for {event!r})")
                    message: dict[str, Any] = json.loads(line)
                    if message.get("event") == event:
                        return message
        except TimeoutError:
            raise RuntimeError(f"{self.name}: no {event!r} within {timeout_s:.0f} s") from None

    async def call(self, cmd: str, event: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        self.send(cmd, **fields)
        return await self.expect(event, timeout_s)


async def start_upstreams(
    procs: Processes, count: int, pacing_ms: float, chunk_bytes: int
) -> tuple[list[Worker], int]:
    """``count`` upstream processes sharing one port; returns them and the port."""
    first, ready = await Worker.start(
        procs, "upstream0", "upstream", "--pacing-ms", str(pacing_ms),
        "--chunk-bytes", str(chunk_bytes),
    )  # fmt: skip
    port = int(ready["port"])
    workers = [first]
    for i in range(1, count):
        w, _ = await Worker.start(
            procs, f"upstream{i}", "upstream", "--port", str(port),
            "--pacing-ms", str(pacing_ms), "--chunk-bytes", str(chunk_bytes),
        )  # fmt: skip
        workers.append(w)
    return workers, port


# -- relays -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_port(port: int, timeout_s: float, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and not _alive(proc):
            raise RuntimeError("relay exited during start-up")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout_s:.0f} s")


@dataclass
class Relay:
    """A relay under test; ``proc`` None for ``direct`` (no relay process)."""

    name: str
    url: str
    proc: asyncio.subprocess.Process | None
    log: Path | None = None

    def pids(self) -> list[int]:
        if self.proc is None:
            return []
        return [self.proc.pid, *children(self.proc.pid)]


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def install_nginx() -> str | None:
    """Install Debian's nginx package when missing (root with apt-get only)."""
    found = nginx_binary()
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    print("nginx not found: installing Debian's package (apt-get install nginx)", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "nginx"]):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run(cmd, env=env, check=True, timeout=300, capture_output=True)
    return nginx_binary()


NGINX_CONF = """\
# Generated by bench/harness.py: a WebSocket reverse proxy, one worker, no compression.
daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile 65536;
pid {run}/nginx.pid;
error_log {run}/nginx-error.log warn;
events {{ worker_connections 16384; multi_accept on; }}
http {{
    access_log off;
    gzip off;
    client_body_temp_path {run}/client_body;
    proxy_temp_path {run}/proxy;
    fastcgi_temp_path {run}/fastcgi;
    uwsgi_temp_path {run}/uwsgi;
    scgi_temp_path {run}/scgi;
    map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://127.0.0.1:{upstream_port};
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $host;
            proxy_buffering off;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
{extra}        }}
    }}
}}
"""


def headroom_config(port: int, upstream_port: int, max_sessions: int, protocol: str) -> str:
    """A one-pool, one-route Headroom configuration (metering is always on)."""
    return f"""\
# Generated by bench/harness.py.
listen: {{host: 127.0.0.1, port: {port}}}
admin: {{enabled: false}}
log_level: warning
log_format: text
drain_timeout_s: 1
limits: {{idle_timeout_s: 120, max_session_s: 3600}}
pools:
  - name: bench
    replicas:
      - {{name: up0, url: "http://127.0.0.1:{upstream_port}", max_sessions: {max_sessions}}}
    queue: {{max_depth: 0}}
routes:
  - path: {ROUTE_PATH}
    pool: bench
    protocol: {protocol}
    audio: {{sample_rate: 24000, channels: 1, sample_width: 2}}
"""


def headroom_command() -> list[str]:
    exe = Path(sys.executable).with_name("headroom")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("headroom")
    return [found] if found else [sys.executable, "-m", "proxy"]


async def start_relay(
    procs: Processes,
    target: str,
    run_dir: Path,
    upstream_port: int,
    *,
    max_sessions: int = 1,
    protocol: str = "vllm-omni-speech-ws",
    gc_trace: Path | None = None,
    gc_freeze_s: float | None = None,
    nginx_buffer: str | None = None,
    headroom_yaml: Callable[[str], str] | None = None,
) -> Relay:
    """Start ``direct`` (nothing), ``nginx`` or ``headroom`` in front of the upstream
    (``headroom_yaml``: a change to Headroom's generated configuration)."""
    if target == "direct":
        return Relay("direct", f"ws://127.0.0.1:{upstream_port}{ROUTE_PATH}", None)
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - before any load
    log = run_dir / f"{target}.log"
    if target == "nginx":
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (apt-get install nginx)")
        nginx_dir = run_dir / "nginx"
        nginx_dir.mkdir(exist_ok=True)
        conf = nginx_dir / "nginx.conf"
        extra = "".join(
            f"            {line};\n"
            for line in (f"proxy_buffer_size {nginx_buffer}", f"proxy_buffers 4 {nginx_buffer}",
                         f"proxy_busy_buffers_size {nginx_buffer}")
            if nginx_buffer
        )  # fmt: skip
        conf.write_text(
            NGINX_CONF.format(run=nginx_dir, port=port, upstream_port=upstream_port, extra=extra)
        )
        cmd = [binary, "-p", str(nginx_dir), "-c", str(conf), "-e", str(nginx_dir / "stderr.log")]
    elif target == "headroom":
        conf = run_dir / "headroom.yaml"
        text = headroom_config(port, upstream_port, max_sessions, protocol)
        conf.write_text(headroom_yaml(text) if headroom_yaml else text)
        cmd = [*headroom_command(), "serve", "--config", str(conf)]
        if gc_trace is not None:  # the same command, with every GC pass logged
            freeze = ["--freeze-after", str(gc_freeze_s)] if gc_freeze_s is not None else []
            cmd = [sys.executable, str(BENCH_DIR / "gc_trace.py"), str(gc_trace), *freeze,
                   "--", *cmd[-3:]]  # fmt: skip
    elif target in ("splice", "splice-meter"):  # the lean-relay prototype
        cmd = [sys.executable, str(BENCH_DIR / "splice_relay.py"), "--port", str(port),
               "--upstream-port", str(upstream_port)]  # fmt: skip
        if target == "splice-meter":
            cmd.append("--meter")
    else:
        raise ValueError(f"unknown target {target!r}")
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip
    procs.add(proc)
    try:
        await wait_port(port, 30.0, proc)
    except RuntimeError as exc:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"{target} did not start: {exc}\n{tail}") from None
    return Relay(target, f"ws://127.0.0.1:{port}{ROUTE_PATH}", proc, log)


# -- machine facts ----------------------------------------------------------------------


def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def source_revision() -> str | None:
    """The checkout's commit, ``+dirty`` when tracked files of ``proxy/`` have changes."""
    root = BENCH_DIR.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
             "proxy"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def headroom_build() -> str | None:
    """Whether the Headroom the bench starts runs its per-chunk modules compiled
    (proxy/speedups.py), asked of the same interpreter and module path (``-P``: no
    current directory, as the ``headroom`` script runs)."""
    code = "from proxy.speedups import build_status; print(build_status().describe())"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=30
        )
        if out.returncode == 0:
            return out.stdout.strip()
    return None


def machine_facts() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    nginx = None
    binary = nginx_binary()
    if binary:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10)
            match = re.search(r"nginx/(\S+)", out.stderr + out.stdout)
            nginx = match.group(1) if match else None
    return {
        "headroom_revision": source_revision(),
        "headroom_build": headroom_build(),
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "uvicorn": _version("uvicorn"),
        "websockets": _version("websockets"),
        "uvloop": _version("uvloop"),
        "headroom": _version("headroom-proxy"),
        "nginx": nginx,
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }
