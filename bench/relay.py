"""Relay cost: Headroom against nginx and a direct connection, side by side, same run.

    python bench/relay.py                       # the issue's table: 500 x 40 ms, 1000 x 200 ms,
                                                # both builds, 4 rounds (about 33 min)
    python bench/relay.py --baseline REV        # + the same two builds of REV
    python bench/relay.py --source REV          # Headroom from REV, not the working tree
    python bench/relay.py --quick               # smoke: 20 sessions, 40 ms, 1 round
    python bench/relay.py --sessions 500 --pacing-ms 40 --json out.json --markdown out.md

A paced upstream (``bench/wsload.py upstream``) streams binary PCM chunks (9.6 KB =
0.2 s of 24 kHz PCM16) whose first 8 bytes are the CLOCK_MONOTONIC send time; client
processes (``bench/wsload.py clients``) compute latency = receive time - send time
(helpers: bench/relay_trees.py builds and starts the trees, bench/relay_matrix.py runs
the rounds and summarises them, bench/relay_report.py prints the report).
Each cell (target x sessions x pacing) measures, in order: the relay idle, the connect
phase (setup CPU per session), the connected RSS, then streaming: a warm-up, then a
steady window in which latency samples and the relay's CPU are taken. Targets:

- ``direct``: client -> upstream (the latency baseline);
- ``nginx``: Debian's nginx (installed if missing), one worker, WebSocket proxy,
  ``proxy_buffering off``, no compression;
- ``headroom`` and ``headroom-compiled``: ``python -m proxy serve`` from a copy of the
  checkout, interpreted, and from a second copy with the per-chunk modules compiled
  (bench/relay_trees.py); one pool, one replica (cap >= sessions), queue off, route
  ``vllm-omni-speech-ws`` (metering is always on), log level warning, the admin listener
  on loopback (the bench reads the metered audio from its ``/metrics`` outside the
  measured windows);
- ``baseline`` and ``baseline-compiled`` (``--baseline REV``): the same two builds of
  ``git archive REV``;
- ``headroom-installed``: the ``headroom`` command of this interpreter's environment
  (what bench/workers_scale.py drives);
- ``headroom-qf``: the interpreted tree with ``queue_feedback: true`` on the route, and
  every session but the first made to wait: Headroom starts with a cap of 1 and a queue
  for all, so each client is accepted early and told its place; after the connect phase
  the cap is raised (``POST /admin/reload``) and the waiters are admitted together. Its
  setup CPU is that whole path.

The relay under test, the upstream and the clients are separate processes: relay CPU is
``/proc/<pid>/task/*/schedstat`` (on-CPU ns; ``/proc/<pid>/stat`` utime+stime, which
keeps exited threads, is the cross-check), memory is VmRSS; nginx is master + worker
(the cell fails when the worker is not found). A fresh relay process per cell.
Everything is on 127.0.0.1 and every phase has a deadline.

The warm-up lasts until each session has streamed ``--warmup-chunks`` chunks when that
fits in ``--max-warmup`` seconds (the session meter's exact quantile sketches turn into
histograms after a few hundred chunks, and a longer session pays for that), else
``--warmup`` seconds; each cell records which.

The matrix is run ``--rounds`` times, in a balanced order (bench/relay_matrix.py: every
other round reversed, each pair of rounds rotated one place); before
each cell the run waits (at most ``--load-wait`` s) for the 1-minute load average to fall
below ``--max-load`` and records the load averages and the machine's busy share before
and after; a cell that started above the limit, or whose window saw more than
``--max-other-cores`` of other processes' CPU, is noisy (bench/relay_matrix.py).

Set-up CPU per session is the median of ``--setup-bursts`` bursts (5): the first is the
connect phase above; the others come after the streaming, each a burst of the same
connects, measured the same way, then closed. Every burst's figure is in the JSON
(``setup_cpu_ms_per_session_bursts``, the first first).

Reported per cell: latency p50/p99 (steady window), added p50/p99 vs direct, relay CPU
per relayed chunk, setup CPU per session, memory per session ((RSS streaming - RSS
idle) / sessions, and the same with the sessions connected but idle), chunks delivered
vs expected, metered audio vs relayed audio, machine CPU busy; then per target and cell
the median and range over rounds, the ratios to nginx and to the baseline, and the
issue's targets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/relay.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # type: ignore[import-not-found,unused-ignore]
    Processes,
    ProcSample,
    Relay,
    Worker,
    cpu_busy,
    free_port,
    gc_summary,
    install_nginx,
    machine_facts,
    nginx_binary,
    percentile,
    raise_fd_limit,
    read_samples,
    sample,
    start_relay,
    start_upstreams,
)
from relay_matrix import (  # type: ignore[import-not-found,unused-ignore]
    LIMITS,
    busy_share,
    rotated,
    summarize,
    targets_met,
    wait_quiet,
)
from relay_report import (  # type: ignore[import-not-found,unused-ignore]
    markdown,
)
from relay_trees import (  # type: ignore[import-not-found,unused-ignore]
    Tree,
    audio_seconds_metered,
    enable_admin,
    prepare_trees,
    start_headroom,
)

TARGETS = ("direct", "nginx", "headroom", "headroom-compiled")
#: Added to the targets by ``--baseline REV``.
BASELINE_TARGETS = ("baseline", "baseline-compiled")
#: The issue's matrix: (sessions, pacing ms).
DEFAULT_CELLS = ((500, 40.0), (1000, 200.0))
#: Headroom with a queue-feedback route, every session admitted after waiting.
QUEUE_FEEDBACK = "headroom-qf"
#: The ``headroom`` command installed beside this interpreter, started by bench/harness.py
#: (bench/workers_scale.py changes its command and configuration there).
INSTALLED = "headroom-installed"
#: Lean-relay prototypes (bench/splice_relay.py), for what-if comparisons only.
PROTOTYPES = ("splice", "splice-meter")
NPROC = os.cpu_count() or 1

CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Bytes of audio per second in a chunk (24 kHz mono PCM16, the route's format).
AUDIO_BYTES_PER_S = 48000


def _split(n: int, parts: int) -> list[int]:
    parts = max(1, min(parts, n))
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


async def run_cell(
    args: argparse.Namespace,
    procs: Processes,
    target: str,
    sessions: int,
    pacing_ms: float,
    upstream: list[Worker],
    upstream_port: int,
    run_dir: Path,
    trees: dict[str, Tree],
    round_index: int = 0,
) -> dict[str, Any]:
    cell_dir = run_dir / f"r{round_index + 1}-{target}-{sessions}-{pacing_ms:g}"
    cell_dir.mkdir(parents=True, exist_ok=True)
    waiting = _QueueFeedback(sessions + 16) if target == QUEUE_FEEDBACK else None
    gc_log = cell_dir / "gc.log" if args.gc_trace or args.gc_freeze else None
    admin_port: int | None = None
    tree = trees.get("headroom" if waiting else target)
    if tree is not None:
        if waiting is not None:
            admin_port, edit = waiting.admin_port, waiting.configure
        else:
            admin_port = free_port()
            edit = functools.partial(enable_admin, port=admin_port)
        relay = await start_headroom(
            procs, tree, cell_dir, upstream_port, max_sessions=sessions + 16,
            protocol=args.protocol, edit=edit, gc_trace=gc_log,
            gc_freeze_s=1.0 if args.gc_freeze else None,
        )  # fmt: skip
    elif target == INSTALLED:
        relay = await start_relay(
            procs, "headroom", cell_dir, upstream_port, max_sessions=sessions + 16,
            protocol=args.protocol, gc_trace=gc_log,
            gc_freeze_s=1.0 if args.gc_freeze else None,
        )  # fmt: skip
    else:
        relay = await start_relay(procs, target, cell_dir, upstream_port,
                                  nginx_buffer=args.nginx_buffer)  # fmt: skip
    if relay.proc is not None:
        print(f"   {target} pid {relay.proc.pid}", file=sys.stderr)
    clients: list[Worker] = []
    try:
        for i, _ in enumerate(_split(sessions, args.client_procs)):
            w, _ready = await Worker.start(
                procs, f"clients{i}", "clients", "--url", relay.url, "--timeout-s", "20"
            )
            clients.append(w)
        cell = await _measure(args, relay, clients, upstream, target, sessions, pacing_ms,
                              cell_dir, waiting, admin_port)  # fmt: skip
        cell["round"] = round_index
        cell["build"] = tree.build if tree is not None else None
        cell["revision"] = tree.revision if tree is not None else None
        return cell
    finally:
        for w in clients:
            with contextlib.suppress(Exception):
                w.send("exit")
        for w in clients:
            await procs.stop(w.proc, grace_s=3.0)
        if relay.proc is not None:
            await procs.stop(relay.proc, grace_s=5.0)


class _QueueFeedback:
    """``headroom-qf``: a queue-feedback route, a cap of 1 and a queue for every session
    while they connect; :meth:`admit_all` raises the cap to ``cap`` and waits until all
    the waiters are admitted."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.admin_port = free_port()
        self.config = ""

    def configure(self, text: str) -> str:
        swaps = [
            ("admin: {enabled: false}",
             f"admin: {{enabled: true, host: 127.0.0.1, port: {self.admin_port}}}"),
            (f"max_sessions: {self.cap}}}", "max_sessions: 1}"),
            ("queue: {max_depth: 0}", f"queue: {{max_depth: {self.cap}, max_wait_s: 600}}"),
            ("    protocol: ", "    queue_feedback: true\n    protocol: "),
        ]  # fmt: skip
        for old, new in swaps:
            if text.count(old) != 1:
                raise RuntimeError(f"headroom-qf: {old!r} not once in the bench configuration")
            text = text.replace(old, new)
        self.config = text
        return text

    async def _admin(self, method: str, path: str) -> dict[str, Any]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.admin_port)
        try:
            writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         "Content-Length: 0\r\nConnection: close\r\n\r\n".encode())  # fmt: skip
            raw = await reader.read()
        finally:
            writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"admin {method} {path}: {head[:200]!r}")
        result: dict[str, Any] = json.loads(body)
        return result

    async def reset(self, config_path: Path) -> None:
        """Back to a cap of 1 (every session closed), for another burst of waiters."""
        config_path.write_text(self.config)  # noqa: ASYNC240 - between phases, not under load
        await self._admin("POST", "/admin/reload")

    async def admit_all(self, config_path: Path, sessions: int, deadline_s: float) -> None:
        config_path.write_text(  # noqa: ASYNC240 - between phases, not under load
            self.config.replace("max_sessions: 1}", f"max_sessions: {self.cap}}}")
        )
        await self._admin("POST", "/admin/reload")
        end = time.monotonic() + deadline_s
        while True:
            pool = (await self._admin("GET", "/admin/status"))["pools"]["bench"]
            if pool["queue_depth"] == 0 and pool["active"] >= sessions:
                return
            if time.monotonic() > end:
                raise RuntimeError(f"headroom-qf: waiters not all admitted: {pool}")
            await asyncio.sleep(0.1)


