"""Run ``headroom`` with every garbage-collector pass logged (a profiling aid).

    python bench/gc_trace.py OUT [--freeze-after S] -- serve --config FILE

Each collection appends one line to OUT: ``end_monotonic_ns generation pause_ns
collected``. ``--freeze-after S`` calls ``gc.freeze()`` S seconds after start (from a
timer thread, once the server has started): a what-if for the recommendation to freeze
the start-up heap so full collections no longer walk it.

``bench/relay.py --gc-trace`` (and ``bench/reject_storm.py --gc-trace``) start Headroom
this way and report the collections that fell in each measured window (count per
generation, total and longest pause): the evidence for loop pauses seen as latency or
gap tails.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Any


def install(path: str) -> None:
    out = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    started = [0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
            return
        pause = time.perf_counter_ns() - started[0]
        out.write(f"{time.monotonic_ns()} {info['generation']} {pause} {info['collected']}\n")

    gc.callbacks.append(on_gc)


def main() -> int:
    args = sys.argv[1:]
    if "--" not in args or args.index("--") not in (1, 3):
        print(__doc__, file=sys.stderr)
        return 2
    split = args.index("--")
    install(args[0])
    if split == 3 and args[1] == "--freeze-after":
        timer = threading.Timer(float(args[2]), gc.freeze)
        timer.daemon = True
        timer.start()
    from proxy.process.cli import main as headroom

    return int(headroom(args[split + 1 :]))


if __name__ == "__main__":
    sys.exit(main())
