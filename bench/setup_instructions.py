"""Set-up cost in instructions: one WebSocket session's set-up through Headroom, counted
by valgrind's callgrind, for a number that does not move with the machine's load.

    python bench/setup_instructions.py                      # the working tree
    python bench/setup_instructions.py --tree /tmp/a --tree .   # two trees, one after the other

``bench/relay.py`` measures set-up as CPU time, and on a shared machine the same burst of
connects in the same process costs 0.27-0.49 ms a session from one round to the next
(bench/RESULTS.md). Instructions do not: Headroom runs under callgrind with counting off,
the sessions are primed, then counting is switched on (``callgrind_control -i on``) for
``--sessions`` connects through a paced upstream (``bench/wsload.py``, nothing streams)
and a short settle, and off again. Two runs of the same tree agree to within about 1 %
(the gateway's background loops run meanwhile): compare trees in one invocation.

What it counts is user-space instructions of the Headroom process: Python, uvloop,
httptools, libc, the compiled per-chunk modules. Not the kernel (the system calls), not
cache misses, not the garbage collector's memory traffic: a change that saves
instructions saves time in about that proportion, but time is what the limit is on;
``bench/relay.py`` and ``bench/connect_ab.py`` stay the judges of that.

Needs valgrind (Debian: ``apt-get install valgrind``). Headroom runs about 50 times
slower under it; 200 sessions take some 20 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/setup_instructions.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # type: ignore[import-not-found,unused-ignore]
    ROUTE_PATH,
    Processes,
    Worker,
    free_port,
    headroom_config,
    raise_fd_limit,
    start_upstreams,
    wait_port,
)

_TOTALS = re.compile(r"^totals:\s+(\d+)", re.MULTILINE)


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=60)


def _counted(out: Path, log: Path) -> int:
    """The instructions counted while counting was on: the total of the dump
    ``callgrind_control -d`` wrote beside ``out``. Removes the output files."""
    dumps = sorted(out.parent.glob(out.name + ".*"))
    if not dumps:
        raise RuntimeError(f"callgrind wrote no dump (see {log})")
    match = _TOTALS.search(dumps[-1].read_text())
    for path in [out, *dumps]:
        path.unlink(missing_ok=True)
    if match is None:
        raise RuntimeError(f"no totals line in {dumps[-1]}")
    return int(match.group(1))


async def measure(tree: Path, sessions: int, run_dir: Path) -> dict[str, Any]:
    """Instructions per session of ``tree``'s Headroom (``PYTHONPATH=tree``, an absolute
    path)."""
    procs = Processes()
    out = run_dir / "callgrind.out"
    log_path = run_dir / "headroom.log"
    log = log_path.open("wb")
    try:
        _, upstream_port = await start_upstreams(procs, 1, 40.0, 9600)
        port = free_port()
        config = run_dir / "headroom.yaml"
        text = headroom_config(port, upstream_port, sessions + 16, "vllm-omni-speech-ws")
        config.write_text(text)
        proc = await asyncio.create_subprocess_exec(
            "valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out}", sys.executable, "-m", "proxy", "serve",
            "--config", str(config),
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, cwd=str(tree),
            env={**os.environ, "PYTHONPATH": str(tree)}, start_new_session=True,
        )  # fmt: skip
        procs.add(proc)
        await wait_port(port, 300.0, proc)
        url = f"ws://127.0.0.1:{port}{ROUTE_PATH}"
        client, _ = await Worker.start(procs, "clients", "clients", "--url", url,
                                       "--timeout-s", "120")  # fmt: skip
        # prime: imports and first-use allocations are not the sessions'
        await client.call("connect", "connected", 300.0, n=20, concurrency=5)
        await client.call("close", "closed", 300.0)
        await asyncio.sleep(2.0)
        _control("-i", "on", str(proc.pid))
        reply = await client.call("connect", "connected", 600.0, n=sessions, concurrency=10)
        await asyncio.sleep(1.0)
        _control("-i", "off", str(proc.pid))
        _control("-d", str(proc.pid))
        connected = int(reply["ok"])
        if connected != sessions:
            raise RuntimeError(f"{connected} of {sessions} connected: {reply['failed']}")
        await client.call("close", "closed", 300.0)
    finally:
        await procs.stop_all()
        log.close()
    total = _counted(out, log_path)
    return {"tree": str(tree), "sessions": sessions, "instructions": total,
            "instructions_per_session": round(total / sessions)}  # fmt: skip


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    raise_fd_limit()
    results = []
    for tree in args.tree:
        run_dir = Path(tempfile.mkdtemp(prefix="headroom-setup-ir-"))
        try:
            result = await measure(tree, args.sessions, run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        print(f"{tree}: {result['instructions_per_session']:,} instructions per session "
              f"({result['instructions']:,} for {args.sessions})", flush=True)  # fmt: skip
        results.append(result)
    if len(results) > 1:
        base = results[0]["instructions_per_session"]
        for r in results[1:]:
            print(f"{r['tree']} / {results[0]['tree']}: {r['instructions_per_session'] / base:.3f}")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", help="source tree (holds proxy/); repeatable")
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = p.parse_args(argv)
    args.tree = [Path(t).resolve() for t in args.tree or ["."]]
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    results = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