async def _connect_burst(
    args: argparse.Namespace,
    clients: list[Worker],
    shares: list[int],
    pids: list[int],
    timeout_s: float,
    target: str,
    cell_dir: Path,
    waiting: _QueueFeedback | None,
    failed: dict[str, int],
) -> tuple[ProcSample, ProcSample, float, int]:
    """One burst of connects (``shares[i]`` from client process ``i``), and for
    ``headroom-qf`` the admission of the waiters, then a settle: the relay's samples
    before and after, the connects' wall time and how many connected. Failures are
    counted into ``failed``."""
    before = sample(pids)
    started = time.monotonic()
    replies = await asyncio.gather(
        *(w.call("connect", "connected", timeout_s, n=n, concurrency=args.concurrency)
          for w, n in zip(clients, shares, strict=True))
    )  # fmt: skip
    seconds = time.monotonic() - started
    connected = sum(int(r["ok"]) for r in replies)
    for r in replies:
        for k, v in r["failed"].items():
            failed[k] = failed.get(k, 0) + int(v)
    if not connected:
        raise RuntimeError(f"no session connected through {target}: {failed}")
    if waiting is not None:  # connected = accepted to wait; now admit them all
        await waiting.admit_all(cell_dir / "headroom.yaml", connected, timeout_s)
    await asyncio.sleep(args.settle)
    return before, sample(pids), seconds, connected


