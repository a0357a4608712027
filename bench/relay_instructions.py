"""Instructions per relayed chunk, counted by callgrind: two trees compared without the
machine's noise.

    python bench/relay_instructions.py --baseline REV             # compiled, 20 x 40 ms
                                                                  # and 500 x 1000 ms
    python bench/relay_instructions.py --baseline REV --builds compiled interpreted
    python bench/relay_instructions.py --baseline REV --cache-sim --json out.json

bench/relay.py measures the relay's CPU time per chunk, which moves with the machine
(another process, the host, the order of the cells) by more than a few per cent between
rounds. This bench counts what does not move: the user-space instructions the relay
process executes per chunk it relays, under ``valgrind --tool=callgrind``, and, in a
second pass without valgrind, the system calls it makes per chunk (``perf stat`` on the
``raw_syscalls:sys_enter`` tracepoint), which stand for its kernel work. Two trees with
the same counts do the same work per chunk; a CPU-time difference between them that the
counts do not show lies in how the machine runs that work (code layout, caches, what ran
before), not in the code path.

Each cell (tree x sessions x pacing): the paced upstream of bench/wsload.py, the relay
(``python -m proxy serve`` from the tree, the bench's one-pool configuration of
bench/harness.py), and the sessions connected and streaming. Under callgrind the relay
starts with instrumentation off (``--instr-atstart=no``: Python's start and the connects
are not counted; bench/setup_instructions.py counts a session's set-up); after
``--settle`` seconds of streaming the counters are zeroed and instrumentation switched
on (``callgrind_control``), and after ``--window`` seconds switched off and the profile
dumped. Chunks are the upstream's sends in the window; a
cell whose relay fell behind (the upstream skipped a tick) is flagged, since a relay
that reads more per wake-up does less work per chunk. With ``--cache-sim`` callgrind
also simulates the caches (L1 and last-level misses per chunk; about twice as slow).

valgrind runs the relay about 50 times slower: keep the chunk rate low (the defaults
relay 500 chunks a second). Everything is on 127.0.0.1 and every phase has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/relay_instructions.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # type: ignore[import-not-found,unused-ignore]
    Processes,
    Worker,
    machine_facts,
    start_upstreams,
)
from relay_trees import (  # type: ignore[import-not-found,unused-ignore]
    HEADROOM_TREES,
    Tree,
    prepare_trees,
    start_headroom,
)

#: valgrind's start of the relay (Python's imports, instrumentation off) on a busy machine.
START_TIMEOUT_S = 300.0
#: A callgrind profile's header lines this bench reads.
_EVENTS = re.compile(r"^events:\s*(.+)$", re.MULTILINE)
_TOTALS = re.compile(r"^totals:\s*(.+)$", re.MULTILINE)


def parse_profile(text: str) -> dict[str, int]:
    """The event totals of a callgrind profile (``events:`` names, ``totals:`` counts)."""
    events, totals = _EVENTS.search(text), _TOTALS.search(text)
    if events is None or totals is None:
        raise ValueError("not a callgrind profile: no events/totals line")
    names, counts = events.group(1).split(), totals.group(1).split()
    if len(names) != len(counts):
        raise ValueError(f"{len(names)} events but {len(counts)} totals")
    return {name: int(count) for name, count in zip(names, counts, strict=True)}


def parse_perf_count(text: str, event: str) -> int:
    """The count of ``event`` in ``perf stat -x,`` output."""
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2] == event and fields[0].isdigit():
            return int(fields[0])
    raise ValueError(f"perf stat reported no {event!r}: {text.strip()[-300:]}")


async def _control(*args: str) -> None:
    done = await asyncio.create_subprocess_exec(
        "callgrind_control", *args, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(done.communicate(), 120)
    if done.returncode != 0:
        raise RuntimeError(f"callgrind_control {' '.join(args)}: {err.decode()[-300:]}")


def _last_dump(cell_dir: Path) -> str:
    """The text of the newest callgrind profile dumped in ``cell_dir``."""
    dumps = sorted(cell_dir.glob("callgrind.out*"), key=lambda p: p.stat().st_mtime)
    if not dumps:
        raise RuntimeError(f"callgrind dumped no profile in {cell_dir}")
    return dumps[-1].read_text(errors="replace")


async def _sent(upstream: Worker) -> tuple[int, int]:
    stats = await upstream.call("stats", "stats", 30.0)
    return int(stats["sent"]), int(stats["skipped"])


async def measure_cell(
    tree: Tree, sessions: int, pacing_ms: float, args: argparse.Namespace, cell_dir: Path,
    *, callgrind: bool,
) -> dict[str, Any]:  # fmt: skip
    """One cell: instructions per chunk under callgrind, or syscalls per chunk without."""
    procs = Processes()
    out = cell_dir / "callgrind.out"
    wrapper = None
    if callgrind:
        wrapper = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={out}", "--dump-instr=no"]  # fmt: skip
        if args.cache_sim:
            wrapper.append("--cache-sim=yes")
    try:
        (upstream, *_), port = await start_upstreams(procs, 1, pacing_ms, args.chunk_bytes)
        relay = await start_headroom(
            procs, tree, cell_dir, port, max_sessions=sessions + 10,
            protocol="vllm-omni-speech-ws", wrapper=wrapper, start_timeout_s=START_TIMEOUT_S,
        )  # fmt: skip
        assert relay.proc is not None
        clients, _ = await Worker.start(
            procs, "clients", "clients", "--url", relay.url, "--timeout-s", "60",
            "--lifetime-s", str(int(args.settle + args.window + 600)),
        )  # fmt: skip
        cell: dict[str, Any] = {"target": tree.target, "sessions": sessions,
                                "pacing_ms": pacing_ms, "revision": tree.revision}  # fmt: skip
        connected = await clients.call("connect", "connected", 600.0, n=sessions, concurrency=16)
        if connected["ok"] != sessions:
            raise RuntimeError(f"{tree.target}: {connected['ok']} of {sessions} connected")
        await clients.call("start", "started", 60.0)
        await asyncio.sleep(args.settle)
        pid = str(relay.proc.pid)
        if callgrind:
            await _control("-z", pid)
            await _control("-i", "on", pid)
            sent0, skipped0 = await _sent(upstream)
            await asyncio.sleep(args.window)
            sent1, skipped1 = await _sent(upstream)
            await _control("-i", "off", pid)
            await _control("-d", pid)
            counts = parse_profile(await asyncio.to_thread(_last_dump, cell_dir))
        else:
            perf = await asyncio.create_subprocess_exec(
                "perf", "stat", "-x,", "-e", "raw_syscalls:sys_enter,task-clock", "-p", pid,
                "--", "sleep", str(args.window), stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            sent0, skipped0 = await _sent(upstream)
            _, err = await asyncio.wait_for(perf.communicate(), args.window + 60)
            sent1, skipped1 = await _sent(upstream)
            counts = {"syscalls": parse_perf_count(err.decode(), "raw_syscalls:sys_enter")}
        chunks = sent1 - sent0
        if chunks <= 0:
            raise RuntimeError(f"{tree.target}: no chunk relayed in the window")
        cell["chunks"] = chunks
        cell["fell_behind"] = skipped1 > skipped0
        cell["per_chunk"] = {name: count / chunks for name, count in counts.items()}
        return cell
    finally:
        await procs.stop_all()


def report(cells: list[dict[str, Any]], baseline_of: dict[str, str]) -> str:
    """A Markdown table: per target and cell, each count per chunk, and the first
    count's ratio to the same build of the baseline."""
    by_key = {(c["target"], c["sessions"], c["pacing_ms"]): c for c in cells}
    names: list[str] = []
    for c in cells:
        names += [n for n in c["per_chunk"] if n not in names]
    head = "| target | sessions x pacing | " + " | ".join(f"{n}/chunk" for n in names)
    lines = [f"{head} | x baseline {names[0]}/chunk | behind |",
             "|---|---|" + "---:|" * len(names) + "---:|---|"]  # fmt: skip
    for c in cells:
        values = [c["per_chunk"].get(n) for n in names]
        shown = [f"{v:,.1f}" if v is not None else "" for v in values]
        base = by_key.get((baseline_of.get(c["target"], ""), c["sessions"], c["pacing_ms"]))
        theirs = base["per_chunk"].get(names[0]) if base is not None else None
        ratio = f"{values[0] / theirs:.4f}" if values[0] and theirs else ""
        behind = "yes" if c["fell_behind"] else ""
        cell = f"{c['sessions']} x {c['pacing_ms']:g} ms"
        lines.append(f"| {c['target']} | {cell} | {' | '.join(shown)} | {ratio} | {behind} |")
    return "\n".join(lines)