async def _measure(
    args: argparse.Namespace,
    relay: Relay,
    clients: list[Worker],
    upstream: list[Worker],
    target: str,
    sessions: int,
    pacing_ms: float,
    cell_dir: Path,
    waiting: _QueueFeedback | None = None,
    admin_port: int | None = None,
) -> dict[str, Any]:
    pids = relay.pids()
    if target == "nginx" and len(pids) < 2:
        await asyncio.sleep(1.0)  # the master forks its worker after it listens
        pids = relay.pids()
        if len(pids) < 2:
            raise RuntimeError(f"nginx: worker process not found (pids {pids})")
    loadgen_pids = [w.pid for w in clients + upstream]
    shares = _split(sessions, len(clients))
    connect_timeout = 30.0 + sessions * 0.05

    # Prime: one short session through the relay, so lazy imports and first-use
    # allocations are not charged to the sessions measured.
    await clients[0].call("connect", "connected", 30.0, n=2, concurrency=2)
    await clients[0].call("start", "started", 10.0)
    await asyncio.sleep(args.prime)
    await clients[0].call("close", "closed", 30.0)
    await asyncio.sleep(args.prime)

    failed: dict[str, int] = {}
    idle, after_connect, connect_s, connected = await _connect_burst(
        args, clients, shares, pids, connect_timeout, target, cell_dir, waiting, failed
    )

    await asyncio.gather(*(w.call("start", "started", 10.0) for w in clients))
    warmup_s = warmup_seconds(args, pacing_ms)
    await asyncio.sleep(warmup_s)

    metered0 = await audio_seconds_metered(admin_port) if admin_port is not None else None
    await asyncio.gather(*(w.call("mark", "marked", 10.0) for w in clients))
    w0 = sample(pids)
    g0 = sample(loadgen_pids)
    busy0 = cpu_busy()
    await asyncio.sleep(args.window)
    w1 = sample(pids)
    g1 = sample(loadgen_pids)
    busy1 = cpu_busy()
    stops = await asyncio.gather(
        *(w.call("stop", "stopped", 30.0, out=str(cell_dir / f"c{i}"))
          for i, w in enumerate(clients))
    )  # fmt: skip
    # After the clients stop counting: the scrape is no part of any target's window.
    metered1 = await audio_seconds_metered(admin_port) if admin_port is not None else None
    closes = await asyncio.gather(*(w.call("close", "closed", 60.0) for w in clients))
    has_relay = relay.proc is not None

    # More connect bursts, after the streaming (so the memory figures above are those
    # of the first): one burst of connects is a fraction of a second of CPU-bound work,
    # and on a shared machine the same burst in the same process costs 0.27-0.49 ms a
    # session from one round to the next. The set-up figure is the median of the bursts.
    setup_ms = [(after_connect.cpu_ns - idle.cpu_ns) / 1e6 / connected]
    burst_s = [connect_s]
    for _ in range(args.setup_bursts - 1 if has_relay else 0):
        await asyncio.sleep(args.settle)
        if waiting is not None:
            await waiting.reset(cell_dir / "headroom.yaml")
        before, after, seconds, ok = await _connect_burst(
            args, clients, shares, pids, connect_timeout, target, cell_dir, waiting, failed
        )
        setup_ms.append((after.cpu_ns - before.cpu_ns) / 1e6 / ok)
        burst_s.append(seconds)
        await asyncio.gather(*(w.call("close", "closed", 60.0) for w in clients))

    lat = read_samples([cell_dir / f"c{i}.lat" for i in range(len(clients))])
    gaps = read_samples([cell_dir / f"c{i}.gap" for i in range(len(clients))])
    if not args.keep:
        for i in range(len(clients)):
            for ext in ("lat", "gap", "at"):
                (cell_dir / f"c{i}.{ext}").unlink(missing_ok=True)
    chunks = sum(int(s["chunks"]) for s in stops)
    window_s = (w1.at_ns - w0.at_ns) / 1e9
    expected = connected * window_s / (pacing_ms / 1000.0)
    codes: dict[str, int] = {}
    for c in closes:
        for k, v in c["close_codes"].items():
            codes[k] = codes.get(k, 0) + int(v)
    relay_cpu_ns = w1.cpu_ns - w0.cpu_ns
    busy = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    relayed_audio_s = chunks * args.chunk_bytes / AUDIO_BYTES_PER_S
    metered = (
        _r((metered1 - metered0) / relayed_audio_s)
        if metered0 is not None and metered1 is not None and relayed_audio_s
        else None
    )
    cell: dict[str, Any] = {
        "target": target,
        "sessions": sessions,
        "pacing_ms": pacing_ms,
        "chunk_bytes": args.chunk_bytes,
        "connected": connected,
        "connect_failures": failed,
        "relay_pids": len(pids),
        "warmup_s": _r(warmup_s, 2),
        "chunks_before_window": _r(warmup_s / (pacing_ms / 1000.0), 0),
        "metered_audio_ratio": metered,
        "connect_seconds": _r(connect_s),
        "window_s": _r(window_s),
        "chunks": chunks,
        "chunks_per_s": _r(chunks / window_s if window_s else 0.0, 1),
        "delivered_ratio": _r(chunks / expected if expected else 0.0),
        "latency_ms": {
            "p50": _r(percentile(lat, 50)),
            "p90": _r(percentile(lat, 90)),
            "p99": _r(percentile(lat, 99)),
            "p999": _r(percentile(lat, 99.9)),
            "max": _r(lat[-1] / 1e6 if lat else None),
            "samples": len(lat),
        },
        "gap_ms": {"p50": _r(percentile(gaps, 50)), "p99": _r(percentile(gaps, 99))},
        "relay_cpu_us_per_chunk": _r(relay_cpu_ns / 1e3 / chunks) if has_relay and chunks
        else None,
        "relay_cpu_us_per_chunk_stat": _r((w1.stat_ns - w0.stat_ns) / 1e3 / chunks)
        if has_relay and chunks else None,
        "relay_cpu_ticks": (w1.stat_ns - w0.stat_ns) * CLK_TCK // 1_000_000_000
        if has_relay else None,
        "relay_sys_share": _r((w1.sys_ns - w0.sys_ns) / (w1.stat_ns - w0.stat_ns))
        if has_relay and w1.stat_ns > w0.stat_ns else None,
        "relay_cpu_cores": _r(relay_cpu_ns / (w1.at_ns - w0.at_ns)) if has_relay else None,
        "setup_cpu_ms_per_session": _r(statistics.median(setup_ms)) if has_relay else None,
        "setup_cpu_ms_per_session_bursts": [_r(x) for x in setup_ms] if has_relay else [],
        "connect_seconds_bursts": [_r(x) for x in burst_s] if has_relay else [],
        "rss_idle_kb": idle.rss_kb if has_relay else None,
        "mem_kb_per_session": _r((w1.rss_kb - idle.rss_kb) / connected, 2)
        if has_relay and connected else None,
        "mem_kb_per_session_connected": _r((after_connect.rss_kb - idle.rss_kb) / connected, 2)
        if has_relay and connected else None,
        "loadgen_cpu_cores": _r((g1.cpu_ns - g0.cpu_ns) / (g1.at_ns - g0.at_ns)),
        "machine_busy": _r(busy),
        "other_cpu_cores": _r(
            busy * NPROC
            - (relay_cpu_ns / (w1.at_ns - w0.at_ns) if has_relay else 0.0)
            - (g1.cpu_ns - g0.cpu_ns) / (g1.at_ns - g0.at_ns)
        ),
        "close_codes": codes,
        "sessions_alive_at_stop": sum(int(s["alive"]) for s in stops),
        "sessions_silent": sum(int(s["silent"]) for s in stops),
    }  # fmt: skip
    if (args.gc_trace or args.gc_freeze) and target == "headroom":
        cell["gc_in_window"] = gc_summary(cell_dir / "gc.log", w0.at_ns, w1.at_ns)
        cell["gc_in_setup"] = gc_summary(cell_dir / "gc.log", idle.at_ns, after_connect.at_ns)
    return cell


def warmup_seconds(args: argparse.Namespace, pacing_ms: float) -> float:
    """Streamed before the window: ``--warmup-chunks`` chunks a session when that fits
    in ``--max-warmup`` seconds, else ``--warmup`` seconds."""
    by_chunks = float(args.warmup_chunks) * pacing_ms / 1000.0
    floor = float(args.warmup)
    return max(floor, by_chunks) if by_chunks <= args.max_warmup else floor


def _added(cells: list[dict[str, Any]]) -> None:
    """Fill in added latency vs the direct cell of the same shape and round."""
    direct = {
        (c["sessions"], c["pacing_ms"], c.get("round", 0)): c
        for c in cells if c["target"] == "direct"
    }  # fmt: skip
    for c in cells:
        d = direct.get((c["sessions"], c["pacing_ms"], c.get("round", 0)))
        for q in ("p50", "p99"):
            mine, base = c["latency_ms"][q], d["latency_ms"][q] if d else None
            c[f"added_{q}_ms"] = _r(mine - base) if mine is not None and base is not None else None


def _noisy(args: argparse.Namespace, gate: dict[str, Any], cell: dict[str, Any]) -> list[str]:
    why = []
    if not gate["quiet"]:
        why.append(f"load {cell['load_before'][0]:.2f} >= {args.max_load:g}")
    other = cell.get("other_cpu_cores")
    if other is not None and other > args.max_other_cores:
        why.append(f"other load {other:.2f} cores")
    return why