def merge(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The callgrind and syscall passes of each cell in one row (syscalls appended)."""
    merged: dict[tuple[str, int, float], dict[str, Any]] = {}
    for cell in runs:
        key = (cell["target"], cell["sessions"], cell["pacing_ms"])
        if key not in merged:
            merged[key] = {**cell, "per_chunk": dict(cell["per_chunk"])}
        else:
            row = merged[key]
            row["per_chunk"].update(cell["per_chunk"])
            row["fell_behind"] = row["fell_behind"] or cell["fell_behind"]
    return list(merged.values())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    builds = set(args.builds)
    targets = [
        target for target, (origin, compiled) in HEADROOM_TREES.items()
        if ("compiled" if compiled else "interpreted") in builds
        and (origin == "checkout" or args.baseline)
    ]  # fmt: skip
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="relay-instructions-"))
    trees = prepare_trees(targets, run_dir, args.baseline, args.source)
    runs: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    for sessions, pacing_ms in args.cells:
        for target, tree in trees.items():
            for callgrind in (True, False) if args.syscalls else (True,):
                kind = "callgrind" if callgrind else "syscalls"
                cell_dir = run_dir / f"{target}-{sessions}x{pacing_ms:g}-{kind}"
                cell_dir.mkdir(parents=True, exist_ok=True)
                print(f"-- {target} {sessions} x {pacing_ms:g} ms ({kind})", file=sys.stderr,
                      flush=True)  # fmt: skip
                runs.append(await measure_cell(tree, sessions, pacing_ms, args, cell_dir,
                                               callgrind=callgrind))  # fmt: skip
                load.append(os.getloadavg()[0])
    cells = merge(runs)
    baseline_of = {"headroom": "baseline", "headroom-compiled": "baseline-compiled"}
    result = {
        "benchmark": "relay_instructions",
        "machine": machine_facts(),
        "trees": {t: {"revision": tree.revision, "build": tree.build} for t, tree in trees.items()},
        "config": {k: v for k, v in vars(args).items() if k not in {"json", "markdown"}},
        "load_average": {"median": statistics.median(load), "max": max(load)},
        "cells": cells,
        "table": report(cells, baseline_of),
    }
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--baseline", metavar="REV", help="also count this git revision's trees")
    p.add_argument("--source", metavar="REV", help="the Headroom trees from this revision")
    p.add_argument("--builds", nargs="+", choices=("compiled", "interpreted"),
                   default=["compiled"])  # fmt: skip
    p.add_argument("--sessions", type=int, nargs="+", default=[20, 500])
    p.add_argument("--pacing-ms", type=float, nargs="+", default=[40.0, 1000.0],
                   help="one per --sessions value (the cells are pairs)")  # fmt: skip
    p.add_argument("--window", type=float, default=30.0, help="counted seconds per cell")
    p.add_argument("--settle", type=float, default=15.0, help="seconds streamed before")
    p.add_argument("--chunk-bytes", type=int, default=9600)
    p.add_argument("--cache-sim", action="store_true", help="simulate the caches too")
    p.add_argument("--no-syscalls", dest="syscalls", action="store_false",
                   help="skip the pass that counts system calls with perf")  # fmt: skip
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--markdown", metavar="OUT")
    p.add_argument("--run-dir")
    p.add_argument("--keep", action="store_true", help="keep the run dir and the profiles")
    args = p.parse_args(argv)
    if len(args.sessions) != len(args.pacing_ms):
        p.error("give one --pacing-ms value per --sessions value")
    if min(args.sessions) < 1 or min(args.pacing_ms) <= 0 or args.window <= 0:
        p.error("sessions, pacing and window must be positive")
    args.cells = list(zip(args.sessions, args.pacing_ms, strict=True))
    for tool in ("valgrind", "callgrind_control", *(("perf",) if args.syscalls else ())):
        if shutil.which(tool) is None:
            p.error(f"{tool} is not installed (apt-get install valgrind linux-perf)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print(result["table"])
    print(f"load average (1 min) median {result['load_average']['median']:.2f}, "
          f"max {result['load_average']['max']:.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(result["table"] + "\n")


if __name__ == "__main__":
    main()