async def _gated_cell(
    args: argparse.Namespace, procs: Processes, target: str, n: int, pacing: float,
    upstream: list[Worker], port: int, run_dir: Path, trees: dict[str, Tree], r: int,
) -> dict[str, Any]:  # fmt: skip
    """One cell behind the load gate, with the machine's state before and after."""
    gate = await wait_quiet(args.max_load, args.load_wait)
    load_before = list(os.getloadavg())
    busy_before = await busy_share(args.busy_sample)
    cell = await run_cell(args, procs, target, n, pacing, upstream, port, run_dir, trees, r)
    busy_after = await busy_share(args.busy_sample)
    cell.update(
        load_at_gate=[_r(x, 2) for x in gate["load_at_gate"]],
        load_waited_s=_r(gate["load_waited_s"], 1),
        load_before=[_r(x, 2) for x in load_before],
        load_after=[_r(x, 2) for x in os.getloadavg()],
        busy_before=_r(busy_before),
        busy_after=_r(busy_after),
    )
    cell["noisy"] = _noisy(args, gate, cell)
    return cell


def _wanted(args: argparse.Namespace) -> list[str]:
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.baseline:
        wanted += [t for t in BASELINE_TARGETS if t not in wanted]
    known = (*TARGETS, *BASELINE_TARGETS, QUEUE_FEEDBACK, INSTALLED, *PROTOTYPES)
    for t in wanted:
        if t not in known:
            raise SystemExit(f"unknown target {t!r} (choose from {', '.join(known)})")
        if t in BASELINE_TARGETS and not args.baseline:
            raise SystemExit(f"target {t!r} needs --baseline REV")
    return wanted


async def run(args: argparse.Namespace) -> dict[str, Any]:
    raise_fd_limit()
    wanted = _wanted(args)
    notes: list[str] = []
    no_nginx = "nginx" in wanted and nginx_binary() is None
    if no_nginx and (args.no_install or install_nginx() is None):
        notes.append("nginx not installed: nginx cells skipped")
        wanted.remove("nginx")
    procs = Processes()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="headroom-bench-"))
    cells: list[dict[str, Any]] = []
    started = time.monotonic()
    load_start = list(os.getloadavg())
    trees: dict[str, Tree] = {}
    try:
        needed = [*wanted, "headroom"] if QUEUE_FEEDBACK in wanted else wanted
        trees = prepare_trees(needed, run_dir, args.baseline, args.source)
        for r in range(args.rounds):
            order = rotated(wanted, r)
            print(f"== round {r + 1} of {args.rounds}: {' '.join(order)}", file=sys.stderr)
            for n, pacing in args.cells:
                upstream, port = await start_upstreams(
                    procs, args.upstream_procs, pacing, args.chunk_bytes
                )
                try:
                    for target in order:
                        if time.monotonic() - started > args.max_total_s:
                            notes.append(f"time budget ({args.max_total_s:.0f} s) reached")
                            raise TimeoutError
                        print(f"-- r{r + 1} {target}: {n} sessions, {pacing:g} ms",
                              file=sys.stderr)  # fmt: skip
                        try:
                            cell = await _gated_cell(args, procs, target, n, pacing, upstream,
                                                     port, run_dir, trees, r)  # fmt: skip
                        except RuntimeError as exc:
                            notes.append(f"r{r + 1} {target} {n}x{pacing:g}ms failed: {exc}")
                            print(f"   failed: {exc}", file=sys.stderr)
                            continue
                        cells.append(cell)
                        print(
                            f"   p50 {cell['latency_ms']['p50']} ms, p99 "
                            f"{cell['latency_ms']['p99']} ms, cpu/chunk "
                            f"{cell['relay_cpu_us_per_chunk']} us, delivered "
                            f"{cell['delivered_ratio']}, load {cell['load_before']}"
                            + (f", noisy: {'; '.join(cell['noisy'])}" if cell["noisy"] else ""),
                            file=sys.stderr,
                        )
                finally:
                    for w in upstream:
                        await procs.stop(w.proc, grace_s=1.0)
    except TimeoutError:
        pass
    except (RuntimeError, subprocess.SubprocessError) as exc:
        notes.append(f"stopped: {exc}")
        print(f"stopped: {exc}", file=sys.stderr)
    finally:
        await procs.stop_all()
        if not (args.run_dir or args.keep or notes):  # keep the logs when something failed
            shutil.rmtree(run_dir, ignore_errors=True)
        elif notes:
            print(f"logs kept in {run_dir}", file=sys.stderr)
    _added(cells)
    rows = summarize(cells)
    limits = {"cpu_x_baseline": LIMITS["cpu_x_baseline"] + args.baseline_tolerance}
    return {
        "benchmark": "relay",
        "machine": machine_facts(),
        "trees": {t: {"revision": tree.revision, "build": tree.build} for t, tree in trees.items()},
        "config": {
            "targets": wanted,
            "cells": [[n, p] for n, p in args.cells],
            "rounds": args.rounds,
            "baseline": args.baseline,
            "source": args.source,
            "baseline_tolerance": args.baseline_tolerance,
            "max_load": args.max_load,
            "load_wait_s": args.load_wait,
            "max_other_cores": args.max_other_cores,
            "chunk_bytes": args.chunk_bytes,
            "protocol": args.protocol,
            "gc_freeze": args.gc_freeze,
            "nginx_buffer": args.nginx_buffer,
            "warmup_s": args.warmup,
            "warmup_chunks": args.warmup_chunks,
            "max_warmup_s": args.max_warmup,
            "window_s": args.window,
            "client_procs": args.client_procs,
            "setup_bursts": args.setup_bursts,
            "upstream_procs": args.upstream_procs,
            "command": " ".join(sys.argv),
        },
        "load_start": [_r(x, 2) for x in load_start],
        "load_end": [_r(x, 2) for x in os.getloadavg()],
        "elapsed_s": _r(time.monotonic() - started, 1),
        "cells": cells,
        "summary": rows,
        "checks": targets_met(rows, limits),
        "notes": notes,
    }


def _cells(args: argparse.Namespace) -> list[tuple[int, float]]:
    """``--sessions`` x ``--pacing-ms`` when either is given, else the issue's matrix."""
    if args.sessions is None and args.pacing_ms is None:
        return list(DEFAULT_CELLS)
    sessions = args.sessions or sorted({n for n, _ in DEFAULT_CELLS})
    pacings = args.pacing_ms or sorted({p for _, p in DEFAULT_CELLS})
    return [(n, p) for p in pacings for n in sessions]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--targets", default=",".join(TARGETS),
        help=f"comma-separated, from {', '.join(TARGETS)} (also {QUEUE_FEEDBACK}: "
        f"queue-feedback sessions; {', '.join(BASELINE_TARGETS)} with --baseline)",
    )  # fmt: skip
    p.add_argument("--baseline", metavar="REV",
                   help="also measure this git revision, interpreted and compiled")  # fmt: skip
    p.add_argument(
        "--source", metavar="REV",
        help="Headroom's trees from this git revision instead of the working tree",
    )  # fmt: skip
    p.add_argument(
        "--baseline-tolerance", type=float, default=0.02,
        help="per-chunk CPU may be this much above the baseline's (median ratio)",
    )  # fmt: skip
    p.add_argument("--sessions", type=int, nargs="+",
                   help="sessions per cell (with --pacing-ms: every combination); default: "
                   "500 x 40 ms and 1000 x 200 ms")  # fmt: skip
    p.add_argument("--pacing-ms", type=float, nargs="+")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="the matrix, in a balanced order (every other round reversed)",
    )
    p.add_argument(
        "--max-load", type=float, default=1.0,
        help="wait before each cell for the 1-minute load average below this",
    )  # fmt: skip
    p.add_argument(
        "--load-wait", type=float, default=60.0,
        help="seconds to wait for --max-load at most (then the cell is noisy)",
    )  # fmt: skip
    p.add_argument(
        "--max-other-cores", type=float, default=0.3,
        help="other processes' cores in the window above which a cell is noisy",
    )  # fmt: skip
    p.add_argument(
        "--busy-sample", type=float, default=1.0,
        help="seconds of machine busy share sampled before and after each cell",
    )  # fmt: skip
    p.add_argument("--chunk-bytes", type=int, default=9600)
    p.add_argument("--protocol", default="vllm-omni-speech-ws", help="Headroom route protocol")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds streamed before the window")
    p.add_argument("--warmup-chunks", type=int, default=520,
                   help="stream this many chunks a session before the window when that "
                   "takes at most --max-warmup seconds")  # fmt: skip
    p.add_argument("--max-warmup", type=float, default=25.0)
    p.add_argument("--window", type=float, default=6.0, help="steady window, seconds")
    p.add_argument("--settle", type=float, default=0.5, help="seconds after connecting")
    p.add_argument("--prime", type=float, default=0.5, help="seconds of the priming session")
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--upstream-procs", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=50, help="connects in flight per process")
    p.add_argument(
        "--setup-bursts", type=int, default=5,
        help="connect bursts per cell; the set-up figure is their median (the first "
        "burst's sessions are the ones streamed)",
    )  # fmt: skip
    p.add_argument("--max-total-s", type=float, default=5400.0, help="stop starting cells after")
    p.add_argument(
        "--quick", action="store_true",
        help="smoke: 20 sessions, 40 ms, 1 round, 1 s window, short load wait",
    )  # fmt: skip
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    p.add_argument("--markdown", metavar="OUT", help="write the report as Markdown")
    p.add_argument("--run-dir", help="working directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the run dir and raw samples")
    p.add_argument("--nginx-buffer", help="nginx proxy_buffer_size (default: nginx's own, 4k here)")
    p.add_argument(
        "--gc-trace", action="store_true",
        help="log Headroom's GC passes; the JSON gets those of the window and the set-up",
    )  # fmt: skip
    p.add_argument(
        "--gc-freeze", action="store_true", help="what-if: gc.freeze() Headroom after start"
    )
    p.add_argument("--no-install", action="store_true", help="never apt-get install nginx")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.pacing_ms = [20], [40.0]
        args.warmup, args.window, args.settle, args.prime = 0.3, 1.0, 0.2, 0.2
        args.client_procs, args.setup_bursts = 1, 2
        args.warmup_chunks, args.busy_sample = 0, 0.2
        args.load_wait = min(args.load_wait, 5.0)
        if "--rounds" not in (argv if argv is not None else sys.argv[1:]):
            args.rounds = 1
    args.cells = _cells(args)
    if args.setup_bursts < 1:
        p.error("--setup-bursts must be at least 1")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.chunk_bytes < 8:
        p.error("--chunk-bytes must be at least 8 (the send stamp)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    report = markdown(result)
    print(report)
    for note in result["notes"]:
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        notes = "".join(f"\nnote: {n}" for n in result["notes"])
        Path(args.markdown).write_text(report + "\n" + notes + ("\n" if notes else ""))
    return 0 if result["cells"] else 1


if __name__ == "__main__":
    sys.exit(main())
